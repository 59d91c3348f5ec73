// retry.go holds the retries: slices that failed with a retryable error or
// that an endpoint refused are posted again, each failure moving the slice
// to the next rail, up to Config.RetryLimit.

package ring

import (
	"github.com/moonring/moonring/cq"
)

// postRedo posts again the slices that failed or were not accepted. The
// tokens are processed from one buffer while refusals (and retries that a
// synchronous flush produces) gather in the other: no allocation per round.
func (r *Ring) postRedo() bool {
	redo := r.redo
	r.redo = r.spare[:0]
	work := false
	for i, tok := range redo {
		q := r.live(tok)
		if q == nil {
			continue
		}
		if r.outstanding+len(r.batch) >= r.done.Cap() || !r.add(q, tok) {
			r.redo = append(r.redo, redo[i:]...)
			break
		}
		work = true
	}
	r.spare = redo[:0]
	return work
}

// fail handles a slice that Post refused with an error.
func (r *Ring) fail(tok uint64, err error) {
	idx, _, _ := splitToken(tok)
	q := &r.reqs[idx]
	code := codeOf(err)
	if code == cq.CodeTransport && int(q.retries) < r.cfg.RetryLimit {
		q.retries++
		r.stats.Retries++
		r.logRetry(q, code)
		r.redo = append(r.redo, tok+attemptOne)
		return
	}
	r.finish(idx, code)
}

func (r *Ring) logRetry(q *request, code cq.Code) {
	if r.cfg.Logger != nil {
		r.cfg.Logger.Info("moonring: slice retried on another rail", "segment", q.seg.Name, "userdata", q.userData, "retry", q.retries, "err", code.Err())
	}
}
