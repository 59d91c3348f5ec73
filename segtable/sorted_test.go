package segtable

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/internal/proptest"
)

// TestSortedModel inserts and deletes thousands of values, many under
// equal keys, against a flat sorted slice: enough to split chunks and join
// them again. After each change every lookup agrees with the model.
func TestSortedModel(t *testing.T) {
	t.Run("default", testSortedModel)
	for _, pend := range []int{0, 1, pendCap} {
		t.Run(fmt.Sprintf("small-pend%d", pend), func(t *testing.T) {
			// Leaves of 4 under nodes of 4: a tree five or six levels
			// high, its nodes split and joined at every level.
			mc, mp, mq := maxChunk, maxPage, maxPend
			maxChunk, maxPage, maxPend = 4, 4, pend
			defer func() { maxChunk, maxPage, maxPend = mc, mp, mq }()
			testSortedModel(t)
		})
	}
}

func testSortedModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 1))
	var s Sorted[int]
	var model []kv
	check := func(step int) {
		t.Helper()
		if s.Len() != len(model) {
			t.Fatalf("step %d: Len %d, want %d", step, s.Len(), len(model))
		}
		got := s.Values()
		for i, x := range model {
			if got[i] != x.v {
				t.Fatalf("step %d: value %d is %d, want %d", step, i, got[i], x.v)
			}
		}
		if err := checkTree(s.tree()); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		for range 20 {
			key := rng.Uint64N(4000)
			i := floorOf(model, key)
			v, k, idx, ok := s.Floor(key)
			if ok != (i >= 0) || ok && (v != model[i].v || k != model[i].k || idx != i) {
				t.Fatalf("step %d: Floor(%d) = %d, %d, %d, %v; want index %d", step, key, v, k, idx, ok, i)
			}
			var desc []int
			s.Descend(key, func(_ uint64, v int) bool { desc = append(desc, v); return len(desc) < 3 })
			for j, v := range desc {
				if model[i-j].v != v {
					t.Fatalf("step %d: Descend(%d)[%d] = %d, want %d", step, key, j, v, model[i-j].v)
				}
			}
		}
	}
	next := 0
	for step := range 6000 {
		grow := step < 3000 || rng.IntN(3) == 0
		if step > 4500 {
			grow = rng.IntN(8) == 0
		}
		if grow || len(model) == 0 {
			k := rng.Uint64N(4000)
			next++
			s.Insert(k, next)
			i := floorOf(model, k) + 1
			model = slices.Insert(model, i, kv{k, next})
		} else {
			i := rng.IntN(len(model))
			x := model[i]
			if !s.Delete(x.k, func(v int) bool { return v == x.v }) {
				t.Fatalf("step %d: Delete(%d, %d) found nothing", step, x.k, x.v)
			}
			model = slices.Delete(model, i, i+1)
			if s.Delete(x.k, func(v int) bool { return v == x.v }) {
				t.Fatalf("step %d: Delete(%d, %d) twice", step, x.k, x.v)
			}
		}
		if step%50 == 0 || step > 5900 {
			check(step)
		}
	}
	for len(model) > 0 {
		x := model[0]
		s.Delete(x.k, func(v int) bool { return v == x.v })
		model = model[1:]
	}
	check(-1)
	if s.tree() != nil {
		t.Fatal("nodes left when empty")
	}
}

type kv struct {
	k uint64
	v int
}

// floorOf returns the index of the last element of m whose key is at most
// k, or -1.
func floorOf(m []kv, k uint64) int {
	i := -1
	for j, x := range m {
		if x.k <= k {
			i = j
		}
	}
	return i
}

// checkTree returns what is wrong with the tree under root, if anything:
// a node empty or over its maximum, an inner root of one child, keys out
// of order, a child's first key or offset not as its parent has them, a
// count that is not the sum of the counts below, heights that do not
// step down by one.
func checkTree[T any](root *sortedNode[T]) error {
	if root == nil {
		return nil
	}
	if root.h > 0 && len(root.kids) < 2 {
		return fmt.Errorf("root of height %d has %d children", root.h, len(root.kids))
	}
	var last uint64
	var walk func(nd *sortedNode[T]) error
	walk = func(nd *sortedNode[T]) error {
		if len(nd.keys) == 0 || len(nd.keys) > nd.max() {
			return fmt.Errorf("node of height %d with %d entries", nd.h, len(nd.keys))
		}
		if nd.h == 0 {
			if len(nd.vals) != len(nd.keys) || nd.count() != len(nd.keys) || nd.kids != nil {
				return fmt.Errorf("leaf of %d keys, %d values, count %d", len(nd.keys), len(nd.vals), nd.count())
			}
			for _, k := range nd.keys {
				if k < last {
					return fmt.Errorf("key %d after %d", k, last)
				}
				last = k
			}
			return nil
		}
		if len(nd.kids) != len(nd.keys) || len(nd.counts()) != len(nd.keys)+1 || nd.vals != nil {
			return fmt.Errorf("inner node of %d keys, %d kids, %d counts", len(nd.keys), len(nd.kids), len(nd.counts()))
		}
		n := 0
		for c := range nd.kids {
			kid := nd.kid(c)
			if kid.h != nd.h-1 || nd.keys[c] != kid.keys[0] || nd.offset(c) != n {
				return fmt.Errorf("kid %d of a node of height %d: height %d, first key %d (node has %d), offset %d (want %d)", c, nd.h, kid.h, kid.keys[0], nd.keys[c], nd.offset(c), n)
			}
			if err := walk(kid); err != nil {
				return err
			}
			n += kid.count()
		}
		if nd.count() != n {
			return fmt.Errorf("node of height %d counts %d values, holds %d", nd.h, nd.count(), n)
		}
		return nil
	}
	return walk(root)
}

// levelCounts returns how many nodes the tree under root has at each
// height, leaves first.
func levelCounts[T any](root *sortedNode[T]) []int {
	if root == nil {
		return nil
	}
	counts := make([]int, root.h+1)
	var walk func(nd *sortedNode[T])
	walk = func(nd *sortedNode[T]) {
		counts[nd.h]++
		for c := range nd.kids {
			walk(nd.kid(c))
		}
	}
	walk(root)
	return counts
}

// sortedOp is one step of TestSortedProperty: insert a value under key A
// (a run of B%8+1 of them under rising, falling or equal keys), delete
// the value at model index A, delete the value inserted last (as a buffer
// registered and unregistered again), delete a key and value it does not
// hold, or reset to the model's values.
type sortedOp struct {
	Kind int
	A, B uint32
}

const (
	sortedInsert = iota
	sortedInsertRun
	sortedDelete
	sortedDeleteMissing
	sortedReset
	sortedDeleteLast
)

// TestSortedProperty runs random sequences of insertions (single, and
// runs in rising, falling and equal key order), deletions and resets on a
// Sorted of tiny fan-outs (leaves of 4 under nodes of 4, then of 8 and 4;
// none, one and pendCap values pending) against a sorted slice, checking
// after every step the tree's shape (checkTree), the pending values' order
// and every lookup: Len, Values, Floor with its index, FloorValue,
// Descend and Ascend stopped early.
func TestSortedProperty(t *testing.T) {
	for _, f := range [][3]int{{4, 4, 0}, {4, 4, 1}, {4, 4, pendCap}, {8, 4, pendCap}} {
		t.Run(fmt.Sprintf("leaf%d-node%d-pend%d", f[0], f[1], f[2]), func(t *testing.T) {
			mc, mp, mq := maxChunk, maxPage, maxPend
			maxChunk, maxPage, maxPend = f[0], f[1], f[2]
			defer func() { maxChunk, maxPage, maxPend = mc, mp, mq }()
			props := proptest.Properties(t, 100)
			props.Property("Sorted matches a sorted slice", prop.ForAll(runSortedOps,
				gen.SliceOfN(300, gen.Struct(reflect.TypeOf(sortedOp{}), map[string]gopter.Gen{
					"Kind": gen.Weighted([]gen.WeightedGen{
						{Weight: 5, Gen: gen.Const(sortedInsert)},
						{Weight: 2, Gen: gen.Const(sortedInsertRun)},
						{Weight: 5, Gen: gen.Const(sortedDelete)},
						{Weight: 1, Gen: gen.Const(sortedDeleteMissing)},
						{Weight: 1, Gen: gen.Const(sortedReset)},
						{Weight: 3, Gen: gen.Const(sortedDeleteLast)},
					}),
					"A": gen.UInt32(),
					"B": gen.UInt32(),
				}))))
			props.TestingRun(t)
		})
	}
}

// runSortedOps runs ops on a Sorted and a model: "" when they agree.
func runSortedOps(ops []sortedOp) string {
	var s Sorted[int]
	var model []kv
	next := 0
	last := kv{} // the value inserted last, v 0 when none or deleted
	insert := func(k uint64) {
		last = kv{k, next + 1}
		next++
		s.Insert(k, next)
		i := floorOf(model, k) + 1
		model = slices.Insert(model, i, kv{k, next})
	}
	for step, op := range ops {
		switch op.Kind {
		case sortedInsert:
			insert(uint64(op.A % 200))
		case sortedInsertRun:
			k, n := uint64(op.A%200), int(op.B%8)+1
			for j := range n {
				switch op.B / 8 % 3 {
				case 0:
					insert(k + uint64(j))
				case 1:
					insert(k + uint64(n-j))
				default:
					insert(k)
				}
			}
		case sortedDelete:
			if len(model) == 0 {
				continue
			}
			i := int(op.A % uint32(len(model)))
			x := model[i]
			if !s.Delete(x.k, func(v int) bool { return v == x.v }) {
				return fmt.Sprintf("step %d: Delete(%d, %d) found nothing", step, x.k, x.v)
			}
			model = slices.Delete(model, i, i+1)
		case sortedDeleteLast:
			if last.v == 0 {
				continue
			}
			i := slices.Index(model, last)
			if i < 0 {
				continue // deleted at random since
			}
			if !s.Delete(last.k, func(v int) bool { return v == last.v }) {
				return fmt.Sprintf("step %d: Delete of the last inserted (%d, %d) found nothing", step, last.k, last.v)
			}
			model = slices.Delete(model, i, i+1)
			last = kv{}
		case sortedDeleteMissing:
			if s.Delete(uint64(op.A%220), func(v int) bool { return v < 0 }) {
				return fmt.Sprintf("step %d: Delete of a value never inserted", step)
			}
		case sortedReset:
			keys, vals := make([]uint64, len(model)), make([]int, len(model))
			for i, x := range model {
				keys[i], vals[i] = x.k, x.v
			}
			s.Reset(keys, vals)
		}
		if msg := checkSorted(&s, model, uint64(op.B%220)); msg != "" {
			return fmt.Sprintf("step %d (%+v): %s", step, op, msg)
		}
	}
	return ""
}

// checkSorted compares s with model: shape, Len, Values, and Floor and
// Descend at key: "" when they agree.
func checkSorted(s *Sorted[int], model []kv, key uint64) string {
	if err := checkTree(s.tree()); err != nil {
		return err.Error()
	}
	if w := s.view.Load(); w != nil {
		if w.n > maxPend || !slices.IsSorted(w.keys[:w.n]) {
			return fmt.Sprintf("pending keys %v (maxPend %d)", w.keys[:w.n], maxPend)
		}
		for j := w.n; j < pendCap; j++ {
			if w.vals[j] != 0 {
				return fmt.Sprintf("pending value %d past the %d pending", j, w.n)
			}
		}
	}
	if s.Len() != len(model) {
		return fmt.Sprintf("Len %d, want %d", s.Len(), len(model))
	}
	for i, v := range s.Values() {
		if v != model[i].v {
			return fmt.Sprintf("value %d is %d, want %d", i, v, model[i].v)
		}
	}
	i := floorOf(model, key)
	v, k, idx, ok := s.Floor(key)
	if ok != (i >= 0) || ok && (v != model[i].v || k != model[i].k || idx != i) {
		return fmt.Sprintf("Floor(%d) = %d, %d, %d, %v; want index %d", key, v, k, idx, ok, i)
	}
	if fv, fk, fok := s.FloorValue(key); fok != ok || fv != v || fk != k {
		return fmt.Sprintf("FloorValue(%d) = %d, %d, %v; Floor %d, %d, %v", key, fv, fk, fok, v, k, ok)
	}
	var asc []int
	s.Ascend(func(_ uint64, v int) bool { asc = append(asc, v); return len(asc) <= i })
	for a, v := range asc {
		if model[a].v != v {
			return fmt.Sprintf("Ascend stopped after %d: value %d is %d, want %d", i+1, a, v, model[a].v)
		}
	}
	if want := min(i+1, len(model)); len(asc) != want && !(i < 0 && len(asc) == min(1, len(model))) {
		return fmt.Sprintf("Ascend stopped after %d values, want %d", len(asc), want)
	}
	j := i
	var bad string
	s.Descend(key, func(k uint64, v int) bool {
		if j < 0 || model[j].v != v || model[j].k != k {
			bad = fmt.Sprintf("Descend(%d) at model index %d: %d under %d", key, j, v, k)
			return false
		}
		j--
		return j >= i-5
	})
	if bad != "" {
		return bad
	}
	if j >= 0 && j >= i-5 {
		return fmt.Sprintf("Descend(%d) stopped early at model index %d", key, j)
	}
	return ""
}

// TestSortedWalkIsASnapshot: a walk that runs while values change sees
// the sequence as it was when it began: changes in the middle of a tall
// tree between its first and second step (a value deleted and inserted
// again under its key, as an address unregistered and registered again)
// neither list a value twice nor put one out of order (with leaves swapped
// into their parents in place, a walk inside a copied node saw both).
func TestSortedWalkIsASnapshot(t *testing.T) {
	var s Sorted[int]
	const n = 5000
	keys, vals := make([]uint64, n), make([]int, n)
	for i := range keys {
		keys[i], vals[i] = uint64(2*i), i
	}
	s.Reset(keys, vals)
	if s.tree().h < 2 {
		t.Fatalf("a tree of height %d: want inner nodes under the root", s.tree().h)
	}
	mid := uint64(2 * (n / 2))
	var got []uint64
	var gotVals []int
	s.Ascend(func(k uint64, v int) bool {
		if len(got) == 0 {
			if !s.Delete(mid, func(int) bool { return true }) {
				t.Fatal("Delete found nothing")
			}
			s.Insert(mid, -1)
			s.Insert(mid+1, -2)
			s.Insert(3, -3)
		}
		got, gotVals = append(got, k), append(gotVals, v)
		return true
	})
	if len(got) != n {
		t.Fatalf("the walk saw %d values, want the %d it began with", len(got), n)
	}
	for i := range got {
		if got[i] != keys[i] || gotVals[i] != vals[i] {
			t.Fatalf("value %d of the walk: %d under %d, want %d under %d", i, gotVals[i], got[i], vals[i], keys[i])
		}
	}
	if err := checkTree(s.tree()); err != nil {
		t.Fatal(err)
	}
	if s.Len() != n+2 {
		t.Fatalf("Len %d after the changes, want %d", s.Len(), n+2)
	}
}

// TestSortedPendingWalkIsASnapshot: a walk that begins with values
// pending sees them, in order, and not the changes made during the walk:
// a pending value deleted, others inserted until the pending ones go into
// the tree, a value of the tree deleted.
func TestSortedPendingWalkIsASnapshot(t *testing.T) {
	const n = 5000
	keys, vals := make([]uint64, n), make([]int, n)
	for i := range keys {
		keys[i], vals[i] = uint64(4*i), i
	}
	mid := uint64(4 * (n / 2))
	want := slices.Insert(slices.Clone(vals), n/2+1, -2, -1)
	for _, walk := range []string{"ascend", "descend"} {
		var s Sorted[int]
		s.Reset(keys, vals)
		s.Insert(mid+1, -1)
		s.Insert(mid, -2) // after the tree's value under mid
		var got []int
		changed := false
		fn := func(k uint64, v int) bool {
			if !changed {
				changed = true
				if !s.Delete(mid+1, func(v int) bool { return v == -1 }) {
					t.Fatal("Delete of a pending value found nothing")
				}
				for i := range 2 * pendCap {
					s.Insert(mid+2, -10-i)
				}
				if !s.Delete(0, func(int) bool { return true }) {
					t.Fatal("Delete found nothing")
				}
			}
			got = append(got, v)
			return true
		}
		if walk == "ascend" {
			s.Ascend(fn)
		} else {
			s.Descend(^uint64(0), fn)
			slices.Reverse(got)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%s: the walk saw %d values, want the %d it began with (first difference at %d)", walk, len(got), len(want), firstDiff(got, want))
		}
		if err := checkTree(s.tree()); err != nil {
			t.Fatal(err)
		}
		if s.Len() != n+2*pendCap {
			t.Fatalf("Len %d after the changes, want %d", s.Len(), n+2*pendCap)
		}
	}
}

func firstDiff(a, b []int) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// TestSortedConcurrent: lookups without a lock while one changer inserts
// and deletes values between fixed ones (splitting, joining and changing
// leaves, in a tree of tiny fan-outs): every fixed value is
// found under its key at every moment, and a key between two fixed ones
// finds the value inserted under it or the fixed one below. Run with
// -race, it also checks that what a change writes is read atomically.
func TestSortedConcurrent(t *testing.T) {
	for _, pend := range []int{0, pendCap} {
		t.Run(fmt.Sprintf("pend%d", pend), func(t *testing.T) {
			mq := maxPend
			maxPend = pend
			defer func() { maxPend = mq }()
			testSortedConcurrent(t)
		})
	}
}

func testSortedConcurrent(t *testing.T) {
	mc, mp := maxChunk, maxPage
	maxChunk, maxPage = 4, 4
	defer func() { maxChunk, maxPage = mc, mp }()
	const fixed = 200
	var s Sorted[int]
	for i := range fixed {
		s.Insert(uint64(4*i), 4*i) // value = key for fixed ones
	}
	var stop atomic.Bool
	var bad atomic.Value
	var wg sync.WaitGroup
	for g := range 2 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 3))
			for !stop.Load() {
				k := rng.Uint64N(4 * fixed)
				v, got, _, ok := s.Floor(k)
				fv, fk, fok := s.FloorValue(k)
				base := k &^ 3
				switch {
				case !ok || !fok:
					bad.Store(fmt.Sprintf("Floor(%d) found nothing", k))
				case got < base || got > k || fk < base || fk > k:
					bad.Store(fmt.Sprintf("Floor(%d) = key %d / %d", k, got, fk))
				case got == base && v != int(base) || fk == base && fv != int(base):
					bad.Store(fmt.Sprintf("Floor(%d) = %d / %d under fixed key %d", k, v, fv, base))
				}
				s.Descend(base, func(dk uint64, dv int) bool {
					if dk != base || dv != int(base) {
						bad.Store(fmt.Sprintf("Descend(%d) starts at %d: %d", base, dk, dv))
					}
					return false
				})
			}
		})
	}
	rng := rand.New(rand.NewPCG(7, 7))
	var extra []uint64
	for range 20000 {
		if len(extra) > 0 && rng.IntN(2) == 0 {
			j := rng.IntN(len(extra))
			k := extra[j]
			if !s.Delete(k, func(v int) bool { return v == -int(k) }) {
				t.Fatalf("Delete(%d) found nothing", k)
			}
			extra = slices.Delete(extra, j, j+1)
			continue
		}
		k := rng.Uint64N(4*fixed)&^3 + 1 + rng.Uint64N(3)
		s.Insert(k, -int(k))
		extra = append(extra, k)
	}
	stop.Store(true)
	wg.Wait()
	if msg := bad.Load(); msg != nil {
		t.Fatal(msg)
	}
	if err := checkTree(s.tree()); err != nil {
		t.Fatal(err)
	}
	if s.Len() != fixed+len(extra) {
		t.Fatalf("Len %d, want %d", s.Len(), fixed+len(extra))
	}
}

// TestSortedChurnBelowAll: a value inserted below every other one, at a
// full first leaf under full nodes (values inserted in rising order),
// and deleted again, as a buffer registered and unregistered below the
// others: the tree comes back to its shape, and the cycle copies no full
// leaf or node, only makes small ones (a leaf of one, the nodes of one
// kid above it, the root); under a full root too, which the cycle makes
// a new root above and drops again. With nothing pending (maxPend 0),
// as every insertion into a full pending array goes into the tree.
func TestSortedChurnBelowAll(t *testing.T) {
	mp := maxPend
	maxPend = 0
	defer func() { maxPend = mp }()
	t.Run("default", func(t *testing.T) { testSortedChurnBelowAll(t, 20000, 1200) })
	t.Run("full", func(t *testing.T) {
		mc, mp := maxChunk, maxPage
		maxChunk, maxPage = 4, 4
		defer func() { maxChunk, maxPage = mc, mp }()
		testSortedChurnBelowAll(t, 4*4*4*4, 1000)
	})
}

func testSortedChurnBelowAll(t *testing.T, n int, maxBytes float64) {
	var s Sorted[int]
	for i := range n {
		s.Insert(uint64(1000+i), i)
	}
	root := s.tree()
	shape := levelCounts(root)
	cycle := func() {
		s.Insert(1, -1)
		if !s.Delete(1, func(v int) bool { return v == -1 }) {
			t.Fatal("Delete found nothing")
		}
	}
	cycle()
	if got := levelCounts(s.tree()); !slices.Equal(got, shape) {
		t.Fatalf("nodes at each height %v after the cycle, %v before", got, shape)
	}
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	allocs := testing.AllocsPerRun(100, cycle)
	runtime.ReadMemStats(&ms1)
	bytes := float64(ms1.TotalAlloc-ms0.TotalAlloc) / 101
	t.Logf("height %d, shape %v: %.0f allocations, %.0f bytes a cycle", root.h, shape, allocs, bytes)
	if max := float64(5*root.h + 8); allocs > max {
		t.Errorf("%.0f allocations a cycle, want at most %.0f", allocs, max)
	}
	if bytes > maxBytes {
		t.Errorf("%.0f bytes a cycle, want at most %.0f (a full leaf copied is %d values)", bytes, maxBytes, maxChunk)
	}
	if err := checkTree(s.tree()); err != nil {
		t.Fatal(err)
	}
}

// TestSortedChurnPending: a value inserted and deleted again in the
// middle of many, where leaves and nodes are full (values inserted in
// rising order, a gap left), with at most maxPend-1 other insertions
// between, copies no node: the tree stays the one it was, and a cycle
// allocates one version, whatever the number of values. With nothing
// pending, the same cycle copies a leaf and the nodes above it, twice.
func TestSortedChurnPending(t *testing.T) {
	const n = 100000
	var s Sorted[int]
	for i := range n + 1 {
		if i != n/2 {
			s.Insert(uint64(16*i), i)
		}
	}
	mid := uint64(16 * (n / 2))
	cycle := func() {
		s.Insert(mid, -1)
		if !s.Delete(mid, func(v int) bool { return v == -1 }) {
			t.Fatal("Delete found nothing")
		}
	}
	measure := func() (allocs, bytes float64) {
		cycle()
		var ms0, ms1 runtime.MemStats
		runtime.ReadMemStats(&ms0)
		allocs = testing.AllocsPerRun(100, cycle)
		runtime.ReadMemStats(&ms1)
		return allocs, float64(ms1.TotalAlloc-ms0.TotalAlloc) / 101
	}
	cycle() // the insertion into a full pending array puts it into the tree
	root := s.tree()
	allocs, bytes := measure()
	t.Logf("pending: %.0f allocations, %.0f bytes a cycle (height %d)", allocs, bytes, root.h)
	if s.tree() != root {
		t.Error("the cycle changed the tree")
	}
	if allocs > 1 || bytes > 96 {
		t.Errorf("%.0f allocations, %.0f bytes a cycle: want one version, at most 96 bytes", allocs, bytes)
	}
	if s.Len() != n {
		t.Fatalf("Len %d, want %d", s.Len(), n)
	}
	mp := maxPend
	maxPend = 0
	defer func() { maxPend = mp }()
	allocs, bytes = measure()
	t.Logf("nothing pending: %.0f allocations, %.0f bytes a cycle", allocs, bytes)
	if err := checkTree(s.tree()); err != nil {
		t.Fatal(err)
	}
}
