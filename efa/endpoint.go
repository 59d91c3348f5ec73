//go:build efa && cgo

// endpoint.go holds the Endpoint, the way to one peer segment: Open with
// its probe (one byte read before the first Post), the published keys
// that Post checks remote ranges against, Update and Close.

package efa

import (
	"cmp"
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
	kr := e.keys.Load().first()
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

// keyTable is the peer's buffers and their keys, in the shape of its
// descriptor's chunks (segtable.Mirror): an Update makes the entries of
// the chunks that changed and shares the others' with the table before.
// Buffers of no bytes or past the address space are left out. Update
// replaces it whole: a slot's keys, compared by pointer, tell whether an
// Update came since the slot's Post.
type keyTable struct {
	m *segtable.Mirror[keyRange]
}

// lookup returns the key range holding [addr, addr+n); none for n == 0.
// It allocates nothing.
func (t *keyTable) lookup(addr, n uint64) (*keyRange, bool) {
	if n == 0 {
		return nil, false
	}
	kr, _ := t.m.Floor(addr) // kr.addr <= addr
	if kr == nil || n > kr.length || addr-kr.addr > kr.length-n {
		return nil, false
	}
	return kr, true
}

// first returns the key range of the first buffer, in address order,
// whose key is valid; nil when none. O(n log n) at worst: for Open's
// probe.
func (t *keyTable) first() *keyRange {
	for i := range t.m.Len() {
		b := t.m.Buffer(i)
		if kr, _ := t.m.Floor(b.Addr); kr != nil && kr.addr == b.Addr && kr.ok {
			return kr
		}
	}
	return nil
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

// setKeys makes the endpoint's keys those of desc, from its keys before:
// the entries of desc's chunks that the descriptor before shared (by
// pointer: a republish after one registration shares all but one or two)
// are reused, the others' keys parsed. Callers serialize it (mu, or an
// endpoint not yet shared).
func (e *Endpoint) setKeys(desc *segtable.SegmentDesc) {
	var old *segtable.Mirror[keyRange]
	if kt := e.keys.Load(); kt != nil {
		old = kt.m
	}
	virt := e.t.virt // the same for every table of the endpoint, as NewMirror needs
	m := segtable.NewMirror(old, chunksOf(desc), func(b *segtable.BufferDesc) (keyRange, bool) {
		return keyEntry(b, virt)
	})
	e.keys.Store(&keyTable{m: m})
}

// keyEntry is b's entry in a keyTable; b is left out (false) when it has no
// bytes or runs past the address space.
func keyEntry(b *segtable.BufferDesc, virt bool) (keyRange, bool) {
	if b.Length == 0 || b.Addr+b.Length < b.Addr {
		return keyRange{}, false
	}
	kr := keyRange{addr: b.Addr, length: b.Length}
	if k, err := parseKey(b.Keys[Name]); err == nil && k.base == b.Addr && k.length == b.Length {
		kr.key, kr.ok = k.key, true
		if !virt {
			kr.delta = k.base
		}
	}
	return kr, true
}

// chunksOf is segtable.ChunksOf, but sorts a flat descriptor's buffers
// first when they are not sorted by address (Validate refuses such a
// descriptor; the keys were looked up in a sorted copy before the
// Mirror, and still are). A flat descriptor costs O(n) anyway.
func chunksOf(d *segtable.SegmentDesc) *segtable.BufferChunks {
	byAddr := func(x, y segtable.BufferDesc) int { return cmp.Compare(x.Addr, y.Addr) }
	if d.Chunked == nil && !slices.IsSortedFunc(d.Buffers, byAddr) {
		bufs := slices.Clone(d.Buffers)
		slices.SortFunc(bufs, byAddr)
		return segtable.ChunksOf(&segtable.SegmentDesc{Buffers: bufs})
	}
	return segtable.ChunksOf(d)
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
	t.lockPolling()
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
