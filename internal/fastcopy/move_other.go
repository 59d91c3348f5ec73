//go:build !amd64 || race

package fastcopy

import "unsafe"

// fast is false: Copy is copy().
const fast = false

func move(dst, src unsafe.Pointer, n uintptr) {
	copy(unsafe.Slice((*byte)(dst), n), unsafe.Slice((*byte)(src), n))
}
