package fastcopy

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/internal/proptest"
)

// TestCopyPairMatchesTwoCopies: for any lengths and offsets in one span,
// the four ranges apart or overlapping in any way, CopyPair leaves exactly
// what copy(d1, s1) and then copy(d2, s2) leave and returns their counts.
func TestCopyPairMatchesTwoCopies(t *testing.T) {
	const span = 4 << 20
	mem := make([]byte, span)
	want := make([]byte, span)
	size := gen.OneGenOf(gen.IntRange(0, 2*pairMin), gen.IntRange(pairMin-200, pairMin+5000), gen.IntRange(0, span/4))
	at := gen.IntRange(0, 3*span/4)
	props := proptest.Properties(t, 400)
	props.Property("CopyPair == copy; copy", prop.ForAll(
		func(l1, l2, sl2 int, at []int) bool {
			d1, s1, d2, s2 := at[0], at[1], at[2], at[3]
			fill(mem, byte(l1^l2))
			copy(want, mem)
			n1, n2 := CopyPair(mem[d1:d1+l1], mem[s1:s1+l1], mem[d2:d2+l2], mem[s2:s2+sl2])
			m1 := copy(want[d1:d1+l1], want[s1:s1+l1])
			m2 := copy(want[d2:d2+l2], want[s2:s2+sl2])
			return n1 == m1 && n2 == m2 && bytes.Equal(mem, want)
		},
		size, size, size, gen.SliceOfN(4, at),
	))
	props.TestingRun(t)
}

// TestCopyPairApart: two copies apart, at every destination offset within
// a cache line (each its own), lengths equal and not, each destination
// between guard pages' neighbours: every byte moves, nothing beside the
// destinations changes, and no access strays past a guard page.
func TestCopyPairApart(t *testing.T) {
	for _, n := range [][2]int{{pairMin, pairMin}, {pairMin + 4096 + 129, pairMin}, {pairMin, 3*chunk + 77}, {chunk + 1, chunk + 1}} {
		for _, front := range []bool{true, false} {
			get := guarded
			if front {
				get = guardedFront
			}
			s1, s2 := get(t, n[0]+64), get(t, n[1]+64)
			d1, d2 := get(t, n[0]+64), get(t, n[1]+64)
			fill(s1, 1)
			fill(s2, 2)
			for off := 0; off < 64; off += 7 {
				o1, o2 := off, (off*5+3)%64
				if !front {
					o1, o2 = 64-o1, 64-o2
				}
				a1, b1 := d1[o1:o1+n[0]], s1[63-off:63-off+n[0]]
				a2, b2 := d2[o2:o2+n[1]], s2[off:off+n[1]]
				fill(d1, 0xee)
				fill(d2, 0xdd)
				was1, was2 := bytes.Clone(d1), bytes.Clone(d2)
				g1, g2 := CopyPair(a1, b1, a2, b2)
				if g1 != n[0] || g2 != n[1] || !bytes.Equal(a1, b1) || !bytes.Equal(a2, b2) {
					t.Fatalf("%v bytes at %d/%d (front guard %v): returned %d, %d; equal %v, %v", n, o1, o2, front, g1, g2, bytes.Equal(a1, b1), bytes.Equal(a2, b2))
				}
				untouched := func(d, was, a []byte) bool {
					lo := int(uintptr(unsafe.Pointer(&a[0])) - uintptr(unsafe.Pointer(&d[0])))
					return bytes.Equal(d[:lo], was[:lo]) && bytes.Equal(d[lo+len(a):], was[lo+len(a):])
				}
				if !untouched(d1, was1, a1) || !untouched(d2, was2, a2) {
					t.Fatalf("%v bytes at %d/%d (front guard %v): bytes outside a destination changed", n, o1, o2, front)
				}
			}
		}
	}
}

func TestCopyPairAllocs(t *testing.T) {
	s1, d1, s2, d2 := make([]byte, 1<<20), make([]byte, 1<<20), make([]byte, 64<<10), make([]byte, 64<<10)
	if a := testing.AllocsPerRun(100, func() { CopyPair(d1, s1, d2, s2) }); a != 0 {
		t.Fatalf("%v allocations per CopyPair", a)
	}
}
