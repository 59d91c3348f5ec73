// Package local is the in-process transport: it copies between the
// registered buffers of engines that live in the same process, and between
// an engine's own buffers. It is the reference transport of the conformance
// suite and the benchmarks: what it costs is what the engine costs.
//
// # Concurrency
//
// A Transport and its endpoints are safe for concurrent use. Post copies on
// the caller's goroutine and completes each slice before it returns.
//
// # Lifetimes
//
// A Transport is reachable by other engines of the process from New until
// Close. Unregister waits for copies into or out of the buffer in progress.
//
// # Safety
//
// The target side checks every slice as a remote transport would: the range
// must lie inside one buffer registered with this transport, the key must
// match that buffer's, and the buffer must be remote-accessible unless the
// slice comes through the engine's own Self endpoint.
package local

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/fastcopy"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Name is the transport's name in segment descriptors.
const Name = "local"

var (
	registry sync.Map // endpoint string -> *Transport
	nextID   atomic.Uint64
)

// Transport is the in-process transport of one engine. Use New.
type Transport struct {
	id      string
	self    string // the engine's segment name, the From of notifications
	deliver atomic.Pointer[func(*transport.Notification) error]
	mu      sync.Mutex // serializes changes of regs
	seq     uint64     // the last registration handle, under mu
	// regs holds the registrations by address, read lock-free; a change
	// copies O(sqrt n) of them (a flat list copied whole made n
	// registrations cost n²).
	regs   segtable.Sorted[*region]
	closed atomic.Bool
}

type region struct {
	handle uint64 // the Registration's Handle
	addr   uintptr
	base   unsafe.Pointer
	length uint64
	key    uint64
	remote bool
	ref    segtable.Ref
}

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Notifier  = (*Transport)(nil)
)

// SetNotify sets the engine's name and the function that takes the
// notifications other engines send to it.
func (t *Transport) SetNotify(self string, deliver func(*transport.Notification) error) {
	t.self = self
	t.deliver.Store(&deliver)
}

// New returns a transport reachable from other engines of this process.
func New() *Transport {
	t := &Transport{id: strconv.Itoa(os.Getpid()) + "/" + strconv.FormatUint(nextID.Add(1), 10)}
	registry.Store(t.id, t)
	return t
}

// Name returns "local".
func (t *Transport) Name() string { return Name }

// Endpoint returns the transport's process-unique address.
func (t *Transport) Endpoint() string { return t.id }

// SliceSize returns 1 MiB: a copy has no rails to spread over, and large
// copies are fastest in large pieces (memmove's non-temporal path): with
// 64 KiB slices a 64 MiB copy ran at 79 % of one copy(), with 1 MiB at 90 %+.
func (t *Transport) SliceSize() uint64 { return 1 << 20 }

// find returns the region holding [addr, addr+n), or nil. Regions are
// sorted by start; they may nest while an old registration drains under a
// new one of the same memory, so the last one starting at or below addr is
// tried first, then those before it.
func find(rs *segtable.Sorted[*region], addr uint64, n uint64) *region {
	if r, _, _, ok := rs.Floor(addr); ok && n <= r.length && addr-uint64(r.addr) <= r.length-n && !r.ref.Closing() {
		return r // the common case, without the walk's closure
	}
	var found, closing *region
	rs.Descend(addr, func(_ uint64, r *region) bool { // one step unless it misses (nested, or a bad slice)
		if n <= r.length && addr-uint64(r.addr) <= r.length-n {
			if !r.ref.Closing() {
				found = r
				return false
			}
			if closing == nil {
				closing = r // one being unregistered, if no other holds the range
			}
		}
		return true
	})
	if found != nil {
		return found
	}
	return closing
}

// Register attaches a random 64-bit key to b.
func (t *Transport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	if t.closed.Load() {
		return segtable.Registration{}, fmt.Errorf("local: register: %w", transport.ErrClosed)
	}
	var k [8]byte
	rand.Read(k[:])
	mem := b.Bytes()
	r := &region{addr: b.Addr, base: unsafe.Pointer(unsafe.SliceData(mem)), length: b.Length, key: binary.LittleEndian.Uint64(k[:]), remote: b.Remote}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.seq++
	r.handle = t.seq
	// After any region with the same start: find, scanning back, meets
	// the newest registration of the same memory first.
	t.regs.Insert(uint64(r.addr), r)
	return segtable.Registration{Handle: r.handle, Key: strconv.FormatUint(r.key, 16)}, nil
}

// Unregister forgets b once no copy uses it.
func (t *Transport) Unregister(b *segtable.Buffer, reg segtable.Registration) error {
	// By handle, not by address: the same memory may be registered again
	// (as a new buffer) before this old registration goes.
	var r *region
	t.regs.Descend(uint64(b.Addr), func(k uint64, x *region) bool {
		if x.handle == reg.Handle {
			r = x
		}
		return r == nil && k == uint64(b.Addr)
	})
	if r == nil {
		return fmt.Errorf("local: unregister %#x: %w", b.Addr, segtable.ErrNotFound)
	}
	// Copies are short; a minute without progress means a bug, not load.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := r.ref.Drain(ctx); err != nil {
		return fmt.Errorf("local: unregister %#x: %w", b.Addr, err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.regs.Delete(uint64(r.addr), func(x *region) bool { return x == r })
	return nil
}

// Open returns an endpoint to the engine of this process that published
// desc, or ErrUnreachable when it lives elsewhere.
func (t *Transport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	if t.closed.Load() {
		return nil, fmt.Errorf("local: open %s: %w", desc.Name, transport.ErrClosed)
	}
	v, ok := registry.Load(desc.Endpoints[Name])
	if !ok {
		return nil, fmt.Errorf("local: open %s: %w", desc.Name, transport.ErrUnreachable)
	}
	e := &Endpoint{from: t}
	e.to.Store(v.(*Transport))
	e.Update(desc)
	return e, nil
}

// Self returns the endpoint for the engine's own segment: it reaches every
// buffer registered with t, remote-accessible or not.
func (t *Transport) Self() transport.Endpoint {
	e := &Endpoint{from: t, self: true}
	e.to.Store(t)
	return e
}

// Close makes the transport unreachable; slices posted to it afterwards
// fail with ErrClosed.
func (t *Transport) Close() error {
	if !t.closed.Swap(true) {
		registry.Delete(t.id)
	}
	return nil
}

// Endpoint copies to and from one engine of this process.
type Endpoint struct {
	from   *Transport
	to     atomic.Pointer[Transport] // a restarted peer's is swapped in by Update
	self   bool
	keys   atomic.Pointer[keyTable] // from the descriptor, by address
	closed atomic.Bool
}

type keyRange struct {
	addr, length, key uint64
}

// keyTable is the descriptor's keys by address, with the starts packed
// apart: keyFor, once per slice, searches 8-byte starts rather than
// 24-byte ranges.
type keyTable struct {
	starts []uint64
	ranges []keyRange
}

var (
	_ transport.Endpoint      = (*Endpoint)(nil)
	_ transport.HoldingCopier = (*Endpoint)(nil)
)

// Rails returns 1: a copy has one lane.
func (e *Endpoint) Rails() int { return 1 }

// Update takes the keys of the segment's buffers from desc, and the
// engine that now publishes it (a restarted one) when that changed.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	if v, ok := registry.Load(desc.Endpoints[Name]); ok && !e.self {
		e.to.Store(v.(*Transport))
	}
	kt := &keyTable{starts: make([]uint64, 0, len(desc.Buffers)), ranges: make([]keyRange, 0, len(desc.Buffers))}
	for _, b := range desc.Buffers {
		k, err := strconv.ParseUint(b.Keys[Name], 16, 64)
		if err != nil {
			continue // no key for this transport: slices to it are denied
		}
		kt.starts = append(kt.starts, b.Addr)
		kt.ranges = append(kt.ranges, keyRange{b.Addr, b.Length, k})
	}
	e.keys.Store(kt)
}

func (e *Endpoint) keyFor(addr, n uint64) (uint64, bool) {
	kt := e.keys.Load()
	i, j := 0, len(kt.starts) // the last start at or below addr; ranges do not overlap
	for i < j {
		h := int(uint(i+j) >> 1)
		if kt.starts[h] > addr {
			j = h
		} else {
			i = h + 1
		}
	}
	if i == 0 {
		return 0, false
	}
	r := &kt.ranges[i-1]
	if n > r.length || addr-r.addr > r.length-n {
		return 0, false
	}
	return r.key, true
}

// Post copies every slice and completes it before returning.
func (e *Endpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	for i := range s {
		c.Complete(s[i].Token, e.Copy(&s[i]))
	}
	return len(s), nil
}

// Copy moves one slice synchronously, with the checks of Post.
func (e *Endpoint) Copy(s *transport.Slice) error { return e.copy(s, nil) }

// CopyHold is Copy that leaves its reference on the target region in h
// (see transport.HoldingCopier).
func (e *Endpoint) CopyHold(s *transport.Slice, h *transport.Holds) error { return e.copy(s, h) }

func (e *Endpoint) copy(s *transport.Slice, h *transport.Holds) error {
	to := e.to.Load()
	if e.closed.Load() || to.closed.Load() || e.from.closed.Load() {
		return transport.ErrClosed
	}
	if s.Op == transport.Notify {
		return e.notify(s)
	}
	r := find(&to.regs, s.Remote, s.Length)
	if r == nil {
		return transport.ErrRange
	}
	if !e.self {
		// The target checks what the initiator presents, as over a wire.
		key, ok := e.keyFor(s.Remote, s.Length)
		if !ok || key != r.key || !r.remote {
			return transport.ErrDenied
		}
	}
	ok, release := h.Take(&r.ref)
	if !ok {
		return transport.ErrDenied // being unregistered
	}
	remote := unsafe.Slice((*byte)(unsafe.Add(r.base, s.Remote-uint64(r.addr))), s.Length)
	local := unsafe.Slice((*byte)(s.Local), s.Length)
	if s.Op == transport.Write {
		fastcopy.Copy(remote, local)
	} else {
		fastcopy.Copy(local, remote)
	}
	if release {
		r.ref.Release()
	}
	return nil
}

func (e *Endpoint) notify(s *transport.Slice) error {
	d := e.to.Load().deliver.Load()
	if d == nil {
		return transport.ErrDenied // the target takes no notifications
	}
	if s.Length > transport.MaxNotifyMessage {
		return transport.ErrRange
	}
	n := transport.Notification{From: e.from.self, Tag: s.Remote}
	if s.Length > 0 {
		n.Msg = unsafe.Slice((*byte)(s.Local), s.Length)
	}
	return (*d)(&n)
}

// Close fails slices posted afterwards with ErrClosed.
func (e *Endpoint) Close() error {
	e.closed.Store(true)
	return nil
}
