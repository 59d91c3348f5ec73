//go:build amd64 && !race

package fastcopy

import (
	"unsafe"

	"github.com/klauspost/cpuid/v2"
)

var fast = cpuid.CPU.Has(cpuid.ERMS)

// move copies n bytes from src to dst with REP MOVSB; the ranges must not
// overlap.
//
//go:noescape
func move(dst, src unsafe.Pointer, n uintptr)
