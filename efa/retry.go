//go:build efa && cgo

// retry.go holds the retries: an operation that failed as if its
// connection broke is posted again, on a fresh connection (its peer
// reset), when due; Close of an endpoint drops those still waiting.

package efa

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"time"

	"github.com/moonring/moonring/transport"
)

// Retries of operations that failed as if their connection broke: at
// most maxTries, the n-th retryDelay<<(2n) after the failure.
const (
	maxTries   = 4
	retryDelay = time.Millisecond
)

// queueRetries resets the peers of the slots in idx (in slotRetry) and
// queues the slots for Poll to post again when due.
func (t *Transport) queueRetries(idx []uint32) {
	now := time.Now().UnixNano()
	var (
		last    *peer
		lastGen uint64
	)
	for _, i := range idx {
		s := &t.slots[i]
		if s.tries == 0 {
			// The peer the operation went to: after an Update, the
			// endpoint's peer is another, whose generations s.gen
			// does not count. (Once per peer and generation: those
			// after are no-ops, but may start goroutines, see soon.)
			if s.peer != last || s.gen != lastGen {
				t.reset(s.peer, s.gen)
				last, lastGen = s.peer, s.gen
			}
			s.failed = now
		}
		s.due = now + int64(retryDelay)<<(2*s.tries)
		s.tries++
	}
	t.retryMu.Lock()
	t.retries = append(t.retries, idx...)
	t.nretry.Store(int64(len(t.retries)))
	t.retryMu.Unlock()
}

// retryDue posts the queued retries that are due; those it cannot post it
// completes, and counts.
func (t *Transport) retryDue() int {
	var (
		idx  [chunk]uint32
		ops  [chunk]C.mr_op
		done [chunk]completion
	)
	now := time.Now().UnixNano()
	n := 0
	// Not RLock: Poll never waits for the guard (see Transport.guard).
	// While a writer holds it or waits, the retries wait for a later Poll.
	if !t.guard.TryRLock() {
		return 0
	}
	t.retryMu.Lock()
	for k := 0; k < len(t.retries) && n < chunk; {
		i := t.retries[k]
		if t.slots[i].due > now {
			k++
			continue
		}
		idx[n] = i
		n++
		t.retries[k] = t.retries[len(t.retries)-1]
		t.retries = t.retries[:len(t.retries)-1]
	}
	t.nretry.Store(int64(len(t.retries)))
	t.retryMu.Unlock()
	if n == 0 {
		t.guard.RUnlock()
		return 0
	}
	var (
		at   [chunk]uint8 // ops[j] is the slot idx[at[j]]
		ok   [chunk]bool  // idx[k]'s operation was posted
		wait [chunk]bool  // idx[k]'s operation waits for room at the provider
		idle [chunk]*peer // peers that may be dropped now
		dead [chunk]bool  // idx[k]'s peer is a shm peer whose process is gone
	)
	ni := 0
	m := 0
	if !t.closed.Load() {
		for k, i := range idx[:n] {
			s := &t.slots[i]
			// The endpoint's peer now (Update may have replaced the one
			// that failed), loaded under the guard: see drop. A gone one
			// (its address left the AV), or one whose descriptor no
			// longer lists efa (withdrawn), gets nothing: the slot fails
			// below, with ErrClosed when the endpoint closed.
			e := s.ep.Load()
			p := e.peer.Load()
			if p.gone.Load() || e.closed.Load() || e.withdrawn.Load() {
				continue
			}
			// A shm peer that died may hold the lock of its region: a
			// retry would spin in the provider as a Post would (see
			// exited.go).
			if p.pid != 0 && p.exitedPeer(now) {
				dead[k] = true
				continue
			}
			// Its rkey and remote address came from the keys of the
			// Post: after an Update (a restarted peer whose Go heap,
			// and provider-chosen keys, may well look the same) they
			// could name other memory. It fails instead, with ErrPeer,
			// and its caller's retry resolves it again.
			if e.keys.Load() != s.keys {
				continue
			}
			s.peer = p
			s.gen = p.gen.Load()
			s.op.dest = C.uint64_t(p.addr.Load())
			s.op.rc = 0
			ops[m] = s.op
			at[m] = uint8(k)
			m++
			p.ops.Add(1)
			s.posted.Store(now)
			s.state.Store(slotBusy)
		}
	}
	posted := 0
	if m > 0 {
		posted = int(C.mr_post(t.res, &ops[0], C.size_t(m)))
	}
	for j := 0; j < m; j++ {
		if j < posted && ops[j].rc == 0 {
			ok[at[j]] = true
			continue
		}
		s := &t.slots[idx[at[j]]]
		// Not taken (the provider's queue is full, as tcp;ofi_rxm's is
		// while it connects again): it waits for room, within the
		// timeout that counts from the failure.
		wait[at[j]] = j >= posted && (t.cfg.Timeout < 0 || now-s.failed < int64(t.cfg.Timeout)) // < 0: no timeout
		if p := s.peer; p.returned() {
			idle[ni] = p
			ni++
		}
	}
	nd, nf, nw := 0, 0, 0
	var freed, waiting [chunk]uint32
	for k, i := range idx[:n] {
		if ok[k] {
			continue
		}
		s := &t.slots[i]
		switch s.reclaim(wait[k]) {
		case slotRetry:
			s.peer = nil
			s.due = now + int64(retryDelay)
			waiting[nw] = i
			nw++
			continue
		case slotAbandoned:
			// Endpoint.Close expired it, and completed its slice: the
			// provider never had it, so no completion will free the
			// slot; free it here.
			s.peer = nil
			freed[nf] = i
			nf++
			continue
		case slotBusy:
		default:
			continue
		}
		s.peer = nil
		e := s.ep.Load()
		e.inflight.Add(-1)
		err := errPeerRetry
		if t.closed.Load() || e.closed.Load() {
			err = errClosed
		} else if dead[k] {
			err = errPeerExited
		}
		done[nd] = completion{s.c, s.token, err}
		s.c = nil
		nd++
		freed[nf] = i
		nf++
	}
	if nw > 0 {
		t.retryMu.Lock()
		t.retries = append(t.retries, waiting[:nw]...)
		t.nretry.Store(int64(len(t.retries)))
		t.retryMu.Unlock()
	}
	t.guard.RUnlock()
	t.release(freed[:nf])
	for _, p := range idle[:ni] {
		t.dropSoon(p)
	}
	for _, d := range done[:nd] {
		d.c.Complete(d.token, d.err)
	}
	return nd
}

var errPeerRetry = fmt.Errorf("efa: operation failed, and could not be posted again on a fresh connection: %w", transport.ErrPeer)

// dropRetries fails with ErrClosed the slots of e that wait to be posted
// again (slotRetry, on the retry list): no completion from the provider
// will come for them. Under the guard's write lock, which retryDue holds
// shared while it posts or takes back the retries it popped; those it
// takes back it fails itself, with ErrClosed, as e is closed.
func (t *Transport) dropRetries(e *Endpoint) {
	var (
		done  []completion
		freed []uint32
	)
	t.guard.Lock()
	t.retryMu.Lock()
	k := 0
	for _, i := range t.retries {
		s := &t.slots[i]
		if s.ep.Load() != e || !s.state.CompareAndSwap(slotRetry, slotFree) {
			t.retries[k] = i
			k++
			continue
		}
		e.inflight.Add(-1)
		done = append(done, completion{s.c, s.token, errClosed})
		s.c, s.peer = nil, nil
		freed = append(freed, i)
	}
	t.retries = t.retries[:k]
	t.nretry.Store(int64(k))
	t.retryMu.Unlock()
	t.guard.Unlock()
	t.release(freed)
	for _, d := range done {
		d.c.Complete(d.token, d.err)
	}
}
