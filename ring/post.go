// post.go holds slicing and posting: how a request is cut into slices, the
// queue of requests with slices left to post, the batch of slices bound to
// one endpoint, the notification that follows a request's data, and flush,
// which hands the batch to the endpoint's Post.

package ring

import (
	"unsafe"

	"github.com/moonring/moonring/transport"
)

// sliceCount returns how many slices a request of length n is cut into: a
// tail shorter than a quarter slice joins the slice before it.
func sliceCount(n, size uint64) uint32 {
	c := (n + size - 1) / size
	if c > 1 && n-(c-1)*size < size/4 {
		c--
	}
	if c > 1<<sliceBits-2 {
		// MaxLength keeps this out of reach; stay in range anyway, with
		// index c free for a notification.
		c = 1<<sliceBits - 2
	}
	return uint32(c)
}

// MaxSlice returns the longest slice a ring posts with slice size size:
// a tail shorter than a quarter slice joins the slice before it. (Requests
// of more than 2^28-2 slices would get a longer last slice; MaxLength
// keeps them out of reach.)
func MaxSlice(size uint64) uint64 {
	if size < 4 {
		return size
	}
	return size + size/4 - 1
}

// sliceRange returns the offset and length of slice i of a request.
func sliceRange(n, size uint64, count, i uint32) (off, length uint64) {
	off = uint64(i) * size
	if i == count-1 {
		return off, n - off
	}
	return off, size
}

// maxSlice returns the longest slice request q posts: its longest block
// for a list's, else MaxSlice of its slice size.
func (q *request) maxSlice() uint64 {
	if q.blocks != nil {
		return q.sliceSize
	}
	return MaxSlice(q.sliceSize)
}

// slice returns the local offset, remote address, length and remote
// buffer position of data slice i of request q: a cut of its range, or
// for a list's request its block i.
func (q *request) slice(i uint32) (local, remote, n uint64, rindex uint32) {
	if q.blocks == nil {
		off, n := sliceRange(q.length, q.sliceSize, q.nslices, i)
		return q.local + off, q.remote + off, n, q.rindex
	}
	b := &q.blocks[i]
	rindex = q.rindex
	if q.rvaries {
		// The blocks lie in several remote buffers: find this one's
		// again (a hint only: a transport checks it, and searches when
		// the descriptor changed since).
		if ri := q.seg.Resolve(b.Remote, b.Length); ri >= 0 {
			rindex = uint32(ri)
		}
	}
	return b.Local, b.Remote, b.Length, rindex
}

// sliceLen returns the length of data slice i of request q (slice's n,
// without the search).
func (q *request) sliceLen(i uint32) uint64 {
	if q.blocks != nil {
		return q.blocks[i].Length
	}
	_, n := sliceRange(q.length, q.sliceSize, q.nslices, i)
	return n
}

// live returns the active request a token names, or nil.
func (r *Ring) live(tok uint64) *request {
	idx, gen, _ := splitToken(tok)
	if int(idx) >= len(r.reqs) {
		return nil
	}
	q := &r.reqs[idx]
	if q.gen != gen || q.state != stActive {
		return nil
	}
	return q
}

// postPending appends the unposted slices of queued requests to the batch:
// each endpoint's queue in turn, starting one further each call, skipping
// those whose waiting room is closed (an endpoint without room holds back
// only its own queue); then drops the queues left empty.
func (r *Ring) postPending() bool {
	work := false
	n := len(r.queues)
	r.qturn++
	for k := 0; k < n; k++ {
		pq := r.queues[(r.qturn+k)%n]
		w, stop := r.postQueue(pq)
		work = work || w
		if stop {
			break
		}
	}
	r.pruneQueues()
	return work
}

// postQueue appends the slices of pq's redo list, then the unposted slices
// of its requests, oldest first, to the batch, until the queue is empty or
// its endpoint refuses slices.
// It reports whether it added any, and stop when the ring must stop
// posting this round: the completion queue could not take more, or the
// ring yields to a higher class (see yieldBytes).
func (r *Ring) postQueue(pq *postQueue) (work, stop bool) {
	if r.waiting(pq) {
		return false, false
	}
	if len(pq.redo) > 0 {
		w, stop, full := r.postQueueRedo(pq)
		if stop || full {
			return w, stop
		}
		work = w
	}
	for pq.head != noSlot {
		idx := pq.head
		q := &r.reqs[idx]
		if ep := q.endpoint(); ep != pq.ep {
			// A failover moved the request since it was queued.
			r.dequeue(idx)
			r.enqueue(idx)
			continue
		}
		if r.outstanding+len(r.batch) >= r.done.Cap() {
			return work, true
		}
		tok := token(idx, q.gen, q.posted)
		if !r.add(q, tok) {
			return work, false // pq's endpoint is full: its waiting room closed
		}
		work = true
		if r.live(tok) == nil {
			continue // a flush ended the request (and took it out of the queue)
		}
		q.posted++
		if q.posted >= q.nslices {
			r.dequeue(idx)
		}
		if r.inlineBytes >= r.yieldAt {
			return true, true // a higher class may be waiting: see yieldBytes
		}
	}
	return work, false
}

// add appends one slice to the batch, flushing first when the batch is full
// or bound to another endpoint. It reports false when tok's endpoint
// refused slices of its full batch (flush queued them for redo, and closed
// the endpoint's waiting room) and tok was not added: the caller keeps tok
// and stops posting to that endpoint for this round. A flush may also end q
// (a synchronous copy failed): then tok is dropped, and add reports true;
// callers check r.live(tok) before touching q again.
func (r *Ring) add(q *request, tok uint64) bool {
	ep := q.path.Endpoint
	if q.staged {
		ep = q.path.Staged
	}
	if len(r.batch) >= r.batchMax || (len(r.batch) > 0 && r.batchEP != ep) {
		// A refusal by another endpoint closes that one's waiting room
		// (flush), not ep's: tok goes into the emptied batch.
		other := r.batchEP != ep
		if !r.flush() && !other {
			return false
		}
		if r.live(tok) == nil {
			return true
		}
	}
	_, _, i := splitToken(tok)
	rails := ep.Rails()
	if len(r.batch) == 0 {
		r.batchMax = postWidth(ep)
	}
	r.batchEP = ep
	r.batch = r.batch[:len(r.batch)+1]
	sl := &r.batch[len(r.batch)-1]
	sl.Rail = uint16((uint64(q.rail) + uint64(i) + attempt(tok)) % uint64(rails))
	sl.Class = r.cfg.Class
	sl.Driven = false
	if r.driving {
		if r.drivenEP == nil {
			if _, ok := ep.(transport.Driver); ok {
				r.drivenEP = ep
			}
		}
		sl.Driven = r.drivenEP == ep
	}
	sl.LocalHandle = q.handle
	sl.Token = tok
	if i == q.nslices { // the notification, after every data slice
		msg := r.message(q.userData)
		sl.Op, sl.Remote, sl.Length, sl.RemoteIndex = transport.Notify, q.tag, uint64(len(msg)), 0
		sl.Local = unsafe.Pointer(unsafe.SliceData(msg))
		return true
	}
	local, remote, n, rindex := q.slice(i)
	if r.yieldAt != noYield {
		if _, ok := ep.(transport.Copier); ok {
			r.inlineBytes += n // copied on the poller at the flush
		}
	}
	r.postedBytes += n
	sl.Op = q.op
	sl.Local = q.buf.Pointer(local)
	sl.Remote, sl.Length, sl.RemoteIndex = remote, n, rindex
	return true
}

// Messenger is implemented by Sinks that attach a message to the
// notification of a request with FlagNotify.
type Messenger interface {
	// Message returns the message of userData's notification (at most
	// transport.MaxNotifyMessage bytes), valid until the request completes.
	Message(userData uint64) []byte
}

func (r *Ring) message(userData uint64) []byte {
	if m, ok := r.cfg.Sink.(Messenger); ok {
		return m.Message(userData)
	}
	return nil
}

// refillAfter is how many of the ring's slices complete, after an
// endpoint refused some for want of room, before the ring offers that
// endpoint slices again (fewer when fewer are out): see waiting.
const refillAfter = 16

// flush posts the batch and reports whether the endpoint took all of it.
func (r *Ring) flush() bool {
	if len(r.batch) == 0 {
		return true
	}
	// No reference is held across a call into an endpoint: one may wait
	// on a goroutine (shm's control socket reader) that waits for the
	// reference to go.
	r.holds.Release()
	if cp, ok := r.batchEP.(transport.Copier); ok {
		if r.lent {
			// Not on a borrowed goroutine: the poller copies these.
			for i := range r.batch {
				r.redo = append(r.redo, r.batch[i].Token)
			}
			clear(r.batch)
			r.batch = r.batch[:0]
			r.batchEP = nil
			r.deferred = true
			return true
		}
		r.share(cp)
		r.copyBatch(cp)
		return true
	}
	// Count the slices as outstanding before posting: a transport may
	// complete them inside Post.
	for _, s := range r.batch {
		r.reqs[s.Token&(1<<idxBits-1)].outstanding++
	}
	r.outstanding += len(r.batch)
	n, err := r.batchEP.Post(r, r.batch)
	n = min(max(n, 0), len(r.batch)) // slices before n were accepted, error or not
	rest := r.batch[n:]
	for _, s := range rest {
		r.reqs[s.Token&(1<<idxBits-1)].outstanding--
		r.outstanding--
	}
	if err == nil && len(rest) > 0 {
		r.refused(r.batchEP) // no room: see waiting
	}
	for _, s := range rest {
		switch {
		case err == nil:
			r.redoOn(r.batchEP, s.Token)
		case r.live(s.Token) != nil:
			r.fail(s.Token, err)
		}
	}
	all := n == len(r.batch)
	clear(r.batch) // drop pointers into buffers
	r.batch = r.batch[:0]
	r.batchEP = nil
	return all
}

// postWidth is how many slices a batch for ep holds: batchCap, or what a
// transport.WidePoster asks for, up to wideCap. A Copier keeps batchCap:
// its batches are shared with copy workers in jobs of that size.
func postWidth(ep transport.Endpoint) int {
	if _, ok := ep.(transport.Copier); ok {
		return batchCap
	}
	if w, ok := ep.(transport.WidePoster); ok {
		return min(max(w.PostWidth(), 1), wideCap)
	}
	return batchCap
}
