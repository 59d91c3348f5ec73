package ring

import (
	"fmt"
	"testing"
	"time"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
)

// TestFullEndpointHoldsOnlyItsOwn: an endpoint without room (a peer that
// stopped reading: it holds the slices it took and refuses the rest)
// holds back its own request's slices, not the requests behind it for
// another endpoint, which complete (COMPLETED, not TIMEOUT: they no
// longer wait for the full endpoint's room);
// on a poller that parks (a submitter steps its rings) and on one that
// stays busy, and stepped by hand. Once the full endpoint takes its slices
// again its request completes too, every byte in place, and the ring keeps
// no queue for either endpoint.
func TestFullEndpointHoldsOnlyItsOwn(t *testing.T) {
	for _, mode := range []string{"manual", "parked", "busy"} {
		t.Run(mode, func(t *testing.T) {
			full := &fakeEP{hold: true, capacity: 2}
			cfg := Config{SliceSize: 64 << 10, Timeout: 2 * time.Second}
			var h *harness
			switch mode {
			case "manual":
				h = newHarness(t, cfg, full, true)
			case "parked":
				h = newHarness(t, cfg, full, false)
			default:
				h = newHarnessPoller(t, cfg, full, false, PollerConfig{Busy: true})
			}
			other := &fakeEP{mem: h.remote, base: full.base, rails: 1, out: map[uint64]bool{}}
			seg2, err := h.segs.Open("other", h.seg.Desc(), 0, 0, other, nil)
			if err != nil {
				t.Fatal(err)
			}
			fillPattern(h.local, 3)
			const n = 256 << 10 // 4 slices: the full endpoint takes 2
			es := []sq.Entry{h.write(1, 0, 0, n)}
			for i := uint64(0); i < 6; i++ {
				e := h.write(2+i, n+i*4096, n+i*4096, 4096)
				e.Segment = seg2.ID
				es = append(es, e)
			}
			h.submit(es...)
			for _, c := range h.collect(6) {
				expectCode(t, c, cq.CodeOK)
				if c.UserData < 2 {
					t.Fatalf("completion of request %d while its endpoint holds its slices", c.UserData)
				}
			}
			if got, want := string(h.remote[n:n+6*4096]), string(h.local[n:n+6*4096]); got != want {
				t.Fatal("the other endpoint's bytes differ")
			}
			full.setHold(false)
			var got []cq.Completion
			deadline := time.Now().Add(hang)
			for len(got) == 0 {
				if time.Now().After(deadline) {
					t.Fatal("hang: the full endpoint's request never completed")
				}
				full.release(-1, nil)
				got = h.poll()
				time.Sleep(time.Millisecond)
			}
			expectCode(t, got[0], cq.CodeOK)
			if string(h.remote[:n]) != string(h.local[:n]) {
				t.Fatal("the full endpoint's bytes differ")
			}
			checkPostedOnce(t, full, 4)
			h.fence()
			if q := h.r.Stats(); q.InFlight != 0 {
				t.Fatalf("%d in flight after every completion", q.InFlight)
			}
		})
	}
}

// TestQueuesDropped: a ring that posted to many endpoints, each refusing
// some slices for a while, keeps no queue for any of them once their
// requests are done (nothing per peer it no longer talks to).
func TestQueuesDropped(t *testing.T) {
	first := &fakeEP{hold: true, capacity: 1}
	h := newHarness(t, Config{SliceSize: 4096}, first, true)
	eps := []*fakeEP{first}
	ids := []segtable.SegmentID{h.seg.ID}
	for i := range 20 {
		ep := &fakeEP{mem: h.remote, base: first.base, rails: 1, out: map[uint64]bool{}, hold: true, capacity: 1}
		s, err := h.segs.Open(fmt.Sprint("peer", i), h.seg.Desc(), 0, 0, ep, nil)
		if err != nil {
			t.Fatal(err)
		}
		eps = append(eps, ep)
		ids = append(ids, s.ID)
	}
	var es []sq.Entry
	for i, id := range ids {
		e := h.write(uint64(i+1), 0, 0, 4*4096)
		e.Segment = id
		es = append(es, e)
	}
	h.submit(es...)
	h.step()
	if len(h.r.queues) != len(eps) {
		t.Fatalf("%d queues with %d endpoints refusing slices", len(h.r.queues), len(eps))
	}
	var got []cq.Completion
	deadline := time.Now().Add(hang)
	for len(got) < len(eps) {
		if time.Now().After(deadline) {
			t.Fatalf("hang: %d of %d completions", len(got), len(eps))
		}
		for _, ep := range eps {
			ep.release(-1, nil)
		}
		got = append(got, h.poll()...)
	}
	for _, c := range got {
		expectCode(t, c, cq.CodeOK)
	}
	for i := 0; i < 2*refillAfter; i++ {
		h.step() // the waiting rooms open with no slice out
	}
	if len(h.r.queues) != 0 || len(h.r.queueByEP) != 0 || h.r.queued != 0 {
		t.Fatalf("%d queues, %d by endpoint, %d queued after every request completed", len(h.r.queues), len(h.r.queueByEP), h.r.queued)
	}
}

// TestRefusedSlicesWaitWithTheirEndpoint: the slices an endpoint refuses
// for want of room wait on that endpoint's queue, not in the ring's redo
// list, which every round walks: rounds while the endpoint's waiting room
// is closed offer it nothing and walk none of them (the KV pattern's full
// TCP endpoint left dozens in that list at every completion). Once it
// has room again each slice is posted exactly once, in order, and every
// byte lands.
func TestRefusedSlicesWaitWithTheirEndpoint(t *testing.T) {
	full := &fakeEP{hold: true, capacity: 4}
	h := newHarness(t, Config{SliceSize: 4096, Timeout: 5 * time.Second}, full, true)
	fillPattern(h.local, 9)
	const slices = 40
	h.submit(h.write(1, 0, 0, slices*4096))
	h.step()
	if got := len(full.postsCopy()); got != 4 {
		t.Fatalf("the endpoint took %d slices, want its capacity, 4", got)
	}
	if len(h.r.redo) != 0 || h.r.qredo != slices-4 {
		t.Fatalf("refused slices: %d in the ring's redo list, %d on queues; want 0 and %d", len(h.r.redo), h.r.qredo, slices-4)
	}
	offered := full.offeredCount()
	for range 100 {
		h.step()
	}
	if got := full.offeredCount(); got != offered {
		t.Fatalf("%d slices offered to an endpoint whose waiting room is closed", got-offered)
	}
	if len(h.r.redo) != 0 || h.r.qredo != slices-4 {
		t.Fatalf("after 100 rounds: %d in the ring's redo list, %d on queues", len(h.r.redo), h.r.qredo)
	}
	full.setHold(false)
	var got []cq.Completion
	deadline := time.Now().Add(hang)
	for len(got) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("hang: the request never completed")
		}
		full.release(-1, nil)
		got = h.poll()
	}
	expectCode(t, got[0], cq.CodeOK)
	if string(h.remote[:slices*4096]) != string(h.local[:slices*4096]) {
		t.Fatal("the bytes differ")
	}
	checkPostedOnce(t, full, slices)
	prev := -1
	for _, s := range full.postsCopy() {
		_, _, i := splitToken(s.Token)
		if int(i) <= prev {
			t.Fatalf("slice %d posted after slice %d", i, prev)
		}
		prev = int(i)
	}
	if h.r.qredo != 0 || len(h.r.queues) != 0 {
		t.Fatalf("%d slices and %d queues left after the request", h.r.qredo, len(h.r.queues))
	}
}

func (f *fakeEP) offeredCount() int { f.mu.Lock(); defer f.mu.Unlock(); return f.offered }

// TestEndedRequestsTokensWakeNothing: the slices a request left waiting on
// a full endpoint's queue count for nothing once the request ends (here
// it times out while the endpoint holds four of its slices): the ring
// has no slice to post, so it sets no 100 µs timer to post them (a
// poller would wake ten thousand times a second while the endpoint stays
// full), and the queue drops them when it is next served.
func TestEndedRequestsTokensWakeNothing(t *testing.T) {
	full := &fakeEP{hold: true, capacity: 4}
	h := newHarness(t, Config{SliceSize: 4096, Timeout: 10 * time.Millisecond}, full, true)
	const slices = 40
	h.submit(h.write(1, 0, 0, slices*4096))
	h.step()
	if h.r.qredo != slices-4 {
		t.Fatalf("%d slices waiting on queues, want %d", h.r.qredo, slices-4)
	}
	if at := h.r.wakeAt(h.clock); at-h.clock > int64(time.Millisecond) {
		t.Fatalf("live slices wait for room, yet the ring wakes in %v", time.Duration(at-h.clock))
	}
	h.clock += int64(50 * time.Millisecond)
	h.step()
	if c := h.r.Peek(); c == nil || c.UserData != 1 || c.Status != cq.Timeout {
		t.Fatalf("completion %+v; want request 1 TIMEOUT", c)
	}
	h.r.Advance(1)
	if h.r.qredo != 0 {
		t.Fatalf("%d slices of an ended request still counted", h.r.qredo)
	}
	if at := h.r.wakeAt(h.clock); at-h.clock <= int64(time.Millisecond) {
		t.Fatalf("the ring wakes in %v for the slices of an ended request", time.Duration(at-h.clock))
	}
	full.setHold(false)
	full.release(-1, nil) // the endpoint's room opens: its queue drops the dead slices
	for range 3 {
		h.step()
	}
	if len(h.r.queues) != 0 || h.r.qredo != 0 {
		t.Fatalf("%d queues and %d slices left after the request", len(h.r.queues), h.r.qredo)
	}
	if got := len(full.postsCopy()); got != 4 {
		t.Fatalf("%d slices posted, want the 4 taken before the request ended", got)
	}
}
