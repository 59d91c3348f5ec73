//go:build !amd64 || race || msan || asan

package fastcopy

import "unsafe"

// Copy is copy() here.
const (
	erms        = false
	wide        = false
	prefetchW   = false
	canPrefetch = false
)

// stream is a variable, as on amd64, for the benchmarks that turn it off.
var stream = false

func moveString(dst, src unsafe.Pointer, n uintptr) {
	copy(unsafe.Slice((*byte)(dst), n), unsafe.Slice((*byte)(src), n))
}

func move512(dst, src unsafe.Pointer, n uintptr) { moveString(dst, src, n) }

func prefetch(dst, src unsafe.Pointer, n uintptr, mode uint8) {}

func moveStream(dst, src unsafe.Pointer, n uintptr) { moveString(dst, src, n) }

func movePair(d1, s1, d2, s2 unsafe.Pointer, n uintptr) {
	moveString(d1, s1, n)
	moveString(d2, s2, n)
}

func moveQuad(d, s *[4]unsafe.Pointer, n uintptr) {
	for i := range d {
		moveString(d[i], s[i], n)
	}
}
