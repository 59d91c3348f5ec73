package segtable

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestSortedModel inserts and deletes thousands of values, many under
// equal keys, against a flat sorted slice: enough to split chunks and join
// them again. After each change every lookup agrees with the model.
func TestSortedModel(t *testing.T) {
	t.Run("default", testSortedModel)
	t.Run("small", func(t *testing.T) {
		// Chunks of 4 in pages of 4: hundreds of pages, split and joined.
		mc, mp := maxChunk, maxPage
		maxChunk, maxPage = 4, 4
		defer func() { maxChunk, maxPage = mc, mp }()
		testSortedModel(t)
	})
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
		sn := s.load()
		total := 0
		for p, pg := range sn.pages {
			if len(pg.chunks) == 0 || len(pg.chunks) > maxPage || sn.firsts[p] != pg.firsts[0] || int(sn.offs[p]) != total {
				t.Fatalf("step %d: page %d of %d chunks, first %d, offset %d (want %d)", step, p, len(pg.chunks), sn.firsts[p], sn.offs[p], total)
			}
			for c, ch := range pg.chunks {
				if len(ch.keys) == 0 || len(ch.keys) > maxChunk || pg.firsts[c] != ch.keys[0] || int(pg.offs[c])+int(sn.offs[p]) != total {
					t.Fatalf("step %d: page %d chunk %d of %d keys, first %d", step, p, c, len(ch.keys), pg.firsts[c])
				}
				total += len(ch.keys)
			}
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
	if n := len(s.load().pages); n != 0 {
		t.Fatalf("%d pages left when empty", n)
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
