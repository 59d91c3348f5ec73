package segtable

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"unsafe"

	"github.com/moonring/moonring/internal/mem"
)

// Location says where a buffer's memory lives: "cpu:N" for NUMA node N,
// "cuda:N" for GPU N. The empty Location means "cpu" on no particular node.
type Location string

// CPU returns the location of host memory on NUMA node n.
func CPU(node int) Location { return Location(fmt.Sprintf("cpu:%d", node)) }

// CUDA returns the location of the memory of GPU n.
func CUDA(gpu int) Location { return Location(fmt.Sprintf("cuda:%d", gpu)) }

// Parse splits l into its kind ("cpu", "cuda") and index (-1 when absent).
func (l Location) Parse() (kind string, index int, err error) {
	if l == "" {
		return "cpu", -1, nil
	}
	kind, num, ok := strings.Cut(string(l), ":")
	if kind != "cpu" && kind != "cuda" {
		return "", 0, fmt.Errorf("segtable: bad location %q: kind must be cpu or cuda", string(l))
	}
	if !ok {
		return kind, -1, nil
	}
	// strconv, not fmt.Sscanf: this runs on every registration, and
	// Sscanf's scanner cost more than the rest of Parse.
	index, err = strconv.Atoi(num)
	if err != nil || index < 0 || strconv.Itoa(index) != num {
		return "", 0, fmt.Errorf("segtable: bad location %q: bad index", string(l))
	}
	return kind, index, nil
}

// MaxTransports is how many transports one engine can have installed at once;
// a buffer keeps one registration per transport slot.
const MaxTransports = 8

// Registration is what a transport attached to a buffer: a handle the
// transport uses locally and a key it publishes for peers ("" when peers
// need none).
type Registration struct {
	Handle uint64
	Key    string
	// Staged marks memory the slot's transport cannot reach itself (GPU
	// memory, for a transport of host memory): requests on it take the
	// segment's Staged endpoint, which moves it through host buffers, and
	// Handle is the staging transport's. The slot's transport never saw
	// the registration, so there is nothing to unregister from it.
	Staged bool
}

// Buffer is one registered range of local memory. Its fields other than
// Regs are fixed at registration; Regs is written while the engine installs
// or uninstalls a transport and read by pollers. Safe for concurrent use.
type Buffer struct {
	ID       BufferID
	Addr     uintptr
	Length   uint64
	Location Location
	// Remote says whether peers may access the buffer.
	Remote bool
	// Regs holds one registration per transport slot.
	Regs [MaxTransports]atomic.Pointer[Registration]

	base   unsafe.Pointer // Addr as a pointer: pinned Go memory or mmap'd memory
	ref    ref
	pinner runtime.Pinner
}

// Bytes returns the buffer's memory. Valid until the buffer is unregistered.
func (b *Buffer) Bytes() []byte {
	// base came from a live slice at registration and the pinner keeps Go
	// memory from being freed until unregistration.
	return unsafe.Slice((*byte)(b.base), b.Length)
}

// Pointer returns the address of byte off of the buffer; off must be within
// bounds. Valid until the buffer is unregistered.
func (b *Buffer) Pointer(off uint64) unsafe.Pointer {
	return unsafe.Add(b.base, off)
}

// Acquire takes a reference that keeps the buffer registered; it fails once
// unregistration has begun. Every successful Acquire needs one Release.
func (b *Buffer) Acquire() bool { return b.ref.Acquire() }

// Release drops a reference taken by Acquire.
func (b *Buffer) Release() { b.ref.Release() }

// Closing reports whether unregistration has begun. Users that do not take
// references check it before each use and answer Buffers.Busy.
func (b *Buffer) Closing() bool { return b.ref.Closing() }

// InUse returns how many references are held.
func (b *Buffer) InUse() int { return b.ref.InUse() }

// Contains reports whether [off, off+n) lies inside the buffer and n > 0.
func (b *Buffer) Contains(off, n uint64) bool {
	return n > 0 && n <= b.Length && off <= b.Length-n
}

// Buffers is the table of registered local buffers: lookups by ID in O(1)
// and by address in O(log n) take no lock; registration takes a mutex,
// changes a slot of the table by ID in place and publishes new copies of
// the parts of the address index it changes (see table and Sorted). The zero value is an empty table ready for use.
// Safe for concurrent use.
type Buffers struct {
	// Busy, when set before the table is shared, reports whether users
	// that do not take references still use a buffer; Unregister waits for
	// it to say false.
	Busy func(*Buffer) bool

	t      table[Buffer]
	sorted Sorted[*Buffer] // by Addr; changed under t.mu
}

// Register adds the memory of buf. It refuses an empty slice and a range
// that overlaps a registered buffer, and pins Go memory until Unregister.
func (bs *Buffers) Register(buf []byte, loc Location, remote bool) (*Buffer, error) {
	if len(buf) == 0 {
		return nil, ErrEmpty
	}
	if _, _, err := loc.Parse(); err != nil {
		return nil, err
	}
	b := &Buffer{base: unsafe.Pointer(unsafe.SliceData(buf)), Addr: uintptr(unsafe.Pointer(unsafe.SliceData(buf))), Length: uint64(len(buf)), Location: loc, Remote: remote}
	bs.t.mu.Lock()
	defer bs.t.mu.Unlock()
	// Buffers do not overlap, so the last one that starts before b's end
	// is the only one that may meet b.
	if x, _, ok := bs.sorted.FloorValue(uint64(b.Addr) + b.Length - 1); ok && uint64(x.Addr)+x.Length > uint64(b.Addr) {
		return nil, fmt.Errorf("%w: [%#x, +%d) meets buffer %d", ErrOverlap, b.Addr, b.Length, x.ID)
	}
	if _, err := bs.t.insert(b, func(id uint32) { b.ID = BufferID(id) }); err != nil {
		return nil, err
	}
	// Pin keeps Go memory alive (and, by contract, in place) while peers and
	// devices hold its address. For other memory it pins nothing but
	// still makes a pinner with a finalizer, which every collection then
	// visits: a fifth to a quarter of a collection's work beside 100k
	// buffers of Alloc's memory (BenchmarkScaleChurn). Memory of
	// mem.Alloc (the engine's Alloc) is left unpinned; IsAllocated looks
	// its start up in a map, and walks the live allocations only for a
	// buffer that does not start one.
	if !mem.IsAllocated(b.Addr) {
		b.pinner.Pin(unsafe.SliceData(buf))
	}
	bs.sorted.Insert(uint64(b.Addr), b)
	return b, nil
}

// Get returns the live buffer named id, or nil. Lock-free.
func (bs *Buffers) Get(id BufferID) *Buffer { return bs.t.get(uint32(id)) }

// Find returns the buffer that holds [addr, addr+n), or nil. Lock-free.
func (bs *Buffers) Find(addr uintptr, n uint64) *Buffer {
	b, _, ok := bs.sorted.FloorValue(uint64(addr))
	if !ok || !b.Contains(uint64(addr-b.Addr), n) {
		return nil
	}
	return b
}

// Overlapping returns a buffer that meets [addr, addr+n), or nil.
// Lock-free.
func (bs *Buffers) Overlapping(addr uintptr, n uint64) *Buffer {
	if n == 0 {
		return nil
	}
	end := uint64(addr) + n - 1
	if end < uint64(addr) {
		end = ^uint64(0)
	}
	b, _, ok := bs.sorted.FloorValue(end)
	if !ok || uint64(b.Addr)+b.Length <= uint64(addr) {
		return nil
	}
	return b
}

// Len returns how many buffers are registered. Lock-free.
func (bs *Buffers) Len() int { return bs.sorted.Len() }

// Each calls fn for every registered buffer in the order of their
// addresses, until fn returns false. Lock-free: a buffer registered or
// unregistered during the walk is seen or not (see Sorted).
func (bs *Buffers) Each(fn func(*Buffer) bool) {
	bs.sorted.Ascend(func(_ uint64, b *Buffer) bool { return fn(b) })
}

// Unregister removes the buffer named id once no request holds it. New
// requests are refused from the moment it is called. If ctx ends first, the
// buffer stays registered and the error wraps ErrBusy.
func (bs *Buffers) Unregister(ctx context.Context, id BufferID) (*Buffer, error) {
	b := bs.Get(id)
	if b == nil {
		return nil, fmt.Errorf("%w: buffer %d", ErrNotFound, id)
	}
	if err := b.ref.DrainWhile(ctx, bs.busy(b)); err != nil {
		return nil, fmt.Errorf("buffer %d: %w", id, err)
	}
	bs.t.mu.Lock()
	defer bs.t.mu.Unlock()
	if bs.t.get(uint32(id)) != b {
		return nil, fmt.Errorf("%w: buffer %d", ErrNotFound, id)
	}
	bs.t.set(uint32(id), nil)
	bs.sorted.Delete(uint64(b.Addr), func(x *Buffer) bool { return x == b })
	b.pinner.Unpin()
	return b, nil
}

// UnregisterAll removes every buffer, each once no request holds it, and
// returns them. It is Unregister of each, but changes the table once: for
// an owner that is closing, whose n Unregisters would copy the table's
// chunks n times. If ctx ends first, the buffers not yet drained stay
// registered and the error wraps ErrBusy.
func (bs *Buffers) UnregisterAll(ctx context.Context) ([]*Buffer, error) {
	all := bs.All()
	var err error
	done := all[:0:0]
	for _, b := range all {
		if derr := b.ref.DrainWhile(ctx, bs.busy(b)); derr != nil {
			err = fmt.Errorf("buffer %d: %w", b.ID, derr)
			break
		}
		done = append(done, b)
	}
	bs.t.mu.Lock()
	defer bs.t.mu.Unlock()
	gone := make(map[*Buffer]bool, len(done))
	ids := make([]uint32, 0, len(done))
	for _, b := range done {
		if bs.t.get(uint32(b.ID)) == b {
			gone[b] = true
			ids = append(ids, uint32(b.ID))
		}
	}
	bs.t.removeAll(ids)
	var keys []uint64
	var keep []*Buffer
	bs.sorted.Ascend(func(k uint64, b *Buffer) bool {
		if !gone[b] {
			keys, keep = append(keys, k), append(keep, b)
		}
		return true
	})
	bs.sorted.Reset(keys, keep)
	out := done[:0]
	for _, b := range done {
		if gone[b] {
			b.pinner.Unpin()
			out = append(out, b)
		}
	}
	return out, err
}

// All returns the registered buffers sorted by address: a new slice,
// built in O(n).
func (bs *Buffers) All() []*Buffer { return bs.sorted.Values() }

func (bs *Buffers) busy(b *Buffer) func() bool {
	if bs.Busy == nil {
		return nil
	}
	return func() bool { return bs.Busy(b) }
}
