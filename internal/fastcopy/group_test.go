package fastcopy

import (
	"bytes"
	"fmt"
	"testing"
	"unsafe"

	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/internal/proptest"
)

// TestGroupMatchesCopies: for one to five copies (five: an Add to a full
// Group) of any lengths at any offsets in one span, apart or overlapping
// in any way, a Group leaves exactly what copy() of each, in order, leaves.
func TestGroupMatchesCopies(t *testing.T) {
	const span = 4 << 20
	mem := make([]byte, span)
	want := make([]byte, span)
	// A length from a raw draw: small or around pairMin or up to span/8, a
	// third of the time each (gopter's slices of OneGenOf discard most
	// draws).
	size := func(r uint32) int {
		switch v := int(r / 3); r % 3 {
		case 0:
			return v % (2*pairMin + 1)
		case 1:
			return pairMin - 200 + v%5201
		default:
			return v % (span/8 + 1)
		}
	}
	at := gen.IntRange(0, 7*span/8)
	var g Group
	props := proptest.Properties(t, 400)
	props.Property("Group == copy, in order", prop.ForAll(
		func(k int, dl, sl []uint32, at []int) bool {
			fill(mem, byte(k)^byte(dl[0]^sl[1]))
			copy(want, mem)
			for i := range k {
				d, s, dn, sn := at[2*i], at[2*i+1], size(dl[i]), size(sl[i])
				g.Add(mem[d:d+dn], mem[s:s+sn])
				copy(want[d:d+dn], want[s:s+sn])
			}
			g.Copy()
			return g.Len() == 0 && bytes.Equal(mem, want)
		},
		gen.IntRange(1, GroupMax+1), gen.SliceOfN(GroupMax+1, gen.UInt32()), gen.SliceOfN(GroupMax+1, gen.UInt32()), gen.SliceOfN(2*GroupMax+2, at),
	))
	props.TestingRun(t)
}

// TestGroupApart: four copies apart, at every destination and source
// offset within a cache line (each copy its own order of them; every
// offset where Copy streams), lengths equal and not, each buffer next to
// a guard page, so that every copy's destination and source start
// (front) or end right against one at some offset: every byte moves,
// nothing beside the destinations changes, and no access strays past a
// guard page.
func TestGroupApart(t *testing.T) {
	for _, n := range [][GroupMax]int{
		{pairMin, pairMin, pairMin, pairMin},
		{pairMin + 4096 + 129, pairMin, pairMin + 1, 2 * pairMin},
		{pairMin, 3*chunk + 77, chunk/GroupMax + 64, pairMin + 200},
		{chunk + 1, chunk + 1, chunk + 1, chunk + 1},
	} {
		for _, front := range []bool{true, false} {
			t.Run(fmt.Sprintf("%v/front=%v", n, front), func(t *testing.T) {
				get := guarded
				if front {
					get = guardedFront
				}
				var src, dst [GroupMax][]byte
				for i := range GroupMax {
					src[i], dst[i] = get(t, n[i]+64), get(t, n[i]+64)
					fill(src[i], byte(i+1))
				}
				var g Group
				step := 1
				if !stream {
					step = 9 // every copy is copy() (the race detector, no AVX2): a few offsets do
				}
				for off := 0; off < 64; off += step {
					var a, b [GroupMax][]byte
					var was [GroupMax][]byte
					for i := range GroupMax {
						o, so := (off*(2*i+1)+3*i)%64, (off+i)%64 // each a permutation of 0-63
						if !front {
							o, so = 64-o, 64-so
						}
						a[i], b[i] = dst[i][o:o+n[i]], src[i][so:so+n[i]]
						fill(dst[i], byte(0xe0+i))
						was[i] = bytes.Clone(dst[i])
						if full := g.Add(a[i], b[i]); full != (i == GroupMax-1) {
							t.Fatalf("Add %d reported full %v", i, full)
						}
					}
					g.Copy()
					for i := range GroupMax {
						if !bytes.Equal(a[i], b[i]) {
							t.Fatalf("offset %d: copy %d did not move its bytes", off, i)
						}
						lo := int(uintptr(unsafe.Pointer(&a[i][0])) - uintptr(unsafe.Pointer(&dst[i][0])))
						if !bytes.Equal(dst[i][:lo], was[i][:lo]) || !bytes.Equal(dst[i][lo+n[i]:], was[i][lo+n[i]:]) {
							t.Fatalf("offset %d: bytes outside copy %d's destination changed", off, i)
						}
					}
				}
			})
		}
	}
}

func TestGroupAllocs(t *testing.T) {
	var src, dst [GroupMax][]byte
	for i := range GroupMax {
		src[i], dst[i] = make([]byte, 64<<10), make([]byte, 64<<10)
	}
	var g Group
	if a := testing.AllocsPerRun(100, func() {
		for i := range GroupMax {
			g.Add(dst[i], src[i])
		}
		g.Copy()
	}); a != 0 {
		t.Fatalf("%v allocations per Group of four", a)
	}
}

// TestGroupOverlapsInOrder: four copies of 40 KiB, apart but for one
// destination that overlaps one other range (its own source, another's
// source or destination, before or after it in the group, by a little or by
// half): each leaves what copy() of the four in order leaves. (The property
// test rarely draws four long copies apart but for one overlap.)
func TestGroupOverlapsInOrder(t *testing.T) {
	const n, slot = 40 << 10, 128 << 10
	mem := make([]byte, 2*GroupMax*slot+slot)
	want := make([]byte, len(mem))
	var g Group
	for i := range GroupMax {
		for y := range 2 * GroupMax { // range y: copy y/2's destination (even) or source (odd)
			if y == 2*i {
				continue
			}
			for _, delta := range []int{-n / 2, -1000, 1000, n / 2} {
				at := [2 * GroupMax]int{}
				for r := range at {
					at[r] = slot/2 + r*slot
				}
				at[2*i] = at[y] + delta
				fill(mem, byte(i*16+y))
				copy(want, mem)
				for k := range GroupMax {
					d, s := at[2*k], at[2*k+1]
					g.Add(mem[d:d+n], mem[s:s+n])
					copy(want[d:d+n], want[s:s+n])
				}
				g.Copy()
				if !bytes.Equal(mem, want) {
					t.Fatalf("copy %d's destination at range %d %+d: not what four copies in order leave", i, y, delta)
				}
			}
		}
	}
}
