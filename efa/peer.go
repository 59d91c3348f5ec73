//go:build efa && cgo

// peer.go holds the peers: one remote fabric address in the address
// vector, shared by the endpoints to it, reset (removed and inserted
// again) after a failure that looks like a broken connection, and dropped
// once no endpoint uses it and the provider holds no operation to it.

package efa

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"sync/atomic"

	"github.com/moonring/moonring/transport"
)

// peer is one remote fabric address in the address vector. When an
// operation to it fails as if the connection broke, the address is
// removed and inserted again (a new generation), so that a provider that
// connects underneath (tcp;ofi_rxm) starts a fresh connection for the
// retries instead of failing them on the broken one.
//
// Endpoints to the same endpoint string share one peer. It leaves the
// address vector and Transport.peers once no endpoint uses it (users) and
// the provider holds no operation to it (ops); see drop.
type peer struct {
	key  string        // its key in Transport.peers: the endpoint string
	name []byte        // the provider address
	addr atomic.Uint64 // fi_addr_t
	gen  atomic.Uint64
	// users counts the endpoints whose peer this is (Open, Update), and
	// changes under peerMu only; the completion path reads it without.
	users atomic.Int32
	// ops counts the slots holding an operation posted to addr that the
	// provider has not returned: busy ones and abandoned ones (a timeout
	// or Close failed their slices, but the provider still holds them).
	// It rises only under guard's read lock, and never once gone is set
	// (see drop).
	ops atomic.Int64
	// gone is set when addr left the address vector: under peerMu and
	// the guard's write lock by drop, under peerMu by Close once the
	// transport is closed (no Post or reset gets past closed then).
	// Nothing may be posted to addr, nor reset, after.
	gone atomic.Bool
	// stalled is the UnixNano of the first Post that the provider refused
	// with -FI_EAGAIN without taking anything since; 0 when none.
	stalled atomic.Int64
	// full is 1 + the transport's Poll count when the provider last took
	// nothing for the peer; 0 when it took something since. Until the
	// next Poll (which is what frees the provider's queue) Post does not
	// try again: on a busy machine a spinning poster would otherwise burn
	// the time the progress it waits for needs.
	full atomic.Uint64
	// budget is how many operations the provider took for the peer before
	// its last -FI_EAGAIN, doubled after every Post it took whole (0: no
	// limit). Post prepares no more than that: shm, for one, takes one
	// 4 KiB WRITE at a time, and preparing 64 to undo 63 cost more than
	// the provider's own work.
	budget atomic.Int32
	// pid is the process of a shm peer (from its address; 0 for other
	// providers). Post checks the process is still there before going
	// into the provider (exitedPeer): at once while suspect (an operation
	// to it failed or timed out; a completion that succeeds clears it),
	// else when checked (UnixNano) is livenessEvery old. Once it is gone,
	// dead stays set.
	pid     int
	suspect atomic.Bool
	dead    atomic.Bool
	checked atomic.Int64
}

// peer returns the peer that published ep, inserting its address into the
// address vector the first time.
func (t *Transport) peer(ep string) (*peer, error) {
	prov, addr, err := parseEndpoint(ep)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w: %w", ep, transport.ErrUnreachable, err)
	}
	if prov != t.prov {
		return nil, fmt.Errorf("peer on provider %q, this transport on %q: %w", prov, t.prov, transport.ErrUnreachable)
	}
	if t.strAddr {
		// A string address: one NUL, at the end, and printable before.
		for i, c := range addr {
			if (c == 0) != (i == len(addr)-1) || (c != 0 && (c < ' ' || c > '~')) {
				return nil, fmt.Errorf("address %q: %w: %w", addr, transport.ErrUnreachable, errBadDesc)
			}
		}
	} else if len(addr) != t.nameLen {
		return nil, fmt.Errorf("address of %d bytes, want %d: %w: %w", len(addr), t.nameLen, transport.ErrUnreachable, errBadDesc)
	}
	t.peerMu.Lock()
	defer t.peerMu.Unlock()
	if p, ok := t.peers[ep]; ok {
		p.users.Add(1)
		return p, nil
	}
	t.guard.RLock()
	defer t.guard.RUnlock()
	if t.closed.Load() {
		return nil, transport.ErrClosed
	}
	p := &peer{key: ep, name: addr, pid: shmPeerPid(addr)}
	a, err := t.insert(addr)
	if err != nil {
		return nil, err
	}
	p.addr.Store(a)
	p.users.Store(1)
	t.peers[ep] = p
	return p, nil
}

// unuse gives back an endpoint's use of p (from peer), and drops p when it
// was the last.
func (t *Transport) unuse(p *peer) {
	t.peerMu.Lock()
	last := p.users.Add(-1) == 0
	t.peerMu.Unlock()
	if last {
		t.drop(p)
	}
}

// drop removes p's address from the address vector, and p from
// t.peers, when no endpoint uses p and the provider holds no operation to
// it; otherwise it does nothing, and the last of those to go calls it
// again (unuse), or has it called (dropSoon, from the completion that
// brings ops to 0).
//
// Why wait for ops: libfabric leaves undefined what becomes of operations
// in progress to a removed address (fi_av(3)); the software providers free
// the AV index at once for the next fi_av_insert to reuse, shm unmaps the
// peer's region, and rxm (FI_AV_REMOVE_CLEANUP) frees the connection the
// operations are queued on. An operation still held, abandoned ones
// included, could then land at, or be retried to, another peer at the
// same fi_addr. Once the provider returned every context for the address,
// nothing refers to it any more. A peer whose operation the provider
// never returns stays, as that operation's slot does, until Close.
//
// ops rises only under guard's read lock: in Post, for the peer of an
// endpoint found open (which holds a use of it: Close marks the endpoint
// closed, and Update swaps its peer, before giving the use up); in
// retryDue, for a peer not gone. drop checks ops and sets gone under the
// write lock, after users fell to 0: any such section either ended before
// (its operations counted, or undone by their completion or by itself,
// which then calls drop again) or starts after, and finds the endpoint
// closed, another peer in it, or p gone. Endpoints are closed and updated
// seldom, so the write lock costs the data path little.
//
// drop waits for peerMu and the guard: the data path calls dropSoon.
func (t *Transport) drop(p *peer) {
	t.peerMu.Lock()
	defer t.peerMu.Unlock()
	if p.users.Load() != 0 || p.gone.Load() {
		return // used again (Open of the same endpoint), or dropped already
	}
	t.guard.Lock()
	defer t.guard.Unlock()
	t.dropLocked(p)
}

// dropSoon is drop for the data path (Poll, Post), which never waits for
// the guard: see soon.
func (t *Transport) dropSoon(p *peer) {
	t.soon(func() bool { return p.users.Load() == 0 && !p.gone.Load() && p.ops.Load() == 0 },
		func() { t.dropLocked(p) })
}

// dropLocked is drop with peerMu and the guard's write lock held.
func (t *Transport) dropLocked(p *peer) {
	if p.users.Load() != 0 || p.gone.Load() || p.ops.Load() != 0 {
		return
	}
	if !t.closed.Load() {
		t.remove(p) // after Close the entry went with the address vector
	}
	t.forget(p)
}

// soon runs fn holding peerMu and the guard's write lock, for the data
// path, which never waits for the guard (see Transport.guard) nor for
// peerMu (peer holds it while it waits for the guard): at once when both
// are free, else in a goroutine of its own that waits for them. That
// goroutine, a waiting writer, holds Posts and retryDue back (they take
// nothing meanwhile), never Poll's cq_poll. fn runs rarely (a peer's last
// operation returned, a connection broke), and seldom finds the locks
// taken. needed, checked under peerMu before the goroutine asks for the
// guard, says whether fn still has anything to do: the changes fn makes
// happen under peerMu, so a goroutine queued behind one that did the
// work (a reset asked for by every failed operation of a batch) gives up
// without holding Posts back for nothing.
func (t *Transport) soon(needed func() bool, fn func()) {
	if t.peerMu.TryLock() {
		if t.guard.TryLock() {
			fn()
			t.guard.Unlock()
			t.peerMu.Unlock()
			return
		}
		t.peerMu.Unlock()
	}
	t.soonWaiting.Add(1)
	go func() {
		defer t.soonWaiting.Add(-1)
		t.peerMu.Lock()
		defer t.peerMu.Unlock()
		if !needed() {
			return
		}
		t.soonWrote.Add(1)
		t.guard.Lock()
		fn()
		t.guard.Unlock()
	}()
}

// remove takes p's address out of the address vector; a failure leaves
// nothing to undo (the entry goes with the vector at Close). The caller
// holds the guard exclusively, and the transport is not closed. It also
// takes pollMu, so that the vector changes with nothing else in the
// provider, as before cq_poll left the guard.
func (t *Transport) remove(p *peer) {
	t.pollMu.Lock()
	C.fi_remove(t.res, C.uint64_t(p.addr.Load()))
	t.pollMu.Unlock()
}

// forget marks p gone, its address out of the vector, and takes it out of
// t.peers. The caller holds peerMu.
func (t *Transport) forget(p *peer) {
	p.gone.Store(true)
	delete(t.peers, p.key)
}

// returned counts one operation to p as returned by the provider, and
// reports whether p may be dropped now (its caller then calls dropSoon,
// with no lock held).
func (p *peer) returned() bool {
	return p.ops.Add(-1) == 0 && p.users.Load() == 0
}

// opsDone counts n operations to p as returned by the provider (or never
// posted), and drops p (dropSoon: Post calls it) when they were the last
// and no endpoint uses it. The caller holds no lock.
func (t *Transport) opsDone(p *peer, n int64) {
	if p.ops.Add(-n) == 0 && p.users.Load() == 0 {
		t.dropSoon(p)
	}
}

// insert puts addr into the address vector; the caller holds guard.
func (t *Transport) insert(addr []byte) (uint64, error) {
	buf := C.CBytes(addr)
	defer C.free(buf)
	var a C.uint64_t
	if rc := C.fi_insert(t.res, buf, &a); rc != 0 {
		return 0, fmt.Errorf("fi_av_insert: %s: %w", fiStrerror(int(rc)), transport.ErrUnreachable)
	}
	return uint64(a), nil
}

// reset gives p a fresh address vector entry, unless an operation of a
// later generation already did. It holds the guard exclusively, as drop
// does: Post and retryDue load a peer's fi_addr and post to it under the
// read side, and tcp;ofi_rxm dereferences a NULL peer when an operation
// names an address that has left the vector. Its callers are on the data
// path (a failed operation, a stalled Post): it does not wait for the
// locks (see soon).
func (t *Transport) reset(p *peer, gen uint64) {
	if p.gen.Load() != gen || p.gone.Load() {
		return // a later generation reset it, or its address left the AV (drop)
	}
	t.soon(func() bool { return p.gen.Load() == gen && !p.gone.Load() && !t.closed.Load() },
		func() { t.resetLocked(p, gen) })
}

// resetLocked is reset with peerMu and the guard's write lock held.
func (t *Transport) resetLocked(p *peer, gen uint64) {
	if p.gen.Load() != gen || p.gone.Load() || t.closed.Load() {
		return
	}
	t.pollMu.Lock() // as remove: the vector changes with nothing else in the provider
	C.fi_remove(t.res, C.uint64_t(p.addr.Load()))
	a, err := t.insert(p.name)
	t.pollMu.Unlock()
	if err != nil {
		// The old address has left the vector and no new one came:
		// the peer is gone (Post fails its slices with ErrPeer), and
		// the next Open, or Update of an endpoint using it, inserts
		// the address afresh.
		t.forget(p)
		return
	}
	p.addr.Store(a)
	p.gen.Add(1)
}
