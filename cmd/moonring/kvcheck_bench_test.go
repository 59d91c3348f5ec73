package main

import (
	"encoding/binary"
	"testing"
)

// slotHoldsWord is slotHolds a word at a time: the reference the unrolled
// one is held to, and its speed in BenchmarkSlotHolds.
func slotHoldsWord(b []byte, stamp uint64) bool {
	for k := 0; k+8 <= len(b); k += 8 {
		if binary.LittleEndian.Uint64(b[k:]) != stamp+uint64(k>>3)*kvMul {
			return false
		}
	}
	return true
}

// Every byte of a block counts, in the unrolled body and in the tail: a
// flip anywhere is seen, as the word-at-a-time check sees it.
func TestSlotHoldsEveryByte(t *testing.T) {
	for _, n := range []int{0, 8, 56, 64, 72, 128, 200, 4096 + 40} {
		b := make([]byte, n)
		fillSlot(b, 7)
		if !slotHolds(b, 7) || !slotHoldsWord(b, 7) {
			t.Fatalf("%d bytes: a block does not hold its own stamp", n)
		}
		if n >= 8 && slotHolds(b, 8) {
			t.Fatalf("%d bytes: a block holds another stamp", n)
		}
		for i := range n &^ 7 {
			b[i] ^= 0x40
			if slotHolds(b, 7) {
				t.Fatalf("%d bytes: byte %d flipped and not seen", n, i)
			}
			b[i] ^= 0x40
		}
	}
}

func benchSlotHolds(b *testing.B, holds func([]byte, uint64) bool) {
	const n, block = 64 << 20, 32 << 10
	mem := make([]byte, n)
	for i := 0; i < n; i += block {
		fillSlot(mem[i:i+block], uint64(i)+1)
	}
	b.SetBytes(n)
	for b.Loop() {
		for i := 0; i < n; i += block {
			if !holds(mem[i:i+block], uint64(i)+1) {
				b.Fatal("a block does not hold its stamp")
			}
		}
	}
}

// BenchmarkSlotHolds checks 64 MiB of 32 KiB blocks, as the kv pattern's
// checks do after each request, with the unrolled check and a word at a
// time.
func BenchmarkSlotHolds(b *testing.B) {
	b.Run("unrolled", func(b *testing.B) { benchSlotHolds(b, slotHolds) })
	b.Run("word", func(b *testing.B) { benchSlotHolds(b, slotHoldsWord) })
}
