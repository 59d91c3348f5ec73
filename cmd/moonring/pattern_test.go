package main

import "testing"

// TestFillPattern checks fillPattern against pattern byte by byte, for
// lengths around its 512-byte runs and past the 256 runs after which
// i>>9's low byte wraps.
func TestFillPattern(t *testing.T) {
	for _, n := range []int{0, 1, 7, 511, 512, 513, 1000, 4096 + 7, 256*512 + 3, 1<<20 + 100} {
		b := make([]byte, n)
		for i := range b {
			b[i] = ^pattern(i) // no byte right before the fill
		}
		fillPattern(b)
		for i, v := range b {
			if v != pattern(i) {
				t.Fatalf("len %d: byte %d is %#x, want %#x", n, i, v, pattern(i))
			}
		}
	}
}

// BenchmarkFillPattern is fillPattern beside the byte loop it replaced
// (pattern(i) a byte at a time), over 256 MiB.
func BenchmarkFillPattern(b *testing.B) {
	buf := make([]byte, 256<<20)
	b.Run("words", func(b *testing.B) {
		b.SetBytes(int64(len(buf)))
		for b.Loop() {
			fillPattern(buf)
		}
	})
	b.Run("bytes", func(b *testing.B) {
		b.SetBytes(int64(len(buf)))
		for b.Loop() {
			for i := range buf {
				buf[i] = pattern(i)
			}
		}
	})
}
