// Package testpattern fills test memory with bytes that depend on a seed
// and on their position, and finds where two buffers part. Tests fill a
// source, move it, and check the destination byte for byte; the pattern
// makes a misplaced or stale byte visible (each 8-byte word is a hash of
// the seed and its position), and FillAt and Check let a window of a
// buffer be refilled or checked alone, in this process or in a child. Test
// code only.
package testpattern

import (
	"bytes"
	"encoding/binary"
	"fmt"
)

// word returns word k of the pattern of seed: bytes 8k to 8k+7, little
// endian. It is splitmix64's output for the state seed's hash plus k+1
// steps, so every seed is its own stream and every word of it differs.
func word(seed, k uint64) uint64 {
	z := mix(seed^0x6a09e667f3bcc909) + (k+1)*0x9e3779b97f4a7c15
	return mix(z)
}

func mix(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// At returns byte i of the pattern of seed.
func At(seed, i uint64) byte { return byte(word(seed, i/8) >> (8 * (i % 8))) }

// Fill fills b with the pattern of seed from its start.
func Fill(b []byte, seed uint64) { FillAt(b, seed, 0) }

// FillAt fills b with the pattern of seed from position off: b[i] becomes
// At(seed, off+i). So FillAt(b[off:], seed, off) leaves b as Fill(b, seed)
// does, and a prefix of the pattern is the pattern of a shorter buffer.
func FillAt(b []byte, seed, off uint64) {
	i := 0
	for ; i < len(b) && (off+uint64(i))%8 != 0; i++ {
		b[i] = At(seed, off+uint64(i))
	}
	k := (off + uint64(i)) / 8
	for ; i+8 <= len(b); i, k = i+8, k+1 {
		binary.LittleEndian.PutUint64(b[i:], word(seed, k))
	}
	for ; i < len(b); i++ {
		b[i] = At(seed, off+uint64(i))
	}
}

// Bytes returns n bytes of the pattern of seed from its start.
func Bytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	Fill(b, seed)
	return b
}

// FirstDiff returns the index of the first byte where a and b differ, the
// length of the shorter when it is a prefix of the other, or -1 when they
// are equal.
func FirstDiff(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// Check compares got with the pattern of seed from position off and
// returns nil, or an error naming the first wrong byte by its position in
// the pattern.
func Check(got []byte, seed, off uint64) error {
	want := make([]byte, len(got))
	FillAt(want, seed, off)
	if i := FirstDiff(got, want); i >= 0 {
		return fmt.Errorf("byte %d is %#x, want %#x (pattern %d)", off+uint64(i), got[i], want[i], seed)
	}
	return nil
}
