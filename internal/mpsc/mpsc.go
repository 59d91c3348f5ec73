// Package mpsc is the bounded multi-producer, single-consumer ring that the
// submission and completion queues are built on.
//
// # Layout
//
//	tail  (producers CAS it to reserve positions)      | pad
//	head  (the consumer stores it after releasing)     | pad
//	seq[i]  per slot: p+1 once position p is published
//	buf[i]  per slot: the value, written by the reserving producer
//
// A producer loads head once, reserves up to the free count with one CAS on
// tail, writes its values with plain stores and publishes each slot by storing
// seq = position+1. The consumer reads slots in order while seq matches, then
// releases them all with one store of head. The seq store publishes the plain
// writes of buf to the consumer; the head store publishes the consumer's
// release to producers.
//
// # Concurrency
//
// Any number of goroutines may call the producer methods at once; exactly one
// goroutine at a time may call the consumer methods. A producer descheduled
// between its reservation and its publication holds up the consumer at that
// slot until it resumes, as in every ring of this kind.
package mpsc

import (
	"errors"
	"sync/atomic"

	"golang.org/x/sys/cpu"
)

// ErrSize reports a capacity that is not a power of two in [2, 1<<30].
var ErrSize = errors.New("mpsc: size must be a power of two between 2 and 1<<30")

// Queue is a bounded MPSC ring of T. Its zero value is not usable; use New.
// T should hold no pointers so the ring is invisible to the garbage collector.
type Queue[T any] struct {
	// tail is the next position to reserve; written by producers (CAS).
	tail atomic.Uint64
	_    cpu.CacheLinePad
	// head is the first position not yet released; written only by the
	// consumer, once per Release; read by producers once per reservation.
	head atomic.Uint64
	_    cpu.CacheLinePad
	// local is the consumer's private copy of head.
	local uint64
	mask  uint64
	seq   []atomic.Uint64
	buf   []T
}

// New returns a queue of size slots.
func New[T any](size int) (*Queue[T], error) {
	if size < 2 || size > 1<<30 || size&(size-1) != 0 {
		return nil, ErrSize
	}
	return &Queue[T]{
		mask: uint64(size - 1),
		seq:  make([]atomic.Uint64, size),
		buf:  make([]T, size),
	}, nil
}

// Cap returns the number of slots.
func (q *Queue[T]) Cap() int { return len(q.buf) }

// Reserve claims up to n consecutive positions and returns the first and the
// count, which is 0 when the queue is full. The caller must fill every
// claimed slot through Slot and publish each with Publish, promptly.
func (q *Queue[T]) Reserve(n int) (pos uint64, got int) {
	size := uint64(len(q.buf))
	for {
		t := q.tail.Load()
		free := size - (t - q.head.Load())
		if free == 0 || n <= 0 {
			return 0, 0
		}
		k := uint64(n)
		if k > free {
			k = free
		}
		if q.tail.CompareAndSwap(t, t+k) {
			return t, int(k)
		}
	}
}

// Slot returns the storage of a reserved position (producer) or of a
// readable one (consumer).
func (q *Queue[T]) Slot(pos uint64) *T { return &q.buf[pos&q.mask] }

// Publish makes a reserved position visible to the consumer.
func (q *Queue[T]) Publish(pos uint64) { q.seq[pos&q.mask].Store(pos + 1) }

// Push copies as many values of vs as fit and returns how many it copied.
func (q *Queue[T]) Push(vs []T) int {
	pos, n := q.Reserve(len(vs))
	for i := 0; i < n; i++ {
		q.buf[(pos+uint64(i))&q.mask] = vs[i]
	}
	for i := 0; i < n; i++ {
		q.Publish(pos + uint64(i))
	}
	return n
}

// PushOne copies v into the queue and reports whether it fit.
func (q *Queue[T]) PushOne(v *T) bool {
	pos, n := q.Reserve(1)
	if n == 0 {
		return false
	}
	q.buf[pos&q.mask] = *v
	q.Publish(pos)
	return true
}

// Readable returns the consumer's first unreleased position and how many
// published values follow it in order, at most max. Consumer only.
func (q *Queue[T]) Readable(max int) (pos uint64, n int) {
	h := q.local
	for n < max && n < len(q.buf) && q.seq[(h+uint64(n))&q.mask].Load() == h+uint64(n)+1 {
		n++
	}
	return h, n
}

// Release gives n read positions back to producers. Consumer only; n must
// not exceed what Readable reported.
func (q *Queue[T]) Release(n int) {
	q.local += uint64(n)
	q.head.Store(q.local)
}

// Pop copies up to len(dst) values out and releases them. Consumer only.
func (q *Queue[T]) Pop(dst []T) int {
	pos, n := q.Readable(len(dst))
	for i := 0; i < n; i++ {
		dst[i] = q.buf[(pos+uint64(i))&q.mask]
	}
	q.Release(n)
	return n
}

// Len returns the number of reserved, unreleased positions: a snapshot, exact
// only when no goroutine is using the queue.
func (q *Queue[T]) Len() int {
	h := q.head.Load() // head first: a later tail is never below it
	return int(q.tail.Load() - h)
}

// Empty reports whether nothing is published at the consumer's position.
// Consumer only.
func (q *Queue[T]) Empty() bool {
	return q.seq[q.local&q.mask].Load() != q.local+1
}
