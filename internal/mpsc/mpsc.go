// Package mpsc is the bounded multi-producer, single-consumer ring that the
// submission and completion queues are built on.
//
// # Layout
//
//	mask, buf read-only                                    | pad
//	claim     producers CAS it to reserve positions        |
//	limit     head + size as a producer last saw it        | pad
//	committed positions below it are readable; producers   | pad
//	          advance it in reservation order
//	head      the consumer stores it after releasing,      | pad
//	local     and keeps its own copy
//	buf[i]    the values (another allocation)
//
// A producer reserves below limit with one CAS on claim (loading head, the
// consumer's line, only when limit says the ring looks full), writes its values with plain stores, waits until committed reaches
// its first position (at once, unless an earlier producer is still writing)
// and stores committed past its last. The consumer loads committed once per
// batch, reads the values in place and releases them with one store of head.
// The committed store publishes the producers' plain writes; the head store
// publishes the consumer's release. No per-slot flag is written or read, so
// a batch costs each side one shared cache line besides the values, as in
// the disruptor's single-cursor design.
//
// # Concurrency
//
// Any number of goroutines may call the producer methods at once; exactly one
// goroutine at a time may call the consumer methods. A producer descheduled
// between its reservation and its commit holds up later producers' commits
// (they yield while they wait) and so the consumer, as in every ring of this
// kind.
package mpsc

import (
	"errors"
	"runtime"
	"sync/atomic"

	"golang.org/x/sys/cpu"
)

// ErrSize reports a capacity that is not a power of two in [2, 1<<30].
var ErrSize = errors.New("mpsc: size must be a power of two between 2 and 1<<30")

// ErrNotEmpty reports a Grow of a queue that holds reserved positions.
var ErrNotEmpty = errors.New("mpsc: the queue is not empty")

// Queue is a bounded MPSC ring of T. Its zero value is not usable; use New.
// T should hold no pointers so the ring is invisible to the garbage collector.
type Queue[T any] struct {
	_ cpu.CacheLinePad
	// mask and buf never change: both sides read them on every call, so
	// they share a line with nothing that is written.
	mask uint64
	buf  []T
	_    cpu.CacheLinePad
	// claim is the next position to reserve; producers CAS it.
	claim atomic.Uint64
	// limit is head + size as some producer last loaded head: never more
	// than the true bound, since head only grows. It spares producers a
	// load of head, a line the consumer writes, on every reservation.
	limit atomic.Uint64
	_     cpu.CacheLinePad
	// committed is the first position not yet readable; producers store it
	// in reservation order, the consumer loads it once per batch.
	committed atomic.Uint64
	_         cpu.CacheLinePad
	// head is the first position not yet released; written only by the
	// consumer, once per Release; loaded by producers when limit runs out.
	head atomic.Uint64
	// local is the consumer's private copy of head.
	local uint64
	_     cpu.CacheLinePad
}

// New returns a queue of size slots.
func New[T any](size int) (*Queue[T], error) {
	if size < 2 || size > 1<<30 || size&(size-1) != 0 {
		return nil, ErrSize
	}
	q := &Queue[T]{mask: uint64(size - 1), buf: make([]T, size)}
	q.limit.Store(uint64(size))
	return q, nil
}

// Cap returns the number of slots.
func (q *Queue[T]) Cap() int { return len(q.buf) }

// Grow gives an empty queue size slots (at least its Cap), keeping its
// positions: the next reserved is the one that would have been. It is for
// a queue that starts small and grows the first time it fills. No
// producer and no consumer may use the queue during the call, and the
// caller's way of keeping them out must order their next calls after it
// (an atomic flag they load, a lock); Len may be called meanwhile. It
// returns ErrSize for a bad size and ErrNotEmpty if any position is
// reserved and not released, changing nothing then.
func (q *Queue[T]) Grow(size int) error {
	if size < len(q.buf) || size > 1<<30 || size&(size-1) != 0 {
		return ErrSize
	}
	h := q.head.Load()
	if q.claim.Load() != h || q.committed.Load() != h || q.local != h {
		return ErrNotEmpty
	}
	q.buf = make([]T, size)
	q.mask = uint64(size - 1)
	q.limit.Store(h + uint64(size))
	return nil
}

// Reserve claims up to n consecutive positions and returns the first and the
// count, which is 0 when the queue is full. The caller must fill every
// claimed slot through Slot and then call Commit once, promptly.
func (q *Queue[T]) Reserve(n int) (pos uint64, got int) {
	size := uint64(len(q.buf))
	for {
		if n <= 0 {
			return 0, 0
		}
		t := q.claim.Load()
		limit := q.limit.Load()
		if t+uint64(n) > limit { // the ring may have room that limit does not show
			limit = q.head.Load() + size
			if t >= limit {
				return 0, 0
			}
			q.limit.Store(limit) // a racing producer may store a lower one: it reloads sooner
		}
		k := min(uint64(n), limit-t)
		if q.claim.CompareAndSwap(t, t+k) {
			return t, int(k)
		}
	}
}

// Slot returns the storage of a reserved position (producer) or of a
// readable one (consumer).
func (q *Queue[T]) Slot(pos uint64) *T { return &q.buf[pos&q.mask] }

// Commit makes the n positions reserved from pos readable, after those of
// every earlier reservation.
func (q *Queue[T]) Commit(pos uint64, n int) {
	for spins := 0; q.committed.Load() != pos; spins++ {
		if spins > 16 {
			runtime.Gosched() // an earlier producer is between Reserve and Commit
		}
	}
	q.committed.Store(pos + uint64(n))
}

// Push copies as many values of vs as fit and returns how many it copied.
func (q *Queue[T]) Push(vs []T) int {
	pos, n := q.Reserve(len(vs))
	if n == 0 {
		return 0
	}
	i := int(pos & q.mask)
	c := copy(q.buf[i:], vs[:n])
	copy(q.buf, vs[c:n])
	q.Commit(pos, n)
	return n
}

// PushOne copies v into the queue and reports whether it fit.
func (q *Queue[T]) PushOne(v *T) bool {
	pos, n := q.Reserve(1)
	if n == 0 {
		return false
	}
	q.buf[pos&q.mask] = *v
	q.Commit(pos, 1)
	return true
}

// Readable returns the consumer's first unreleased position and how many
// committed values follow it, at most max. Consumer only.
func (q *Queue[T]) Readable(max int) (pos uint64, n int) {
	h := q.local
	avail := q.committed.Load() - h
	if uint64(max) < avail {
		return h, max
	}
	return h, int(avail)
}

// Release gives n read positions back to producers. Consumer only; n must
// not exceed what Readable reported.
func (q *Queue[T]) Release(n int) {
	if n <= 0 {
		return
	}
	q.local += uint64(n)
	q.head.Store(q.local)
}

// Pop copies up to len(dst) values out and releases them. Consumer only.
func (q *Queue[T]) Pop(dst []T) int {
	pos, n := q.Readable(len(dst))
	i := int(pos & q.mask)
	c := copy(dst[:n], q.buf[i:])
	copy(dst[c:n], q.buf)
	q.Release(n)
	return n
}

// Committed returns the first position not yet committed: positions below
// it hold published values until the consumer releases them. A second
// reader that trails the consumer (a sender ahead of a completer) uses it.
func (q *Queue[T]) Committed() uint64 { return q.committed.Load() }

// Head returns the consumer's first unreleased position. Consumer only.
func (q *Queue[T]) Head() uint64 { return q.local }

// Released returns the consumer's first unreleased position as last
// published, for another reader: positions below it may be reused.
func (q *Queue[T]) Released() uint64 { return q.head.Load() }

// Len returns the number of reserved, unreleased positions: a snapshot, exact
// only when no goroutine is using the queue.
func (q *Queue[T]) Len() int {
	h := q.head.Load() // head first: a later claim is never below it
	return int(q.claim.Load() - h)
}

// Empty reports whether nothing is committed past the consumer's position.
// Consumer only.
func (q *Queue[T]) Empty() bool { return q.committed.Load() == q.local }
