//go:build amd64 && !race && !msan && !asan

package fastcopy

import (
	"unsafe"

	"github.com/klauspost/cpuid/v2"
)

var (
	erms = cpuid.CPU.Has(cpuid.ERMS)
	wide = cpuid.CPU.VendorID == cpuid.AMD && cpuid.CPU.Has(cpuid.AVX512F)
)

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
