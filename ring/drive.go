// drive.go holds the caller driving its own requests: a submit that posts
// its entries on the caller's goroutine (the poller parked) and then reads
// their answers there too, on transports that allow it (transport.Driver),
// rather than sleep until a transport goroutine wakes it.

package ring

import (
	"context"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// SubmitDriven submits es as Submit does and, when this call posted them
// itself (the poller parked and the ring had no request in flight, see
// Submit) to an endpoint that is a transport.Driver, reads their answers
// on the caller's goroutine until w.Done(), deadline (UnixNano; 0: none)
// passes, or nothing is left in flight on the connection it reads. It is
// for a caller about to wait for what it submits
// (io_uring_submit_and_wait): it then waits as usual, and finds its
// completions in already. A Cancel, a timeout or Close ending one of the
// ring's requests meanwhile makes the driver leave once no answer is
// being read. Safe for
// concurrent use; w.Done must be cheap and safe to call from this
// goroutine.
func (r *Ring) SubmitDriven(es []sq.Entry, w transport.Until, deadline int64) (int, error) {
	if r.closed.Load() {
		return 0, ErrClosed
	}
	n := r.sq.PushQuiet(es)
	var d transport.Driver
	if n > 0 {
		d = r.poller.submittedDriven(r)
	}
	if r.closed.Load() {
		r.poller.drainClosed(r) // as in Submit
	}
	if d != nil {
		r.drvMu.Lock()
		r.drv = append(r.drv, d) // several callers may drive at once
		r.drvMu.Unlock()
		d.Drive(w, deadline)
		r.drvMu.Lock()
		for i, x := range r.drv {
			if x == d {
				last := len(r.drv) - 1
				r.drv[i], r.drv[last] = r.drv[last], nil
				r.drv = r.drv[:last]
				break
			}
		}
		r.drvMu.Unlock()
	}
	if n < len(es) {
		return n, ErrSQFull
	}
	return n, nil
}

// submittedDriven is submitted for SubmitDriven: when the submitter steps
// the rings itself, r's slices to the first Driver endpoint they go to are
// marked Driven, and that endpoint is returned for the submitter to drive
// (it must: see transport.Driver). Nil when nothing was driven.
func (p *Poller) submittedDriven(r *Ring) (d transport.Driver) {
	if p.borrow() {
		if r.active == 0 { // the token is held: r's table is ours to read
			r.driving = true
			more := p.stepLent()
			r.driving = false
			if r.drivenEP != nil {
				d = r.drivenEP.(transport.Driver)
				r.drivenEP = nil
			}
			p.giveBack()
			if !more {
				return d
			}
		} else {
			p.giveBack()
		}
	}
	p.bell.Ring()
	return d
}

// interruptDriver makes a SubmitDriven call driving an endpoint leave its
// reading and look at its condition again: the ring ended a request by
// timeout, cancel or close, which no answer the driver reads would show.
func (r *Ring) interruptDriver() {
	r.drvMu.Lock()
	defer r.drvMu.Unlock()
	for _, d := range r.drv {
		d.Interrupt() // cheap, never blocks
	}
}

// SubmitAndWait submits es and waits until at least n completions are
// ready, as Submit then CQ().Wait(ctx, n) would (io_uring_submit_and_wait).
// When it posts the entries itself (the poller parked, the ring idle) and
// ctx can never be canceled (context.Background, context.WithoutCancel),
// it also reads their answers on the caller's goroutine (SubmitDriven),
// which saves a goroutine hand-off per answer on transports that allow it
// (tcp); the wait then ends with the requests, each of which has its
// deadline (Timeout). A ctx that can end (a cancel, a deadline) is waited
// on as CQ().Wait does, without driving: a driver reading the socket would
// not see it end. It returns how many entries it submitted and the error
// of the submit (ErrSQFull: fewer fit) or of the wait. It reads the CQ:
// one goroutine at a time, as for CQ().Wait.
func (r *Ring) SubmitAndWait(ctx context.Context, es []sq.Entry, n int) (int, error) {
	var k int
	var err error
	if ctx.Done() == nil {
		r.until = cqUntil{q: r.cq, n: n}
		k, err = r.SubmitDriven(es, &r.until, 0)
	} else {
		k, err = r.Submit(es)
	}
	if err != nil {
		return k, err
	}
	return k, r.cq.Wait(ctx, n)
}

// cqUntil is SubmitAndWait's condition: n completions ready in q.
type cqUntil struct {
	q *cq.Ring
	n int
}

// Done implements transport.Until.
func (u *cqUntil) Done() bool { return u.q.Ready() >= u.n }
