// room.go holds the waiting of submitters for room in a ring's SQ: they
// park until the poller takes entries, rather than poll for it.

package ring

import "time"

// WaitRoom waits until r's SQ has room for an entry, and returns nil; it
// returns ErrClosed once the ring is closed, and ErrSQFull when expire
// fires first (a nil expire never does). The poller wakes the waiters
// when it takes entries from the SQ, so a submitter that found the SQ
// full parks without spending a CPU the poller and its copy workers
// need, and without a timer's wakeups: in process, the kv pattern's
// submitters (moonring bench --pattern kv) had spent most of the time
// they waited runnable, between Gosched calls, beside the poller. Room
// seen here may be taken by another submitter before the caller's Submit:
// submit, and wait again on ErrSQFull. Safe for concurrent use, by any
// number of waiters; it does not allocate.
func (r *Ring) WaitRoom(expire <-chan time.Time) error {
	r.roomWaiters.Add(1)
	defer r.roomWaiters.Add(-1)
	for {
		// After the count above: a poller that takes entries after this
		// look sees a waiter, and wakes it (see wakeRoom).
		if r.closed.Load() {
			return ErrClosed
		}
		if r.sq.Len() < r.sq.Cap() {
			if r.roomWaiters.Load() > 1 {
				r.wakeRoom() // one token wakes one waiter: pass it on
			}
			return nil
		}
		select {
		case <-r.room:
		case <-r.shut:
			return ErrClosed
		case <-expire:
			return ErrSQFull
		}
	}
}

// wakeRoom wakes a submitter waiting in WaitRoom, if any: the holder of
// the poller's token once it took entries from the SQ, or a waiter that
// found room, for the next one. A wake with no waiter left is a token
// the next waiter finds, looks at the SQ once more and waits again.
func (r *Ring) wakeRoom() {
	if r.roomWaiters.Load() > 0 {
		select {
		case r.room <- struct{}{}:
		default: // a token is waiting already
		}
	}
}
