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
//
// # Keys
//
// A buffer's key is "SECRET.HANDLE", both hex: a random 64-bit secret and
// the segtable.Handle of its registration in the target's table of
// regions. The target finds the region the key names by its handle (O(1),
// no search of its regions), then checks what the key claims: the
// generation (a handle kept after its buffer was unregistered names
// nothing), the secret, that the slice lies inside the region, and that
// the region is remote-accessible. An initiator takes a slice's key from
// the position the engine found the buffer at in the descriptor's chunks
// (transport.Slice.RemoteIndex, a segtable.Pos), checked against the
// address, so a request costs one search of the buffers (the engine's
// Resolve) however many there are. Keys never leave the process (the registry is
// process-wide), so no peer holds the older form (the secret alone),
// which is refused as a garbled key.
package local

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
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
	// regs holds the registrations by address, read lock-free; a change
	// copies a leaf of them, at times nodes above it (see segtable.Sorted: a
	// flat list copied whole made n registrations cost n²). The Self endpoint
	// searches it, and so does a refused slice (to tell a range error
	// from a denial).
	regs segtable.Sorted[*region]
	// byHandle holds the same registrations by the handle their keys
	// carry: a peer's slice finds its region here in O(1).
	byHandle segtable.Handles[region]
	closed   atomic.Bool
}

type region struct {
	handle segtable.Handle // the Registration's Handle, in the key
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

// Register attaches a key to b: a random 64-bit secret and the handle
// of its registration (see Keys in the package's doc).
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
	h, err := t.byHandle.Add(r)
	if err != nil {
		return segtable.Registration{}, fmt.Errorf("local: register %#x: %w", b.Addr, err)
	}
	r.handle = h
	// After any region with the same start: find, scanning back, meets
	// the newest registration of the same memory first.
	t.regs.Insert(uint64(r.addr), r)
	return segtable.Registration{Handle: uint64(h), Key: formatKey(r.key, h)}, nil
}

// Unregister forgets b once no copy uses it.
func (t *Transport) Unregister(b *segtable.Buffer, reg segtable.Registration) error {
	// By handle, not by address: the same memory may be registered again
	// (as a new buffer) before this old registration goes.
	var r *region
	if reg.Handle <= math.MaxUint32 {
		r = t.byHandle.Get(segtable.Handle(reg.Handle))
	}
	if r == nil || r.addr != b.Addr {
		return fmt.Errorf("local: unregister %#x: %w", b.Addr, segtable.ErrNotFound)
	}
	// Copies are short; a minute without progress means a bug, not load.
	if err := r.ref.DrainFor(time.Minute); err != nil {
		return fmt.Errorf("local: unregister %#x: %w", b.Addr, err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.regs.Delete(uint64(r.addr), func(x *region) bool { return x == r })
	t.byHandle.Remove(r.handle)
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
	keys   atomic.Pointer[segtable.Mirror[keyRange]] // from the descriptor, every buffer
	closed atomic.Bool
}

// keyRange is a buffer of the descriptor and the key it lists for this
// transport; ok is false when it lists none (or one that does not parse),
// and slices to the buffer are denied.
type keyRange struct {
	addr, length uint64
	secret       uint64
	handle       segtable.Handle
	ok           bool
}

var (
	_ transport.Endpoint      = (*Endpoint)(nil)
	_ transport.HoldingCopier = (*Endpoint)(nil)
	_ transport.InlineCopier  = (*Endpoint)(nil)
)

// Rails returns 1: a copy has one lane.
func (e *Endpoint) Rails() int { return 1 }

// Update takes the keys of the segment's buffers from desc, and the
// engine that now publishes it (a restarted one) when that changed. The
// keys are kept in the shape of the descriptor's chunks
// (segtable.Mirror): a republish parses the keys of the chunks that
// changed since the last Update, not of every buffer.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	if v, ok := registry.Load(desc.Endpoints[Name]); ok && !e.self {
		e.to.Store(v.(*Transport))
	}
	e.keys.Store(segtable.NewMirror(e.keys.Load(), segtable.ChunksOf(desc), keyRangeOf))
}

// keyRangeOf is a descriptor's buffer's entry: every buffer, with a key or
// not, so that positions match the engine's (Resolve's, the hint).
func keyRangeOf(b *segtable.BufferDesc) (keyRange, bool) {
	r := keyRange{addr: b.Addr, length: b.Length}
	r.secret, r.handle, r.ok = parseKey(b.Keys[Name])
	return r, true
}

// keyFor returns the descriptor's entry for the buffer holding [addr,
// addr+n), or nil: the entry at position hint (a segtable.Pos, as the
// engine's Resolve found it in its copy of the descriptor) when it holds
// the range (the common case: O(1)), else the one a search finds. Ranges
// do not overlap (a descriptor is validated), so at most one entry holds
// the range, and the hint changes the cost, never the answer.
func (e *Endpoint) keyFor(addr, n uint64, hint uint32) *keyRange {
	m := e.keys.Load()
	if r := m.At(hint); r != nil && addr >= r.addr && n <= r.length && addr-r.addr <= r.length-n {
		return r
	}
	r, _ := m.Floor(addr)
	if r == nil || n > r.length || addr-r.addr > r.length-n {
		return nil
	}
	return r
}

// formatKey returns the key of a region: its secret and handle (see Keys
// in the package's doc).
func formatKey(secret uint64, h segtable.Handle) string {
	return strconv.FormatUint(secret, 16) + "." + strconv.FormatUint(uint64(h), 16)
}

// parseKey reads a key made by formatKey; ok is false for anything else
// (no key, the secret alone, garbage).
func parseKey(k string) (secret uint64, h segtable.Handle, ok bool) {
	s, hs, found := strings.Cut(k, ".")
	if !found {
		return 0, 0, false
	}
	secret, err := strconv.ParseUint(s, 16, 64)
	if err != nil {
		return 0, 0, false
	}
	hv, err := strconv.ParseUint(hs, 16, 32)
	if err != nil || hv == 0 {
		return 0, 0, false
	}
	return secret, segtable.Handle(hv), true
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

// CopyNow moves s at once unless it is a notification, which it leaves
// to CopyBatch: a copy gains nothing from a batch but the company of
// others (transport.InlineCopier).
func (e *Endpoint) CopyNow(s *transport.Slice, h *transport.Holds) (bool, error) {
	if s.Op == transport.Notify {
		return false, nil
	}
	return true, e.copy(s, h)
}

// CopyBatch moves the slices in order, as Copy would, but consecutive
// copies large enough move four at once (transport.CopyGroup): a run of
// scattered blocks then keeps four times the misses in flight
// (transport.BatchCopier).
func (e *Endpoint) CopyBatch(s []transport.Slice, errs []error) {
	var h transport.Holds
	var g transport.CopyGroup
	for i := range s {
		a := &s[i]
		if a.Op == transport.Notify || !transport.CopyGroups(a.Length) {
			g.Flush()
			if a.Op == transport.Notify {
				h.Release() // the handler may wait on what waits for a reference
			}
			errs[i] = e.copy(a, &h)
			continue
		}
		r, release, err := e.take(a, &h)
		if errs[i] = err; err == nil {
			dst, src := through(r, a)
			g.Add(dst, src, &r.ref, release)
		}
	}
	g.Flush()
	h.Release()
}

func (e *Endpoint) copy(s *transport.Slice, h *transport.Holds) error {
	if s.Op == transport.Notify {
		if e.closed.Load() || e.to.Load().closed.Load() || e.from.closed.Load() {
			return transport.ErrClosed
		}
		return e.notify(s)
	}
	r, release, err := e.take(s, h)
	if err != nil {
		return err
	}
	fastcopy.Copy(through(r, s))
	if release {
		r.ref.Release()
	}
	return nil
}

// take checks s, a copy, and takes the reference on the target region it
// reaches, in h when h can hold it (release: the caller releases it after
// the copy).
func (e *Endpoint) take(s *transport.Slice, h *transport.Holds) (r *region, release bool, err error) {
	to := e.to.Load()
	if e.closed.Load() || to.closed.Load() || e.from.closed.Load() {
		return nil, false, transport.ErrClosed
	}
	if e.self {
		if r = find(&to.regs, s.Remote, s.Length); r == nil {
			return nil, false, transport.ErrRange
		}
	} else if r = e.target(to, s); r == nil {
		return nil, false, refused(to, s)
	}
	ok, release := h.Take(&r.ref)
	if !ok {
		return nil, false, transport.ErrDenied // being unregistered
	}
	return r, release, nil
}

// through returns the destination and the source of s, a copy in r.
func through(r *region, s *transport.Slice) (dst, src []byte) {
	remote := unsafe.Slice((*byte)(unsafe.Add(r.base, s.Remote-uint64(r.addr))), s.Length)
	local := unsafe.Slice((*byte)(s.Local), s.Length)
	if s.Op == transport.Write {
		return remote, local
	}
	return local, remote
}

// target returns the region a peer's slice may reach, or nil: the
// initiator presents the key its descriptor lists for the buffer holding
// the range, and the target, as over a wire, checks what the key claims:
// a live handle (a stale generation names nothing), the region's secret,
// the range inside the region, and a remote-accessible region. The
// region may be closing (Take refuses it).
func (e *Endpoint) target(to *Transport, s *transport.Slice) *region {
	k := e.keyFor(s.Remote, s.Length, s.RemoteIndex)
	if k == nil || !k.ok {
		return nil
	}
	r := to.byHandle.Get(k.handle)
	if r == nil || r.key != k.secret || !r.remote || s.Length > r.length || s.Remote-uint64(r.addr) > r.length-s.Length {
		return nil
	}
	return r
}

// refused returns the error of a peer's slice that target refused:
// ErrRange when no region of the target holds the range, ErrDenied when
// one does but the key did not open it (as when regions were searched by
// address first). Off the path of requests that succeed.
func refused(to *Transport, s *transport.Slice) error {
	if find(&to.regs, s.Remote, s.Length) == nil {
		return transport.ErrRange
	}
	return transport.ErrDenied
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
