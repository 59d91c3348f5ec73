package segtable

import (
	"sync"
	"sync/atomic"
)

// Handle names a value in a Handles table: an index and a generation, like
// a BufferID, so a handle kept after its value was removed never names one
// added later. The zero Handle names nothing. A transport may publish one
// in a buffer's key so that its target finds the buffer's registration
// without a search (see package local); a handle from a peer is a claim,
// and its user checks what it names (bounds, a secret, access).
type Handle uint32

// Handles is a table of values by Handle with O(1) lock-free lookup (a
// slotDir: three loads), so an empty table is about 600 bytes. A slot is changed in place
// (its handle and value are atomics, and Get reads the handle on both
// sides of the value), so Add and Remove copy and allocate nothing once
// the slot's chunk exists: a copy-on-write chunk, as the engine's tables
// had (2 KiB copied and left to the collector per change), made a
// register/unregister cycle of the local transport dearer
// (BenchmarkScaleChurn, CPU time per cycle, 3 rounds: 2-3 µs at one
// buffer, 5-10 µs at 10k). It holds up to MaxEntries values at once;
// an index is retired after 4095 uses rather than let a generation wrap
// (see ErrFull).
//
// Get is safe for concurrent use with everything; Add and Remove take a
// lock. A value is reachable from Add until Remove returns; a Get that
// began before may still return it, so a user that frees what a value
// holds first makes it refuse new users (segtable.Ref's Drain) and waits
// for those it has. The zero value is an empty table ready for use.
type Handles[T any] struct {
	mu  sync.Mutex
	ix  indexes // under mu
	dir slotDir[T]
}

// handleSlot is one value and the handle (or ID, in a table) that names
// it; 0 when free. Writers (under the table's mutex) store the value
// before the handle on Add, and clear the handle before the value on
// Remove.
type handleSlot[T any] struct {
	id atomic.Uint32
	v  atomic.Pointer[T]
}

// Get returns the value h names, or nil when it names none (removed, never
// added, or a generation not its slot's). Lock-free.
func (hs *Handles[T]) Get(h Handle) *T {
	s := hs.dir.find(uint32(h) & idIndexMask)
	if s == nil {
		return nil
	}
	if h == 0 || s.id.Load() != uint32(h) {
		return nil
	}
	v := s.v.Load()
	// The handle again: a Remove and an Add since the first load would
	// have left the value of another handle (the handle changes before
	// the value goes, and the new value comes before the new handle).
	if s.id.Load() != uint32(h) {
		return nil
	}
	return v
}

// Add stores v and returns its handle, or ErrFull.
func (hs *Handles[T]) Add(v *T) (Handle, error) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	idx, id, err := hs.ix.take()
	if err != nil {
		return 0, err
	}
	s := hs.slot(idx)
	s.v.Store(v)
	s.id.Store(id)
	return Handle(id), nil
}

// Remove forgets the value h names and reports whether there was one;
// from then on Get(h) returns nil.
func (hs *Handles[T]) Remove(h Handle) bool {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if h == 0 || hs.Get(h) == nil {
		return false
	}
	idx, _ := splitID(uint32(h))
	s := hs.slot(idx)
	s.id.Store(0)
	s.v.Store(nil)
	hs.ix.retire(idx)
	return true
}

// slot returns idx's slot, making it when it is not there yet; mu must be
// held.
func (hs *Handles[T]) slot(idx int) *handleSlot[T] { return hs.dir.slot(idx) }
