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
