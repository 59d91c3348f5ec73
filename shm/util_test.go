//go:build linux

package shm_test

import (
	"slices"
	"unsafe"

	"github.com/moonring/moonring/segtable"
)

func unsafePointer(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }

func slicesSortDesc(d *segtable.SegmentDesc) {
	slices.SortFunc(d.Buffers, func(x, y segtable.BufferDesc) int {
		switch {
		case x.Addr < y.Addr:
			return -1
		case x.Addr > y.Addr:
			return 1
		}
		return 0
	})
}
