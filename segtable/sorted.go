package segtable

import "sync/atomic"

// Sorted is a copy-on-write sequence of values ordered by a uint64 key (an
// address), kept as a two-level tree: chunks of at most maxChunk values
// (their keys packed, apart from the values), in pages of at most maxPage
// chunks, under one array of pages. Lookups load one snapshot and search
// the pages' first keys, then one page's chunks' first keys, then one
// chunk's keys, in O(log n) and without a lock. A change copies one chunk,
// one page's arrays and the top array, O(maxChunk + maxPage + n/(maxChunk
// maxPage)): flat up to millions of values, where one level of chunks made
// each change copy O(sqrt n) (a chunk of up to 512 values and the array
// over all chunks, about 25 KB at 100k values). A value past the end of a
// full chunk starts a chunk of its own, and past the end of a full page a
// page of its own, so that values inserted in key order (buffers
// registered one after another) leave full chunks and pages. Equal keys
// keep the order they were inserted in.
//
// Lookups are safe for concurrent use with each other and with one
// changer; changes (Insert, Delete, Reset) must be serialized by the
// caller. The zero value is empty and ready for use.
type Sorted[T any] struct {
	snap atomic.Pointer[sortedSnap[T]]
}

// The tree's fan-outs: variables only so that tests can make trees of
// many pages from few values.
var (
	maxChunk = 64 // a chunk that grows past it splits in two
	maxPage  = 32 // chunks of a page; one that grows past it splits
)

// A chunk or page that shrinks under a quarter of its maximum joins a
// neighbour that has room.
func minChunk() int { return maxChunk / 4 }
func minPage() int  { return maxPage / 4 }

// A snapshot's and a page's arrays are never modified once published, so
// a change that leaves every first key as it was (one chunk, or one page,
// replaced by one that starts at the same key: most insertions and
// deletions) shares firsts with the snapshot or page it replaces, and
// copies only the pointers and the offsets. The offsets are 32 bits: a
// Sorted holds fewer than 2^31 values (the tables it indexes hold at most
// MaxEntries).
type sortedSnap[T any] struct {
	firsts []uint64 // firsts[p] is pages[p].firsts[0]
	pages  []*sortedPage[T]
	offs   []int32 // offs[p]: how many values lie before page p
	n      int
}

type sortedPage[T any] struct {
	firsts []uint64 // firsts[c] is chunks[c].keys[0]
	chunks []*sortedChunk[T]
	offs   []int32 // offs[c]: how many values of the page lie before chunk c
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

// floor returns the page, chunk and offset of the last value whose key is
// at most key, or p = -1.
func (sn *sortedSnap[T]) floor(key uint64) (p, c, i int) {
	if p = floorIndex(sn.firsts, key); p < 0 {
		return -1, 0, 0
	}
	pg := sn.pages[p]
	c = floorIndex(pg.firsts, key)
	return p, c, floorIndex(pg.chunks[c].keys, key)
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
	p, c, i := sn.floor(key)
	if p < 0 {
		return v, 0, -1, false
	}
	pg := sn.pages[p]
	ch := pg.chunks[c]
	return ch.vals[i], ch.keys[i], int(sn.offs[p]) + int(pg.offs[c]) + i, true
}

// Descend calls fn for the values whose keys are at most key, from the
// last down, until fn returns false.
func (s *Sorted[T]) Descend(key uint64, fn func(k uint64, v T) bool) {
	sn := s.load()
	p, c, i := sn.floor(key)
	for ; p >= 0; p-- {
		pg := sn.pages[p]
		if c < 0 {
			c = len(pg.chunks) - 1
		}
		for ; c >= 0; c-- {
			ch := pg.chunks[c]
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
}

// Ascend calls fn for every value in order, until fn returns false.
func (s *Sorted[T]) Ascend(fn func(k uint64, v T) bool) { s.load().ascend(fn) }

func (sn *sortedSnap[T]) ascend(fn func(k uint64, v T) bool) {
	if sn == nil {
		return
	}
	for _, pg := range sn.pages {
		for _, ch := range pg.chunks {
			for i, k := range ch.keys {
				if !fn(k, ch.vals[i]) {
					return
				}
			}
		}
	}
}

// Values returns the values in order: a new slice.
func (s *Sorted[T]) Values() []T {
	sn := s.load()
	out := make([]T, 0, sn.n)
	for _, pg := range sn.pages {
		for _, ch := range pg.chunks {
			out = append(out, ch.vals...)
		}
	}
	return out
}

// Insert adds v under key, after any value of an equal key.
func (s *Sorted[T]) Insert(key uint64, v T) {
	sn := s.load()
	if len(sn.pages) == 0 {
		s.publish(sn, 0, 0, []*sortedPage[T]{newPage([]*sortedChunk[T]{{keys: []uint64{key}, vals: []T{v}}})})
		return
	}
	p, c, i := sn.floor(key)
	if p < 0 {
		p, c, i = 0, 0, -1 // before everything: the first chunk's head
	}
	pg := sn.pages[p]
	old := pg.chunks[c]
	at := i + 1
	if len(old.keys) == maxChunk && at == len(old.keys) {
		// Past the end of a full chunk: at the head of the next chunk
		// when it has room (insertions in falling key order fill chunks
		// too), else a chunk of its own, which leaves the full one full
		// rather than halves (insertions in key order); past the end of a
		// full page, the next page's head when it has room, else a page
		// of its own.
		if c+1 < len(pg.chunks) && len(pg.chunks[c+1].keys) < maxChunk {
			s.publish(sn, p, p+1, pg.with(c+1, c+2, []*sortedChunk[T]{prependKey(key, v, pg.chunks[c+1])}, nil))
			return
		}
		one := []*sortedChunk[T]{{keys: []uint64{key}, vals: []T{v}}}
		if c == len(pg.chunks)-1 && len(pg.chunks) == maxPage {
			if p+1 < len(sn.pages) {
				np := sn.pages[p+1]
				if len(np.chunks[0].keys) < maxChunk {
					s.publish(sn, p+1, p+2, np.with(0, 1, []*sortedChunk[T]{prependKey(key, v, np.chunks[0])}, nil))
					return
				}
				if len(np.chunks) < maxPage {
					s.publish(sn, p+1, p+2, np.with(0, 0, one, nil))
					return
				}
			}
			s.publish(sn, p+1, p+1, []*sortedPage[T]{newPage(one)})
			return
		}
		s.publish(sn, p, p+1, pg.with(c+1, c+1, one, nil))
		return
	}
	keys := make([]uint64, 0, len(old.keys)+1)
	keys = append(append(append(keys, old.keys[:at]...), key), old.keys[at:]...)
	vals := make([]T, 0, len(old.vals)+1)
	vals = append(append(append(vals, old.vals[:at]...), v), old.vals[at:]...)
	with := []*sortedChunk[T]{{keys, vals}}
	if len(keys) > maxChunk {
		h := len(keys) / 2
		with = []*sortedChunk[T]{{keys: keys[:h:h], vals: vals[:h:h]}, {keys: keys[h:], vals: vals[h:]}}
	}
	s.publish(sn, p, p+1, pg.with(c, c+1, with, nil))
}

// Delete removes the first value under key for which match reports true,
// and reports whether there was one.
func (s *Sorted[T]) Delete(key uint64, match func(T) bool) bool {
	sn := s.load()
	p, c, i := sn.floor(key)
	for ; p >= 0; p-- {
		pg := sn.pages[p]
		if c < 0 {
			c = len(pg.chunks) - 1
		}
		for ; c >= 0; c-- {
			ch := pg.chunks[c]
			if i < 0 {
				i = len(ch.keys) - 1
			}
			for ; i >= 0 && ch.keys[i] == key; i-- {
				if match(ch.vals[i]) {
					s.deleteAt(sn, p, c, i)
					return true
				}
			}
			if i >= 0 {
				return false // a smaller key: none left under key
			}
		}
	}
	return false
}

func (s *Sorted[T]) deleteAt(sn *sortedSnap[T], p, c, i int) {
	pg := sn.pages[p]
	old := pg.chunks[c]
	keys := make([]uint64, 0, len(old.keys)-1)
	keys = append(append(keys, old.keys[:i]...), old.keys[i+1:]...)
	vals := make([]T, 0, len(old.vals)-1)
	vals = append(append(vals, old.vals[:i]...), old.vals[i+1:]...)
	lo, hi := c, c+1
	var with []*sortedChunk[T]
	if len(keys) > 0 {
		if len(keys) < minChunk() {
			// Join the smaller neighbour in the page if the two fit in a
			// chunk, so that deletions do not leave many small chunks.
			n := -1
			if c > 0 {
				n = c - 1
			}
			if c+1 < len(pg.chunks) && (n < 0 || len(pg.chunks[c+1].keys) < len(pg.chunks[n].keys)) {
				n = c + 1
			}
			if n >= 0 && len(pg.chunks[n].keys)+len(keys) <= maxChunk {
				nb := pg.chunks[n]
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
		with = []*sortedChunk[T]{{keys, vals}}
	}
	// A page left small joins the smaller neighbour page if they fit.
	plo, phi := p, p+1
	var nb *sortedPage[T]
	left := false
	if len(pg.chunks)-(hi-lo)+len(with) < minPage() {
		n := -1
		if p > 0 {
			n = p - 1
		}
		if p+1 < len(sn.pages) && (n < 0 || len(sn.pages[p+1].chunks) < len(sn.pages[n].chunks)) {
			n = p + 1
		}
		if n >= 0 && len(sn.pages[n].chunks)+len(pg.chunks)-(hi-lo)+len(with) <= maxPage {
			nb, left = sn.pages[n], n < p
			plo, phi = min(p, n), max(p, n)+1
		}
	}
	var pages []*sortedPage[T]
	if nb != nil {
		pages = pg.with(lo, hi, with, &join[T]{page: nb, left: left})
	} else {
		pages = pg.with(lo, hi, with, nil)
	}
	s.publish(sn, plo, phi, pages)
}

// join is a neighbour page that a page's replacement takes in.
type join[T any] struct {
	page *sortedPage[T]
	left bool // it comes before the page
}

// with returns the pages that replace pg once its chunks [lo, hi) are
// replaced by chunks, and the chunks of j's page joined: none when no
// chunk is left, two when they are more than maxPage.
// prependKey returns a chunk of key (value v) followed by ch's.
func prependKey[T any](key uint64, v T, ch *sortedChunk[T]) *sortedChunk[T] {
	keys := make([]uint64, 0, len(ch.keys)+1)
	vals := make([]T, 0, len(ch.vals)+1)
	return &sortedChunk[T]{keys: append(append(keys, key), ch.keys...), vals: append(append(vals, v), ch.vals...)}
}

func (pg *sortedPage[T]) with(lo, hi int, chunks []*sortedChunk[T], j *join[T]) []*sortedPage[T] {
	n := len(pg.chunks) - (hi - lo) + len(chunks)
	if j != nil {
		n += len(j.page.chunks)
	}
	all := make([]*sortedChunk[T], 0, n)
	if j != nil && j.left {
		all = append(all, j.page.chunks...)
	}
	all = append(append(append(all, pg.chunks[:lo]...), chunks...), pg.chunks[hi:]...)
	if j != nil && !j.left {
		all = append(all, j.page.chunks...)
	}
	switch {
	case len(all) == 0:
		return nil
	case len(all) > maxPage:
		h := len(all) / 2
		return []*sortedPage[T]{newPage(all[:h:h]), newPage(all[h:])}
	case j == nil && len(chunks) == hi-lo && sameFirsts(chunks, pg.firsts[lo:hi]):
		return []*sortedPage[T]{pageOf(all, pg.firsts)}
	}
	return []*sortedPage[T]{newPage(all)}
}

// sameFirsts reports whether chunks start at the keys firsts.
func sameFirsts[T any](chunks []*sortedChunk[T], firsts []uint64) bool {
	for c, ch := range chunks {
		if ch.keys[0] != firsts[c] {
			return false
		}
	}
	return true
}

// newPage returns a page of chunks, which it keeps.
func newPage[T any](chunks []*sortedChunk[T]) *sortedPage[T] {
	firsts := make([]uint64, len(chunks))
	for c, ch := range chunks {
		firsts[c] = ch.keys[0]
	}
	return pageOf(chunks, firsts)
}

// pageOf returns a page of chunks whose first keys are firsts; it keeps
// both.
func pageOf[T any](chunks []*sortedChunk[T], firsts []uint64) *sortedPage[T] {
	pg := &sortedPage[T]{firsts: firsts, chunks: chunks, offs: make([]int32, len(chunks))}
	for c, ch := range chunks {
		pg.offs[c] = int32(pg.n)
		pg.n += len(ch.keys)
	}
	return pg
}

// Reset replaces the sequence with keys and vals, which must be sorted by
// key and of one length. Chunks and pages are filled to half, so that the
// next insertions split none.
func (s *Sorted[T]) Reset(keys []uint64, vals []T) {
	var chunks []*sortedChunk[T]
	for lo := 0; lo < len(keys); lo += maxChunk / 2 {
		hi := min(lo+maxChunk/2, len(keys))
		chunks = append(chunks, &sortedChunk[T]{keys: keys[lo:hi:hi], vals: vals[lo:hi:hi]})
	}
	var pages []*sortedPage[T]
	for lo := 0; lo < len(chunks); lo += maxPage / 2 {
		hi := min(lo+maxPage/2, len(chunks))
		pages = append(pages, newPage(chunks[lo:hi:hi]))
	}
	s.publish(&sortedSnap[T]{}, 0, 0, pages)
}

// publish stores a snapshot that is sn with pages [lo, hi) replaced by
// with.
func (s *Sorted[T]) publish(sn *sortedSnap[T], lo, hi int, with []*sortedPage[T]) {
	n := len(sn.pages) - (hi - lo) + len(with)
	ns := &sortedSnap[T]{pages: make([]*sortedPage[T], 0, n), offs: make([]int32, n)}
	ns.pages = append(append(append(ns.pages, sn.pages[:lo]...), with...), sn.pages[hi:]...)
	if len(with) == hi-lo && samePageFirsts(with, sn.firsts[lo:hi]) {
		ns.firsts = sn.firsts
	} else {
		ns.firsts = make([]uint64, 0, n)
		ns.firsts = append(ns.firsts, sn.firsts[:lo]...)
		for _, pg := range ns.pages[lo:] {
			ns.firsts = append(ns.firsts, pg.firsts[0])
		}
	}
	copy(ns.offs, sn.offs[:lo])
	total := 0
	if lo > 0 {
		total = int(sn.offs[lo-1]) + sn.pages[lo-1].n
	}
	for p := lo; p < n; p++ {
		ns.offs[p] = int32(total)
		total += ns.pages[p].n
	}
	ns.n = total
	s.snap.Store(ns)
}

// samePageFirsts reports whether pages start at the keys firsts.
func samePageFirsts[T any](pages []*sortedPage[T], firsts []uint64) bool {
	for p, pg := range pages {
		if pg.firsts[0] != firsts[p] {
			return false
		}
	}
	return true
}
