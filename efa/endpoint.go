//go:build efa && cgo

// endpoint.go holds the Endpoint, the way to one peer segment: Open with
// its probe (one byte read before the first Post), the published keys
// that Post checks remote ranges against, Update and Close.

package efa

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Open inserts the peer's address into the address vector (once per peer,
// shared by its endpoints, until the last of them closes) and returns an
// endpoint with the keys of desc.
// When desc publishes a buffer with a valid key, Open first reads one
// byte of it, polling, until ctx ends: that proves the peer answers, and
// lets a provider that connects underneath (tcp;ofi_rxm) connect before
// the first Post. The error wraps ErrUnreachable when the peer does not.
func (t *Transport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	if t.closed.Load() {
		return nil, fmt.Errorf("efa: open %s: %w", desc.Name, transport.ErrClosed)
	}
	p, err := t.peer(desc.Endpoints[Name])
	if err != nil {
		return nil, fmt.Errorf("efa: open %s: %w", desc.Name, err)
	}
	e := &Endpoint{t: t, name: desc.Endpoints[Name]}
	e.peer.Store(p)
	e.setKeys(desc)
	if err := e.probe(ctx); err != nil {
		e.Close()
		return nil, fmt.Errorf("efa: open %s: %w", desc.Name, err)
	}
	return e, nil
}

// probeTries is how many times Open probes a peer whose probe failed as
// if its connection broke (each time after the retries of the slice
// itself): a connection that other operations' faults tear down (a
// forged key makes tcp;ofi_rxm's target drop it) cancels the probe too.
const probeTries = 3

// probe reads one byte of the first buffer with a valid key into the
// transport's scratch memory and waits for it; it probes again, up to
// probeTries times, while the read fails with ErrPeer.
func (e *Endpoint) probe(ctx context.Context) error {
	var err error
	for range probeTries {
		if err = e.probeOnce(ctx); !errors.Is(err, transport.ErrPeer) {
			return err
		}
	}
	return err
}

func (e *Endpoint) probeOnce(ctx context.Context) error {
	var kr *keyRange
	kt := e.keys.Load()
	for i, k := range kt.ks {
		if k.ok {
			kr = &kt.ks[i]
			break
		}
	}
	if kr == nil {
		return nil
	}
	pc := &probeCompleter{done: make(chan error, 1)}
	s := []transport.Slice{{Op: transport.Read, LocalHandle: 0, Local: e.t.scratch, Remote: kr.addr, Length: 1, Token: 1}}
	for {
		n, err := e.Post(pc, s)
		if err != nil {
			return err
		}
		if n == 1 {
			break
		}
		if err := e.pollWait(ctx, nil); err != nil {
			return fmt.Errorf("probe not accepted: %w: %w", transport.ErrUnreachable, err)
		}
	}
	if err := e.pollWait(ctx, pc.done); err != nil {
		return fmt.Errorf("probe: %w: %w", transport.ErrUnreachable, err)
	}
	if err := <-pc.done; err != nil {
		return fmt.Errorf("probe: %w: %w", transport.ErrUnreachable, err)
	}
	return nil
}

// pollWait polls until done has a value (without taking it), or, when
// done is nil, for one round; it fails when ctx ends first.
func (e *Endpoint) pollWait(ctx context.Context, done chan error) error {
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		if e.t.closing.Load() {
			return transport.ErrClosed
		}
		if done != nil && len(done) > 0 {
			return nil
		}
		if e.t.Poll() == 0 {
			time.Sleep(20 * time.Microsecond)
		}
		if done == nil {
			return nil
		}
	}
}

type probeCompleter struct{ done chan error }

func (p *probeCompleter) Complete(_ uint64, err error) { p.done <- err }

// Endpoint is the way to one peer segment: the peer's fabric address and
// the keys of its buffers. Safe for concurrent use.
type Endpoint struct {
	t        *Transport
	name     string                   // the endpoint string peer came from, under mu
	peer     atomic.Pointer[peer]     // a restarted peer's is swapped in by Update
	keys     atomic.Pointer[keyTable] // replaced whole by Update
	closed   atomic.Bool
	inflight atomic.Int64
	mu       sync.Mutex // serializes Update
	// withdrawn is set while the peer's descriptor lists no efa endpoint
	// (its engine uninstalled the transport): Post fails slices with
	// errWithdrawn, a failure of the path, until an Update lists one.
	withdrawn atomic.Bool
}

// keyTable is the peer's buffers: ranges holds their address ranges
// sorted, searched with segtable.SegmentDesc.Find, and ks[i] the key of
// ranges.Buffers[i]. Buffers of no bytes or past the address space are
// left out.
type keyTable struct {
	ranges segtable.SegmentDesc
	ks     []keyRange
}

// lookup returns the key range holding [addr, addr+n); none for n == 0.
func (t *keyTable) lookup(addr, n uint64) (*keyRange, bool) {
	if n == 0 {
		return nil, false
	}
	i := t.ranges.Find(addr, n)
	if i < 0 {
		return nil, false
	}
	return &t.ks[i], true
}

// keyRange is one of the peer's buffers as its descriptor published it.
type keyRange struct {
	addr, length uint64
	key          uint64
	delta        uint64 // subtracted from addresses: 0, or the base for offset-addressed MRs
	ok           bool   // the key parsed and names this very buffer
}

var _ transport.Endpoint = (*Endpoint)(nil)

// Rails returns 1: one libfabric endpoint carries every slice; the
// provider spreads them over its own paths.
func (e *Endpoint) Rails() int { return 1 }

// Update takes the buffers and keys of desc, and the peer's new address
// when it restarted; the old address leaves the address vector once no
// endpoint uses it and its operations in flight are over. A desc that
// lists no efa endpoint (the peer no longer offers the transport) leaves
// keys and address as they were, and Post fails slices with an error
// wrapping ErrPeer until an Update lists one again: the path is gone, the
// requests are not at fault (its buffers' keys went with the transport,
// and a slice refused for want of one would end with ErrDenied, which
// the engine does not fail over). Safe for concurrent use.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if desc.Endpoints[Name] == "" {
		e.withdrawn.Store(true)
		return
	}
	defer e.withdrawn.Store(false) // once keys and peer are the new ones
	// The keys first, then the peer: Post loads the peer, then the keys,
	// so it never pairs the new peer with the old keys (a restarted peer,
	// its Go heap at the same addresses and provider-chosen keys the
	// same small numbers, could take an old key for a new buffer). The
	// other mix, the old peer with the new keys, fails at the old peer.
	e.setKeys(desc)
	// A closed endpoint gave its peer up (Close) and takes no other: it
	// would never give that one up. A gone peer (its address could not be
	// inserted again after a reset) is replaced even by the same address.
	if ep := desc.Endpoints[Name]; (ep != e.name || e.peer.Load().gone.Load()) && !e.closed.Load() {
		if p, err := e.t.peer(ep); err == nil {
			old := e.peer.Swap(p)
			e.name = ep
			e.t.unuse(old) // after the swap: see drop
		}
	}
}

func (e *Endpoint) setKeys(desc *segtable.SegmentDesc) {
	bufs := desc.AllBuffers() // flat: O(n) a republish (see segtable.SegmentDesc.AllBuffers)
	ks := make([]keyRange, 0, len(bufs))
	for _, b := range bufs {
		if b.Length == 0 || b.Addr+b.Length < b.Addr {
			continue
		}
		kr := keyRange{addr: b.Addr, length: b.Length}
		if k, err := parseKey(b.Keys[Name]); err == nil && k.base == b.Addr && k.length == b.Length {
			kr.key, kr.ok = k.key, true
			if !e.t.virt {
				kr.delta = k.base
			}
		}
		ks = append(ks, kr)
	}
	slices.SortFunc(ks, func(x, y keyRange) int { return cmpU64(x.addr, y.addr) })
	rs := make([]segtable.BufferDesc, len(ks))
	for i, k := range ks {
		rs[i] = segtable.BufferDesc{Addr: k.addr, Length: k.length}
	}
	e.keys.Store(&keyTable{ranges: segtable.SegmentDesc{Buffers: rs}, ks: ks})
}

// Close refuses new slices and waits, polling, up to Config.Linger for
// the endpoint's slices in flight to complete; those it still sees then
// are failed with ErrClosed. Every slice of the endpoint that completes
// after Close began completes with ErrClosed. The peer's address leaves
// the address vector once no endpoint uses it and the provider holds no
// operation to it (see Transport.drop). Safe for concurrent use.
func (e *Endpoint) Close() error {
	if e.closed.Swap(true) {
		return nil
	}
	t := e.t
	deadline := time.Now().Add(t.cfg.Linger)
	for e.inflight.Load() > 0 && !t.closed.Load() && time.Now().Before(deadline) {
		if t.Poll() == 0 {
			time.Sleep(20 * time.Microsecond)
		}
	}
	// A Post that saw the endpoint open may still hold the guard, its
	// slots busy but not yet posted or undone: it finishes before the
	// write lock is granted, and a Post after it sees closed. Then the
	// slots that expire abandons are the provider's alone.
	t.guard.Lock()
	t.guard.Unlock()
	if e.inflight.Load() > 0 {
		t.expire(time.Now().UnixNano()+1, e, errClosed)
		t.dropRetries(e)
	}
	// Under mu, so that an Update in progress does not swap in a peer
	// after this gave up the one it saw.
	e.mu.Lock()
	t.unuse(e.peer.Load())
	e.mu.Unlock()
	return nil
}
