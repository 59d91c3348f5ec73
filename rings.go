package moonring

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/moonring/moonring/ring"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/topology"
	"github.com/moonring/moonring/transport"
)

// Rings and their pollers: a poller per NUMA node, the caller's rings, and
// whether requests in flight use a buffer or segment.

// poller returns the poller of a NUMA node, starting it. mu must be held.
func (e *Engine) poller(node int) *ring.Poller {
	if n, ok := e.topo.Node(node); !ok || n.ID != node {
		node = 0
	}
	if p := e.pollers[node]; p != nil {
		return p
	}
	pc := ring.PollerConfig{Spin: e.cfg.PollerSpin, Busy: e.cfg.BusyPoll, Promote: e.cfg.PromoteAfter, CopyWorkers: max(e.cfg.CopyWorkers, 0)}
	if n, ok := e.topo.Node(node); ok && e.cfg.PinPollers {
		pc.CPUs, pc.Pin = n.CPUs, topology.PinThread
	}
	p := ring.NewPoller(pc)
	for _, t := range e.transports {
		if h, ok := t.(transport.Poller); ok {
			p.AddHook(h)
		}
	}
	e.pollers[node] = p
	list := make([]*ring.Poller, 0, len(e.pollers))
	for _, p := range e.pollers {
		list = append(list, p)
	}
	e.pollerList.Store(&list)
	return p
}

// inFlight reports whether a request of any ring names buf or seg.
func (e *Engine) inFlight(buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint]) bool {
	if ps := e.pollerList.Load(); ps != nil {
		for _, p := range *ps {
			if p.Uses(buf, seg) {
				return true
			}
		}
	}
	return false
}

// nodeOf returns the NUMA node of a location: N for "cpu:N", else 0. It
// runs per request, so it does not call Location.Parse, whose fmt.Sscanf
// allocates; registered locations are valid, hence canonical.
func nodeOf(loc Location) int {
	if n, ok := strings.CutPrefix(string(loc), "cpu:"); ok {
		if idx, err := strconv.Atoi(n); err == nil && idx >= 0 {
			return idx
		}
	}
	return 0
}

// RingConfig sizes a ring made by NewRing. Zero fields take the defaults.
type RingConfig struct {
	// Entries is the SQ size, a power of two (default 256).
	Entries int
	// CQEntries is the CQ size, a power of two (default 2*Entries).
	CQEntries int
	// MaxInFlight bounds requests in flight (default Entries).
	MaxInFlight int
	// Node is the NUMA node whose poller drains the ring (default 0).
	Node int
	// Class is the ring's priority class (default ClassNormal): small
	// latency-critical requests on a ClassHigh ring, bulk streams on a
	// ClassLow one. See Class.
	Class Class
}

// NewRing returns a ring drained by the poller of cfg.Node. The caller owns
// it and closes it; Engine.Close closes rings still open.
func (e *Engine) NewRing(cfg RingConfig) (*Ring, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return nil, ErrClosed
	}
	r, err := ring.New(ring.Config{
		Entries: cfg.Entries, CQEntries: cfg.CQEntries, MaxInFlight: cfg.MaxInFlight, Class: cfg.Class,
		SliceSize: e.cfg.SliceSize, RetryLimit: e.cfg.RetryLimit, Timeout: e.cfg.Timeout, Logger: e.cfg.Logger,
	}, &e.tables, e.poller(cfg.Node))
	if err != nil {
		return nil, fmt.Errorf("moonring: new ring: %w", err)
	}
	for old := range e.rings {
		if old.Closed() { // closed by their owner: Close need not see them
			delete(e.rings, old)
		}
	}
	e.ringSeq++
	e.rings[r] = e.ringSeq
	return r, nil
}
