//go:build efa && cgo

package efa

import (
	"time"

	"github.com/moonring/moonring/transport"
)

// PeerCount returns how many peers t holds, each with its address in the
// address vector. Safe for concurrent use.
func PeerCount(t *Transport) int {
	t.peerMu.Lock()
	defer t.peerMu.Unlock()
	return len(t.peers)
}

// PeerAddr returns the fi_addr_t of ep's peer now. Safe for concurrent use.
func PeerAddr(ep transport.Endpoint) uint64 {
	return ep.(*Endpoint).peer.Load().addr.Load()
}

// ResetPeer gives ep's peer a fresh address vector entry, as a failed
// operation does. Safe for concurrent use.
func ResetPeer(ep transport.Endpoint) {
	t := ep.(*Endpoint).t
	p := ep.(*Endpoint).peer.Load()
	t.peerMu.Lock()
	defer t.peerMu.Unlock()
	t.guard.Lock()
	defer t.guard.Unlock()
	t.resetLocked(p, p.gen.Load())
}

// SlotsFree returns how many operation slots t has free. Safe for
// concurrent use.
func SlotsFree(t *Transport) int {
	t.freeMu.Lock()
	defer t.freeMu.Unlock()
	return len(t.free)
}

// LosePeer does to ep's peer what a reset does when its address cannot be
// inserted again: the address leaves the vector and the peer is gone.
func LosePeer(ep transport.Endpoint) {
	t := ep.(*Endpoint).t
	p := ep.(*Endpoint).peer.Load()
	t.peerMu.Lock()
	defer t.peerMu.Unlock()
	t.guard.Lock()
	defer t.guard.Unlock()
	t.remove(p)
	t.forget(p)
}

// PlantRetry puts a free slot on the retry list for ep, as if its
// operation had failed as a broken connection's and been retried three
// times: its next try is due in about 64 ms. c hears of it with token.
func PlantRetry(ep transport.Endpoint, c transport.Completer, token uint64) {
	e, s, idx := plant(ep, c, token)
	s.keys, s.peer = e.keys.Load(), e.peer.Load()
	s.tries, s.failed = 3, time.Now().UnixNano()
	s.state.Store(slotRetry)
	e.t.queueRetries(idx[:])
}

// plant takes a free slot of ep's transport for a slice of ep, counted in
// flight; the caller sets its state.
func plant(ep transport.Endpoint, c transport.Completer, token uint64) (*Endpoint, *slot, [1]uint32) {
	e := ep.(*Endpoint)
	var idx [1]uint32
	if e.t.take(idx[:]) != 1 {
		panic("efa test: no free slot")
	}
	s := &e.t.slots[idx[0]]
	s.c, s.token = c, token
	s.ep.Store(e)
	e.inflight.Add(1)
	return e, s, idx
}

// PlantBusy marks a free slot busy for ep, posted an hour ago, as Post
// does before it hands the operation to the provider (call it holding
// the guard, HoldGuard). undo gives the slot back as Post does for an
// operation the provider did not take.
func PlantBusy(ep transport.Endpoint, c transport.Completer, token uint64) (undo func()) {
	e, s, idx := plant(ep, c, token)
	s.posted.Store(time.Now().Add(-time.Hour).UnixNano())
	s.state.Store(slotBusy)
	return func() {
		s.state.Store(slotFree)
		s.c = nil
		e.inflight.Add(-1)
		e.t.release(idx[:])
	}
}

// HoldGuard takes t's guard shared, as a Post in progress holds it, and
// returns its release.
func HoldGuard(t *Transport) (release func()) {
	t.guard.RLock()
	return t.guard.RUnlock
}

// ExpireAll runs the timeout scan as if every busy slot were overdue, and
// returns how many slices it failed.
func ExpireAll(t *Transport) int { return t.expire(time.Now().UnixNano()+1, nil, errTimeout) }

// WriterWaiting reports whether a writer holds t's guard or waits for it
// (a reader's TryRLock then fails).
func WriterWaiting(t *Transport) bool {
	if t.guard.TryRLock() {
		t.guard.RUnlock()
		return false
	}
	return true
}

// PeerOps returns how many operations to ep's peer the provider holds (or
// a Post is posting). Safe for concurrent use.
func PeerOps(ep transport.Endpoint) int64 {
	return ep.(*Endpoint).peer.Load().ops.Load()
}

// PeerGen returns the generation of ep's peer: how often its address was
// reset. Safe for concurrent use.
func PeerGen(ep transport.Endpoint) uint64 {
	return ep.(*Endpoint).peer.Load().gen.Load()
}

// PlantBroken does what deliver does with an operation of ep that failed
// as if its connection broke, the first time: it resets the peer and
// queues the slot's retry, due in a millisecond, through queueRetries.
// The slot holds no operation: its keys are none of the endpoint's, so
// the retry fails (ErrPeer) rather than posts. c hears of it with token.
func PlantBroken(ep transport.Endpoint, c transport.Completer, token uint64) {
	e, s, idx := plant(ep, c, token)
	p := e.peer.Load()
	s.keys, s.peer, s.gen = nil, p, p.gen.Load()
	s.state.Store(slotRetry)
	e.t.queueRetries(idx[:])
}

// ResetSoon asks for a reset of ep's peer at its current generation, as a
// failed operation does (reset), and returns that generation.
func ResetSoon(ep transport.Endpoint) uint64 {
	e := ep.(*Endpoint)
	p := e.peer.Load()
	gen := p.gen.Load()
	e.t.reset(p, gen)
	return gen
}

// SoonCounts returns how many of soon's goroutines are waiting or running,
// and how many took the guard's write lock so far.
func SoonCounts(t *Transport) (waiting, wrote int64) {
	return t.soonWaiting.Load(), t.soonWrote.Load()
}

// ErrPeerExited is errPeerExited, for the two-process tests.
var ErrPeerExited = errPeerExited

// WatchPeerPid makes ep's peer one whose process is pid, and suspect (an
// operation to it failed): the next Post or retry asks whether pid is
// there. Call it before anything polls the transport.
func WatchPeerPid(ep transport.Endpoint, pid int) {
	p := ep.(*Endpoint).peer.Load()
	p.pid = pid
	p.suspect.Store(true)
}

// ErrPeerRetry is errPeerRetry, for the two-process tests.
var ErrPeerRetry = errPeerRetry
