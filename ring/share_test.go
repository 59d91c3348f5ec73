package ring

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/cq"
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
	failAt       uint64        // a copy of the slice there fails with ErrDenied (0: none)
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
