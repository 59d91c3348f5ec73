//go:build amd64 && !race && !msan && !asan

package fastcopy

import (
	"unsafe"

	"github.com/klauspost/cpuid/v2"
)

var (
	erms = cpuid.CPU.Has(cpuid.ERMS)
	wide = cpuid.CPU.VendorID == cpuid.AMD && cpuid.CPU.Has(cpuid.AVX512F)
	// prefetchW: the CPU has PREFETCHW (CPUID 0x80000001, ECX bit 8,
	// 3DNowPrefetch): every AMD64 CPU, and Intel's since Broadwell.
	prefetchW = func() bool {
		if top, _ := cpuidLeaf(0x80000000); top < 0x80000001 {
			return false
		}
		_, ecx := cpuidLeaf(0x80000001)
		return ecx&(1<<8) != 0
	}()
	// stream: the CPU has moveStream's AVX2 loads and non-temporal
	// stores (every AMD64 CPU since 2015, and Intel's since Haswell).
	stream = cpuid.CPU.Has(cpuid.AVX2)
	// canPrefetch: Prefetch does something.
	canPrefetch = true
)

// prefetch issues a prefetch for every 64 bytes of the first n > 0 bytes
// of src, and of dst as mode says (prefSrc, prefRead, prefWrite).
//
//go:noescape
func prefetch(dst, src unsafe.Pointer, n uintptr, mode uint8)

// cpuidLeaf returns EAX and ECX of CPUID leaf, sub-leaf 0.
func cpuidLeaf(leaf uint32) (eax, ecx uint32)

// moveString copies n bytes from src to dst with REP MOVSB; the ranges
// must not overlap.
//
//go:noescape
func moveString(dst, src unsafe.Pointer, n uintptr)

// move512 copies n >= 64 bytes from src to dst with 64-byte AVX-512 loads
// and stores, the last 64 bytes overlapping the ones before; the ranges
// must not overlap.
//
//go:noescape
func move512(dst, src unsafe.Pointer, n uintptr)

// moveStream copies n >= 128 bytes from src to dst with 32-byte AVX2
// loads and non-temporal stores from dst's first 64-byte boundary on (the
// bytes before it, and the last 64, with plain stores), prefetching the
// source streamDist ahead while that is inside it, and ends with SFENCE:
// the stores are seen before any store after it. The ranges must not
// overlap.
//
//go:noescape
func moveStream(dst, src unsafe.Pointer, n uintptr)

// movePair copies n bytes from s1 to d1 and n bytes from s2 to d2 at once,
// 128 bytes of each a round, with moveStream's loads, non-temporal stores
// and prefetches, and ends with SFENCE. n must be a positive multiple of
// 128, d1 and d2 on 64-byte boundaries, and no two of the four ranges
// may overlap.
//
//go:noescape
func movePair(d1, s1, d2, s2 unsafe.Pointer, n uintptr)

// moveQuad copies n bytes from s[i] to d[i] for each i at once, 128 bytes
// of each a round, as movePair does two. n must be a positive multiple of
// 128, each d[i] on a 64-byte boundary, and no destination may overlap
// another range.
//
//go:noescape
func moveQuad(d, s *[4]unsafe.Pointer, n uintptr)
