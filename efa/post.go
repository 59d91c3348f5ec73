//go:build efa && cgo

// post.go holds Post: slices checked against the peer's keys and the
// local registrations, posted as fi_writemsg / fi_readmsg, 64 per cgo
// call, with the backpressure of a provider whose queue is full.

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

var errPeerGone = fmt.Errorf("efa: the peer's address could not be inserted again after a failure: %w", transport.ErrPeer)

var errStalled = fmt.Errorf("efa: the provider took no operation for the peer within the timeout: %w", transport.ErrPeer)

var errWithdrawn = fmt.Errorf("efa: the peer's descriptor no longer lists an efa endpoint: %w", transport.ErrPeer)

var (
	errNotify   = fmt.Errorf("efa: notifications are not carried: %w", errors.Join(transport.ErrDenied, transport.ErrNotSupported))
	errRange    = fmt.Errorf("efa: %w", transport.ErrRange)
	errDenied   = fmt.Errorf("efa: no valid key for the range: %w", transport.ErrDenied)
	errLocal    = fmt.Errorf("efa: local range outside its registration: %w", transport.ErrRange)
	errTooLarge = fmt.Errorf("efa: slice longer than the provider's max_msg_size: %w", transport.ErrRange)
)

// Post posts the slices as fi_writemsg / fi_readmsg, one cgo call per 64
// slices. Slices that cannot be valid (range in no published buffer, no
// valid key, unknown local handle) are completed at once with an error. It
// accepts fewer slices when every slot is in flight or the provider's
// queue is full (-FI_EAGAIN): Poll frees both; and none while a change
// that posts must not overlap (Close, Unregister, an endpoint's Close, a
// peer's removal or reset, the timeout scan) holds the transport's lock
// or waits for it, which takes microseconds unless a post in progress
// waits for the provider. While the peer's
// descriptor lists no efa endpoint (see Update) it takes none, and fails
// with an error wrapping ErrPeer.
func (e *Endpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	t := e.t
	if len(s) == 0 {
		return 0, nil
	}
	if t.closing.Load() || e.closed.Load() {
		return 0, errClosed
	}
	if e.withdrawn.Load() {
		return 0, errWithdrawn
	}
	if f := e.peer.Load().full.Load(); f != 0 && f == t.polls.Load()+1 {
		return 0, nil // the provider's queue is full until the next Poll
	}
	done := 0
	for done < len(s) {
		n, more, err := e.post(c, s[done:min(len(s), done+chunk)])
		done += n
		if err != nil || !more {
			return done, err
		}
	}
	return done, nil
}

// post posts at most chunk slices, and says whether the provider and the
// slots may take more.
func (e *Endpoint) post(c transport.Completer, s []transport.Slice) (int, bool, error) {
	t := e.t
	var (
		ops   [chunk]C.mr_op
		at    [chunk]uint8  // ops[j] is the slice s[at[j]]
		idx   [chunk]uint32 // the slots taken
		fails [chunk]failure
	)
	nf := 0
	p := e.peer.Load()
	if f := p.full.Load(); f != 0 && f == t.polls.Load()+1 && !t.closing.Load() && !e.closed.Load() {
		return 0, false, nil // the provider's queue is full until the next Poll
	}
	if b := int(p.budget.Load()); b > 0 && b < len(s) {
		s = s[:b]
	}
	// Not RLock: a writer waiting for the guard behind another post in
	// the provider would keep this goroutine, an engine's poller maybe,
	// from polling (see Transport.guard). The slices wait for a later
	// Post, as when the provider's queue is full.
	if !t.guard.TryRLock() {
		return 0, false, nil
	}
	if t.closing.Load() || e.closed.Load() {
		t.guard.RUnlock()
		return 0, false, errClosed
	}
	// Again under the guard, which is what keeps drop from removing the
	// peer's address while its operations are counted and posted: an
	// Update since may have replaced the peer, and given it up.
	p = e.peer.Load()
	if p.gone.Load() {
		// Its address left the vector and could not come back (reset).
		t.guard.RUnlock()
		return 0, false, errPeerGone
	}
	now := time.Now().UnixNano()
	if p.pid != 0 && p.exitedPeer(now) {
		// A shm peer that died may have left the provider's lock in its
		// region held: a post would spin there for good.
		t.guard.RUnlock()
		return 0, false, errPeerExited
	}
	nslots := t.take(idx[:len(s)])
	if nslots == 0 {
		t.guard.RUnlock()
		return 0, false, nil
	}
	regs := t.regList()
	kp := e.keys.Load()
	gen := p.gen.Load()
	dest := C.uint64_t(p.addr.Load())
	var last *region
	end := len(s) // where the slots ran out
	m := 0
	for i := range s {
		sl := &s[i]
		var err error
		var kr *keyRange
		var r *region
		switch {
		case sl.Op == transport.Notify:
			err = errNotify
		case sl.Op != transport.Read && sl.Op != transport.Write:
			err = errRange
		case sl.Length > t.maxMsg:
			err = errTooLarge
		}
		if err == nil {
			var ok bool
			if kr, ok = kp.lookup(sl.Remote, sl.Length); !ok {
				err = errRange
			} else if !kr.ok {
				err = errDenied
			}
		}
		if err == nil {
			if last != nil && last.handle == sl.LocalHandle {
				r = last
			} else if r = findRegion(regs, sl.LocalHandle); r != nil {
				last = r
			}
			local := uint64(uintptr(sl.Local))
			if r == nil || local < r.addr || sl.Length > r.length || local-r.addr > r.length-sl.Length {
				err = errLocal
			}
		}
		if err != nil {
			fails[nf] = failure{i, err}
			nf++
			continue
		}
		if m == nslots {
			end = i
			break
		}
		k := idx[m]
		sp := &t.slots[k]
		sp.c, sp.token, sp.gen, sp.tries, sp.peer, sp.keys = c, sl.Token, gen, 0, p, kp
		sp.ep.Store(e)
		ops[m] = C.mr_op{
			local: C.uint64_t(uintptr(sl.Local)),
			len:   C.uint64_t(sl.Length),
			desc:  C.uint64_t(r.desc),
			raddr: C.uint64_t(sl.Remote - kr.delta),
			rkey:  C.uint64_t(kr.key),
			dest:  dest,
			ctx:   C.uint64_t(uintptr(t.ctxs) + uintptr(k)*t.ctxSize),
			op:    C.uint32_t(sl.Op),
		}
		sp.op = ops[m]
		sp.posted.Store(now)
		sp.state.Store(slotBusy)
		e.inflight.Add(1)
		at[m] = uint8(i)
		m++
	}
	posted := 0
	if m > 0 {
		// Counted before the provider has them: their completions may
		// come before mr_post returns.
		p.ops.Add(int64(m))
		posted = int(C.mr_post(t.res, &ops[0], C.size_t(m)))
	}
	accepted := end
	stall := false
	if posted < m {
		accepted = int(at[posted])
		since := p.stalled.Load()
		if posted > 0 {
			p.stalled.Store(0)
		} else if p.full.Store(t.polls.Load() + 1); since == 0 {
			p.stalled.Store(now)
		} else if t.cfg.Timeout > 0 && now-since > int64(t.cfg.Timeout) {
			// The provider has taken nothing for this peer for a whole
			// timeout (tcp;ofi_rxm does so while it cannot connect):
			// the slices fail as a broken peer's would.
			stall = true
			accepted = end
			for j := posted; j < m; j++ {
				fails[nf] = failure{int(at[j]), errStalled}
				nf++
			}
		}
	} else if m > 0 && p.stalled.Load() != 0 {
		p.stalled.Store(0)
	}
	if posted > 0 && p.full.Load() != 0 {
		p.full.Store(0)
	}
	if posted < m {
		p.budget.Store(int32(max(posted, 1)))
	} else if b := p.budget.Load(); b > 0 && m == int(b) {
		if b *= 2; b >= chunk {
			b = 0
		}
		p.budget.Store(b)
	}
	// Undo what was not posted, and free what failed to post, while the
	// guard still keeps Close from sweeping the slots.
	undone := int64(0)
	for j := 0; j < m; j++ {
		if j < posted && ops[j].rc == 0 {
			continue
		}
		sp := &t.slots[idx[j]]
		sp.state.Store(slotFree)
		sp.c, sp.peer = nil, nil
		e.inflight.Add(-1)
		undone++
		if j < posted {
			fails[nf] = failure{int(at[j]), postError(int(ops[j].rc))}
			nf++
		}
	}
	t.guard.RUnlock()
	if undone > 0 {
		t.opsDone(p, undone)
	}
	if stall {
		p.stalled.Store(0)
		t.reset(p, gen)
	}
	// Give back the slots not holding a posted operation.
	var back [chunk]uint32
	nb := 0
	for j := 0; j < nslots; j++ {
		if j >= posted || ops[j].rc != 0 {
			back[nb] = idx[j]
			nb++
		}
	}
	t.release(back[:nb])
	// Complete the failures among the accepted slices.
	for _, f := range fails[:nf] {
		if f.i < accepted {
			c.Complete(s[f.i].Token, f.err)
		}
	}
	return accepted, accepted > 0 && posted == m && end == len(s), nil
}

// failure is a slice that Post completes with an error.
type failure struct {
	i   int // in the posted slices
	err error
}
