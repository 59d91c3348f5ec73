package ring

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// parEP is a fakeEP that copies synchronously and records how many copies
// ran at once: each copy waits (up to linger) for a second one to start.
// A copy of a slice at gateAt (an offset into R1) waits for gate first.
type parEP struct {
	*fakeEP
	inside, most atomic.Int32
	linger       time.Duration
	gateAt       uint64
	gate         chan struct{}
	gated        chan struct{} // closed when the gated copy waits
	failAt       uint64        // a copy of the slice there fails with ErrDenied (0: none), after the gated copy started when that is further on
	r1           uint64
}

func (p *parEP) Copy(s *transport.Slice) error {
	n := p.inside.Add(1)
	defer p.inside.Add(-1)
	for m := p.most.Load(); n > m && !p.most.CompareAndSwap(m, n); m = p.most.Load() {
	}
	if p.gate != nil && s.Remote == p.r1+p.gateAt {
		close(p.gated)
		<-p.gate
	}
	for end := time.Now().Add(p.linger); p.inside.Load() < 2 && time.Now().Before(end); {
		time.Sleep(50 * time.Microsecond)
	}
	if p.failAt != 0 && s.Remote == p.r1+p.failAt {
		if p.gated != nil && p.gateAt > p.failAt {
			// Fail once the gated copy (a worker's, further on) waits.
			select {
			case <-p.gated:
			case <-time.After(hang):
			}
		}
		return transport.ErrDenied
	}
	return p.move(s)
}

const shareBlock = 32 << 10

// shareWrites returns n WRITEs of shareBlock bytes, request i from local
// and remote offset i*shareBlock.
func shareWrites(h *harness, n int) []sq.Entry {
	var es []sq.Entry
	for i := range n {
		off := uint64(i) * shareBlock
		es = append(es, h.write(uint64(i), off, off, shareBlock))
	}
	return es
}

// TestCopyWorkersShare: with a copy worker, a batch of large synchronous
// copies moves on two goroutines at once (the poller and the worker), the
// data lands, and a slice that fails on the worker fails its request with
// its code; without workers no two copies ever overlap. The second half
// is the control: the first would fail without sharing.
func TestCopyWorkersShare(t *testing.T) {
	for _, workers := range []int{1, 0} {
		f := &fakeEP{}
		h := newHarnessPoller(t, Config{SliceSize: 64 << 10}, f, false, PollerConfig{CopyWorkers: workers})
		ep := &parEP{fakeEP: f, linger: 20 * time.Millisecond, r1: h.r1, failAt: 15 * shareBlock}
		h.seg.Path().Endpoint = ep
		fillPattern(h.local, 9)
		es := shareWrites(h, 16) // 512 KiB: all of R1
		h.submit(es...)
		for _, c := range h.collect(len(es)) {
			if c.UserData == 15 {
				expectCode(t, c, cq.CodeDenied)
			} else {
				expectCode(t, c, cq.CodeOK)
			}
		}
		for _, e := range es[:15] {
			r := e.Remote - h.r1
			if string(h.remote[r:r+e.Length]) != string(h.local[e.Local:e.Local+e.Length]) {
				t.Fatalf("workers %d: write %d: data differs", workers, e.UserData)
			}
		}
		st := h.r.Stats()
		switch {
		case workers > 0 && (ep.most.Load() < 2 || st.Shared == 0):
			t.Fatalf("with a worker: at most %d copies at once, %d slices shared; want 2 and some", ep.most.Load(), st.Shared)
		case workers == 0 && (ep.most.Load() != 1 || st.Shared != 0):
			t.Fatalf("without workers: %d copies at once, %d slices shared; want 1 and none", ep.most.Load(), st.Shared)
		}
		if st.InFlight != 0 {
			t.Fatalf("workers %d: %d requests still in the table", workers, st.InFlight)
		}
	}
}

// A worker queues its results request by request: while its copy of
// request 10 waits, the requests it copied before (its part starts at 8
// or earlier) complete, each once.
func TestCopyWorkerQueuesByRequest(t *testing.T) {
	f := &fakeEP{}
	h := newHarnessPoller(t, Config{SliceSize: 64 << 10}, f, false, PollerConfig{CopyWorkers: 1})
	ep := &parEP{fakeEP: f, r1: h.r1, gateAt: 10 * shareBlock, gate: make(chan struct{}), gated: make(chan struct{})}
	h.seg.Path().Endpoint = ep
	defer close(ep.gate)
	h.submit(shareWrites(h, 16)...)
	select {
	case <-ep.gated:
	case <-time.After(hang):
		t.Fatal("the gated copy never started")
	}
	seen := map[uint64]bool{}
	for _, c := range h.collect(10) {
		expectCode(t, c, cq.CodeOK)
		if c.UserData >= 10 || seen[c.UserData] {
			t.Fatalf("completion of %d while the worker holds 10-15 (seen %v)", c.UserData, seen)
		}
		seen[c.UserData] = true
	}
}

// TestCopyWorkerHoldsSlot: a request canceled while a worker copies its
// slice completes CANCELED at once, but keeps its slot (its buffer is in
// use) until the copy ends; and the poller's Stop waits for the worker.
func TestCopyWorkerHoldsSlot(t *testing.T) {
	f := &fakeEP{}
	h := newHarnessPoller(t, Config{SliceSize: 64 << 10}, f, false, PollerConfig{CopyWorkers: 1})
	// The worker takes the batch's tail, half its bytes: requests 8-15,
	// in order. Its first copy waits at the gate.
	ep := &parEP{fakeEP: f, r1: h.r1, gateAt: 8 * shareBlock, gate: make(chan struct{}), gated: make(chan struct{})}
	h.seg.Path().Endpoint = ep
	opened := false
	open := func() {
		if !opened {
			opened = true
			close(ep.gate)
		}
	}
	defer open()
	es := shareWrites(h, 16)
	h.submit(es...)
	select {
	case <-ep.gated:
	case <-time.After(hang):
		t.Fatal("the gated copy never started")
	}
	for _, c := range h.collect(8) {
		expectCode(t, c, cq.CodeOK)
		if c.UserData >= 8 {
			t.Fatalf("request %d completed while the worker holds it", c.UserData)
		}
	}
	h.submit(sq.Entry{Op: sq.Cancel, Remote: 8})
	c := h.collect(1)[0]
	expectCode(t, c, cq.CodeCanceled)
	if c.UserData != 8 {
		t.Fatalf("completion of %d; want the canceled 8", c.UserData)
	}
	if st := h.r.Stats(); st.InFlight != 8 {
		t.Fatalf("%d requests in the table; want 8 (the canceled one's slot held while its copy runs)", st.InFlight)
	}
	stopped := make(chan struct{})
	go func() {
		h.p.Stop()
		close(stopped)
	}()
	select {
	case <-stopped:
		t.Fatal("Stop returned while a worker was copying")
	case <-time.After(50 * time.Millisecond):
	}
	open()
	select {
	case <-stopped:
	case <-time.After(hang):
		t.Fatal("Stop did not return after the copy ended")
	}
	// The rest end once each: done, or closed with the poller.
	for _, c := range h.poll() {
		if c.UserData <= 8 || (c.Code != cq.CodeOK && c.Code != cq.CodeClosed) {
			t.Fatalf("after Stop: request %d with code %v", c.UserData, c.Code)
		}
	}
}

// TestCopyWorkerPolls: a copy worker with CopySpin polls for its next
// part rather than park between batches a little apart, and one without
// parks before each (PollerStats.CopyParks); both copy every part.
func TestCopyWorkerPolls(t *testing.T) {
	const rounds = 6
	for _, spin := range []time.Duration{time.Minute, -1} {
		f := &fakeEP{}
		h := newHarnessPoller(t, Config{SliceSize: 64 << 10}, f, false, PollerConfig{CopyWorkers: 1, CopySpin: spin})
		h.seg.Path().Endpoint = &plainCopier{f}
		fillPattern(h.local, 3)
		for range rounds {
			es := shareWrites(h, 16) // 512 KiB: shared
			h.submit(es...)
			for _, c := range h.collect(len(es)) {
				expectCode(t, c, cq.CodeOK)
			}
			time.Sleep(time.Millisecond) // the worker waits for the next
		}
		if st := h.r.Stats(); st.Shared < rounds {
			t.Fatalf("spin %v: %d slices shared; want some in each of %d batches", spin, st.Shared, rounds)
		}
		parks := h.p.Stats().CopyParks
		switch {
		case spin > 0 && parks != 0:
			t.Fatalf("spin %v: the worker parked %d times; want none", spin, parks)
		case spin < 0 && parks < rounds/2:
			t.Fatalf("no spin: the worker parked %d times in %d waits; want one a wait", parks, rounds+1)
		}
		if string(h.remote[:16*shareBlock]) != string(h.local[:16*shareBlock]) {
			t.Fatalf("spin %v: the bytes did not land", spin)
		}
	}
}

// plainCopier is a fakeEP that copies synchronously, one slice a call.
type plainCopier struct{ *fakeEP }

func (c *plainCopier) Copy(s *transport.Slice) error { return c.move(s) }

// TestShareNoHeadOfLine: with a copy worker, large one-slice copies
// submitted behind a request whose endpoint is full (its slices wait for
// room) are still copied at once, inline, rather than queued behind that
// request's unposted slices until their deadlines pass.
func TestShareNoHeadOfLine(t *testing.T) {
	f := &fakeEP{hold: true, capacity: 2}
	// A busy poller takes the entries itself: a submitter stepping a
	// parked poller's rings (lend) leaves every copy to it, and the
	// slices go through the ring's queue whatever sharing says, where a
	// ring waiting for room at one endpoint holds back the others
	// (waitingRoom; known, not this test's).
	h := newHarnessPoller(t, Config{SliceSize: 64 << 10, Timeout: 2 * time.Second}, f, false, PollerConfig{CopyWorkers: 1, Busy: true})
	cf := &fakeEP{mem: h.remote, base: f.base, rails: 1, out: map[uint64]bool{}}
	seg2, err := h.segs.Open("copier", h.seg.Desc(), 0, 0, &plainCopier{cf}, nil)
	if err != nil {
		t.Fatal(err)
	}
	small := func(ud, off uint64) sq.Entry {
		e := h.write(ud, off, off, shareBlock)
		e.Segment = seg2.ID
		return e
	}
	// 8 slices for the full endpoint, which takes 2 and holds them.
	h.submit(h.write(1, 0, 0, 512<<10), small(2, 0), small(3, shareBlock), small(4, 2*shareBlock))
	for _, c := range h.collect(3) {
		expectCode(t, c, cq.CodeOK)
		if c.UserData < 2 {
			t.Fatalf("completion of %d while its endpoint holds its slices", c.UserData)
		}
	}
	f.setHold(false)
	for len(h.poll()) == 0 {
		f.release(-1, nil)
		time.Sleep(time.Millisecond)
	}
}

// TestShareSkipsGone: the slices a worker holds of a request that ended
// meanwhile (a slice of the poller's part failed, and its completion is
// out) are not copied: the caller's READ buffer is left alone, but for the
// one slice the worker was copying when the request ended.
func TestShareSkipsGone(t *testing.T) {
	f := &fakeEP{}
	h := newHarnessPoller(t, Config{SliceSize: shareBlock}, f, false, PollerConfig{CopyWorkers: 1})
	// 16 slices of one READ: the poller copies 0-7, the worker 8-15, its
	// first waiting at the gate; slice 1 fails once it waits.
	ep := &parEP{fakeEP: f, r1: h.r1, failAt: 1 * shareBlock, gateAt: 8 * shareBlock, gate: make(chan struct{}), gated: make(chan struct{})}
	h.seg.Path().Endpoint = ep
	fillPattern(h.remote, 4)
	h.submit(h.read(1, 0, 0, 16*shareBlock))
	select {
	case <-ep.gated:
	case <-time.After(hang):
		t.Fatal("the gated copy never started")
	}
	expectCode(t, h.collect(1)[0], cq.CodeDenied)
	close(ep.gate)
	waitFor(t, "the worker's slices to come back", func() bool { return h.r.Stats().InFlight == 0 })
	for i, b := range h.local[9*shareBlock : 16*shareBlock] {
		if b != 0 {
			t.Fatalf("byte %d of the failed READ's buffer written after its completion", 9*shareBlock+i)
		}
	}
}

// TestShareWeighs: the poller's weight in a shared batch falls a step
// each time every worker is found idle, down to minWeight, stays while a
// worker has room, and climbs back a step each time the workers' queues
// are full, up to an equal share; share splits a batch's bytes by it.
func TestShareWeighs(t *testing.T) {
	c := &copiers{n: 1, free: make(chan *copyJob, jobsPerWorker), jobs: make(chan *copyJob, jobsPerWorker), pw: fullWeight}
	for range jobsPerWorker {
		c.free <- &copyJob{}
	}
	for i := 1; i <= fullWeight; i++ {
		want := max(fullWeight-i, minWeight)
		if got := c.weigh(); got != want {
			t.Fatalf("idle worker, step %d: weight %d; want %d", i, got, want)
		}
	}
	if got := c.weigh(); got != minWeight {
		t.Fatalf("idle worker at the floor: weight %d; want %d", got, minWeight)
	}
	for len(c.free) > 1 {
		<-c.free // the worker copies one part, and has others queued
		if got := c.weigh(); got != minWeight {
			t.Fatalf("worker busy, %d jobs free: weight %d; want it kept at %d", len(c.free), got, minWeight)
		}
	}
	<-c.free // and has every job
	for i := 1; i <= fullWeight; i++ {
		want := min(minWeight+i, fullWeight)
		if got := c.weigh(); got != want {
			t.Fatalf("backlogged worker, step %d: weight %d; want %d", i, got, want)
		}
	}
}

// parHoldEP is a parEP whose memory is one region with a reference count,
// as local's: CopyHold leaves the reference in the Holds it is given, Copy
// takes and drops its own.
type parHoldEP struct {
	*parEP
	ref      segtable.Ref
	acquires atomic.Int32
}

func (p *parHoldEP) Copy(s *transport.Slice) error { return p.CopyHold(s, nil) }

func (p *parHoldEP) CopyHold(s *transport.Slice, h *transport.Holds) error {
	held := h != nil && h.Has(&p.ref)
	ok, release := h.Take(&p.ref)
	if !ok {
		return transport.ErrDenied
	}
	if !held {
		p.acquires.Add(1)
	}
	err := p.parEP.Copy(s)
	if release {
		p.ref.Release()
	}
	return err
}

// TestCopyWorkerHolds: a batch shared with a copy worker, on an endpoint
// that can hold its reference (a HoldingCopier), takes the reference once
// per run of copies, on the poller and on the worker, not once per slice,
// and nothing holds it once the requests are done.
func TestCopyWorkerHolds(t *testing.T) {
	f := &fakeEP{}
	h := newHarnessPoller(t, Config{SliceSize: 64 << 10}, f, false, PollerConfig{CopyWorkers: 1})
	ep := &parHoldEP{parEP: &parEP{fakeEP: f, linger: 20 * time.Millisecond, r1: h.r1}}
	h.seg.Path().Endpoint = ep
	fillPattern(h.local, 9)
	es := shareWrites(h, 16)
	h.submit(es...)
	for _, c := range h.collect(len(es)) {
		expectCode(t, c, cq.CodeOK)
	}
	for _, e := range es {
		r := e.Remote - h.r1
		if string(h.remote[r:r+e.Length]) != string(h.local[e.Local:e.Local+e.Length]) {
			t.Fatalf("write %d: data differs", e.UserData)
		}
	}
	st := h.r.Stats()
	if ep.most.Load() < 2 || st.Shared == 0 {
		t.Fatalf("at most %d copies at once, %d slices shared; want 2 and some", ep.most.Load(), st.Shared)
	}
	if n := ep.ref.InUse(); n != 0 {
		t.Fatalf("%d references held after every request completed", n)
	}
	if a := ep.acquires.Load(); a > 4 {
		t.Fatalf("%d acquires for 16 slices in one round shared with one worker", a)
	}
	t.Logf("%d acquires, %d slices shared", ep.acquires.Load(), st.Shared)
}
