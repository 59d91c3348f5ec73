package segtable

import "sync/atomic"

// Sorted is a copy-on-write sequence of values ordered by a uint64 key (an
// address), kept in chunks of at most maxChunk: lookups load one snapshot
// and search the chunks' first keys, then one chunk's keys (packed
// uint64s, not the values), in O(log n) and without a lock; a change
// copies one chunk and the small arrays over the chunks, O(sqrt n) for n
// values, where one flat sorted slice copied all n. Equal keys keep the
// order they were inserted in.
//
// Lookups are safe for concurrent use with each other and with one
// changer; changes (Insert, Delete, Reset) must be serialized by the
// caller. The zero value is empty and ready for use.
type Sorted[T any] struct {
	snap atomic.Pointer[sortedSnap[T]]
}

const (
	maxChunk = 512          // a chunk that grows past it splits in two
	minChunk = maxChunk / 8 // one that shrinks under it joins a neighbour
)

type sortedSnap[T any] struct {
	firsts []uint64 // firsts[c] is chunks[c].keys[0]
	chunks []sortedChunk[T]
	offs   []int // offs[c]: how many values lie before chunk c
	n      int
}

type sortedChunk[T any] struct {
	keys []uint64
	vals []T
}

func (s *Sorted[T]) load() *sortedSnap[T] {
	if p := s.snap.Load(); p != nil {
		return p
	}
	return &sortedSnap[T]{}
}

// Len returns how many values the sequence holds.
func (s *Sorted[T]) Len() int { return s.load().n }

// floor returns the chunk and offset of the last value whose key is at
// most key, or c = -1.
func (sn *sortedSnap[T]) floor(key uint64) (c, i int) {
	if c = floorIndex(sn.firsts, key); c < 0 {
		return -1, 0
	}
	return c, floorIndex(sn.chunks[c].keys, key)
}

// floorIndex returns the index of the last element of a, which is sorted,
// that is at most key, or -1. A plain binary search: one without a branch
// on the data (the borrow of bits.Sub64 as a mask) halved the time of a
// lookup of a random address among many (no mispredictions), but made
// each step wait on the last one's load, and requests to the same buffer,
// whose branches a CPU predicts and whose loads it runs ahead, took twice
// as long at 10k buffers (BenchmarkScaleBuffers to=last 155 ns against
// 80).
func floorIndex(a []uint64, key uint64) int {
	i, j := 0, len(a)
	for i < j {
		h := int(uint(i+j) >> 1)
		if a[h] > key {
			j = h
		} else {
			i = h + 1
		}
	}
	return i - 1
}

// Floor returns the last value whose key is at most key, that key, and the
// value's index in the sequence; ok is false when every key is larger.
func (s *Sorted[T]) Floor(key uint64) (v T, k uint64, index int, ok bool) {
	sn := s.load()
	c, i := sn.floor(key)
	if c < 0 {
		return v, 0, -1, false
	}
	ch := &sn.chunks[c]
	return ch.vals[i], ch.keys[i], sn.offs[c] + i, true
}

// Descend calls fn for the values whose keys are at most key, from the
// last down, until fn returns false.
func (s *Sorted[T]) Descend(key uint64, fn func(k uint64, v T) bool) {
	sn := s.load()
	c, i := sn.floor(key)
	for ; c >= 0; c-- {
		ch := sn.chunks[c]
		if i < 0 {
			i = len(ch.keys) - 1
		}
		for ; i >= 0; i-- {
			if !fn(ch.keys[i], ch.vals[i]) {
				return
			}
		}
	}
}

// Ascend calls fn for every value in order, until fn returns false.
func (s *Sorted[T]) Ascend(fn func(k uint64, v T) bool) { s.load().ascend(fn) }

func (sn *sortedSnap[T]) ascend(fn func(k uint64, v T) bool) {
	if sn == nil {
		return
	}
	for _, ch := range sn.chunks {
		for i, k := range ch.keys {
			if !fn(k, ch.vals[i]) {
				return
			}
		}
	}
}

// Values returns the values in order: a new slice.
func (s *Sorted[T]) Values() []T {
	sn := s.load()
	out := make([]T, 0, sn.n)
	for _, ch := range sn.chunks {
		out = append(out, ch.vals...)
	}
	return out
}

// Insert adds v under key, after any value of an equal key.
func (s *Sorted[T]) Insert(key uint64, v T) {
	sn := s.load()
	if len(sn.chunks) == 0 {
		s.publish(sn, 0, 0, []sortedChunk[T]{{keys: []uint64{key}, vals: []T{v}}})
		return
	}
	c, i := sn.floor(key)
	if c < 0 {
		c, i = 0, -1 // before everything: the first chunk's head
	}
	old := sn.chunks[c]
	at := i + 1
	keys := make([]uint64, 0, len(old.keys)+1)
	keys = append(append(append(keys, old.keys[:at]...), key), old.keys[at:]...)
	vals := make([]T, 0, len(old.vals)+1)
	vals = append(append(append(vals, old.vals[:at]...), v), old.vals[at:]...)
	if len(keys) <= maxChunk {
		s.publish(sn, c, c+1, []sortedChunk[T]{{keys, vals}})
		return
	}
	h := len(keys) / 2
	s.publish(sn, c, c+1, []sortedChunk[T]{
		{keys: keys[:h:h], vals: vals[:h:h]},
		{keys: keys[h:], vals: vals[h:]},
	})
}

// Delete removes the first value under key for which match reports true,
// and reports whether there was one.
func (s *Sorted[T]) Delete(key uint64, match func(T) bool) bool {
	sn := s.load()
	c, i := sn.floor(key)
	for ; c >= 0; c-- {
		ch := sn.chunks[c]
		if i < 0 {
			i = len(ch.keys) - 1
		}
		for ; i >= 0 && ch.keys[i] == key; i-- {
			if match(ch.vals[i]) {
				s.deleteAt(sn, c, i)
				return true
			}
		}
		if i >= 0 {
			return false // a smaller key: none left under key
		}
	}
	return false
}

func (s *Sorted[T]) deleteAt(sn *sortedSnap[T], c, i int) {
	old := sn.chunks[c]
	if len(old.keys) == 1 {
		s.publish(sn, c, c+1, nil)
		return
	}
	keys := make([]uint64, 0, len(old.keys)-1)
	keys = append(append(keys, old.keys[:i]...), old.keys[i+1:]...)
	vals := make([]T, 0, len(old.vals)-1)
	vals = append(append(vals, old.vals[:i]...), old.vals[i+1:]...)
	lo, hi := c, c+1
	if len(keys) < minChunk {
		// Join a neighbour, the smaller, if the two fit in a chunk, so
		// that deletions do not leave many small chunks behind.
		n := -1
		if c > 0 {
			n = c - 1
		}
		if c+1 < len(sn.chunks) && (n < 0 || len(sn.chunks[c+1].keys) < len(sn.chunks[n].keys)) {
			n = c + 1
		}
		if n >= 0 && len(sn.chunks[n].keys)+len(keys) <= maxChunk {
			nb := sn.chunks[n]
			if n < c {
				keys = append(append([]uint64(nil), nb.keys...), keys...)
				vals = append(append([]T(nil), nb.vals...), vals...)
				lo = n
			} else {
				keys = append(keys, nb.keys...)
				vals = append(vals, nb.vals...)
				hi = n + 1
			}
		}
	}
	s.publish(sn, lo, hi, []sortedChunk[T]{{keys, vals}})
}

// Reset replaces the sequence with keys and vals, which must be sorted by
// key and of one length.
func (s *Sorted[T]) Reset(keys []uint64, vals []T) {
	var chunks []sortedChunk[T]
	for lo := 0; lo < len(keys); lo += maxChunk / 2 {
		hi := min(lo+maxChunk/2, len(keys))
		chunks = append(chunks, sortedChunk[T]{keys: keys[lo:hi:hi], vals: vals[lo:hi:hi]})
	}
	s.publish(&sortedSnap[T]{}, 0, 0, chunks)
}

// publish stores a snapshot that is sn with chunks [lo, hi) replaced by
// with.
func (s *Sorted[T]) publish(sn *sortedSnap[T], lo, hi int, with []sortedChunk[T]) {
	n := len(sn.chunks) - (hi - lo) + len(with)
	ns := &sortedSnap[T]{firsts: make([]uint64, 0, n), chunks: make([]sortedChunk[T], 0, n), offs: make([]int, n)}
	ns.chunks = append(append(append(ns.chunks, sn.chunks[:lo]...), with...), sn.chunks[hi:]...)
	ns.firsts = append(ns.firsts, sn.firsts[:lo]...)
	for _, ch := range ns.chunks[lo:] {
		ns.firsts = append(ns.firsts, ch.keys[0])
	}
	copy(ns.offs, sn.offs[:lo])
	total := 0
	if lo > 0 {
		total = sn.offs[lo-1] + len(sn.chunks[lo-1].keys)
	}
	for c := lo; c < n; c++ {
		ns.offs[c] = total
		total += len(ns.chunks[c].keys)
	}
	ns.n = total
	s.snap.Store(ns)
}
