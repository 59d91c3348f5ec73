//go:build efa && cgo

// poll.go holds the completions: Poll reads the completion queue in one
// cgo call and completes the slices (queueing those to retry), and the
// timeout scan abandons operations the provider holds too long.

package efa

/*
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"time"

	"github.com/moonring/moonring/transport"
)

// completion is a Complete call to make once no lock is held.
type completion struct {
	c     transport.Completer
	token uint64
	err   error
}

// Poll reads up to 64 completions from the completion queue in one cgo
// call (which is also what makes a software provider progress peers'
// operations on this side), completes their slices, and fails slices
// older than Config.Timeout. It returns how many slices it completed.
// Safe for concurrent use; pollers of the engine call it.
func (t *Transport) Poll() int {
	polls := t.polls.Add(1)
	var ents [chunk]C.cq_ent
	// pollMu, not the guard: a writer waiting for the guard behind a post
	// in the provider must not keep the progress that post may wait for.
	t.pollMu.RLock()
	if t.closed.Load() {
		t.pollMu.RUnlock()
		return 0
	}
	n := int(C.cq_poll(t.res, &ents[0], chunk))
	base := uintptr(t.ctxs) // under pollMu: Close clears it
	t.pollMu.RUnlock()
	nd := 0
	if n > 0 {
		nd = t.deliver(ents[:n], base)
	}
	if t.nretry.Load() > 0 {
		nd += t.retryDue()
	}
	if t.cfg.Timeout > 0 && polls%64 == 0 { // Add's own value: concurrent pollers could all miss a multiple of 64
		now := time.Now().UnixNano()
		last := t.lastScan.Load()
		if now-last > int64(min(t.cfg.Timeout/4, time.Second)) && t.lastScan.CompareAndSwap(last, now) {
			nd += t.scan(now - int64(t.cfg.Timeout))
		}
	}
	return nd
}

// deliver completes the slices of the completion entries ents (queueing
// those to retry), and returns how many it completed. base is the address
// of the operation contexts when the entries were read.
func (t *Transport) deliver(ents []C.cq_ent, base uintptr) int {
	var (
		done  [chunk]completion
		retry [chunk]uint32
		idle  [chunk]*peer // peers that may be dropped now
	)
	nd, nr, ni := 0, 0, 0
	// returned counts s's operation as given back by the provider and
	// notes its peer when that was the peer's last use.
	returned := func(s *slot) {
		if s.peer.returned() {
			idle[ni] = s.peer
			ni++
		}
	}
	{
		var freed [chunk]uint32
		nf := 0
		for _, ent := range ents {
			off := uintptr(ent.ctx) - base
			i := off / t.ctxSize
			if uintptr(ent.ctx) < base || off%t.ctxSize != 0 || i >= uintptr(len(t.slots)) {
				continue // not ours: a provider bug; nothing to complete
			}
			s := &t.slots[i]
			var err error
			retryable := false
			if ent.err != 0 {
				err = cqError(int(ent.err), int(ent.perr))
				// An operation that failed as if its connection broke
				// is posted once more, on a fresh connection: RMA is
				// idempotent, and tcp;ofi_rxm fails the operations that
				// follow a broken connection until it connects again.
				// (Retried enough, it fails: the state never leaves
				// busy, so a Close sweeping at once cannot see it twice.)
				retryable = errors.Is(err, transport.ErrPeer) && s.tries < maxTries && !s.ep.Load().closed.Load()
				if s.peer != nil && !s.peer.suspect.Load() {
					s.peer.suspect.Store(true)
				}
			} else if s.peer != nil && s.peer.suspect.Load() {
				s.peer.suspect.Store(false)
			}
			switch s.claim(retryable) {
			case slotAbandoned:
				// Timed out or closed meanwhile: the slice was failed
				// there; this was the provider's last word.
				returned(s)
				s.peer = nil
				freed[nf] = uint32(i)
				nf++
				continue
			case slotRetry:
				// The provider is done with it: retryDue counts it
				// again, for the peer it posts it to.
				returned(s)
				retry[nr] = uint32(i)
				nr++
				continue
			case slotBusy:
			default:
				continue // not the provider's: a provider bug
			}
			returned(s)
			s.peer = nil
			e := s.ep.Load()
			e.inflight.Add(-1)
			if e.closed.Load() || t.closing.Load() {
				err = errClosed
			}
			done[nd] = completion{s.c, s.token, err}
			s.c = nil
			nd++
			freed[nf] = uint32(i)
			nf++
		}
		t.release(freed[:nf])
	}
	if nr > 0 {
		t.queueRetries(retry[:nr])
	}
	// Before the slices complete: whoever waits on them then finds the
	// peers that they were the last use of gone (unless a Post holds the
	// guard: then soon after, see dropSoon).
	for _, p := range idle[:ni] {
		t.dropSoon(p)
	}
	for _, d := range done[:nd] {
		d.c.Complete(d.token, d.err)
	}
	return nd
}

var errTimeout = fmt.Errorf("efa: no completion from the provider within the timeout: %w", transport.ErrPeer)

// scan is Poll's timeout scan: expire of every endpoint's slots posted
// before cutoff, with errTimeout. Poll does not wait for the guard (see
// Transport.guard): when it is held, a goroutine waits for it and scans,
// one at a time, and Poll returns at once.
func (t *Transport) scan(cutoff int64) int {
	if t.guard.TryLock() {
		done := t.expireLocked(cutoff, nil, errTimeout)
		t.guard.Unlock()
		for _, d := range done {
			d.c.Complete(d.token, d.err)
		}
		return len(done)
	}
	if t.scanning.CompareAndSwap(false, true) {
		go func() {
			defer t.scanning.Store(false)
			t.expire(cutoff, nil, errTimeout)
		}()
	}
	return 0
}

// expire abandons the busy slots posted before cutoff (of endpoint e when
// not nil) and completes them with err. The provider still holds them: they
// become free when their completion comes, or at Close. It waits for the
// guard's write lock: not for the data path (scan).
func (t *Transport) expire(cutoff int64, e *Endpoint, err error) int {
	t.guard.Lock()
	done := t.expireLocked(cutoff, e, err)
	t.guard.Unlock()
	for _, d := range done {
		d.c.Complete(d.token, d.err)
	}
	return len(done)
}

// expireLocked is expire's scan; it returns the completions to make once
// the guard is free.
//
// It scans under the guard's write lock: Post and retryDue hold it shared
// from marking their slots busy until those are posted or taken back (a
// plain store to free), so every busy slot the scan sees is the
// provider's. (Without it, a scan could fail a slot that Post then gave
// back as not taken: the slice completed and posted again, or lost.)
func (t *Transport) expireLocked(cutoff int64, e *Endpoint, err error) []completion {
	var done []completion
	for i := range t.slots {
		s := &t.slots[i]
		if s.state.Load() != slotBusy || s.posted.Load() >= cutoff || (e != nil && s.ep.Load() != e) {
			continue
		}
		// Hold the slot while reading it: the provider may return the
		// operation at any moment, and deliver would free the slot and
		// Post reuse it under a plain abandoned state.
		if !s.state.CompareAndSwap(slotBusy, slotExpiring) {
			continue
		}
		if s.posted.Load() >= cutoff || (e != nil && s.ep.Load() != e) {
			s.state.Store(slotBusy) // reused since the check above
			continue
		}
		s.ep.Load().inflight.Add(-1)
		if s.peer != nil && err == errTimeout {
			s.peer.suspect.Store(true) // no word from it within the timeout
		}
		done = append(done, completion{s.c, s.token, err})
		s.c = nil
		s.state.Store(slotAbandoned)
	}
	return done
}
