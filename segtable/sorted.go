package segtable

import (
	"sync/atomic"
	"unsafe"
)

// Sorted is a copy-on-write sequence of values ordered by a uint64 key (an
// address), kept as a B+ tree: leaves of at most maxChunk values (their
// keys packed, apart from the values) under inner nodes of at most
// maxPage children, each holding its children's first keys packed, their
// pointers and how many values lie before each. Lookups load the published
// view (the root and the few values pending beside it) and search one node a level, in O(log n) and without a lock. A change copies
// one leaf: a tree of two levels under one array of every page copied
// that array on every change, which grew with n (57 pages, 1.1-1.4 KiB,
// at 100k values), and the garbage of a register/unregister cycle beside
// 100k buffers cost the collector more than the cycle's own work
// (BenchmarkScaleChurn). The inner nodes above the leaf are copied too,
// O(maxPage log n) bytes, and a new root published. Swapping the new leaf
// into its parent in place (an atomic store, the counts above changed in
// place) was tried and dropped: a third less garbage a change in the
// middle of 100k values, but a lookup or walk that overlapped two changes
// then read old subtrees beside current ones (a reader inside a node that
// one change copied kept it while another changed its kids in place): a
// walk listed a value twice (DescList's flat list, so Segment.Buffer(i) of
// the engine's own segment off by one) and Floor returned a key and an
// index of no version. Inner nodes of 16
// children left less garbage a change than 32, at the same height up to
// 250k values (four levels at 100k, three at 10k). A value past the end of a full leaf goes to the
// head of the next leaf when that has room, else to a leaf of its own (and
// one before everything, at a full first leaf, too), and a node that
// overflows past its last child (or before its first) leaves the full
// node whole, so that values inserted in key order, rising or falling,
// leave full nodes.
// Equal keys keep the order they were inserted in.
//
// The last few values inserted (up to maxPend) wait beside the tree,
// pending, in a small sorted array of the version a change publishes
// (sortedView), and go into the tree, with path copies, only when an
// insertion finds the array full. Deleting a pending value takes it out
// of the array and copies no node: a value inserted and deleted again
// with fewer than maxPend insertions between (a buffer registered for a
// while and unregistered, the churn of BenchmarkScaleChurn) costs a
// version of a hundred bytes or so a change, where the path copies of
// the leaf and the nodes above it cost 1.5-2 KiB in the middle of 100k
// values, the bulk of a cycle's garbage in the three address indexes
// an engine keeps. Any other change costs what it did plus that version
// (and an insertion into a full array, the path copies of the pending
// values, which the insertions before it did not make). Lookups search
// the array too: a few compares beside the tree's levels.
//
// Lookups are safe for concurrent use with each other and with one
// changer; changes (Insert, Delete, Reset) must be serialized by the
// caller. A lookup or a walk (Ascend, Descend, Values) that runs during
// changes sees the sequence as it was when it loaded the version (the
// tree's root and the pending values, neither modified once published):
// one version. The zero value is empty and ready for use.
type Sorted[T any] struct {
	view atomic.Pointer[sortedView[T]] // nil when never changed
	// undo is the version before the last change when that change put a
	// value into the pending array (at undoAt, making the current
	// version), for the changer only: deleting that value again
	// publishes undo again (it is immutable) rather than a copy.
	undo   *sortedView[T]
	undoAt int
	// ver counts the changes, for caches of what was built from the
	// values.
	ver atomic.Uint64
}

// sortedView is one version of a Sorted: the tree and the values pending
// beside it, never modified once published.
type sortedView[T any] struct {
	root *sortedNode[T] // nil when the tree is empty
	n    int            // pending values, in keys[:n] and vals[:n]
	// keys are sorted, equal keys in the order of insertion; a pending
	// value comes after every value of the tree with an equal key (it
	// was inserted after them).
	keys [pendCap]uint64
	vals [pendCap]T
}

// pendCap is the room for pending values in a version; maxPend, at most
// pendCap, how many wait (a variable only so that tests can turn it
// off or make it one).
const pendCap = 4

var maxPend = pendCap

// The tree's fan-outs: variables only so that tests can make tall trees
// from few values.
var (
	maxChunk = 64 // values of a leaf; one that grows past it splits
	maxPage  = 16 // children of an inner node; one that grows past it splits
)

// sortedNode is a leaf (h 0: keys and vals) or an inner node (h > 0: its
// children's first keys in keys, and kids). A node is never modified once
// published: a change copies what it changes.
//
// An inner node's counts lie in the array of its keys, past their length
// (up to the capacity): for each kid how many values of the node lie
// before it, then how many the node holds. One allocation for both, and
// no slice header of their own: a node is 80 bytes, not 112, and a cycle
// of registering and unregistering a buffer below every other one makes
// and drops a few nodes in each index.
type sortedNode[T any] struct {
	keys []uint64
	vals []T
	// kids are the children, *sortedNode[T] as unsafe.Pointer (Go
	// pointers all the same, which the collector traces), read with
	// atomic loads: a remnant of the in-place swap (see Sorted), as
	// cheap as plain loads on amd64.
	kids []unsafe.Pointer
	h    int // height above the leaves
}

// kid returns child c of an inner node.
func (nd *sortedNode[T]) kid(c int) *sortedNode[T] {
	return (*sortedNode[T])(atomic.LoadPointer(&nd.kids[c]))
}

// counts returns an inner node's counts: how many values lie before each
// kid, then how many the node holds (see sortedNode).
func (nd *sortedNode[T]) counts() []uint64 { return nd.keys[len(nd.keys):cap(nd.keys)] }

// offset returns how many values of an inner node lie before kid c.
func (nd *sortedNode[T]) offset(c int) int { return int(atomic.LoadUint64(&nd.counts()[c])) }

// count returns how many values lie under nd.
func (nd *sortedNode[T]) count() int {
	if nd.h == 0 {
		return len(nd.keys)
	}
	return int(atomic.LoadUint64(&nd.counts()[len(nd.kids)]))
}

// nodes returns a list of node pointers as kids holds them.
func nodes[T any](nds ...*sortedNode[T]) []unsafe.Pointer {
	out := make([]unsafe.Pointer, len(nds))
	for i, nd := range nds {
		out[i] = unsafe.Pointer(nd)
	}
	return out
}

// at returns the node p (an element of kids, or of a list from nodes).
func at[T any](p unsafe.Pointer) *sortedNode[T] { return (*sortedNode[T])(p) }

// max returns how many entries (values or children) nd may hold.
func (nd *sortedNode[T]) max() int {
	if nd.h == 0 {
		return maxChunk
	}
	return maxPage
}

func newLeaf[T any](keys []uint64, vals []T) *sortedNode[T] {
	return &sortedNode[T]{keys: keys, vals: vals}
}

// newInner returns a node over kids, which it keeps.
func newInner[T any](kids []unsafe.Pointer) *sortedNode[T] {
	k := len(kids)
	all := make([]uint64, 2*k+1) // keys, then counts (see sortedNode)
	nd := &sortedNode[T]{keys: all[:k], kids: kids, h: at[T](kids[0]).h + 1}
	n := 0
	for c, p := range kids {
		kid := at[T](p)
		all[c] = kid.keys[0]
		all[k+c] = uint64(n)
		n += kid.count()
	}
	all[2*k] = uint64(n)
	return nd
}

// Len returns how many values the sequence holds.
func (s *Sorted[T]) Len() int {
	w := s.view.Load()
	if w == nil {
		return 0
	}
	n := w.n
	if w.root != nil {
		n += w.root.count()
	}
	return n
}

// tree returns the current tree, without the pending values.
func (s *Sorted[T]) tree() *sortedNode[T] {
	if w := s.view.Load(); w != nil {
		return w.root
	}
	return nil
}

// pendFloor returns the index of the last pending value whose key is at
// most key, or -1.
func (w *sortedView[T]) pendFloor(key uint64) int {
	j := w.n - 1
	for j >= 0 && w.keys[j] > key {
		j--
	}
	return j
}

// version returns a number that changes with every change of the
// sequence.
func (s *Sorted[T]) version() uint64 { return s.ver.Load() }

// floorIndex returns the index of the last element of a, which is sorted,
// that is at most key, or -1. A plain binary search: one without a branch
// on the data (the borrow of bits.Sub64 as a mask) halved the time of a
// lookup of a random address among many (no mispredictions), but made
// each step wait on the last one's load, and requests to the same buffer,
// whose branches a CPU predicts and whose loads it runs ahead, took twice
// as long at 10k buffers (BenchmarkScaleBuffers to=last 155 ns against
// 80).
func floorIndex[T uint64 | int](a []T, key T) int {
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
	w := s.view.Load()
	if w == nil {
		return v, 0, -1, false
	}
	v, k, index, ok = w.root.floor(key)
	if w.n == 0 {
		return v, k, index, ok
	}
	// index is -1 when the tree has no key at most key.
	switch j := w.pendFloor(key); {
	case j < 0:
		return v, k, index, ok
	case !ok || w.keys[j] >= k:
		// After the tree's values up to its key (the tree's floor at
		// key is its floor at w.keys[j] too), and the j pending before.
		return w.vals[j], w.keys[j], index + 1 + j, true
	default:
		return v, k, index + 1 + j, true
	}
}

// floor is Floor in the tree under nd (nil: empty).
func (nd *sortedNode[T]) floor(key uint64) (v T, k uint64, index int, ok bool) {
	if nd == nil {
		return v, 0, -1, false
	}
	for nd.h > 0 {
		c := floorIndex(nd.keys, key)
		if c < 0 {
			return v, 0, -1, false
		}
		index += nd.offset(c)
		nd = nd.kid(c)
	}
	i := floorIndex(nd.keys, key)
	if i < 0 {
		return v, 0, -1, false
	}
	return nd.vals[i], nd.keys[i], index + i, true
}

// FloorValue is Floor without the index: it reads no counts on the way
// down, for the users that need the value only (a lookup of a random key
// among many misses the cache at every array it reads).
func (s *Sorted[T]) FloorValue(key uint64) (v T, k uint64, ok bool) {
	w := s.view.Load()
	if w == nil {
		return v, 0, false
	}
	v, k, ok = w.root.floorValue(key)
	if w.n > 0 {
		if j := w.pendFloor(key); j >= 0 && (!ok || w.keys[j] >= k) {
			return w.vals[j], w.keys[j], true
		}
	}
	return v, k, ok
}

// floorValue is FloorValue in the tree under nd (nil: empty).
func (nd *sortedNode[T]) floorValue(key uint64) (v T, k uint64, ok bool) {
	if nd == nil {
		return v, 0, false
	}
	for nd.h > 0 {
		c := floorIndex(nd.keys, key)
		if c < 0 {
			return v, 0, false
		}
		nd = nd.kid(c)
	}
	i := floorIndex(nd.keys, key)
	if i < 0 {
		return v, 0, false
	}
	return nd.vals[i], nd.keys[i], true
}

// Descend calls fn for the values whose keys are at most key, from the
// last down, until fn returns false.
func (s *Sorted[T]) Descend(key uint64, fn func(k uint64, v T) bool) {
	w := s.view.Load()
	if w == nil {
		return
	}
	j := w.pendFloor(key)
	if j < 0 {
		if w.root != nil {
			w.root.descend(key, false, fn)
		}
		return
	}
	// The pending values at most key, merged in: each before (going
	// down) the tree's values of a key at most its own.
	if w.root != nil && !w.root.descend(key, false, func(k uint64, v T) bool {
		for ; j >= 0 && w.keys[j] >= k; j-- {
			if !fn(w.keys[j], w.vals[j]) {
				return false
			}
		}
		return fn(k, v)
	}) {
		return
	}
	for ; j >= 0; j-- {
		if !fn(w.keys[j], w.vals[j]) {
			return
		}
	}
}

// descend calls fn for nd's values whose keys are at most key (every one
// when all), from the last down; false when fn stopped it.
func (nd *sortedNode[T]) descend(key uint64, all bool, fn func(k uint64, v T) bool) bool {
	i := len(nd.keys) - 1
	if !all {
		i = floorIndex(nd.keys, key)
	}
	if nd.h == 0 {
		for ; i >= 0; i-- {
			if !fn(nd.keys[i], nd.vals[i]) {
				return false
			}
		}
		return true
	}
	for ; i >= 0; i-- {
		if !nd.kid(i).descend(key, all, fn) {
			return false
		}
		all = true // the kids before hold only smaller keys
	}
	return true
}

// Ascend calls fn for every value in order, until fn returns false.
func (s *Sorted[T]) Ascend(fn func(k uint64, v T) bool) {
	w := s.view.Load()
	if w == nil {
		return
	}
	if w.n == 0 {
		w.root.ascend(fn)
		return
	}
	// The pending values merged in: each after the tree's values of a
	// key at most its own.
	j := 0
	if !w.root.ascend(func(k uint64, v T) bool {
		for ; j < w.n && w.keys[j] < k; j++ {
			if !fn(w.keys[j], w.vals[j]) {
				return false
			}
		}
		return fn(k, v)
	}) {
		return
	}
	for ; j < w.n; j++ {
		if !fn(w.keys[j], w.vals[j]) {
			return
		}
	}
}

// ascend calls fn for nd's values in order (none for a nil nd); false when
// fn stopped it.
func (nd *sortedNode[T]) ascend(fn func(k uint64, v T) bool) bool {
	if nd == nil {
		return true
	}
	if nd.h == 0 {
		for i, k := range nd.keys {
			if !fn(k, nd.vals[i]) {
				return false
			}
		}
		return true
	}
	for c := range nd.kids {
		if !nd.kid(c).ascend(fn) {
			return false
		}
	}
	return true
}

// Values returns the values in order: a new slice.
func (s *Sorted[T]) Values() []T {
	out := make([]T, 0, s.Len())
	s.Ascend(func(_ uint64, v T) bool {
		out = append(out, v)
		return true
	})
	return out
}

// Insert adds v under key, after any value of an equal key: pending,
// unless maxPend values wait already, which then go into the tree.
func (s *Sorted[T]) Insert(key uint64, v T) {
	defer s.ver.Add(1)
	w := new(sortedView[T])
	if old := s.view.Load(); old != nil {
		*w = *old
	}
	if w.n >= maxPend {
		for i := range w.n {
			w.root = w.root.with(w.keys[i], w.vals[i])
		}
		clear(w.vals[:w.n]) // no reference kept past its length
		w.n = 0
	}
	if maxPend == 0 {
		w.root = w.root.with(key, v)
		s.publish(w)
		return
	}
	i := w.n
	for ; i > 0 && w.keys[i-1] > key; i-- {
		w.keys[i], w.vals[i] = w.keys[i-1], w.vals[i-1]
	}
	w.keys[i], w.vals[i] = key, v
	w.n++
	old := s.view.Load()
	s.publish(w)
	if old != nil && old.root == w.root {
		s.undo, s.undoAt = old, i
	}
}

// publish makes w the current version.
func (s *Sorted[T]) publish(w *sortedView[T]) {
	s.undo = nil
	s.view.Store(w)
}

// with returns the tree under nd (nil: empty) with v inserted under key,
// after any value of an equal key; nd is not modified.
func (nd *sortedNode[T]) with(key uint64, v T) *sortedNode[T] {
	if nd == nil {
		return newLeaf([]uint64{key}, []T{v})
	}
	out := nd.insert(key, v)
	if out.n == 2 {
		return newInner[T](nodes(at[T](out.p[0]), at[T](out.p[1])))
	}
	return at[T](out.p[0])
}

// replacement is what insert returns: the n nodes (none, one or two)
// that replace a node, in an array rather than a slice, which would take
// an allocation for each level of each insertion.
type replacement struct {
	p [2]unsafe.Pointer
	n int
}

func replace1[T any](a *sortedNode[T]) replacement {
	return replacement{p: [2]unsafe.Pointer{unsafe.Pointer(a)}, n: 1}
}

func replace2[T any](a, b *sortedNode[T]) replacement {
	return replacement{p: [2]unsafe.Pointer{unsafe.Pointer(a), unsafe.Pointer(b)}, n: 2}
}

// insert inserts v under key (before everything when key is smaller than
// every key of nd) and returns the nodes that replace nd: one, or two when
// nd overflowed.
func (nd *sortedNode[T]) insert(key uint64, v T) replacement {
	if nd.h == 0 {
		i := floorIndex(nd.keys, key) + 1
		switch {
		case len(nd.keys) >= maxChunk && i == len(nd.keys):
			// Past the end of a full leaf (whose parent found no room
			// in the next one): a leaf of its own, which leaves the full
			// one full rather than halves.
			return replace2(nd, newLeaf([]uint64{key}, []T{v}))
		case len(nd.keys) >= maxChunk && i == 0:
			// Before everything, at a full first leaf: a leaf of its own
			// too (insertions in falling key order below everything, as
			// mmap's top-down placement gives).
			return replace2(newLeaf([]uint64{key}, []T{v}), nd)
		}
		keys := insertAt(nd.keys, i, key)
		vals := insertAt(nd.vals, i, v)
		if len(keys) > maxChunk {
			h := len(keys) / 2
			return replace2(newLeaf(keys[:h:h], vals[:h:h]), newLeaf(keys[h:], vals[h:]))
		}
		return replace1(newLeaf(keys, vals))
	}
	c := max(floorIndex(nd.keys, key), 0)
	kid := nd.kid(c)
	if c+1 < len(nd.kids) && kid.pastFullEnd(key) && nd.kid(c+1).headRoom() {
		// Past the end of a full leaf, before one with room: at its head
		// (insertions in falling key order fill leaves too).
		head := [1]unsafe.Pointer{unsafe.Pointer(nd.kid(c+1).insertHead(key, v))}
		return replace1(newInner[T](splice(nd.kids, c+1, c+2, head[:])))
	}
	out := kid.insert(key, v)
	lo, hi := c, c+1
	if out.n == 2 && len(at[T](out.p[1]).keys) == 1 && c+1 < len(nd.kids) && len(nd.kid(c+1).keys) < nd.kid(c+1).max() {
		// A node of one entry past the end of a full kid: at the head
		// of the next kid, which has room.
		out = replace2(at[T](out.p[0]), join(at[T](out.p[1]), nd.kid(c+1)))
		hi = c + 2
	}
	a, b := at[T](out.p[0]), at[T](out.p[1])
	if len(nd.kids)-(hi-lo)+out.n > maxPage && out.n == 2 {
		// A kid past the end of a full node, or one of one entry before
		// its first: a node of its own, beside nd itself when the kid
		// that overflowed was left as it was (a full leaf, or a node
		// this rule kept whole below).
		switch {
		case hi == len(nd.kids) && a == kid:
			return replace2(nd, newInner[T](nodes(b)))
		case hi == len(nd.kids):
			kids := splice(nd.kids, lo, hi, out.p[:1])
			return replace2(newInner[T](kids), newInner[T](nodes(b)))
		case lo == 0 && len(a.keys) == 1 && b == kid:
			return replace2(newInner[T](nodes(a)), nd)
		case lo == 0 && len(a.keys) == 1:
			kids := splice(nd.kids, lo, hi, out.p[1:2])
			return replace2(newInner[T](nodes(a)), newInner[T](kids))
		}
	}
	kids := splice(nd.kids, lo, hi, out.p[:out.n])
	if len(kids) <= maxPage {
		return replace1(newInner[T](kids))
	}
	h := len(kids) / 2
	return replace2(newInner[T](kids[:h:h]), newInner[T](kids[h:]))
}

// pastFullEnd reports whether key would go past the end of nd's last leaf,
// and that leaf is full.
func (nd *sortedNode[T]) pastFullEnd(key uint64) bool {
	for nd.h > 0 {
		nd = nd.kid(len(nd.kids) - 1)
	}
	return len(nd.keys) >= maxChunk && key >= nd.keys[len(nd.keys)-1]
}

// headRoom reports whether nd's first leaf has room.
func (nd *sortedNode[T]) headRoom() bool {
	for nd.h > 0 {
		nd = nd.kid(0)
	}
	return len(nd.keys) < maxChunk
}

// insertHead returns nd with v under key at the head of its first leaf,
// which must have room.
func (nd *sortedNode[T]) insertHead(key uint64, v T) *sortedNode[T] {
	if nd.h == 0 {
		return newLeaf(insertAt(nd.keys, 0, key), insertAt(nd.vals, 0, v))
	}
	return newInner[T](splice(nd.kids, 0, 1, nodes(nd.kid(0).insertHead(key, v))))
}

// join returns a node of a's entries followed by b's; a and b are of one
// height.
func join[T any](a, b *sortedNode[T]) *sortedNode[T] {
	if a.h == 0 {
		keys := append(append(make([]uint64, 0, len(a.keys)+len(b.keys)), a.keys...), b.keys...)
		vals := append(append(make([]T, 0, len(a.vals)+len(b.vals)), a.vals...), b.vals...)
		return newLeaf(keys, vals)
	}
	return newInner[T](append(append(make([]unsafe.Pointer, 0, len(a.kids)+len(b.kids)), a.kids...), b.kids...))
}

// insertAt returns a new slice of s with x at i.
func insertAt[E any](s []E, i int, x E) []E {
	out := make([]E, 0, len(s)+1)
	return append(append(append(out, s[:i]...), x), s[i:]...)
}

// splice returns a new slice of s with [lo, hi) replaced by with.
func splice[E any](s []E, lo, hi int, with []E) []E {
	out := make([]E, 0, len(s)-(hi-lo)+len(with))
	return append(append(append(out, s[:lo]...), with...), s[hi:]...)
}

// Delete removes the first value under key for which match reports true
// (from the last inserted down), and reports whether there was one.
func (s *Sorted[T]) Delete(key uint64, match func(T) bool) bool {
	old := s.view.Load()
	if old == nil {
		return false
	}
	// The pending values are the last inserted.
	for j := old.n - 1; j >= 0 && old.keys[j] >= key; j-- {
		if old.keys[j] == key && match(old.vals[j]) {
			w := s.undo // the version before that value's insertion
			if w == nil || j != s.undoAt {
				w = &sortedView[T]{root: old.root, n: old.n - 1}
				copy(w.keys[:], old.keys[:j])
				copy(w.keys[j:], old.keys[j+1:old.n])
				copy(w.vals[:], old.vals[:j])
				copy(w.vals[j:], old.vals[j+1:old.n])
			}
			s.publish(w)
			s.ver.Add(1) // after the version is published: see DescList.desc
			return true
		}
	}
	if old.root == nil {
		return false
	}
	out, found, _ := old.root.delete(key, false, match, true)
	if !found {
		return false
	}
	defer s.ver.Add(1)
	for out != nil && out.h > 0 && len(out.kids) == 1 {
		out = out.kid(0)
	}
	w := *old
	w.root = out
	s.publish(&w)
	return true
}

// delete returns nd without the first value under key, from the last
// down (from its end when all), for which match reports true (nil when
// nothing is left), and whether there was one; more reports, when there was
// none, that nd's values down to its first are all under key, so the one
// may lie in the node before. root says nd is the root, which Delete
// replaces by its only kid: of a root of two kids, one of which goes, out
// is the other (not a node of one kid made only to be dropped: a cycle of
// registering and unregistering a buffer below every other one built
// and dropped one each time).
func (nd *sortedNode[T]) delete(key uint64, all bool, match func(T) bool, root bool) (out *sortedNode[T], found, more bool) {
	i := len(nd.keys) - 1
	if !all {
		i = floorIndex(nd.keys, key)
	}
	if nd.h == 0 {
		for ; i >= 0 && nd.keys[i] == key; i-- {
			if match(nd.vals[i]) {
				if len(nd.keys) == 1 {
					return nil, true, false
				}
				keys := append(append(make([]uint64, 0, len(nd.keys)-1), nd.keys[:i]...), nd.keys[i+1:]...)
				vals := append(append(make([]T, 0, len(nd.vals)-1), nd.vals[:i]...), nd.vals[i+1:]...)
				return newLeaf(keys, vals), true, false
			}
		}
		return nd, false, i < 0
	}
	for ; i >= 0; i-- {
		kid, found, more := nd.kid(i).delete(key, all, match, false)
		if found {
			if root && kid == nil && len(nd.kids) == 2 {
				return nd.kid(1 - i), true, false
			}
			return nd.replace(i, kid), true, false
		}
		if !more {
			return nd, false, false
		}
		all = true
	}
	return nd, false, true
}

// joinWith returns the kid of nd that kid, which is to replace kid c,
// joins: the smaller neighbour, when kid shrank to a quarter of its
// maximum or less and the two fit in a node, so that deletions do not
// leave many small nodes; -1 when none.
func (nd *sortedNode[T]) joinWith(c int, kid *sortedNode[T]) int {
	if len(kid.keys) > kid.max()/4 {
		return -1
	}
	n := -1
	if c > 0 {
		n = c - 1
	}
	if c+1 < len(nd.kids) && (n < 0 || len(nd.kid(c+1).keys) < len(nd.kid(n).keys)) {
		n = c + 1
	}
	if n >= 0 && len(nd.kid(n).keys)+len(kid.keys) <= kid.max() {
		return n
	}
	return -1
}

// replace returns a copy of nd with kid c replaced by kid (dropped when
// nil), and kid joined to a neighbour when joinWith says so; nil when no
// kid is left.
func (nd *sortedNode[T]) replace(c int, kid *sortedNode[T]) *sortedNode[T] {
	if kid == nil {
		if len(nd.kids) == 1 {
			return nil
		}
		return newInner[T](splice(nd.kids, c, c+1, nil))
	}
	lo, hi := c, c+1
	switch n := nd.joinWith(c, kid); {
	case n < 0:
	case n < c:
		kid, lo = join(nd.kid(n), kid), n
	default:
		kid, hi = join(kid, nd.kid(n)), n+1
	}
	return newInner[T](splice(nd.kids, lo, hi, nodes(kid)))
}

// Reset replaces the sequence with keys and vals, which must be sorted by
// key and of one length. Leaves and inner nodes are filled to half, so
// that the next insertions split none.
func (s *Sorted[T]) Reset(keys []uint64, vals []T) {
	defer s.ver.Add(1)
	var level []unsafe.Pointer
	for lo := 0; lo < len(keys); lo += maxChunk / 2 {
		hi := min(lo+maxChunk/2, len(keys))
		level = append(level, unsafe.Pointer(newLeaf(keys[lo:hi:hi], vals[lo:hi:hi])))
	}
	for len(level) > 1 {
		var up []unsafe.Pointer
		for lo := 0; lo < len(level); lo += maxPage / 2 {
			hi := min(lo+maxPage/2, len(level))
			up = append(up, unsafe.Pointer(newInner[T](level[lo:hi:hi])))
		}
		level = up
	}
	w := new(sortedView[T])
	if len(level) > 0 {
		w.root = at[T](level[0])
	}
	s.publish(w)
}
