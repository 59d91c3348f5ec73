//go:build efa && cgo

package efa

import "github.com/moonring/moonring/transport"

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
	p := ep.(*Endpoint).peer.Load()
	ep.(*Endpoint).t.reset(p, p.gen.Load())
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
