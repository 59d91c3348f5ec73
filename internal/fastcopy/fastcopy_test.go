package fastcopy

import (
	"bytes"
	"fmt"
	"testing"

	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"
	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/proptest"
)

// guarded returns n bytes that end where a PROT_NONE page begins, so a
// copy that reads or writes one byte past them faults.
func guarded(t testing.TB, n int) []byte {
	t.Helper()
	page := unix.Getpagesize()
	span := (n+page-1)/page*page + page
	m, err := unix.Mmap(-1, 0, span, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(m) })
	if err := unix.Mprotect(m[span-page:], unix.PROT_NONE); err != nil {
		t.Fatal(err)
	}
	return m[span-page-n : span-page]
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*131) ^ seed
	}
}

// TestCopyMatchesCopy: for any lengths and offsets, apart or overlapping,
// Copy leaves exactly what copy() leaves and returns the same count.
func TestCopyMatchesCopy(t *testing.T) {
	const span = 3 << 20
	mem := make([]byte, span)
	want := make([]byte, span)
	props := proptest.Properties(t, 300)
	props.Property("Copy == copy", prop.ForAll(
		func(dl, sl, doff, soff int) bool {
			fill(mem, byte(dl))
			copy(want, mem)
			n := Copy(mem[doff:doff+dl], mem[soff:soff+sl])
			m := copy(want[doff:doff+dl], want[soff:soff+sl])
			return n == m && bytes.Equal(mem, want)
		},
		gen.OneGenOf(gen.IntRange(0, 64<<10), gen.IntRange(0, span/2)),
		gen.OneGenOf(gen.IntRange(0, 64<<10), gen.IntRange(0, span/2)),
		gen.IntRange(0, span/2),
		gen.IntRange(0, span/2),
	))
	props.TestingRun(t)
}

// TestCopyStaysInBounds: copies ending at a guard page, at sizes around
// the threshold and the chunk, move every byte and touch nothing beyond.
func TestCopyStaysInBounds(t *testing.T) {
	for _, n := range []int{0, 1, 63, 64, wideMin - 1, wideMin, wideMin + 1, wideMin + 255, 4096 + 63, threshold - 1, threshold, threshold + 1, chunk - 7, chunk, chunk + 4097, 3*chunk + 5} {
		src, dst := guarded(t, n), guarded(t, n)
		fill(src, 9)
		if got := Copy(dst, src); got != n || !bytes.Equal(dst, src) {
			t.Fatalf("Copy of %d bytes: returned %d, equal %v", n, got, bytes.Equal(dst, src))
		}
		// dst shorter than src: only len(dst) bytes move.
		if n > 0 {
			fill(dst, 1)
			short := dst[:n-1]
			if got := Copy(short, src); got != n-1 || !bytes.Equal(short, src[:n-1]) || dst[n-1] != byte((n-1)*131)^1 {
				t.Fatalf("Copy into %d of %d bytes: returned %d", n-1, n, got)
			}
		}
	}
}

func TestCopyAllocs(t *testing.T) {
	src, dst := make([]byte, 1<<20), make([]byte, 1<<20)
	if a := testing.AllocsPerRun(100, func() { Copy(dst, src) }); a != 0 {
		t.Fatalf("%v allocations per Copy", a)
	}
}

var sizes = []int{4 << 10, 16 << 10, 64 << 10, 1 << 20, 64 << 20}

// BenchmarkCopy is Copy beside copy() (BenchmarkCopyBuiltin) of the same
// buffers, one block over and over.
func BenchmarkCopy(b *testing.B) { benchCopy(b, Copy) }

func BenchmarkCopyBuiltin(b *testing.B) {
	benchCopy(b, func(dst, src []byte) int { return copy(dst, src) })
}

func benchCopy(b *testing.B, cp func(dst, src []byte) int) {
	for _, n := range sizes {
		src, dst := guarded(b, n), guarded(b, n)
		fill(src, 3)
		fill(dst, 4)
		b.Run(fmt.Sprintf("size=%dKiB", n>>10), func(b *testing.B) {
			b.SetBytes(int64(n))
			for b.Loop() {
				cp(dst, src)
			}
		})
	}
}
