package tcp

import (
	"fmt"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/internal/proptest"
	"github.com/moonring/moonring/segtable"
)

// regionOp is one step of TestRegionIndexProperty: add a region under
// buffer index A%5 of generation B%3+1 (three generations of five indexes,
// so lists hold several IDs and several regions of one ID), or remove the
// region at model position A, or one never added.
type regionOp struct {
	Kind int
	A, B uint32
}

// regionID returns the BufferID of index idx and generation gen, as
// segtable packs them (the generation above the index bits).
func regionID(idx, gen uint32) uint32 { return gen<<20 | idx }

// TestRegionIndexProperty runs random additions and removals on a
// regionIndex against a list in the order of additions, checking after
// each step Len, newest and Descend of every ID used (the regions of that
// ID, newest first, and nothing else), and Values.
func TestRegionIndexProperty(t *testing.T) {
	if segtable.BufferID(regionID(3, 2)).Index() != 3 {
		t.Fatal("regionID does not pack as segtable does")
	}
	props := proptest.Properties(t, 300)
	props.Property("regionIndex matches a list", prop.ForAll(func(ops []regionOp) string {
		var x regionIndex
		var model []*region // in the order added
		ids := map[uint32]bool{}
		for step, op := range ops {
			switch op.Kind {
			case 0, 1:
				r := &region{id: regionID(op.A%5+1000*(op.A%2), op.B%3+1)}
				ids[r.id] = true
				x.add(r)
				model = append(model, r)
			case 2:
				if len(model) == 0 {
					continue
				}
				i := int(op.A % uint32(len(model)))
				if !x.remove(model[i]) {
					return fmt.Sprintf("step %d: remove of a region held found nothing", step)
				}
				model = slices.Delete(model, i, i+1)
			default:
				if x.remove(&region{id: regionID(op.A%5, 1)}) {
					return fmt.Sprintf("step %d: remove of a region never added found one", step)
				}
			}
			if x.Len() != len(model) || len(x.Values()) != len(model) {
				return fmt.Sprintf("step %d: Len %d, %d values, want %d", step, x.Len(), len(x.Values()), len(model))
			}
			for id := range ids {
				var want []*region
				for i := len(model) - 1; i >= 0; i-- {
					if model[i].id == id {
						want = append(want, model[i])
					}
				}
				var got []*region
				x.Descend(uint64(id), func(k uint64, r *region) bool {
					if k != uint64(id) {
						got = append(got, nil)
					}
					got = append(got, r)
					return true
				})
				if !slices.Equal(got, want) {
					return fmt.Sprintf("step %d: Descend(%#x) gave %d regions, want %d", step, id, len(got), len(want))
				}
				if n := x.newest(segtable.BufferID(id)); len(want) > 0 && n != want[0] || len(want) == 0 && n != nil {
					return fmt.Sprintf("step %d: newest(%#x) is not the last added", step, id)
				}
			}
		}
		return ""
	}, gen.SliceOf(gen.Struct(reflect.TypeOf(regionOp{}), map[string]gopter.Gen{
		"Kind": gen.IntRange(0, 3),
		"A":    gen.UInt32(),
		"B":    gen.UInt32(),
	}))))
	props.TestingRun(t)
}

// TestRegionIndexConcurrent: lookups while regions come and go find only
// regions of the ID asked for, and always find one that stays registered
// throughout (run it with -race).
func TestRegionIndexConcurrent(t *testing.T) {
	var x regionIndex
	stay := &region{id: regionID(7, 1)}
	x.add(stay)
	var stop atomic.Bool
	var bad atomic.Value
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for !stop.Load() {
				found := false
				x.Descend(uint64(stay.id), func(k uint64, r *region) bool {
					if r.id != stay.id || k != uint64(stay.id) {
						bad.Store(fmt.Sprintf("Descend(%#x) gave a region of %#x", stay.id, r.id))
					}
					found = found || r == stay
					return true
				})
				if !found {
					bad.Store("a region that stays registered was not found")
				}
			}
		})
	}
	for i := range 20000 {
		r := &region{id: regionID(7, uint32(i%3)+1)} // stay's ID too, and others of its index
		x.add(r)
		if i%2 == 0 {
			x.remove(r)
			continue
		}
		again := &region{id: stay.id} // stay's buffer registered again
		x.add(again)
		x.remove(r) // behind the new head: the list before it is copied
		x.remove(again)
	}
	stop.Store(true)
	wg.Wait()
	if msg := bad.Load(); msg != nil {
		t.Fatal(msg)
	}
	if x.Len() != 1 {
		t.Fatalf("Len %d after the churn, want 1", x.Len())
	}
}
