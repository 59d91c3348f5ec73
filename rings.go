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

// Rings and their pollers: Config.Pollers pollers per NUMA node, the
// caller's rings, and whether requests in flight use a buffer or segment.

// maxPollers bounds Config.Pollers.
const maxPollers = 64

// pollerKey names a poller: its NUMA node and its index among the node's.
type pollerKey struct{ node, idx int }

// poller returns the first poller of a NUMA node, starting it. mu must be
// held.
func (e *Engine) poller(node int) *ring.Poller {
	return e.pollerAt(e.nodeOrZero(node), 0)
}

// nodeOrZero returns node when the machine has it, else 0.
func (e *Engine) nodeOrZero(node int) int {
	if n, ok := e.topo.Node(node); !ok || n.ID != node {
		return 0
	}
	return node
}

// ringPoller names the poller of node (of its Config.Pollers) with the
// fewest of the caller's open rings, the first of equals. mu must be held.
func (e *Engine) ringPoller(node int) pollerKey {
	node = e.nodeOrZero(node)
	load := make([]int, e.cfg.Pollers)
	for r, o := range e.rings {
		if !r.Closed() && o.poller.node == node {
			load[o.poller.idx]++
		}
	}
	best := 0
	for i := range load {
		if load[i] < load[best] {
			best = i
		}
	}
	return pollerKey{node, best}
}

// openRing is what the engine keeps of a caller's ring: its number (the
// metrics' label) and its poller.
type openRing struct {
	n      int
	poller pollerKey
}

// pollerAt returns poller idx of node, starting it. mu must be held.
func (e *Engine) pollerAt(node, idx int) *ring.Poller {
	k := pollerKey{node, idx}
	if p := e.pollers[k]; p != nil {
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
	e.pollers[k] = p
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
	// Node is the NUMA node whose poller drains the ring (default 0): of
	// its Config.Pollers, the one with the fewest open rings.
	Node int
	// Class is the ring's priority class (default ClassNormal): small
	// latency-critical requests on a ClassHigh ring, bulk streams on a
	// ClassLow one. See Class.
	Class Class
}

// NewRing returns a ring drained by a poller of cfg.Node (the one with the
// fewest open rings). The caller owns it and closes it; Engine.Close
// closes rings still open.
func (e *Engine) NewRing(cfg RingConfig) (*Ring, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return nil, ErrClosed
	}
	pk := e.ringPoller(cfg.Node)
	r, err := ring.New(ring.Config{
		Entries: cfg.Entries, CQEntries: cfg.CQEntries, MaxInFlight: cfg.MaxInFlight, Class: cfg.Class,
		SliceSize: e.cfg.SliceSize, RetryLimit: e.cfg.RetryLimit, Timeout: e.cfg.Timeout, Logger: e.cfg.Logger,
	}, &e.tables, e.pollerAt(pk.node, pk.idx))
	if err != nil {
		return nil, fmt.Errorf("moonring: new ring: %w", err)
	}
	for old := range e.rings {
		if old.Closed() { // closed by their owner: Close need not see them
			delete(e.rings, old)
		}
	}
	e.ringSeq++
	e.rings[r] = openRing{e.ringSeq, pk}
	return r, nil
}
