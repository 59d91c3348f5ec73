package ring

import (
	"testing"
	"time"

	"github.com/moonring/moonring/cq"
)

// A request that waits for a slot while every slot is held by requests
// whose slices never come back still ends, TIMEOUT, within its deadline,
// and the poller wakes for it on its own (no other event arrives).
func TestBlockedHeadTimesOut(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Entries: 8, MaxInFlight: 2, Timeout: 50 * time.Millisecond}, ep, false)
	h.submit(h.write(1, 0, 0, 4096), h.write(2, 4096, 4096, 4096), h.write(3, 8192, 8192, 4096), h.write(4, 12288, 12288, 4096))
	seen := map[uint64]cq.Status{}
	deadline := time.Now().Add(hang) // a hang detector, not a timing assertion
	for len(seen) < 4 && time.Now().Before(deadline) {
		if c := h.r.Peek(); c != nil {
			seen[c.UserData] = c.Status
			h.r.Advance(1)
		} else {
			time.Sleep(time.Millisecond)
		}
	}
	if len(seen) < 4 {
		t.Fatalf("%d of 4 requests ended while every slot was held: %v", len(seen), seen)
	}
	for ud, st := range seen {
		if st != cq.Timeout {
			t.Errorf("request %d: %s; want TIMEOUT", ud, st)
		}
	}
	if n := ep.heldCount(); n != 2 {
		t.Errorf("%d slices posted; only the two requests with slots may post", n)
	}
}
