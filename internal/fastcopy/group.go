package fastcopy

import "unsafe"

// GroupMax is how many copies a Group holds.
const GroupMax = 4

// Group gathers copies that Copy then moves together: four copies of
// 32 KiB and up at once, 128 bytes of each a round, where Copy would
// stream them (AVX2) and no destination overlaps another range (its own
// source included); otherwise in pairs (CopyPair), which falls back to
// one at a time. Like a pair, four scattered blocks in flight keep more
// of the memory's misses outstanding than one or two: on the development
// VM (AMD EPYC, Zen 5, blocks at random between two 1 GiB pools,
// BenchmarkScattered, medians of 3) 32 KiB blocks moved 12 % more bytes a
// second in fours than in pairs with one goroutine and 7 % with two,
// 1 MiB blocks 15 % and 24 %.
//
// Whatever the buffers, a Group's copies leave what Copy calls made in
// the order they were added would leave. The zero Group is empty and
// ready for use. A Group is not safe for concurrent use; it holds the
// slices it is given until Copy, which leaves it empty for reuse.
type Group struct {
	n        int
	dst, src [GroupMax][]byte
}

// Groups reports whether a copy of n bytes gains from moving in a Group
// (it would move with others at once); a smaller one the caller may as
// well Copy itself, after the Group's Copy where order matters. Safe for
// concurrent use.
func Groups(n uintptr) bool { return stream && n >= pairMin }

// Add adds a copy of min(len(dst), len(src)) bytes from src to dst, to
// move after those added before, and reports whether g is now full. Add
// to a full Group first moves what it holds (Copy).
func (g *Group) Add(dst, src []byte) (full bool) {
	if g.n == GroupMax {
		g.Copy()
	}
	g.dst[g.n], g.src[g.n] = dst, src
	g.n++
	return g.n == GroupMax
}

// Len returns how many copies g holds.
func (g *Group) Len() int { return g.n }

// Copy moves the copies g holds and empties it.
func (g *Group) Copy() {
	d, s := &g.dst, &g.src
	switch g.n {
	case 1:
		Copy(d[0], s[0])
	case 2:
		CopyPair(d[0], s[0], d[1], s[1])
	case 3:
		CopyPair(d[0], s[0], d[1], s[1])
		Copy(d[2], s[2])
	case 4:
		if !g.quad() {
			CopyPair(d[0], s[0], d[1], s[1])
			CopyPair(d[2], s[2], d[3], s[3])
		}
	}
	clear(d[:g.n]) // no pointer into a buffer outlives the copy
	clear(s[:g.n])
	g.n = 0
}

// quad moves g's four copies at once and reports true, when each streams
// and no destination overlaps another copy's source or destination (or
// its own source); else it moves nothing.
func (g *Group) quad() bool {
	var n [GroupMax]int
	var pd, ps [GroupMax]uintptr
	for i := range GroupMax {
		n[i] = min(len(g.dst[i]), len(g.src[i]))
		if !Groups(uintptr(n[i])) {
			return false
		}
		pd[i], ps[i] = uintptr(unsafe.Pointer(&g.dst[i][0])), uintptr(unsafe.Pointer(&g.src[i][0]))
	}
	for i := range GroupMax {
		ni := uintptr(n[i])
		if overlaps(pd[i], ni, ps[i], ni) {
			return false
		}
		for j := i + 1; j < GroupMax; j++ {
			nj := uintptr(n[j])
			if overlaps(pd[i], ni, pd[j], nj) || overlaps(pd[i], ni, ps[j], nj) || overlaps(pd[j], nj, ps[i], ni) {
				return false
			}
		}
	}
	// Each destination's bytes before its first 64-byte boundary, plainly;
	// then the four at once, in pieces that bound the time the assembly
	// cannot be preempted (a MiB in all); then each one's rest, in pairs
	// (under 128 bytes, but for the longer ones').
	var h [GroupMax]int
	m := n[0]
	for i := range GroupMax {
		h[i] = int(-pd[i] & 63)
		copy(g.dst[i][:h[i]], g.src[i][:h[i]])
		m = min(m, n[i]-h[i])
	}
	m &^= 127
	var qd, qs [GroupMax]unsafe.Pointer
	for off := 0; off < m; {
		k := min(m-off, chunk/GroupMax)
		for i := range GroupMax {
			qd[i], qs[i] = unsafe.Pointer(&g.dst[i][h[i]+off]), unsafe.Pointer(&g.src[i][h[i]+off])
		}
		moveQuad(&qd, &qs, uintptr(k))
		off += k
	}
	rest := func(i int) (d, s []byte) { return g.dst[i][h[i]+m : n[i]], g.src[i][h[i]+m : n[i]] }
	d0, s0 := rest(0)
	d1, s1 := rest(1)
	d2, s2 := rest(2)
	d3, s3 := rest(3)
	CopyPair(d0, s0, d1, s1)
	CopyPair(d2, s2, d3, s3)
	return true
}
