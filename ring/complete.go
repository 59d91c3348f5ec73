// complete.go holds completion: the Completer that transports report slices
// to, the poller applying their results to the in-flight table, requests
// ending (finished, canceled, timed out, closed) and the completions they
// write to the CQ or the Sink.

package ring

import (
	"errors"
	"math/bits"
	"slices"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// Complete implements transport.Completer: it queues the slice's result for
// the poller. Safe for concurrent use; it never blocks.
func (r *Ring) Complete(tok uint64, err error) {
	r.queueDone(tok, err)
	r.poller.lend()
}

// queueDone is Complete without getting the result seen to: the caller
// lends (or wakes) the poller once it has queued them all.
func (r *Ring) queueDone(tok uint64, err error) {
	d := doneOf(tok, err)
	if !r.done.PushOne(&d) {
		// Cannot happen: the poller posts at most done.Cap() slices at once.
		panic("ring: slice completion queue overrun")
	}
}

// queueDones queues the results ds of slices at once, as queueDone each.
func (r *Ring) queueDones(ds []sliceDone) {
	if r.done.Push(ds) != len(ds) {
		panic("ring: slice completion queue overrun") // as queueDone's
	}
}

// doneOf returns the result of the slice tok for the completion queue.
func doneOf(tok uint64, err error) sliceDone {
	return sliceDone{token: tok, code: codeOf(err), path: err != nil && isPath(err)}
}

// lend gets new work on the rings seen to: a slice completion (Complete) or
// new SQ entries (Submit). A parked poller lends its rings: the goroutine
// that brought the work steps them itself rather than wake it. For a
// completion that is one wakeup less between a response and its CQE; for a
// submission, the caller posts its own request (io_uring's mode without a
// polling thread), one wakeup less between a submit and the request on the
// wire. An awake poller costs one atomic load; it finds the work itself.
// The poller is woken only when the borrowed round leaves work, or when the
// rings are already borrowed (the borrower hands the token to the poller,
// see giveBack).
func (p *Poller) lend() {
	if p.borrow() {
		more := p.stepLent()
		p.giveBack()
		if !more {
			return
		}
	}
	p.bell.Ring()
}

// submitted gets new entries of r's SQ seen to. When the poller is parked
// and r has no request in flight, the submitter steps the rings itself
// (lend): one request at a time goes out with no wakeup. When r has
// requests in flight the poller is woken instead: more submissions and
// completions are on their way, and the poller gathers them into one
// write where a submitter stepping on each SubmitOne would write each
// frame with a syscall of its own (measured: moonring bench --ring, 32 in
// flight by SubmitOne, fell from 250-280 k to 137-150 k 4 KiB WRITEs a
// second when every Submit stepped).
func (p *Poller) submitted(r *Ring) {
	if p.borrow() {
		if r.active == 0 { // the token is held: r's table is ours to read
			more := p.stepLent()
			p.giveBack()
			if !more {
				return
			}
		} else {
			p.giveBack()
		}
	}
	p.bell.Ring()
}

func codeOf(err error) cq.Code {
	switch {
	case err == nil:
		return cq.CodeOK
	case errors.Is(err, transport.ErrDenied):
		return cq.CodeDenied
	case errors.Is(err, transport.ErrRange):
		return cq.CodeRemoteRange
	case errors.Is(err, transport.ErrClosed):
		return cq.CodeClosed
	case errors.Is(err, transport.ErrNotSupported):
		return cq.CodeNoTransport // the transport cannot do this at all (a notification over nvlink)
	}
	return cq.CodeTransport
}

// isPath reports whether err is a failure of the path rather than of the
// request: the connection to the peer broke (transport.ErrPeer) or the
// endpoint closed under the slice (transport.ErrClosed). Another path to
// the segment may carry the slice; a denied or out-of-range request would
// fail on any path.
func isPath(err error) bool {
	return errors.Is(err, transport.ErrPeer) || errors.Is(err, transport.ErrClosed)
}

// reap applies slice completions.
func (r *Ring) reap() bool {
	pos, n := r.done.Readable(256)
	for i := 0; i < n; i++ {
		d := r.done.Slot(pos + uint64(i))
		r.applySlice(d.token, d.code, d.path)
	}
	r.done.Release(n)
	r.reaped += uint64(n)
	return n > 0
}

func (r *Ring) applySlice(tok uint64, code cq.Code, path bool) {
	idx, gen, i := splitToken(tok)
	if int(idx) >= len(r.reqs) || r.reqs[idx].gen != gen || r.reqs[idx].state == stFree {
		r.stats.Stale++
		return
	}
	q := &r.reqs[idx]
	q.outstanding--
	r.outstanding--
	switch {
	case q.state == stZombie:
		if q.outstanding == 0 {
			r.release(idx)
		}
	case code == cq.CodeOK && i == q.nslices: // the notification was taken
		r.finish(idx, cq.CodeOK)
	case code == cq.CodeOK:
		q.bytes += q.sliceLen(i)
		q.done++
		if q.done == q.nslices {
			if q.notify {
				// Every byte is in place: now the notification.
				r.redo = append(r.redo, token(idx, gen, q.nslices))
			} else {
				r.finish(idx, cq.CodeOK)
			}
		}
	case path && (code == cq.CodeTransport || code == cq.CodeClosed):
		r.pathFailed(idx, tok, code)
	default:
		r.retryOrFinish(idx, tok, code)
	}
}

// finish completes a request; its slot is released when no slice is out.
func (r *Ring) finish(idx int32, code cq.Code) {
	q := &r.reqs[idx]
	if q.state != stActive {
		return
	}
	bytes := q.bytes
	if code != cq.CodeOK {
		bytes = 0 // a request that did not complete moved no bytes it can rely on
	}
	if q.list != nil {
		// Before the completion: a caller that frees the list once it
		// reaps it finds the storage free for its next (a zombie's
		// slices still out read no block).
		q.list.release()
		q.list, q.blocks = nil, nil
	}
	r.ended(q.seg, q.path.Transport, q.op, q.userData, code, bytes, max(r.now-q.started, 0))
	r.dequeue(idx)
	r.qredo -= int(q.qredo) // its tokens there are dead now
	q.qredo = 0
	q.state = stZombie
	if q.outstanding == 0 {
		r.release(idx)
	} else {
		q.gone.Store(true)
	}
}

// ended counts a finished request (took d ns, on the poller's clock) and
// queues its completion.
func (r *Ring) ended(seg *segtable.Segment[transport.Endpoint], slot int, op transport.Op, userData uint64, code cq.Code, bytes uint64, d int64) {
	if code != cq.CodeOK && r.cfg.Logger != nil {
		r.cfg.Logger.Info("moonring: request ended", "segment", seg.Name, "userdata", userData, "status", code.Status(), "err", code.Err())
	}
	r.countSegment(seg, slot, op, code, bytes)
	if code == cq.CodeOK {
		// The poller's clock of this round: no clock read per request.
		r.latency[min(bits.Len64(uint64(d)>>10), len(r.latency)-1)]++
		r.latencySum += d
	}
	r.complete(userData, code, bytes)
}

func (r *Ring) release(idx int32) {
	q := &r.reqs[idx]
	gen := (q.gen + 1) & (1<<genBits - 1)
	if gen == 0 {
		gen = 1
	}
	q.buf, q.seg, q.path = nil, nil, nil
	q.bytes, q.posted, q.done, q.outstanding, q.retries, q.forgive = 0, 0, 0, 0, 0, 0
	q.notify, q.tag, q.pinned = false, 0, false
	q.list, q.blocks, q.rvaries = nil, nil, false // the list released at finish
	q.gen, q.state = gen, stFree
	q.gone.Store(false)
	r.free = append(r.free, idx)
	r.active--
}

// complete queues a completion for the CQ (or the sink).
func (r *Ring) complete(userData uint64, code cq.Code, bytes uint64) {
	r.lastEnd = r.now
	r.stats.Codes[code]++
	switch code {
	case cq.CodeOK:
		r.stats.Requests++
		r.stats.Bytes += bytes
	case cq.CodeTimeout:
		r.stats.Timeouts++
		r.interruptDue = true
	case cq.CodeCanceled:
		r.stats.Canceled++
		r.interruptDue = true
	case cq.CodeClosed:
		r.stats.Failed++
		r.interruptDue = true
	default:
		r.stats.Failed++
	}
	if r.cfg.Sink != nil {
		// A field, not a local: a local passed to an interface method
		// would escape to the heap on every completion.
		r.sinkCQE = cq.Completion{UserData: userData, Bytes: bytes, Status: code.Status(), Code: code}
		r.cfg.Sink.Complete(&r.sinkCQE)
		return
	}
	r.cqes = append(r.cqes, cq.Completion{UserData: userData, Bytes: bytes, Status: code.Status(), Code: code})
	// While taking, cqes may grow past its capacity: take pops at most 64
	// entries (256 while filling a wide endpoint's batch), but posting one
	// can end earlier requests too (a failed post), so up to
	// 256+MaxInFlight; rare, and the capacity is kept.
	if len(r.cqes) >= cap(r.cqes) && !r.taking {
		r.flushCQ()
	}
}

func (r *Ring) flushCQ() {
	if len(r.cqes) > 0 {
		r.cq.PostBatch(r.cqes)
		r.cqes = r.cqes[:0]
	}
	if r.interruptDue {
		r.interruptDue = false
		r.interruptDriver()
	}
}

// cancel finishes the active request with userData.
//
// A request taken in this round may have slices cut and not yet posted:
// they leave the batch first, since once the request's slot is released
// (at once, with no slice out) nothing may reach the transport in its name.
func (r *Ring) cancel(userData uint64) {
	for i := range r.reqs {
		if q := &r.reqs[i]; q.state == stActive && q.userData == userData {
			r.batch = slices.DeleteFunc(r.batch, func(s transport.Slice) bool { return s.Token&(1<<idxBits-1) == uint64(i) })
			r.finish(int32(i), cq.CodeCanceled)
			return
		}
	}
}

// expire times out overdue requests and computes the next deadline.
func (r *Ring) expire(t int64) {
	next := int64(1<<63 - 1)
	for i := range r.reqs {
		q := &r.reqs[i]
		if q.state != stActive {
			continue
		}
		if q.deadline <= t {
			r.finish(int32(i), cq.CodeTimeout)
		} else if q.deadline < next {
			next = q.deadline
		}
	}
	r.nextCheck = next
}

// shutdown completes everything with ErrClosed: entries left in the SQ and
// active requests. Poller only.
func (r *Ring) shutdown() {
	r.drainSQ()
	for i := range r.reqs {
		r.finish(int32(i), cq.CodeClosed)
	}
	r.flushCQ()
	r.detached = true
	r.shutOnce.Do(func() { close(r.shut) })
}

// drainSQ completes the entries left in the SQ with ErrClosed. Poller only.
func (r *Ring) drainSQ() {
	for {
		pos, n := r.sq.Peek(64)
		if n == 0 {
			break
		}
		for i := 0; i < n; i++ {
			if e := r.sq.Entry(pos + uint64(i)); e.Op != sq.Cancel {
				r.complete(e.UserData, cq.CodeClosed, 0)
			}
		}
		r.sq.Advance(n)
	}
	r.flushCQ()
}

// uses reports whether a request in the table (active or waiting for its
// slices) names buf or seg. Poller only.
func (r *Ring) uses(buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint]) bool {
	if r.active == 0 {
		return false
	}
	for i := range r.reqs {
		q := &r.reqs[i]
		if q.state != stFree && ((buf != nil && q.buf == buf) || (seg != nil && q.seg == seg)) {
			return true
		}
	}
	return false
}

// draining reports whether a detached ring still has slices out.
func (r *Ring) draining() bool { return r.active > 0 }
