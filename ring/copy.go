// copy.go holds the synchronous copies: endpoints that move a slice on the
// poller's goroutine (transport.Copier and its BatchCopier, InlineCopier and
// HoldingCopier refinements), including the inline copy of a one-slice
// request that needs no slot at all.

package ring

import (
	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// Results of copyInline.
const (
	inlineNot   = iota // not tried: the request takes the normal way
	inlineDone         // completed (or failed for good)
	inlineRetry        // the copy failed and is worth a retry on another rail
)

// copyInline moves a one-slice request on a synchronous endpoint at once,
// without a slot: nothing between its checks and its completion lets go of
// the poller's goroutine, so no Uses can come in between, and the request
// needs no reference. It tries nothing when the endpoint is not
// synchronous, or batches (a BatchCopier) and more entries wait to join
// the batch, unless it can say per slice that batching gains nothing (an
// InlineCopier). An endpoint that can (HoldingCopier, InlineCopier) leaves
// its reference on the target's memory in r.holds, which step gives back
// at the end of the round and flush before it calls into any endpoint.
func (r *Ring) copyInline(e *sq.Entry, buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint], path *segtable.Path[transport.Endpoint], handle uint64, rindex uint32) int {
	ep := path.Endpoint
	if len(r.batch) > 0 && r.batchEP == ep {
		// Slices of earlier requests to this endpoint wait in the batch:
		// this one goes after them, as it would have.
		return inlineNot
	}
	op := transport.Read
	if e.Op == sq.Write {
		op = transport.Write
	}
	s := &r.inline
	fill := func() {
		s.Op, s.Class, s.Rail, s.LocalHandle, s.Token = op, r.cfg.Class, uint16(uint64(r.rail)%uint64(ep.Rails())), handle, 0
		s.Local, s.Remote, s.Length, s.RemoteIndex = buf.Pointer(e.Local), e.Remote, e.Length, rindex
	}
	var err error
	switch cp := ep.(type) {
	case transport.InlineCopier:
		fill()
		done := false
		done, err = cp.CopyNow(s, &r.holds)
		if !done {
			s.Local = nil
			return inlineNot
		}
	case transport.BatchCopier:
		if len(r.batch) > 0 || r.more {
			return inlineNot // it may join a batch
		}
		fill()
		err = cp.Copy(s)
	case transport.HoldingCopier:
		fill()
		err = cp.CopyHold(s, &r.holds)
	case transport.Copier:
		fill()
		err = cp.Copy(s)
	default:
		return inlineNot
	}
	s.Local = nil // no pointer into the buffer outlives the copy
	code := codeOf(err)
	if r.cfg.RetryLimit > 0 && (code == cq.CodeTransport || code == cq.CodeClosed) && isPath(err) && r.markFailed(seg, path) != path {
		r.inlineMoved, r.inlineCode = true, code // another path is up: start moves the request there
		return inlineRetry
	}
	if code == cq.CodeTransport && r.cfg.RetryLimit > 0 {
		return inlineRetry
	}
	r.rail++
	r.inlineBytes += e.Length
	bytes := e.Length
	if code != cq.CodeOK {
		bytes = 0
	}
	r.ended(seg, path.Transport, op, e.UserData, code, bytes, 0)
	return inlineDone
}

// copyBatch runs the batch on a synchronous endpoint. Each slice is checked
// live just before its copy: an earlier slice of the batch may have ended
// its request, whose buffer must then no longer be touched.
func (r *Ring) copyBatch(cp transport.Copier) {
	var copied uint64
	if bc, ok := cp.(transport.BatchCopier); ok {
		// Every slice moves before any result is applied: no request of
		// the batch can end (and its buffer go back to its owner) while a
		// slice of it is still being copied.
		k := 0
		for i := range r.batch {
			if q := r.live(r.batch[i].Token); q != nil {
				q.outstanding++
				r.outstanding++
				r.batch[k] = r.batch[i]
				k++
			}
		}
		errs := r.errs[:k]
		bc.CopyBatch(r.batch[:k], errs)
		for i := range k {
			r.applySlice(r.batch[i].Token, codeOf(errs[i]), errs[i] != nil && isPath(errs[i]))
			copied += r.batch[i].Length
		}
		clear(errs)
	} else {
		r.copyEach(cp, &copied)
	}
	if copied >= 256<<10 {
		r.poller.slow = true
	}
	clear(r.batch)
	r.batch = r.batch[:0]
	r.batchEP = nil
}

// copyEach moves the batch one slice at a time, each checked live just
// before its copy.
func (r *Ring) copyEach(cp transport.Copier, copied *uint64) {
	for i := range r.batch {
		s := &r.batch[i]
		q := r.live(s.Token)
		if q == nil {
			continue
		}
		q.outstanding++
		r.outstanding++
		err := copyOne(cp, s, &r.holds)
		r.applySlice(s.Token, codeOf(err), err != nil && isPath(err))
		*copied += s.Length
	}
}

// copyOne moves s on cp. An endpoint that can (a HoldingCopier) leaves
// its reference on the target's memory in h, so that a run of copies
// into one region takes and gives back its reference once, not once per
// slice: the reference is a counter that every copier into the region
// writes. A notification goes out with h emptied first: no reference is
// held across a call that may wait on another goroutine (see flush).
// The caller gives back what h holds when its run is done.
func copyOne(cp transport.Copier, s *transport.Slice, h *transport.Holds) error {
	if hc, ok := cp.(transport.HoldingCopier); ok && s.Op != transport.Notify {
		return hc.CopyHold(s, h)
	}
	h.Release()
	return cp.Copy(s)
}
