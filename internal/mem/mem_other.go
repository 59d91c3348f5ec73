//go:build !linux

package mem

import (
	"errors"
	"fmt"
	"os"
)

// Alloc maps engine memory; only Linux supports it, elsewhere it returns an
// error wrapping errors.ErrUnsupported.
func Alloc(size int, node int) ([]byte, error) {
	return nil, fmt.Errorf("mem: alloc: %w", errors.ErrUnsupported)
}

// AllocShared maps memory other processes may map; only Linux supports it,
// elsewhere it returns an error wrapping errors.ErrUnsupported.
func AllocShared(size int, node int) ([]byte, error) {
	return nil, fmt.Errorf("mem: alloc shared: %w", errors.ErrUnsupported)
}

// AllocHugeTLB maps memory of reserved huge pages; only Linux supports it,
// elsewhere it returns an error wrapping ErrNoHugeTLB.
func AllocHugeTLB(size int, node int, shared bool) ([]byte, error) {
	return nil, fmt.Errorf("mem: alloc huge pages: %w", ErrNoHugeTLB)
}

// File returns the file behind shared memory; outside Linux there is none.
func File(addr uintptr, n uint64) (*os.File, int64, error) {
	return nil, 0, fmt.Errorf("mem: file: %w", ErrNotAllocated)
}

// Free unmaps memory from [Alloc]; outside Linux nothing was allocated, so it
// returns [ErrNotAllocated].
func Free(b []byte) error { return fmt.Errorf("mem: free: %w", ErrNotAllocated) }

// IsAllocated reports whether addr lies in a live allocation of [Alloc];
// always false outside Linux.
func IsAllocated(addr uintptr) bool { return false }

// AllocGuarded maps a buffer between guard pages; only Linux supports it,
// elsewhere it returns an error wrapping errors.ErrUnsupported.
func AllocGuarded(size int) (buf []byte, free func() error, err error) {
	return nil, nil, fmt.Errorf("mem: alloc guarded: %w", errors.ErrUnsupported)
}
