package segtable_test

import (
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/moonring/moonring/segtable"
)

// TestHandles: a handle names its value until Remove, and never again
// after, even once its index holds another value; the zero handle and
// handles never handed out name nothing.
func TestHandles(t *testing.T) {
	var hs segtable.Handles[int]
	if hs.Get(0) != nil || hs.Get(12345) != nil || hs.Get(^segtable.Handle(0)) != nil {
		t.Fatal("an empty table named a value")
	}
	vals := make([]int, 300) // more than a chunk
	hands := make([]segtable.Handle, len(vals))
	for i := range vals {
		vals[i] = i
		h, err := hs.Add(&vals[i])
		if err != nil {
			t.Fatal(err)
		}
		if h == 0 {
			t.Fatal("Add returned the zero handle")
		}
		hands[i] = h
	}
	for i, h := range hands {
		if got := hs.Get(h); got != &vals[i] {
			t.Fatalf("Get(%#x) = %v; want value %d", h, got, i)
		}
	}
	stale := hands[7]
	if !hs.Remove(stale) {
		t.Fatal("Remove of a live handle said none")
	}
	if hs.Remove(stale) {
		t.Fatal("a second Remove of the same handle said it removed one")
	}
	if hs.Get(stale) != nil {
		t.Fatal("a removed handle still names its value")
	}
	// The freed index is taken again (free is LIFO): the old handle,
	// whose generation is the last one's, names nothing.
	other := 1000
	h, err := hs.Add(&other)
	if err != nil {
		t.Fatal(err)
	}
	if uint32(h)&(1<<20-1) != uint32(stale)&(1<<20-1) {
		t.Fatalf("the freed index was not reused (%#x after %#x): the test proves nothing", h, stale)
	}
	if hs.Get(stale) != nil {
		t.Fatalf("the stale handle %#x names the value added since under %#x", stale, h)
	}
	if hs.Get(h) != &other {
		t.Fatal("the new handle does not name its value")
	}
	// A handle with the index of a live value and any other generation
	// names nothing.
	for gen := uint32(0); gen < 4096; gen++ {
		forged := segtable.Handle(gen<<20 | uint32(hands[3])&(1<<20-1))
		if forged != hands[3] && hs.Get(forged) != nil {
			t.Fatalf("handle %#x (generation %d) named the value of %#x", forged, gen, hands[3])
		}
	}
}

// TestHandlesRetire: an index whose generations ran out is retired, not
// wrapped: no handle of the many it had names a later value.
func TestHandlesRetire(t *testing.T) {
	var hs segtable.Handles[int]
	v := 1
	first, err := hs.Add(&v)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[segtable.Handle]bool{first: true}
	hs.Remove(first)
	for range 5000 { // past 4095 generations of the index
		h, err := hs.Add(&v)
		if err != nil {
			t.Fatal(err)
		}
		if seen[h] {
			t.Fatalf("handle %#x handed out twice", h)
		}
		seen[h] = true
		if !hs.Remove(h) {
			t.Fatal("Remove of a live handle said none")
		}
	}
	w := 2
	h, err := hs.Add(&w)
	if err != nil {
		t.Fatal(err)
	}
	for old := range seen {
		if hs.Get(old) != nil {
			t.Fatalf("old handle %#x names the value of %#x", old, h)
		}
	}
}

// TestHandlesConcurrent: Gets racing Adds and Removes (under -race) see
// either nothing or the value the handle was made for.
func TestHandlesConcurrent(t *testing.T) {
	type val struct{ h atomic.Uint32 }
	var hs segtable.Handles[val]
	var live sync.Map // handle -> *val, possibly removed since
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				live.Range(func(k, _ any) bool {
					h := k.(segtable.Handle)
					if v := hs.Get(h); v != nil && segtable.Handle(v.h.Load()) != h {
						t.Errorf("Get(%#x) returned the value of %#x", h, v.h.Load())
						return false
					}
					return true
				})
			}
		}()
	}
	rng := rand.New(rand.NewPCG(3, 4))
	var hands []segtable.Handle
	for range 20000 {
		if len(hands) > 0 && rng.IntN(2) == 0 {
			i := rng.IntN(len(hands))
			hs.Remove(hands[i])
			hands[i] = hands[len(hands)-1]
			hands = hands[:len(hands)-1]
			continue
		}
		v := new(val)
		h, err := hs.Add(v)
		if err != nil {
			t.Fatal(err)
		}
		v.h.Store(uint32(h))
		live.Store(h, v)
		hands = append(hands, h)
	}
	close(stop)
	wg.Wait()
}
