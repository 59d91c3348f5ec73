//go:build efa && cgo

// slot.go holds the operation slots: a slot is one operation's struct
// fi_context2 (in C memory) and the Go record beside it; its state says
// who owns the record (free, busy at the provider, abandoned, waiting for
// a retry, being expired), and whoever moves it from busy completes the
// slice, exactly once. Also the free-slot stack.

package efa

/*
#include "shim.h"
*/
import "C"

import (
	"runtime"
	"sync/atomic"

	"github.com/moonring/moonring/transport"
)

// chunk is how many slices one cgo call posts, and how many completions one
// Poll reads at most.
const chunk = 64

// Slot states. A slot is one operation's struct fi_context2 (in C memory)
// and the Go record beside it.
const (
	slotFree      = iota
	slotBusy      // posted; its completion is still to come
	slotAbandoned // completed to the engine already (timeout, Close); the provider still holds it
	slotRetry     // failed as if its connection broke; Poll posts it again when due
	slotExpiring  // expire is failing it, for a few instructions: then abandoned (or busy again)
)

// slot is the Go record of one operation. Post writes token, c, ep and
// posted, then publishes them with the store of state; whoever moves state
// from slotBusy with a CAS (Poll, the timeout scan, Close) owns the record
// and completes the slice, exactly once.
type slot struct {
	state  atomic.Uint32
	ep     atomic.Pointer[Endpoint]
	posted atomic.Int64 // UnixNano of the Post
	c      transport.Completer
	token  uint64
	gen    uint64    // the peer's generation at the Post
	peer   *peer     // the peer posted to; counted in its ops while busy or abandoned
	keys   *keyTable // the endpoint's keys at the Post, which op's rkey and raddr came from
	op     C.mr_op   // what was posted, for retries
	tries  int       // retries so far
	due    int64     // UnixNano when the retry is due
	failed int64     // UnixNano of the first failure, which started the retries
}

// claim is how deliver takes slot s whose operation the provider returned:
// busy becomes free (the caller completes the slice; slotBusy returned) or,
// with retry, slotRetry (slotRetry returned); abandoned becomes free
// (slotAbandoned returned: the slice was completed already). An expire
// holding the slot (slotExpiring) lets it go within a few instructions,
// and claim waits for that. Any other state is returned as it is.
func (s *slot) claim(retry bool) uint32 {
	to := uint32(slotFree)
	if retry {
		to = slotRetry
	}
	for {
		switch st := s.settle(); st {
		case slotAbandoned:
			if s.state.CompareAndSwap(slotAbandoned, slotFree) {
				return slotAbandoned
			}
		case slotBusy:
			if s.state.CompareAndSwap(slotBusy, to) {
				if retry {
					return slotRetry
				}
				return slotBusy
			}
		default:
			return st
		}
	}
}

// reclaim takes back slot s, which retryDue holds but did not post (set
// busy, or left in slotRetry when its peer was gone): with wait it goes
// back to slotRetry (slotRetry returned), else it is freed for the caller
// to fail its slice (slotBusy returned); if expire failed it meanwhile it
// is freed (slotAbandoned returned).
func (s *slot) reclaim(wait bool) uint32 {
	for {
		switch st := s.settle(); st {
		case slotBusy:
			if wait && s.state.CompareAndSwap(slotBusy, slotRetry) {
				return slotRetry
			}
			if !wait && s.state.CompareAndSwap(slotBusy, slotFree) {
				return slotBusy
			}
		case slotRetry:
			if s.state.CompareAndSwap(slotRetry, slotFree) {
				return slotBusy
			}
		case slotAbandoned:
			if s.state.CompareAndSwap(slotAbandoned, slotFree) {
				return slotAbandoned
			}
		default:
			return st
		}
	}
}

// settle waits until no expire holds s, and returns s's state then.
func (s *slot) settle() uint32 {
	for {
		if st := s.state.Load(); st != slotExpiring {
			return st
		}
		runtime.Gosched()
	}
}

// take pops up to len(dst) free slots into dst and returns how many.
func (t *Transport) take(dst []uint32) int {
	t.freeMu.Lock()
	n := min(len(dst), len(t.free))
	copy(dst, t.free[len(t.free)-n:])
	t.free = t.free[:len(t.free)-n]
	t.freeMu.Unlock()
	return n
}

func (t *Transport) release(idx []uint32) {
	if len(idx) == 0 {
		return
	}
	t.freeMu.Lock()
	t.free = append(t.free, idx...)
	t.freeMu.Unlock()
}
