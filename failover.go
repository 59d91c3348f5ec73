package moonring

// Failover: a segment holds a path (an endpoint) through every transport
// that reaches it, in order of preference, and new requests take the
// first that is up. The health manager here opens the paths other than
// the one OpenSegment opened (in the background, so that OpenSegment is
// no slower), hears from the rings of each path they marked down
// (ring.Tables.PathDown), cools a down path off with exponential backoff,
// probes it by opening a fresh endpoint, and puts the fresh one in its
// place: new requests move back to it (failback). Rings move requests off
// a failed path themselves (ring/retry.go); the manager only counts,
// logs, probes and fails back.
//
// # Concurrency
//
// One goroutine per engine (run) plus one per probe in progress, all
// tracked by health.wg and ended by Engine.Close (health.stop). health.mu
// guards the segments' candidate lists and the counters; it is a leaf: it
// may be taken while e.mu is held, and no lock is taken while it is held.
// Paths are replaced only under health.mu (segtable.Segment.SetPaths);
// rings read them lock-free.
//
// # Lifetimes
//
// A segment's state lives from OpenSegment (add) to CloseSegment
// (remove); an endpoint a probe opens belongs to the segment once its
// path is set, and is closed by the probe when the segment closed
// meanwhile. A replaced endpoint is closed once its fresh path is set.

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Backoff of the probes of a down path: the first probe comes probeBase
// after the path went down, each failed one doubles the wait, up to
// probeMax. A probe (an endpoint's Open) gets at most probeTimeout.
const (
	probeBase    = 100 * time.Millisecond
	probeMax     = 10 * time.Second
	probeTimeout = 5 * time.Second
)

type path = segtable.Path[transport.Endpoint]
type segment = segtable.Segment[transport.Endpoint]

// errUninstalled: the candidate's transport is no longer installed.
var errUninstalled = errors.New("moonring: transport uninstalled")

// clock is what the health manager reads the time and waits with; a test
// gives it a fake one.
type clock interface {
	Now() time.Time
	After(d time.Duration) <-chan time.Time
}

type realClock struct{}

func (realClock) Now() time.Time                         { return time.Now() }
func (realClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// candidate is one transport that may reach a segment.
type candidate struct {
	slot int
	name string
	path *path // nil while not open
	// opened is set once the transport reached the segment: a candidate
	// never opened whose Open says ErrUnreachable is dropped, one that was
	// open is probed until it comes back.
	opened  bool
	dropped bool
	probing bool
	backoff time.Duration
	next    time.Time // when to probe; zero while up (or not to be probed)
	// downSeen is set once the manager counted and logged the path's
	// going down.
	downSeen bool
	// upSince is when the path last came up: one that goes down again
	// within probeMax of it keeps its backoff growing, so that a path
	// that opens but does not carry requests is not flapped onto every
	// probeBase.
	upSince time.Time
}

// segHealth is what the manager keeps of one open segment.
type segHealth struct {
	seg   *segment
	cands []*candidate // in order of preference
	// inProcess: the segment is reached in-process (local), and has no
	// other path.
	inProcess bool
	closed    bool
}

// pathKey names a counter: a segment and a transport.
type pathKey struct{ segment, transport string }

// pathCounts are the failovers off a path and the failbacks onto it.
type pathCounts struct{ failovers, failbacks uint64 }

type health struct {
	e      *Engine
	ctx    context.Context // canceled by stop: probes in progress end
	cancel context.CancelFunc
	kick   chan struct{} // wakes run: a path went down, a segment came or went, a descriptor changed
	done   chan struct{} // closed when run returns
	wg     sync.WaitGroup

	mu      sync.Mutex
	clock   clock
	base    time.Duration
	max     time.Duration
	segs    map[*segment]*segHealth
	counts  map[pathKey]*pathCounts
	probes  uint64 // probes started, for tests
	stopped bool
}

// init starts the manager's goroutine.
func (h *health) init(e *Engine) {
	h.e = e
	h.ctx, h.cancel = context.WithCancel(context.Background())
	h.kick = make(chan struct{}, 1)
	h.done = make(chan struct{})
	h.clock, h.base, h.max = realClock{}, probeBase, probeMax
	h.segs = map[*segment]*segHealth{}
	h.counts = map[pathKey]*pathCounts{}
	go h.run()
}

// stop ends the manager and waits for its probes. Endpoints it opened
// belong to their segments by then, or were closed.
func (h *health) stop() {
	h.mu.Lock()
	if h.stopped {
		h.mu.Unlock()
		return
	}
	h.stopped = true
	h.mu.Unlock()
	h.cancel()
	h.wake()
	<-h.done
	h.wg.Wait()
}

// wake makes run look at the segments again. It never blocks.
func (h *health) wake() {
	select {
	case h.kick <- struct{}{}:
	default:
	}
}

// pathDown is ring.Tables.PathDown: a ring marked p of seg down (and moved
// its request off it). On the poller: it only wakes run.
func (h *health) pathDown(*segment, *path) { h.wake() }

// add starts watching seg, opened through the candidate at index first of
// cands (transport names in order of preference, with their slots). The
// others are opened in the background, unless the open one is the
// in-process transport (a peer in this process has no other way worth
// keeping). mu of the engine may be held.
func (h *health) add(seg *segment, cands []candidate, first int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopped {
		return
	}
	st := &segHealth{seg: seg, inProcess: cands[first].slot == 0}
	now := h.clock.Now()
	for i := range cands {
		c := cands[i]
		switch {
		case i == first:
			c.path, c.opened, c.upSince = seg.Path(), true, now
		case cands[first].slot == 0 || c.dropped:
			continue
		case i < first:
			// It failed under OpenSegment: probed after the first backoff.
			c.backoff, c.next = h.base, now.Add(h.base)
		default:
			c.next = now // a standby: opened now, in the background
		}
		st.cands = append(st.cands, &c)
	}
	h.segs[seg] = st
	if len(st.cands) > 1 {
		h.wake()
	}
}

// remove stops watching seg; the caller closes its paths' endpoints. A
// probe in progress closes what it opens.
func (h *health) remove(seg *segment) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if st := h.segs[seg]; st != nil {
		st.closed = true
		delete(h.segs, seg)
	}
}

// updated hears that seg's descriptor changed (the peer republished or
// restarted): a transport it lists now that the segment had no candidate
// for becomes one (a peer that installed shm since), and paths down or
// not open are probed now, from the first backoff again.
func (h *health) updated(seg *segment) {
	var installed []string
	if ns := h.e.tnames.Load(); ns != nil {
		for _, n := range ns {
			if n != "" {
				installed = append(installed, n)
			}
		}
	}
	listed := transport.Candidates(installed, seg.Desc(), h.e.cfg.Transports)
	h.mu.Lock()
	st := h.segs[seg]
	if st != nil && !st.inProcess {
		now := h.clock.Now()
		h.merge(st, installed, listed)
		for _, c := range st.cands {
			if !c.probing && (c.path == nil || c.path.Down()) {
				c.dropped, c.backoff, c.next = false, 0, now
			}
		}
	}
	h.mu.Unlock()
	if st != nil {
		h.wake()
	}
}

// merge adds to st the candidates listed (names in order of preference)
// that it lacks, keeping every candidate in order of preference. Those it
// has keep their state. h.mu must be held.
func (h *health) merge(st *segHealth, installed, listed []string) {
	have := map[string]*candidate{}
	all := &segtable.SegmentDesc{Endpoints: map[string]string{}}
	for _, c := range st.cands {
		have[c.name] = c
		all.Endpoints[c.name] = ""
	}
	added := false
	for _, n := range listed {
		if have[n] == nil {
			added = true
			all.Endpoints[n] = ""
			slot := -1
			if ns := h.e.tnames.Load(); ns != nil {
				for i, x := range ns {
					if x == n {
						slot = i
					}
				}
			}
			have[n] = &candidate{slot: slot, name: n, dropped: slot < 0}
		}
	}
	if !added {
		return
	}
	// Candidates' order is one total order, so the old candidates keep
	// theirs among themselves (and their paths, the segment's order).
	var cands []*candidate
	for _, n := range transport.Candidates(installed, all, h.e.cfg.Transports) {
		cands = append(cands, have[n])
	}
	for _, c := range st.cands { // one whose transport went meanwhile: kept while it has a path
		if !slices.Contains(cands, c) && c.path != nil {
			cands = append(cands, c)
		}
	}
	st.cands = cands
}

// run is the manager's goroutine: it notes paths gone down, starts the
// probes that are due and sleeps until the next one or a kick.
func (h *health) run() {
	defer close(h.done)
	for {
		h.mu.Lock()
		if h.stopped {
			h.mu.Unlock()
			return
		}
		clk := h.clock
		wait := h.scan(clk.Now())
		h.mu.Unlock()
		var timer <-chan time.Time
		if wait >= 0 {
			timer = clk.After(wait)
		}
		select {
		case <-h.kick:
		case <-timer:
		case <-h.ctx.Done():
			return
		}
	}
}

// scan notes paths that went down (counted and logged once each),
// starts the probes due at now, and returns how long until the next one
// is due, or -1 for none. h.mu must be held.
func (h *health) scan(now time.Time) time.Duration {
	wait := time.Duration(-1)
	for _, st := range h.segs {
		for _, c := range st.cands {
			if c.dropped || c.probing {
				continue
			}
			if c.path != nil && c.path.Down() && !c.downSeen {
				c.downSeen = true
				if now.Sub(c.upSince) > h.max {
					c.backoff = 0 // it was up long enough: from the first backoff again
				}
				c.backoff = min(max(2*c.backoff, h.base), h.max)
				c.next = now.Add(c.backoff)
				h.count(st.seg.Name, c.name).failovers++
				to := h.e.slotName(st.seg.Path().Transport)
				h.e.cfg.Logger.Warn("moonring: segment changed path: failover", "segment", st.seg.Name, "from", c.name, "to", to)
			}
			if c.next.IsZero() {
				continue
			}
			if d := c.next.Sub(now); d > 0 {
				if wait < 0 || d < wait {
					wait = d
				}
				continue
			}
			c.probing = true
			h.probes++
			h.wg.Add(1)
			go h.probe(st, c)
		}
	}
	return wait
}

// count returns the counters of a segment's path through a transport.
// h.mu must be held.
func (h *health) count(seg, tname string) *pathCounts {
	k := pathKey{seg, tname}
	c := h.counts[k]
	if c == nil {
		c = new(pathCounts)
		h.counts[k] = c
	}
	return c
}

// probe opens a fresh endpoint of c's transport to st's segment and puts
// it in place of c's path.
func (h *health) probe(st *segHealth, c *candidate) {
	defer h.wg.Done()
	e := h.e
	e.mu.Lock()
	t := e.transports[c.slot]
	e.mu.Unlock()
	var ep, staged transport.Endpoint
	var size uint64
	err := errUninstalled
	if t != nil && t.Name() == c.name {
		ctx, cancel := context.WithTimeout(h.ctx, probeTimeout)
		ep, err = t.Open(ctx, st.seg.Desc())
		cancel()
	}
	// Under the engine's lock: an UninstallTransport of t either comes
	// before (and the fresh endpoint is closed) or sees the path.
	e.mu.Lock()
	var unused transport.Endpoint // closed after the lock: a Close may wait on dials
	if err == nil && (e.closed.Load() || e.transports[c.slot] != t) {
		unused, ep, err = ep, nil, errUninstalled
	}
	if err == nil {
		size = t.SliceSize()
		staged = e.stageEndpoint(ep, c.slot, size)
	}
	old, dead := h.probed(st, c, ep, staged, size, err)
	e.mu.Unlock()
	if unused != nil {
		unused.Close()
	}
	if dead != nil {
		closeSegment(dead.Endpoint, dead.Staged)
	}
	if old != nil {
		closeSegment(old.Endpoint, old.Staged)
	}
	h.wake()
}

// probed takes a probe's result: on success the fresh path replaces c's
// (returned as old, for the caller to close) and becomes current if it is
// the preferred one that is up (a failback when c had been up before);
// on failure c waits twice as long for its next probe. A path that no
// segment takes any more is returned as dead, for the caller to close.
func (h *health) probed(st *segHealth, c *candidate, ep, staged transport.Endpoint, size uint64, err error) (old, dead *path) {
	h.mu.Lock()
	defer h.mu.Unlock()
	c.probing = false
	if err != nil {
		switch {
		case st.closed || h.stopped:
		case errors.Is(err, errUninstalled) || (!c.opened && errors.Is(err, transport.ErrUnreachable)):
			c.dropped, c.next = true, time.Time{} // this transport cannot reach the segment
			h.e.cfg.Logger.Debug("moonring: segment not reachable through transport", "segment", st.seg.Name, "transport", c.name, "reason", err)
		default:
			c.backoff = min(max(2*c.backoff, h.base), h.max)
			c.next = h.clock.Now().Add(c.backoff)
			h.e.cfg.Logger.Debug("moonring: probe failed", "segment", st.seg.Name, "transport", c.name, "reason", err, "next", c.backoff)
		}
		return nil, nil
	}
	p := &path{Endpoint: ep, Staged: staged, Transport: c.slot, SliceSize: size}
	if st.closed || h.stopped {
		return nil, p
	}
	old = c.path
	wasOpen := c.opened
	c.path, c.opened, c.downSeen, c.next, c.upSince = p, true, false, time.Time{}, h.clock.Now()
	prev := st.seg.Path()
	var ps []*path
	for _, x := range st.cands {
		if x.path != nil {
			ps = append(ps, x.path)
		}
	}
	st.seg.SetPaths(ps)
	if cur := st.seg.Path(); cur == p && prev != p {
		if wasOpen {
			h.count(st.seg.Name, c.name).failbacks++
			h.e.cfg.Logger.Warn("moonring: segment changed path: failback", "segment", st.seg.Name, "from", h.e.slotName(prev.Transport), "to", c.name)
		} else {
			h.e.cfg.Logger.Info("moonring: segment changed path: a preferred transport reaches it now", "segment", st.seg.Name, "from", h.e.slotName(prev.Transport), "to", c.name)
		}
	} else if old == nil {
		h.e.cfg.Logger.Debug("moonring: segment has a standby path", "segment", st.seg.Name, "transport", c.name)
	}
	return old, nil
}

// slotName returns the name of the transport in slot, or "" (lock-free:
// the names' snapshot).
func (e *Engine) slotName(slot int) string {
	if ns := e.tnames.Load(); ns != nil && slot >= 0 && slot < len(ns) {
		return ns[slot]
	}
	return ""
}

// refreshNames publishes the installed transports' names for lock-free
// readers (slotName, TransportSlot). mu must be held.
func (e *Engine) refreshNames() {
	var ns [segtable.MaxTransports]string
	for i, t := range e.transports {
		if t != nil {
			ns[i] = t.Name()
		}
	}
	e.tnames.Store(&ns)
}

// TransportSlot returns the slot of the installed transport named name,
// for the Transport field of an Entry with FlagTransportOnly or
// FlagTransportPrefer. A slot stays the transport's until it is
// uninstalled. Lock-free and allocation-free; it fails with
// ErrNoSuchTransport for a name not installed.
func (e *Engine) TransportSlot(name string) (uint8, error) {
	if ns := e.tnames.Load(); ns != nil {
		for i, n := range ns {
			if n != "" && n == name {
				return uint8(i), nil
			}
		}
	}
	return 0, ErrNoSuchTransport
}

// PathStats are the failovers and failbacks of one segment's path
// through one transport.
type PathStats struct {
	Segment, Transport string
	// Failovers counts the times requests left the path after it failed.
	Failovers uint64
	// Failbacks counts the times new requests moved back to it after a
	// probe found it working again.
	Failbacks uint64
}

// PathStats returns the failover counters of every segment and transport
// that had one, as the metrics report them. Safe for concurrent use.
func (e *Engine) PathStats() []PathStats {
	h := &e.health
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]PathStats, 0, len(h.counts))
	for k, c := range h.counts {
		out = append(out, PathStats{Segment: k.segment, Transport: k.transport, Failovers: c.failovers, Failbacks: c.failbacks})
	}
	return out
}
