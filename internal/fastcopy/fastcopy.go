// Package fastcopy copies memory between buffers faster than copy() where
// the CPU allows.
//
// On amd64, copies of 32 KiB and up are one REP MOVSB per MiB on CPUs
// with ERMS (enhanced REP MOVSB), and copies from 1 KiB to 32 KiB a loop
// of 64-byte AVX-512 moves on AMD CPUs with AVX-512 (Intel's lower a
// core's clock for 512-bit work, so they keep copy()). On the development
// VM (AMD EPYC, Zen 4) that moved 4 KiB in L1 at 1.8x, 64 KiB at 1.3x and
// 1 MiB at 1.6x the rate of copy(), whose AVX2 loop also slows down
// between 16 and 32 KiB; very large copies, bound by memory, are level.
// Elsewhere, under the race detector and the memory and address
// sanitizers (which do not see assembly's accesses), and for overlapping
// buffers, Copy is copy().
package fastcopy

import (
	"math"
	"unsafe"
)

const (
	// threshold is the smallest copy that takes the string move.
	threshold = 32 << 10
	// wideMin is the smallest copy that takes the AVX-512 loop.
	wideMin = 1 << 10
	// chunk bounds one string move: assembly cannot be preempted, so a
	// 64 MiB copy is cut into pieces that each take tens of microseconds.
	chunk = 1 << 20
)

// least is the smallest copy that Copy does not leave to copy().
var least = func() int {
	switch {
	case wide:
		return wideMin
	case erms:
		return threshold
	}
	return math.MaxInt
}()

// Copy copies min(len(dst), len(src)) bytes from src to dst and returns
// how many, as copy does, overlapping buffers included. It is safe for
// concurrent use on buffers that no other goroutine writes.
func Copy(dst, src []byte) int {
	if len(dst) < least || len(src) < least {
		return copy(dst, src) // inlined: small copies pay no call
	}
	return large(dst, src)
}

func large(dst, src []byte) int {
	n := min(len(dst), len(src))
	d, s := unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0])
	if uintptr(d) < uintptr(s)+uintptr(n) && uintptr(s) < uintptr(d)+uintptr(n) {
		return copy(dst, src) // overlapping: memmove's job
	}
	switch {
	case n < threshold && wide:
		move512(d, s, uintptr(n))
	case n < threshold || !erms:
		return copy(dst, src)
	default:
		for off := 0; off < n; off += chunk {
			moveString(unsafe.Add(d, off), unsafe.Add(s, off), uintptr(min(chunk, n-off)))
		}
	}
	return n
}
