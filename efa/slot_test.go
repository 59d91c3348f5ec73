//go:build efa && cgo

package efa

import (
	"testing"
	"time"
)

// claim and reclaim wait while an expire holds a slot, then act on what
// the expire left: abandoned (freed, the slice completed already) or busy
// again (the slot had been reused; completed as usual).
func TestSlotClaimWaitsForExpire(t *testing.T) {
	for _, tc := range []struct {
		name  string
		after uint32 // what the expire stores
		claim uint32 // what claim returns
	}{
		{"abandoned", slotAbandoned, slotAbandoned},
		{"reverted", slotBusy, slotBusy},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s slot
			s.state.Store(slotExpiring)
			got := make(chan uint32, 1)
			go func() { got <- s.claim(false) }()
			select {
			case v := <-got:
				t.Fatalf("claim returned %d while an expire held the slot", v)
			case <-time.After(20 * time.Millisecond):
			}
			s.state.Store(tc.after)
			if v := <-got; v != tc.claim {
				t.Fatalf("claim returned %d; want %d", v, tc.claim)
			}
			if st := s.state.Load(); st != slotFree {
				t.Fatalf("state %d after claim; want free", st)
			}
		})
	}
	t.Run("retry", func(t *testing.T) {
		var s slot
		s.state.Store(slotBusy)
		if v := s.claim(true); v != slotRetry || s.state.Load() != slotRetry {
			t.Fatalf("claim(retry) = %d, state %d; want slotRetry both", v, s.state.Load())
		}
	})
	t.Run("reclaim", func(t *testing.T) {
		for _, tc := range []struct {
			from  uint32
			wait  bool
			want  uint32
			state uint32
		}{
			{slotBusy, true, slotRetry, slotRetry},
			{slotBusy, false, slotBusy, slotFree},
			{slotRetry, false, slotBusy, slotFree},
			{slotAbandoned, true, slotAbandoned, slotFree},
			{slotFree, false, slotFree, slotFree},
		} {
			var s slot
			s.state.Store(tc.from)
			if v := s.reclaim(tc.wait); v != tc.want || s.state.Load() != tc.state {
				t.Errorf("reclaim(%v) from %d = %d, state %d; want %d, state %d", tc.wait, tc.from, v, s.state.Load(), tc.want, tc.state)
			}
		}
	})
}
