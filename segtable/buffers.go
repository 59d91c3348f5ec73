package segtable

import (
	"context"
	"fmt"
	"runtime"
	"sort"
	"strings"
	"sync/atomic"
	"unsafe"
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
	if _, err := fmt.Sscanf(num, "%d", &index); err != nil || index < 0 || fmt.Sprint(index) != num {
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
// and by address in O(log n) take no lock; registration takes a mutex and
// publishes a new snapshot. The zero value is an empty table ready for use.
// Safe for concurrent use.
type Buffers struct {
	// Busy, when set before the table is shared, reports whether users
	// that do not take references still use a buffer; Unregister waits for
	// it to say false.
	Busy func(*Buffer) bool

	t      table[Buffer]
	sorted atomic.Pointer[[]*Buffer] // by Addr; written under t.mu
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
	sorted := bs.sortedList()
	i := sort.Search(len(sorted), func(i int) bool { return sorted[i].Addr+uintptr(sorted[i].Length) > b.Addr })
	if i < len(sorted) && sorted[i].Addr < b.Addr+uintptr(b.Length) {
		return nil, fmt.Errorf("%w: [%#x, +%d) meets buffer %d", ErrOverlap, b.Addr, b.Length, sorted[i].ID)
	}
	if _, err := bs.t.insert(b, func(id uint32) { b.ID = BufferID(id) }); err != nil {
		return nil, err
	}
	// Pin keeps Go memory alive (and, by contract, in place) while peers and
	// devices hold its address; for non-Go memory it does nothing.
	b.pinner.Pin(unsafe.SliceData(buf))
	s := make([]*Buffer, 0, len(sorted)+1)
	s = append(append(append(s, sorted[:i]...), b), sorted[i:]...)
	bs.sorted.Store(&s)
	return b, nil
}

func (bs *Buffers) sortedList() []*Buffer {
	if p := bs.sorted.Load(); p != nil {
		return *p
	}
	return nil
}

// Get returns the live buffer named id, or nil. Lock-free.
func (bs *Buffers) Get(id BufferID) *Buffer { return bs.t.get(uint32(id)) }

// Find returns the buffer that holds [addr, addr+n), or nil. Lock-free.
func (bs *Buffers) Find(addr uintptr, n uint64) *Buffer {
	s := bs.sortedList()
	i := sort.Search(len(s), func(i int) bool { return s[i].Addr+uintptr(s[i].Length) > addr })
	if i == len(s) || addr < s[i].Addr || !s[i].Contains(uint64(addr-s[i].Addr), n) {
		return nil
	}
	return s[i]
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
	old := bs.sortedList()
	s := make([]*Buffer, 0, len(old))
	for _, x := range old {
		if x != b {
			s = append(s, x)
		}
	}
	bs.sorted.Store(&s)
	b.pinner.Unpin()
	return b, nil
}

// All returns the registered buffers sorted by address: a snapshot that the
// caller must not modify.
func (bs *Buffers) All() []*Buffer { return bs.sortedList() }

func (bs *Buffers) busy(b *Buffer) func() bool {
	if bs.Busy == nil {
		return nil
	}
	return func() bool { return bs.Busy(b) }
}
