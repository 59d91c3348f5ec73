// Package fastcopy copies memory between buffers faster than copy() where
// the CPU allows.
//
// On amd64, copies of 32 KiB and up are, on CPUs with AVX2, a loop of
// 32-byte loads and non-temporal stores that prefetches its source 4 KiB
// ahead (one SFENCE at its end), in pieces of 1 to 2 MiB; without AVX2,
// one REP MOVSB per MiB on CPUs with ERMS (enhanced REP MOVSB). Copies
// from 1 KiB to 32 KiB are a loop of 64-byte AVX-512 moves on AMD CPUs
// with AVX-512 (Intel's lower a core's clock for 512-bit work, so they
// keep copy()). A non-temporal store writes the line without reading it
// first and leaves it out of the cache: a transfer's destination is read
// later, if at all, by another process, a device or the network, and the
// cache keeps what the caller works on. Blocks scattered over large pools,
// as a KV cache's are, gain most: on the development VM (AMD EPYC, Zen 4)
// two goroutines copying 32 KiB blocks at random between two 1 GiB pools
// of huge pages moved 20.5 GB/s with REP MOVSB and 25.4 with the loop,
// about what REP MOVSB moves of sequential blocks (26.2; the loop 30.5;
// BenchmarkScattered, medians of 3).
// From 1 KiB to 32 KiB the AVX-512 loop moved 4 KiB in L1 at 1.8x the
// rate of copy(), whose AVX2 loop slows down between 16 and 32 KiB.
// CopyPair moves two such copies at once, and a Group four, which
// scattered blocks gain from most of all.
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
	case erms, stream:
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

// prefetch's modes: what of the destination it asks for beside the source.
const (
	prefSrc   uint8 = iota // none: Copy stores to it non-temporally
	prefRead               // PREFETCHT0
	prefWrite              // PREFETCHW: for writing
)

// prefetchBytes is how much of the next copy's source and destination
// Prefetch asks for: enough for the misses of its start to be in flight
// while the copy before it runs, few enough instructions to cost little.
const prefetchBytes = 1 << 10

// Prefetch asks the CPU to start loading the first bytes (up to 1 KiB) of
// src, and of dst for writing (unless Copy will store to it
// non-temporally), for a copy of n bytes between them that
// comes after the one about to run. A loop of copies of scattered blocks
// then has the first misses of each block in flight while the block
// before it moves: the hardware prefetchers start on a block only at its
// own first accesses, and stop at every 4 KiB page. On the development VM
// (AMD EPYC, Zen 4) one goroutine's copies of blocks at random in two
// 1 GiB pools moved 20-25 % more bytes a second with it, 4 KiB and 32 KiB
// blocks alike (BenchmarkScattered), and the kv pattern over shm (memfd
// pages of 4 KiB, shm's CopyBatch) from 0.60 to 0.66 of the contiguous
// rate for WRITEs and 0.50 to 0.60 for READs. In process, on huge pages
// or memfds, it gained nothing against the lookup of the next slice. It reads
// and writes nothing, and cannot fault, whatever the addresses (dst and
// src may be stale or unmapped); where the CPU or the build (the race
// detector, the sanitizers) has no such hint, it does nothing. Safe for
// concurrent use.
func Prefetch(dst, src unsafe.Pointer, n uintptr) {
	if canPrefetch && n > 0 {
		mode := prefRead
		switch {
		case stream && n >= threshold:
			mode = prefSrc // non-temporal stores: a cached destination line would only be evicted
		case prefetchW:
			mode = prefWrite
		}
		prefetch(dst, src, min(n, prefetchBytes), mode)
	}
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
	case n < threshold && !stream:
		return copy(dst, src)
	case stream && n >= threshold:
		for off := 0; off < n; {
			k := n - off
			if k >= 2*chunk {
				k = chunk // the last piece is chunk or more: never under 128 bytes
			}
			moveStream(unsafe.Add(d, off), unsafe.Add(s, off), uintptr(k))
			off += k
		}
	case !erms:
		return copy(dst, src)
	default:
		for off := 0; off < n; off += chunk {
			moveString(unsafe.Add(d, off), unsafe.Add(s, off), uintptr(min(chunk, n-off)))
		}
	}
	return n
}
