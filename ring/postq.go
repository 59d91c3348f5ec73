// postq.go holds the queues of requests with slices left to post, one per
// endpoint, and each endpoint's waiting room: an endpoint that refused
// slices for want of room holds back its own queue, never another
// endpoint's.

package ring

import "github.com/moonring/moonring/transport"

// postQueue is one endpoint's FIFO of requests with slices left to post,
// linked through their slots (request.qnext, qprev: no allocation per
// request), and its waiting room (see waiting). A queue lives while it
// holds requests or its endpoint's waiting room is closed; the ring then
// drops it (pruneQueues) and keeps it for reuse.
type postQueue struct {
	ep         transport.Endpoint
	head, tail int32 // request slots, noSlot when empty
	// redo holds the slices ep refused for want of room (and slices
	// to post again that found its waiting room closed), posted again
	// before the queue's requests once the room opens. Kept here, not in
	// the ring's redo list, a waiting endpoint's refused slices cost a
	// round nothing: in the one list every round walked them all, and the
	// KV pattern's full TCP endpoint left dozens there at every
	// completion.
	redo []uint64
	// full is set when ep refused slices for want of room; fullAt is the
	// ring's reaped count then.
	full   bool
	fullAt uint64
}

// noSlot ends a queue's chain of slots.
const noSlot = -1

// maxSpareQueues bounds the dropped queues a ring keeps for reuse.
const maxSpareQueues = 64

// endpoint returns the endpoint q's slices go to now.
func (q *request) endpoint() transport.Endpoint {
	if q.staged {
		return q.path.Staged
	}
	return q.path.Endpoint
}

// queueOf returns ep's queue, made when make is set and there is none
// (else nil).
func (r *Ring) queueOf(ep transport.Endpoint, make bool) *postQueue {
	if pq := r.lastQ; pq != nil && pq.ep == ep {
		return pq
	}
	pq := r.queueByEP[ep]
	if pq == nil {
		if !make {
			return nil
		}
		if n := len(r.spareQ); n > 0 {
			pq = r.spareQ[n-1]
			r.spareQ = r.spareQ[:n-1]
		} else {
			pq = new(postQueue)
		}
		*pq = postQueue{ep: ep, head: noSlot, tail: noSlot, redo: pq.redo[:0]}
		r.queueByEP[ep] = pq
		r.queues = append(r.queues, pq)
	}
	r.lastQ = pq
	return pq
}

// enqueue appends request idx, which has slices left to post, to its
// endpoint's queue, and returns the queue.
func (r *Ring) enqueue(idx int32) *postQueue {
	q := &r.reqs[idx]
	pq := r.queueOf(q.endpoint(), true)
	q.pq, q.qnext, q.qprev = pq, noSlot, pq.tail
	if pq.tail == noSlot {
		pq.head = idx
	} else {
		r.reqs[pq.tail].qnext = idx
	}
	pq.tail = idx
	r.queued++
	return pq
}

// dequeue takes request idx out of its queue, if it is in one.
func (r *Ring) dequeue(idx int32) {
	q := &r.reqs[idx]
	pq := q.pq
	if pq == nil {
		return
	}
	if q.qprev == noSlot {
		pq.head = q.qnext
	} else {
		r.reqs[q.qprev].qnext = q.qnext
	}
	if q.qnext == noSlot {
		pq.tail = q.qprev
	} else {
		r.reqs[q.qnext].qprev = q.qprev
	}
	q.pq, q.qnext, q.qprev = nil, noSlot, noSlot
	r.queued--
}

// redoOn queues tok, a slice for ep, on ep's queue to post again (see
// postQueue.redo).
func (r *Ring) redoOn(ep transport.Endpoint, tok uint64) {
	q := r.live(tok)
	if q == nil {
		return // its request ended: nothing to post
	}
	pq := r.queueOf(ep, true)
	pq.redo = append(pq.redo, tok)
	q.qredo++
	r.qredo++
}

// postQueueRedo posts again the slices of pq's redo list, oldest first.
// It reports whether it added any, stop as postQueue does, and full when
// pq's endpoint refused slices again: the rest stay in the list, behind
// those it refused. The tokens of ended requests are dropped. A slice
// whose request a failover moved to another endpoint goes to the ring's
// redo list (when its old endpoint's queue is served: its waiting room
// open; the request waits for its slices out on the old path anyway).
func (r *Ring) postQueueRedo(pq *postQueue) (work, stop, full bool) {
	redo := pq.redo
	pq.redo = r.qspare[:0] // a refusal while posting appends here
	i := 0
	for ; i < len(redo); i++ {
		tok := redo[i]
		q := r.live(tok)
		if q == nil {
			continue
		}
		if r.outstanding+len(r.batch) >= r.done.Cap() {
			stop = true
			break
		}
		q.qredo-- // it leaves the list: posted, moved, or back through redoOn
		r.qredo--
		if q.endpoint() != pq.ep {
			r.redo = append(r.redo, tok)
			continue
		}
		if !r.add(q, tok) {
			q.qredo++ // kept, at the head of the rest
			r.qredo++
			full = true
			break
		}
		work = true
	}
	for _, tok := range redo[i:] {
		if r.live(tok) != nil {
			pq.redo = append(pq.redo, tok)
		}
	}
	r.qspare = redo[:0]
	return work, stop, full
}

// refused closes ep's waiting room: ep refused slices for want of room.
func (r *Ring) refused(ep transport.Endpoint) {
	pq := r.queueOf(ep, true)
	pq.full, pq.fullAt = true, r.reaped
}

// waiting reports whether pq's endpoint refused slices for want of room
// and the ring waits before offering it more: until refillAfter of the
// ring's slices, or all of those out when fewer, have completed since. An
// offer before then is refused again, and each refused slice costs an add
// and a Post's look: a queue of thousands of slices behind a full
// endpoint (the KV pattern's 16,384 transfers a request) paid that for a
// whole batch at every completion. With none of the ring's slices out
// (the room went to another ring's) nothing holds it back: the ring
// offers again at its next round, which wakeAt brings within 100 µs.
// Other endpoints' queues go on meanwhile: one peer without room (a
// partitioned host) does not hold up the slices for the others.
func (r *Ring) waiting(pq *postQueue) bool {
	if !pq.full {
		return false
	}
	if r.reaped-pq.fullAt < uint64(min(refillAfter, r.outstanding)) {
		return true
	}
	pq.full = false
	return false
}

// waitingFor reports whether ep's waiting room is closed (see waiting).
func (r *Ring) waitingFor(ep transport.Endpoint) bool {
	pq := r.queueOf(ep, false)
	return pq != nil && r.waiting(pq)
}

// pruneQueues drops the queues that hold no request and whose waiting
// room is open, keeping them for reuse: a ring that has talked to many
// peers keeps no state for those it no longer has work for.
func (r *Ring) pruneQueues() {
	kept := r.queues[:0]
	for _, pq := range r.queues {
		if pq.head != noSlot || len(pq.redo) > 0 || r.waiting(pq) {
			kept = append(kept, pq)
			continue
		}
		delete(r.queueByEP, pq.ep)
		if r.lastQ == pq {
			r.lastQ = nil
		}
		pq.ep = nil
		if len(r.spareQ) < maxSpareQueues {
			r.spareQ = append(r.spareQ, pq)
		}
	}
	clear(r.queues[len(kept):])
	r.queues = kept
}
