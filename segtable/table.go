package segtable

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Errors returned by the tables. None of them is helped by retrying the same
// call, except ErrBusy once the work in flight has drained.
var (
	// ErrOverlap: the range overlaps a registered buffer.
	ErrOverlap = errors.New("segtable: range overlaps a registered buffer")
	// ErrEmpty: zero-length range.
	ErrEmpty = errors.New("segtable: empty range")
	// ErrNotFound: no entry with that ID, address or name.
	ErrNotFound = errors.New("segtable: not found")
	// ErrBusy: requests still use the entry; it was left in place.
	ErrBusy = errors.New("segtable: in use by requests in flight")
	// ErrFull: the table holds MaxEntries entries, or has retired so many
	// indexes (each after 4095 entries, so that no ID is ever reused) that
	// none is left.
	ErrFull = errors.New("segtable: table full")
)

// Ref is a reference count with a closing bit: Acquire fails once Drain has
// begun, so the closer can wait for the count to reach zero knowing that it
// only falls. Transports use it to keep a registration alive while a copy
// runs. The zero value is ready for use; safe for concurrent use.
type Ref struct {
	v atomic.Uint64
	// mu and drainers count the Drains under way: the closing bit goes
	// away only with the last one that gives up (one that gave up first
	// would otherwise let references in again under another's wait).
	mu       sync.Mutex
	drainers int
}

type ref = Ref

const closingBit = 1 << 63

// Acquire takes a reference unless the entry is closing.
func (r *Ref) Acquire() bool {
	// Load and CAS rather than add-then-undo: a refused Acquire must not
	// touch the count, or callers retrying in a loop could hold off Drain.
	for {
		v := r.v.Load()
		if v&closingBit != 0 {
			return false
		}
		if r.v.CompareAndSwap(v, v+1) {
			return true
		}
	}
}

// Release drops a reference taken by Acquire.
func (r *Ref) Release() { r.v.Add(^uint64(0)) }

// InUse returns the number of references held.
func (r *Ref) InUse() int { return int(r.v.Load() &^ closingBit) }

// Closing reports whether Drain has begun: a lock-free check for users
// that track their use elsewhere (see DrainWhile).
func (r *Ref) Closing() bool { return r.v.Load()&closingBit != 0 }

// Drain refuses new references and waits until none is held. If ctx ends
// first it returns an error wrapping ErrBusy and the context's error, and
// the entry accepts
// references again unless another Drain still waits.
func (r *Ref) Drain(ctx context.Context) error { return r.DrainWhile(ctx, nil) }

// DrainWhile is Drain that also waits while busy reports true. busy covers
// users that do not take references but check Closing before each use and
// can say whether they still use the entry (the pollers, for their
// in-flight tables).
func (r *Ref) DrainWhile(ctx context.Context, busy func() bool) error {
	return r.drain(ctx, 0, busy)
}

// DrainFor is Drain with a time limit rather than a context: if
// references are still held after limit, it returns an error wrapping
// ErrBusy and context.DeadlineExceeded. It allocates nothing when none
// is held (a context with a timeout is two allocations and a timer, for
// each unregistration).
func (r *Ref) DrainFor(limit time.Duration) error { return r.drain(nil, limit, nil) }

// drain waits as DrainWhile does, until ctx ends or, when ctx is nil,
// until limit has passed since the first wait.
func (r *Ref) drain(ctx context.Context, limit time.Duration, busy func() bool) error {
	r.mu.Lock()
	r.drainers++
	r.v.Or(closingBit)
	r.mu.Unlock()
	wait := time.Microsecond
	var deadline time.Time
	for r.v.Load() != closingBit || (busy != nil && busy()) {
		var err error
		switch {
		case ctx != nil:
			err = ctx.Err()
		case deadline.IsZero():
			deadline = time.Now().Add(limit)
		case !time.Now().Before(deadline):
			err = context.DeadlineExceeded
		}
		if err != nil {
			r.mu.Lock()
			if r.drainers--; r.drainers == 0 {
				r.v.And(^uint64(closingBit))
			}
			r.mu.Unlock()
			// Say who holds it: references (transports moving bytes)
			// and requests the pollers track are counted apart.
			held := fmt.Sprintf("%d transfers hold it", r.InUse())
			if busy != nil && busy() {
				held += ", requests in flight in the rings use it"
			}
			return fmt.Errorf("%w (%s): %w", ErrBusy, held, err)
		}
		time.Sleep(wait)
		if wait < time.Millisecond {
			wait *= 2
		}
	}
	return nil
}

// table is an index of entries by ID in chunks of tableChunk slots: a
// lookup finds the slot in a slotDir and reads it (a few loads, no lock).
// A chunk is made when an index first reaches it and kept; a change takes mu and stores into one slot in place (its ID
// and entry are atomics, and get reads the ID on both sides of the entry,
// as Handles does), so it copies and allocates nothing: a copy-on-write
// chunk (2 KiB copied and left to the collector per change) cost a
// register/unregister cycle beside 100k buffers more in the collector's
// work than in its own (BenchmarkScaleChurn), and a single array copied
// whole made n registrations cost n².
type table[E any] struct {
	mu      sync.Mutex
	slots   slotDir[E]
	indexes // guarded by mu
}

// indexes hands out the indexes of a table and the IDs that name them (an
// index and its generation), and retires them; its user serializes the
// calls. Shared by table and Handles.
type indexes struct {
	size int      // indexes ever handed out
	gens []uint32 // per index; bumped on removal
	free []int    // free indexes
	// first is the lowest index handed out (LocalSegmentID reserves 0).
	first int
}

// take returns a free index and the ID that names it now, or ErrFull.
func (x *indexes) take() (int, uint32, error) {
	var idx int
	if n := len(x.free); n > 0 {
		idx, x.free = x.free[n-1], x.free[:n-1]
	} else {
		idx = max(x.size, x.first)
		if idx >= MaxEntries {
			return 0, 0, ErrFull
		}
		x.size = idx + 1
	}
	for len(x.gens) < x.size {
		x.gens = append(x.gens, 1)
	}
	return idx, makeID(idx, x.gens[idx]), nil
}

// retire bumps the generation of a freed index and frees it.
func (x *indexes) retire(idx int) {
	// Generation 0 never names a live entry. When the generations of an
	// index run out, retire the index rather than wrap: wrapped, an ID kept
	// from the index's first entry would name a later one (after 4095
	// reuses, which a loop that registers and unregisters one buffer
	// reaches in milliseconds, since free is LIFO).
	if gen := (x.gens[idx] + 1) & (1<<(32-idIndexBits) - 1); gen != 0 {
		x.gens[idx] = gen
		x.free = append(x.free, idx)
	}
}

const (
	tableChunkBits = 7
	tableChunk     = 1 << tableChunkBits
)

// get returns the live entry named id, or nil. Lock-free.
func (t *table[E]) get(id uint32) *E {
	s := t.slots.find(id & idIndexMask)
	if s == nil {
		return nil
	}
	if id == 0 || s.id.Load() != id {
		return nil
	}
	e := s.v.Load()
	// The ID again: a removal and an insertion since the first load would
	// have left another ID's entry (the ID goes before the entry, and the
	// new entry comes before the new ID; an ID is never handed out twice).
	if s.id.Load() != id {
		return nil
	}
	return e
}

// insert places e and returns its ID; mu must be held. build is called with
// the ID before the entry is published.
func (t *table[E]) insert(e *E, build func(id uint32)) (uint32, error) {
	idx, id, err := t.take()
	if err != nil {
		return 0, err
	}
	build(id)
	s := t.slot(idx)
	s.v.Store(e)
	s.id.Store(id)
	return id, nil
}

// slot returns idx's slot, making it when it is not there yet; mu must be
// held.
func (t *table[E]) slot(idx int) *handleSlot[E] { return t.slots.slot(idx) }

// set publishes e (or nil) at a live ID; mu must be held.
func (t *table[E]) set(id uint32, e *E) {
	idx, _ := splitID(id)
	s := t.slot(idx)
	if e != nil {
		s.v.Store(e)
		return
	}
	s.id.Store(0)
	s.v.Store(nil)
	t.retire(idx)
}

// removeAll clears the live IDs ids; mu must be held.
func (t *table[E]) removeAll(ids []uint32) {
	for _, id := range ids {
		t.set(id, nil)
	}
}

// each calls fn for every live entry, in the order of their indexes.
func (t *table[E]) each(fn func(*E)) {
	t.mu.Lock()
	n := t.size
	t.mu.Unlock()
	for ci := 0; ci<<tableChunkBits < n; ci++ {
		c := t.slots.chunk(ci)
		if c == nil {
			continue
		}
		for i := range c {
			if e := c[i].v.Load(); e != nil {
				fn(e)
			}
		}
	}
}
