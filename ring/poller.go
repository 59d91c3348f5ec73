package ring

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/cpu"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// PollerConfig tunes a Poller. Zero fields take the defaults.
type PollerConfig struct {
	// Spin is how long the poller keeps polling after its last work before
	// it parks (default 20 µs; none while GOMAXPROCS is 1, where spinning
	// only keeps the process's other goroutines off the CPU). A parked
	// poller is woken by the next submission or slice completion.
	Spin time.Duration
	// Busy keeps the poller polling forever: lowest latency, one core.
	Busy bool
	// CPUs, when not empty, pins the poller's OS thread to these CPUs.
	CPUs []int
	// Pin is called on the poller's locked OS thread with CPUs when CPUs is
	// not empty; the engine passes topology.PinThread.
	Pin func(cpus []int) error
	// Promote is how long a ring waits, with work pending, behind busy
	// rings of a higher class before it is promoted for a round and takes
	// one entry (default 1 ms). See Config.Class.
	Promote time.Duration
	// CopyWorkers is how many goroutines share large batches of
	// synchronous copies (transport.Copier endpoints: plain memory) with
	// the poller, each taking a part of the batch's bytes (equal to the
	// poller's, or up to four times it while the workers wait for the
	// poller) while the poller copies the rest; 0: none. A worker polls for CopySpin
	// after a part, then parks until the next, and is pinned as the
	// poller is. See share.go.
	CopyWorkers int
	// CopySpin is how long a copy worker polls for its next job after
	// one before it parks (default 100 µs, DefaultCopySpin; negative:
	// none; none while GOMAXPROCS is 1). See nextJob in share.go.
	CopySpin time.Duration
}

// DefaultCopySpin is PollerConfig.CopySpin's default.
const DefaultCopySpin = 100 * time.Microsecond

// DefaultSpin is PollerConfig.Spin's default.
const DefaultSpin = 20 * time.Microsecond

// Poller is one goroutine that drains the rings of one NUMA node and drives
// the transports that need polling. Use NewPoller; it runs until Stop. Safe
// for concurrent use.
type Poller struct {
	_     cpu.CacheLinePad
	cfg   PollerConfig
	bell  *sq.Doorbell
	rings atomic.Pointer[[]*Ring]
	hooks atomic.Pointer[[]transport.Poller]

	mu       sync.Mutex // serializes attach, detach and Stop
	requests chan func()
	stop     chan struct{}
	done     chan struct{}
	pinErr   atomic.Pointer[error]
	// token is held by whoever steps the rings: the poller goroutine, or
	// while it is parked a completer or submitter it lent them to. Every
	// field of the rings that the docs call poller-owned belongs to the
	// holder. States: tokFree, tokHeld, tokWanted (see borrow, giveBack and
	// reclaim).
	token atomic.Int32
	// handoff passes the token from a borrower to the poller waiting for
	// it (tokWanted).
	handoff chan struct{}
	// parkUntil is when the parked poller's timer fires (token holder).
	parkUntil int64
	// asked counts callers of do and Stop: the loop looks at its channels
	// only when it is non-zero, not on every round.
	asked atomic.Int32
	_     cpu.CacheLinePad

	// The poller goroutine's own, on a line others do not read.
	// started, parked and parks are kept for Stats.
	started int64
	parked  int64
	parks   uint64
	// slow is set by rings (poller goroutine only) after a round that
	// copied enough bytes for the cached clock to fall behind.
	slow bool
	// oneP: see spin.
	oneP bool
	// copiers are the copy workers (nil without CopyWorkers).
	copiers *copiers
	// busyAt is, per class rank, when a ring of that class was last busy
	// (token holder; see noteBusy and heldAt).
	busyAt [transport.NumClasses]int64
	_      cpu.CacheLinePad
}

// NewPoller starts a poller.
func NewPoller(cfg PollerConfig) *Poller {
	if cfg.Spin == 0 {
		cfg.Spin = DefaultSpin
	}
	if cfg.CopySpin == 0 {
		cfg.CopySpin = DefaultCopySpin
	}
	if cfg.Promote <= 0 {
		cfg.Promote = DefaultPromote
	}
	p := &Poller{
		cfg:      cfg,
		bell:     sq.NewDoorbell(),
		requests: make(chan func(), 1),
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
		handoff:  make(chan struct{}, 1),
	}
	p.started = now()
	p.token.Store(tokHeld)
	if cfg.CopyWorkers > 0 {
		p.startCopiers(cfg.CopyWorkers)
	}
	go p.run()
	return p
}

// PinError returns the error of pinning the poller's thread, or a copy
// worker's (see PollerConfig.CopyWorkers), if any: the first one.
func (p *Poller) PinError() error {
	if e := p.pinErr.Load(); e != nil {
		return *e
	}
	return nil
}

// do runs fn on the poller goroutine and waits for it.
func (p *Poller) do(fn func()) error {
	ran := make(chan struct{})
	p.asked.Add(1)
	defer p.asked.Add(-1)
	select {
	case p.requests <- func() { fn(); close(ran) }:
	case <-p.done:
		return ErrClosed
	}
	p.bell.Ring()
	select {
	case <-ran:
		return nil
	case <-p.done:
		select {
		case <-ran:
			return nil // it ran before the poller stopped: the caller must not run it again
		default:
			return ErrClosed
		}
	}
}

func (p *Poller) attach(r *Ring) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.stop:
		return fmt.Errorf("ring: poller stopped: %w", ErrClosed)
	default:
	}
	p.update(func(rs []*Ring) []*Ring { return insertByClass(rs, r) })
	return nil
}

// update replaces the ring list with fn's result; fn may run more than once.
func (p *Poller) update(fn func([]*Ring) []*Ring) {
	for {
		old := p.rings.Load()
		var rs []*Ring
		if old != nil {
			rs = *old
		}
		n := fn(rs)
		if p.rings.CompareAndSwap(old, &n) {
			return
		}
	}
}

// detach completes the ring's work with ErrClosed on the poller goroutine
// and removes it from the poller (after its last slice came back).
func (p *Poller) detach(r *Ring) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.do(r.shutdown) != nil {
		r.shutdown() // the poller is gone: nothing else touches the ring
	}
}

// drainClosed completes the entries left in the SQ of a closed ring: on
// the poller goroutine, or directly once it is gone (then mu keeps two
// callers from draining at once).
func (p *Poller) drainClosed(r *Ring) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.do(r.drainSQ) != nil {
		r.drainSQ()
	}
}

func (p *Poller) list() []*Ring {
	if rs := p.rings.Load(); rs != nil {
		return *rs
	}
	return nil
}

// AddHook makes the poller call h.Poll on every round.
func (p *Poller) AddHook(h transport.Poller) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var old []transport.Poller
	if hs := p.hooks.Load(); hs != nil {
		old = *hs
	}
	hs := append(slices.Clone(old), h)
	p.hooks.Store(&hs)
}

// RemoveHook undoes AddHook.
func (p *Poller) RemoveHook(h transport.Poller) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if hs := p.hooks.Load(); hs != nil {
		n := slices.DeleteFunc(slices.Clone(*hs), func(x transport.Poller) bool { return x == h })
		p.hooks.Store(&n)
	}
}

// Stop ends the poller after completing the work of its rings with
// ErrClosed. Rings attached to a stopped poller are closed.
func (p *Poller) Stop() {
	p.asked.Add(1)
	p.bell.Ring()
	p.mu.Lock()
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	p.mu.Unlock()
	<-p.done
}

// Wake wakes the poller if it is parked; transports with events to poll
// call it. Safe for concurrent use.
func (p *Poller) Wake() { p.bell.Ring() }

func (p *Poller) run() {
	defer close(p.done)
	// locked: the poller's thread is its own. A Gosched there hands the P
	// to another thread and back (35-40 µs here, not 0.1), so a busy
	// locked poller does not yield to goroutines it readied: the other
	// CPUs of the node run them.
	locked := len(p.cfg.CPUs) > 0 && p.cfg.Pin != nil
	if locked {
		// Locked for good: the thread ends with the poller rather than go
		// back to the scheduler still pinned to this node's CPUs.
		runtime.LockOSThread()
		if err := p.cfg.Pin(p.cfg.CPUs); err != nil {
			p.pinErr.Store(&err)
		}
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	p.oneP = runtime.GOMAXPROCS(0) == 1
	spin := p.spin()
	last := now()
	t := last
	lastYield := t
	busy := false // whether the last round did work
	for iter := 0; ; iter++ {
		// Reading the clock costs as much as a small request (20-25 ns
		// here, a seventh of a 4 KiB shm request), so it is read every
		// sixteenth round, or after a round that copied enough to take
		// long. Deadlines and spins are kept to within a few rounds.
		if iter&15 == 0 || p.slow {
			t = now()
			p.slow = false
		}
		rings := p.list()
		work, prune, woke := p.round(rings, t)
		if prune {
			p.prune()
		}
		if hs := p.hooks.Load(); hs != nil {
			for _, h := range *hs {
				if h.Poll() > 0 {
					work = true
				}
			}
		}
		if p.asked.Load() != 0 {
			select {
			case fn := <-p.requests:
				fn()
				work = true
			case <-p.stop:
				for _, r := range p.list() {
					r.closed.Store(true)
					r.shutdown()
					r.cq.Close()
				}
				// The workers' copies end before done: until then Uses
				// still asks this goroutine, which no longer answers,
				// rather than report a buffer free under a copy.
				p.stopCopiers()
				return
			default:
			}
		}
		if work {
			busy = true
			if !locked && (woke || t-lastYield > int64(yieldEvery)) {
				// A goroutine this round readied (a waiter of a CQ, of a
				// batch) sits on this thread's run queue until another
				// thread steals it, tens of µs on a busy machine: let it
				// run now.
				runtime.Gosched()
				lastYield = t
			}
			continue
		}
		if busy { // the first idle round: the spin starts now
			busy = false
			t = now()
			last = t
			spin = p.spin()
		}
		if p.cfg.Busy || t-last < spin || p.hooksInFlight() {
			if iter&63 == 0 {
				runtime.Gosched()
			}
			continue
		}
		// Park: arm the doorbell, look once more, sleep.
		p.bell.Arm()
		ready, held := p.ready(t)
		if ready || p.hooksInFlight() { // a hook's work may have come up since the check above
			p.bell.Disarm()
			continue
		}
		wait := time.Duration(1<<63 - 1)
		if held {
			// A ring waits behind a higher class: look again when its
			// linger may have passed (or its promotion come), without
			// spinning meanwhile, which would take a CPU the higher
			// class's work needs.
			wait = linger
		}
		for _, r := range rings {
			if !r.detached {
				wait = min(wait, time.Duration(r.wakeAt(t)-t))
			}
		}
		if hs := p.hooks.Load(); hs != nil && len(*hs) > 0 {
			wait = min(wait, time.Millisecond)
		}
		// An idle poller still looks up every 100 ms, so that work a lent
		// step adds (a new request's deadline) rarely comes before the
		// timer; when it does, the lender rings (see stepLent).
		wait = min(wait, maxPark)
		timer.Reset(max(wait, 0))
		p.parkUntil = t + int64(wait)
		parkedAt := now()
		p.parks++
		// While parked the poller lends its rings out: a transport goroutine
		// that completes a slice, or a caller that submits, takes the token
		// and steps them itself (see lend), sparing a wakeup of this
		// goroutine.
		p.token.Store(tokFree)
		var fn func()
		select {
		case <-p.bell.C():
		case <-timer.C:
		case fn = <-p.requests:
		case <-p.stop:
		}
		// Disarm first, so that nobody borrows from now on and the token
		// comes back promptly.
		p.bell.Disarm()
		p.reclaim()
		if fn != nil {
			fn()
		}
		timer.Stop()
		p.bell.Disarm()
		t = now()
		last = t
		if held {
			last -= spin // a round without work after this wake parks at once
		}
		p.parked += t - parkedAt
		p.oneP = runtime.GOMAXPROCS(0) == 1
		spin = p.spin()
	}
}

// round steps each ring once, in the order of their classes (see
// Config.Class): a ring of a lower class than one that is busy (see
// noteBusy) or was within linger is held. It reports whether any ring did
// work, whether a detached ring is done and can be pruned, and whether a
// ring's CQ woke a waiter.
func (p *Poller) round(rings []*Ring, t int64) (work, prune, woke bool) {
	for _, r := range rings {
		if r.detached {
			work = r.reap() || work
			prune = prune || !r.draining()
			continue
		}
		rank := r.cfg.Class.Rank()
		r.yieldAt = noYield
		if rings[0].cfg.Class.Rank() < rank && p.busyWithin(rank, t, stall) {
			r.yieldAt = yieldBytes // a ring of a higher class has work now or had lately
		}
		if r.step(t, p.heldAt(rank, t)) {
			work = true
		}
		p.noteBusy(r, rank, t)
		woke = r.cq.Woke() || woke
	}
	return work, prune, woke
}

// yieldEvery is how often a busy poller yields its thread even when it
// woke no CQ waiter: goroutines that a Sink readied (a batch's waiter) or
// that a transport's completion readied run within about this long.
const yieldEvery = 20 * time.Microsecond

// hooksInFlight reports whether a hook has work in flight that only its
// Poll sees finish (transport.InFlight): the poller does not park then.
func (p *Poller) hooksInFlight() bool {
	if hs := p.hooks.Load(); hs != nil {
		for _, h := range *hs {
			if f, ok := h.(transport.InFlight); ok && f.InFlight() {
				return true
			}
		}
	}
	return false
}

// spin returns how long to poll after the last work before parking. With
// one P nothing else of the process runs while the poller spins (its
// Gosched goes back to it): no submitter, no transport goroutine, not even
// the netpoller that would wake them, so work from them comes only after
// it parks, and the spin just delays it (by the whole spin, in the 8-byte
// READ latency with both processes on one CPU). Then it parks at once,
// unless a transport needs polling (hooks: RDMA, EFA, NVLink), whose
// completions only a Poll sees and which a parked poller looks at once a
// millisecond. oneP is GOMAXPROCS == 1 as the poller last looked, when it
// started or woke from a park (GOMAXPROCS can change at run time; asking
// takes the scheduler's lock, too dear for every idle spell).
func (p *Poller) spin() int64 {
	if p.oneP {
		if hs := p.hooks.Load(); hs == nil || len(*hs) == 0 {
			return 0
		}
	}
	return int64(p.cfg.Spin)
}

// Token states (Poller.token).
const (
	tokFree   int32 = iota // parked: a completer or submitter may borrow the rings
	tokHeld                // the poller or a borrower steps the rings
	tokWanted              // a borrower steps them and the poller waits for the token
)

// borrow takes the token of a parked poller for a goroutine that steps its
// rings itself (stepLent), and reports whether it did. The borrower gives
// it back with giveBack.
func (p *Poller) borrow() bool {
	return p.bell.Armed() && p.token.CompareAndSwap(tokFree, tokHeld)
}

// giveBack returns a borrowed token: to the poller when it waits for it,
// else to the parked poller's pool.
func (p *Poller) giveBack() {
	if !p.token.CompareAndSwap(tokHeld, tokFree) {
		// tokWanted: the poller woke and waits in reclaim; it owns the
		// token (held) from here.
		p.token.Store(tokHeld)
		p.handoff <- struct{}{}
	}
}

// reclaim takes the token back for the poller goroutine after a park. A
// borrower holding it hands it over when done: the poller sleeps meanwhile
// rather than spin. (It spun with Gosched before, and a borrower preempted
// while it held the token then waited for the spinning poller's time slice
// to run out: 1-4 ms on this VM's 2 vCPUs, in 1 % of 8-byte READs with
// submitters borrowing.)
func (p *Poller) reclaim() {
	for {
		if p.token.CompareAndSwap(tokFree, tokHeld) {
			return
		}
		if p.token.CompareAndSwap(tokHeld, tokWanted) {
			<-p.handoff
			return
		}
	}
}

// maxPark bounds a poller's sleep.
const maxPark = 100 * time.Millisecond

// stepLent runs one round of the rings on the caller's goroutine, for a
// caller that took the token of a parked poller, and reports whether the
// poller must wake: work is left, or a ring needs it before its timer.
func (p *Poller) stepLent() bool {
	t := now()
	wake := false
	for _, r := range p.list() {
		if r.detached {
			// A closed ring's last slices are the poller's to reap.
			wake = wake || !r.done.Empty()
			continue
		}
		rank := r.cfg.Class.Rank()
		held := p.heldAt(rank, t)
		wake = r.stepLent(t, held) || wake
		p.noteBusy(r, rank, t)
		if held && !r.sq.Empty() && p.parkUntil > t+int64(linger) {
			wake = true // the poller's timer must see the hold end
		}
		wake = wake || r.wakeAt(t) < p.parkUntil
	}
	return wake || len(p.requests) > 0
}

// PollerStats are a poller's counters.
type PollerStats struct {
	// Up is how long the poller has run; Parked how much of it it slept.
	// The rest it spent working or spinning.
	Up, Parked time.Duration
	// Parks counts the times it went to sleep.
	Parks uint64
	// CopyParks counts the times its copy workers went to sleep waiting
	// for a part (see PollerConfig.CopySpin).
	CopyParks uint64
}

// Stats returns the poller's counters, read on its goroutine (a round
// trip). Safe for concurrent use.
func (p *Poller) Stats() PollerStats {
	var st PollerStats
	p.do(func() {
		st = PollerStats{Up: time.Duration(now() - p.started), Parked: time.Duration(p.parked), Parks: p.parks}
	})
	if c := p.copiers; c != nil {
		st.CopyParks = c.parks.Load()
	}
	return st
}

// ready reports whether a round at t would find work, and whether a ring
// has work it may not start because a higher class holds it back (held:
// see heldAt).
func (p *Poller) ready(t int64) (ready, held bool) {
	for _, r := range p.list() {
		if r.detached {
			// Its slices still come back, and reaping them frees the
			// buffers and segments they hold (Uses).
			if !r.done.Empty() {
				return true, held
			}
			continue
		}
		if r.ready() {
			if r.done.Empty() && p.heldAt(r.cfg.Class.Rank(), t) {
				held = true
				continue
			}
			return true, held
		}
	}
	return len(p.requests) > 0, held
}

// prune drops detached rings whose slices have all come back. Detached
// rings with slices out stay listed so their completions are applied.
func (p *Poller) prune() {
	p.update(func(rs []*Ring) []*Ring {
		return slices.DeleteFunc(slices.Clone(rs), func(r *Ring) bool { return r.detached && !r.draining() })
	})
}

// Uses reports whether a request of the poller's rings, in flight or
// waiting for its slices to come back, names buf or seg (either may be
// nil). It asks the poller goroutine, so it sees every request that passed
// the Closing check. A stopped poller uses nothing.
func (p *Poller) Uses(buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint]) bool {
	used := false
	err := p.do(func() {
		for _, r := range p.list() {
			if r.uses(buf, seg) {
				used = true
				return
			}
		}
	})
	return err == nil && used
}
