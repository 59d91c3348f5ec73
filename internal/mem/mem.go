package mem

import (
	"errors"
	"os"
)

// Sentinel errors.
var (
	// ErrBadSize reports a size that is not positive or that overflows when
	// rounded up to whole pages. A retry does not help.
	ErrBadSize = errors.New("mem: bad allocation size")
	// ErrNotAllocated reports a Free of a slice that is not a live
	// allocation of [Alloc] in its entirety: a foreign or resliced slice, or
	// one already freed. Nothing is unmapped. A retry does not help.
	ErrNotAllocated = errors.New("mem: not a live allocation")
	// ErrNoHugeTLB reports that [AllocHugeTLB] could not take the memory
	// from the kernel's reserved huge pages: the size is not a multiple of
	// [HugeTLBSize], too few are free, or the kernel has none. The caller
	// falls back to [Alloc] or [AllocShared].
	ErrNoHugeTLB = errors.New("mem: no reserved huge pages for this allocation")
)

// HugeTLBSize is the size of the reserved huge pages [AllocHugeTLB] takes
// (the kernel's default huge page size on x86-64 and most arm64 kernels).
const HugeTLBSize = 2 << 20

// hugePageSize is the size from which Alloc asks for transparent huge pages.
const hugePageSize = 2 << 20

// pageSize is the size of a base page; allocations are multiples of it.
var pageSize = os.Getpagesize()

// roundUp rounds size up to whole pages; ok is false for a size that is not
// positive or that overflows.
func roundUp(size int) (n int, ok bool) {
	if size <= 0 || size > int(^uint(0)>>1)-pageSize {
		return 0, false
	}
	return (size + pageSize - 1) &^ (pageSize - 1), true
}
