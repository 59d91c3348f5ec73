// room.go holds the waiting of submitters for room in a ring's SQ: they
// park until the poller has taken a quarter of it, rather than poll for it.

package ring

import "time"

// WaitRoom waits until r's SQ has room, and returns nil; it returns
// ErrClosed once the ring is closed, and ErrSQFull when expire fires
// first with the SQ still full (a nil expire never does). It returns at
// once when the SQ has room for an entry. Else it parks until the poller
// has taken entries enough to leave a quarter of the SQ free (roomLow),
// or until expire, after which it returns nil if there is room for an
// entry by then. So a submitter that found the SQ full spends no CPU the
// poller and its copy workers need, and wakes once per quarter of the SQ,
// not once per few entries taken: in the kv pattern over shm (moonring
// bench --pattern kv), a submitter woken at every take ran 8 % of a CPU
// and kept the poller waiting to run 12 % of the time. Room seen here may
// be taken by another submitter before the caller's Submit: submit, and
// wait again on ErrSQFull. Safe for concurrent use, by any number of
// waiters; it does not allocate.
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
				r.passRoom() // one token wakes one waiter: pass it on
			}
			return nil
		}
		select {
		case <-r.room:
		case <-r.shut:
			return ErrClosed
		case <-expire:
			if r.sq.Len() < r.sq.Cap() {
				return nil // less room than the poller wakes for, but some
			}
			return ErrSQFull
		}
	}
}

// roomLow is the free room in r's SQ at which the poller wakes a waiting
// submitter: a quarter of the SQ, at least one entry. The entries still
// queued (three quarters) keep the poller busy while the submitter runs.
func (r *Ring) roomLow() int { return max(r.sq.Cap()/4, 1) }

// wakeRoom is the poller's, once it took entries from the SQ: it wakes a
// submitter waiting in WaitRoom, if any, when at least roomLow entries
// are free.
func (r *Ring) wakeRoom() {
	if r.roomWaiters.Load() > 0 && r.sq.Cap()-r.sq.Len() >= r.roomLow() {
		r.passRoom()
	}
}

// passRoom wakes a submitter waiting in WaitRoom, if any: the poller's
// (wakeRoom), or a waiter's that found room, for the next one. A wake
// with no waiter left is a token the next waiter finds, looks at the SQ
// once more and waits again.
func (r *Ring) passRoom() {
	if r.roomWaiters.Load() > 0 {
		select {
		case r.room <- struct{}{}:
		default: // a token is waiting already
		}
	}
}
