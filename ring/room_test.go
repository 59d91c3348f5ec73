package ring

import (
	"testing"
	"time"

	"github.com/moonring/moonring/sq"
)

// fillSQ submits Nops until r's SQ is full and returns how many it took.
func fillSQ(t *testing.T, h *harness) int {
	t.Helper()
	n := 0
	for {
		k, err := h.r.Submit([]sq.Entry{{Op: sq.Nop, UserData: uint64(n)}})
		n += k
		if err == ErrSQFull {
			return n
		}
		if err != nil {
			t.Fatalf("Submit: %v", err)
		}
	}
}

// TestWaitRoom: submitters waiting for room in a full SQ stay parked
// until the poller takes entries, and then every one of them returns (one
// wakeup passed on from waiter to waiter); a wait whose expiry fires
// first returns ErrSQFull, and a ring's Close ends a wait with ErrClosed.
func TestWaitRoom(t *testing.T) {
	h := newHarness(t, Config{Entries: 8}, &fakeEP{}, true)
	if n := fillSQ(t, h); n != 8 {
		t.Fatalf("a full SQ of 8 took %d entries", n)
	}
	const waiters = 3
	got := make(chan error, waiters)
	for range waiters {
		go func() { got <- h.r.WaitRoom(nil) }()
	}
	for h.r.roomWaiters.Load() < waiters {
		time.Sleep(time.Millisecond)
	}
	select {
	case err := <-got:
		t.Fatalf("WaitRoom returned %v with the SQ full and no step", err)
	case <-time.After(20 * time.Millisecond):
	}
	h.step() // takes the Nops: room for all
	for range waiters {
		select {
		case err := <-got:
			if err != nil {
				t.Fatalf("WaitRoom after a step: %v", err)
			}
		case <-time.After(hang):
			t.Fatal("a waiter was not woken when the poller took entries")
		}
	}
	h.poll()

	fillSQ(t, h)
	if err := h.r.WaitRoom(time.After(5 * time.Millisecond)); err != ErrSQFull {
		t.Fatalf("WaitRoom past its expiry: %v; want ErrSQFull", err)
	}

	go func() { got <- h.r.WaitRoom(nil) }()
	for h.r.roomWaiters.Load() < 1 {
		time.Sleep(time.Millisecond)
	}
	h.r.Close()
	select {
	case err := <-got:
		if err != ErrClosed {
			t.Fatalf("WaitRoom across Close: %v; want ErrClosed", err)
		}
	case <-time.After(hang):
		t.Fatal("Close left a waiter parked")
	}
	if n := h.r.roomWaiters.Load(); n != 0 {
		t.Fatalf("%d waiters counted after every wait ended", n)
	}
}

// TestWaitRoomLow: a submitter waiting for room in a full SQ of 16 stays
// parked while the poller takes entries one at a time (one slot in
// flight, each slice held by the transport until released) and fewer than
// a quarter of the SQ are free, and wakes once four are; a wait that
// expires with less room than that, but some, returns nil, not
// ErrSQFull.
func TestWaitRoomLow(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Entries: 16, MaxInFlight: 1}, ep, true)
	for i := range 16 {
		if n, err := h.r.Submit([]sq.Entry{h.write(uint64(i), 0, 0, 8)}); n != 1 || err != nil {
			t.Fatalf("entry %d: %d, %v", i, n, err)
		}
	}
	if _, err := h.r.Submit([]sq.Entry{h.write(99, 0, 0, 8)}); err != ErrSQFull {
		t.Fatalf("Submit to a full SQ: %v", err)
	}
	got := make(chan error, 1)
	go func() { got <- h.r.WaitRoom(nil) }()
	for h.r.roomWaiters.Load() < 1 {
		time.Sleep(time.Millisecond)
	}
	free := func() int { return h.r.sq.Cap() - h.r.sq.Len() }
	// One entry a step: the one slot is taken by the first WRITE, and
	// freed when the transport gives its slice back.
	for want := 1; want <= 3; want++ {
		h.step()
		if free() != want {
			t.Fatalf("after step %d: %d entries free, want %d", want, free(), want)
		}
		select {
		case err := <-got:
			t.Fatalf("WaitRoom returned %v with %d of 16 entries free", err, free())
		case <-time.After(10 * time.Millisecond):
		}
		if ep.release(1, nil) != 1 {
			t.Fatal("no slice held")
		}
	}
	h.step() // the fourth: a quarter free
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("WaitRoom with a quarter free: %v", err)
		}
	case <-time.After(hang):
		t.Fatalf("the waiter was not woken with %d of 16 entries free", free())
	}
	// Full again; the poller then frees one entry, less than it wakes
	// for: the wait, expiring, finds that room and returns nil.
	for free() > 0 {
		if _, err := h.r.Submit([]sq.Entry{h.write(50, 0, 0, 8)}); err != nil {
			t.Fatal(err)
		}
	}
	expire := make(chan time.Time)
	go func() { got <- h.r.WaitRoom(expire) }()
	for h.r.roomWaiters.Load() < 1 {
		time.Sleep(time.Millisecond)
	}
	ep.release(1, nil)
	h.step()
	if free() != 1 {
		t.Fatalf("%d entries free, want 1", free())
	}
	select {
	case err := <-got:
		t.Fatalf("WaitRoom returned %v with 1 of 16 entries free, before its expiry", err)
	case <-time.After(10 * time.Millisecond):
	}
	expire <- time.Now()
	if err := <-got; err != nil {
		t.Fatalf("WaitRoom expiring with an entry free: %v; want nil", err)
	}
	ep.setHold(false)
	ep.release(-1, nil)
}
