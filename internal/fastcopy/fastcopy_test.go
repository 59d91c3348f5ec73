package fastcopy

import (
	"bytes"
	"fmt"
	"testing"
	"unsafe"

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

// guardedFront returns n bytes that begin where a PROT_NONE page ends, so
// a copy that reads or writes one byte before them faults.
func guardedFront(t testing.TB, n int) []byte {
	t.Helper()
	page := unix.Getpagesize()
	span := page + (n+page-1)/page*page
	m, err := unix.Mmap(-1, 0, span, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(m) })
	if err := unix.Mprotect(m[:page], unix.PROT_NONE); err != nil {
		t.Fatal(err)
	}
	return m[page : page+n]
}

// TestCopyEveryAlignment: copies from the threshold up (the non-temporal
// loop where the CPU has it), at every offset of the destination and
// source within a cache line, from a guard page before them or up to one
// after them, move exactly their bytes and touch nothing else.
func TestCopyEveryAlignment(t *testing.T) {
	if !stream && !erms {
		t.Skip("Copy is copy() from the threshold up in this build (no AVX2 or ERMS, or the race detector or a sanitizer): nothing of its own to test")
	}
	for _, n := range []int{threshold, threshold + 4096 + 129, 2*chunk + 1} {
		for _, front := range []bool{true, false} {
			get := guarded
			if front {
				get = guardedFront
			}
			src, dst := get(t, n+64), get(t, n+64)
			fill(src, byte(n))
			for off := range 64 {
				d, s := dst[off:off+n], src[63-off:63-off+n]
				if !front {
					d, s = dst[64-off:64-off+n], src[1+off:1+off+n]
				}
				fill(dst, 0xee)
				before := bytes.Clone(dst)
				if got := Copy(d, s); got != n || !bytes.Equal(d, s) {
					t.Fatalf("%d bytes at offset %d (front guard %v): returned %d, equal %v", n, off, front, got, bytes.Equal(d, s))
				}
				lo := int(uintptr(unsafe.Pointer(&d[0])) - uintptr(unsafe.Pointer(&dst[0])))
				if !bytes.Equal(dst[:lo], before[:lo]) || !bytes.Equal(dst[lo+n:], before[lo+n:]) {
					t.Fatalf("%d bytes at offset %d (front guard %v): bytes outside the destination changed", n, off, front)
				}
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
