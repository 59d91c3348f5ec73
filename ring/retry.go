// retry.go holds the retries: slices that failed with a retryable error or
// that an endpoint refused are posted again, each failure moving the slice
// to the next rail, up to Config.RetryLimit; and failover: a slice that
// failed for a reason of its path (the connection broke, the endpoint
// closed) moves its request to the segment's next path that is up.

package ring

import (
	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// postRedo posts again the slices that failed or were not accepted. The
// tokens are processed from one buffer while refusals (and retries that a
// synchronous flush produces) gather in the other: no allocation per round.
// A slice whose endpoint's waiting room is closed (see waiting), or that
// its endpoint refuses, moves to that endpoint's queue (postQueue.redo),
// which posts it again once the room opens; the others go on.
func (r *Ring) postRedo() bool {
	redo := r.redo
	r.redo = r.spare[:0]
	work := false
	for i, tok := range redo {
		q := r.live(tok)
		if q == nil {
			continue
		}
		if r.outstanding+len(r.batch) >= r.done.Cap() {
			r.redo = append(r.redo, redo[i:]...)
			break
		}
		if ep := q.endpoint(); r.waitingFor(ep) || !r.add(q, tok) {
			r.redoOn(ep, tok) // posted again when ep's waiting room opens
			continue
		}
		work = true
	}
	r.spare = redo[:0]
	return work
}

// fail handles a slice that Post refused with an error.
func (r *Ring) fail(tok uint64, err error) {
	idx, _, _ := splitToken(tok)
	code := codeOf(err)
	if (code == cq.CodeTransport || code == cq.CodeClosed) && isPath(err) {
		r.pathFailed(idx, tok, code)
		return
	}
	r.retryOrFinish(idx, tok, code)
}

// retryOrFinish posts a slice that failed with code again on the next
// rail when the failure is retryable and the request has retries left;
// else it ends the request with code.
func (r *Ring) retryOrFinish(idx int32, tok uint64, code cq.Code) {
	q := &r.reqs[idx]
	if code == cq.CodeTransport && int(q.retries) < r.cfg.RetryLimit {
		q.retries++
		r.stats.Retries++
		r.logRetry(q, code)
		r.redo = append(r.redo, tok+attemptOne)
		return
	}
	r.finish(idx, code)
}

// Results of failover.
const (
	pathStay  = iota // no other path takes the request: retry or end as with one path
	pathMoved        // the request moved to another path; post the slice again
	pathDown         // the request may not leave its path, which is down now
)

// pathFailed handles a slice of request idx that failed with code for a
// reason of its path.
func (r *Ring) pathFailed(idx int32, tok uint64, code cq.Code) {
	switch r.failover(&r.reqs[idx]) {
	case pathMoved:
		r.redo = append(r.redo, tok+attemptOne)
	case pathDown:
		r.finish(idx, cq.CodeTransportDown)
	default:
		r.retryOrFinish(idx, tok, code)
	}
}

// failover moves q off its path after a failure of the path, when the
// segment has another path up that can take it: the local buffer is
// registered with that path's transport (and a staged one has a staged
// endpoint there that takes slices of q's size). The move costs one of
// the request's retries; the failures of slices that were still out on
// the path it left cost none, since they are the same failure. A request
// with sq.FlagTransportOnly does not move: it ends with
// CodeTransportDown once its path is marked down.
func (r *Ring) failover(q *request) int {
	if q.forgive > 0 {
		q.forgive--
		r.stats.Retries++
		return pathMoved
	}
	next := r.markFailed(q.seg, q.path)
	switch {
	case next == q.path:
		return pathStay
	case q.pinned:
		return pathDown
	case int(q.retries) >= r.cfg.RetryLimit:
		return pathStay
	}
	reg := q.buf.Regs[next.Transport].Load()
	if reg == nil || reg.Staged != q.staged {
		return pathStay
	}
	if q.staged || q.blocks != nil {
		// Its slices are cut already: the next path must take slices as
		// long (and have bounce buffers for a staged buffer).
		size := next.SliceSize
		if size == 0 {
			size = r.cfg.SliceSize
		}
		if (q.staged && next.Staged == nil) || MaxSlice(size) < q.maxSlice() {
			return pathStay
		}
	}
	from := q.path
	q.path, q.handle = next, reg.Handle
	q.forgive = q.outstanding
	q.retries++
	r.stats.Retries++
	r.stats.Failovers++
	if r.cfg.Logger != nil {
		r.cfg.Logger.Info("moonring: request moved to another path", "segment", q.seg.Name, "userdata", q.userData, "from_slot", from.Transport, "to_slot", next.Transport, "retry", q.retries)
	}
	return pathMoved
}

// markFailed reports a failure of path p of seg (segtable.Segment.Fail),
// tells the engine when it marked p down, and returns the path to take
// now: p when no other is up.
func (r *Ring) markFailed(seg *segtable.Segment[transport.Endpoint], p *segtable.Path[transport.Endpoint]) *segtable.Path[transport.Endpoint] {
	next, marked := seg.Fail(p)
	if marked && r.tables.PathDown != nil {
		r.tables.PathDown(seg, p)
	}
	return next
}

func (r *Ring) logRetry(q *request, code cq.Code) {
	if r.cfg.Logger != nil {
		r.cfg.Logger.Info("moonring: slice retried on another rail", "segment", q.seg.Name, "userdata", q.userData, "retry", q.retries, "err", code.Err())
	}
}
