package mem

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// live maps the base address of every mapping Alloc and AllocShared made to
// the mapping itself (as unix.Mmap returned it, which unix.Munmap requires).
var live struct {
	sync.Mutex
	m map[uintptr]mapping
}

// mapping is one live allocation; fd is the memfd behind a shared one, -1
// for private memory.
type mapping struct {
	b  []byte
	fd int
}

// Alloc maps size bytes of zeroed, private, anonymous memory, rounded up to
// whole pages, and returns it as a slice of length size whose capacity is the
// rounded size. The memory starts page aligned and is not part of the Go heap.
//
// The pages are faulted in before Alloc returns, so that pinning them for a
// NIC later is quick. From 2 MiB on, Alloc asks for transparent huge pages
// (madvise MADV_HUGEPAGE; a kernel without them is not an error). When node
// >= 0 and the machine has more than one NUMA node, the pages are bound to
// that node (mbind MPOL_BIND) before they are touched; binding is best effort where the
// kernel or a seccomp filter forbids it (ENOSYS, EPERM), and other binding
// errors, such as a node that does not exist, fail the allocation. node < 0,
// or a machine with one node, means no binding.
//
// The slice stays valid until [Free], which must receive it with its start
// and capacity unchanged. Alloc is safe for concurrent use.
func Alloc(size int, node int) ([]byte, error) {
	return alloc(size, node, false)
}

// Seals are the seals AllocShared puts on its memfds: the file can neither
// shrink nor grow, and no seal can be added or removed. A peer that maps the
// file can therefore never be made to fault (SIGBUS) by a truncation.
const Seals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// AllocShared is [Alloc] for memory that other processes may map: the pages
// belong to a sealed memfd (see [Seals]) mapped shared, whose descriptor
// [File] hands out. Everything else (size, alignment, huge pages, NUMA
// binding, [Free]) is as for Alloc.
func AllocShared(size int, node int) ([]byte, error) {
	return alloc(size, node, true)
}

// AllocHugeTLB is [Alloc], or [AllocShared] when shared, for memory of the
// kernel's reserved huge pages (hugetlbfs: vm.nr_hugepages, or
// vm.nr_overcommit_hugepages), which every kernel gives shared memory as
// well, where transparent huge pages for a memfd depend on the kernel's
// shmem_enabled (Debian's default, never, gives none). size must be a
// multiple of [HugeTLBSize]; the pages are reserved and faulted in before
// it returns. It fails with [ErrNoHugeTLB] when they cannot be had, and
// takes nothing then. The memory is freed with [Free]; a shared one's
// [File] is a hugetlbfs memfd, sealed as AllocShared's. Safe for
// concurrent use.
func AllocHugeTLB(size int, node int, shared bool) ([]byte, error) {
	if size <= 0 || size%HugeTLBSize != 0 {
		return nil, fmt.Errorf("mem: alloc %d bytes of huge pages: not a multiple of %d: %w", size, HugeTLBSize, ErrNoHugeTLB)
	}
	return allocMapped(size, size, node, shared, true)
}

func alloc(size int, node int, shared bool) ([]byte, error) {
	n, ok := roundUp(size)
	if !ok {
		return nil, fmt.Errorf("mem: alloc %d bytes: %w", size, ErrBadSize)
	}
	return allocMapped(size, n, node, shared, false)
}

// allocMapped maps n bytes (size rounded up) as alloc and AllocHugeTLB
// describe.
func allocMapped(size, n int, node int, shared, huge bool) ([]byte, error) {
	fd := -1
	flags := unix.MAP_PRIVATE | unix.MAP_ANONYMOUS
	if huge {
		flags |= unix.MAP_HUGETLB
	}
	if shared {
		var err error
		if fd, err = memfd(n, huge); err != nil {
			if huge {
				err = fmt.Errorf("%w (%v)", ErrNoHugeTLB, err)
			}
			return nil, fmt.Errorf("mem: alloc %d bytes: %w", size, err)
		}
		flags = unix.MAP_SHARED
	}
	b, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, flags)
	if err != nil {
		closeFD(fd)
		if huge {
			// Too few free (ENOMEM), or no hugetlb in this kernel.
			err = fmt.Errorf("%w (%v)", ErrNoHugeTLB, err)
		}
		return nil, fmt.Errorf("mem: alloc %d bytes: %w", size, err)
	}
	fail := func() {
		unix.Munmap(b)
		closeFD(fd)
	}
	if n >= hugePageSize && !huge {
		if err := unix.Madvise(b, unix.MADV_HUGEPAGE); err != nil && !errors.Is(err, unix.EINVAL) {
			fail()
			return nil, fmt.Errorf("mem: alloc %d bytes: madvise: %w", size, err)
		}
	}
	if node >= 0 && numNodes() > 1 {
		if err := bind(b, node); err != nil {
			fail()
			return nil, fmt.Errorf("mem: alloc %d bytes on node %d: %w", size, node, err)
		}
	}
	// Fault the pages in now, on their node: registering memory with a
	// NIC pins it, and pinning a gigabyte of untouched memory faults it
	// in page by page inside the registration call. A kernel without
	// MADV_POPULATE_WRITE (before 5.14) leaves it to the first touch.
	if err := unix.Madvise(b, unix.MADV_POPULATE_WRITE); err != nil && !errors.Is(err, unix.EINVAL) {
		fail()
		if huge {
			// The node bound to has too few of them.
			err = fmt.Errorf("%w (%v)", ErrNoHugeTLB, err)
		}
		return nil, fmt.Errorf("mem: alloc %d bytes: populate: %w", size, err)
	}
	live.Lock()
	if live.m == nil {
		live.m = make(map[uintptr]mapping)
	}
	live.m[base(b)] = mapping{b, fd}
	live.Unlock()
	return b[:size:n], nil
}

// memfd creates a sealed memfd of n bytes, of reserved huge pages when
// huge (hugetlbfs; they are reserved when it is mapped).
func memfd(n int, huge bool) (int, error) {
	flags := unix.MFD_CLOEXEC | unix.MFD_ALLOW_SEALING
	if huge {
		flags |= unix.MFD_HUGETLB
	}
	fd, err := unix.MemfdCreate("moonring", flags)
	if err == unix.EACCES {
		// vm.memfd_noexec=2 (Linux 6.3 and up) refuses memfds that could
		// be made executable: ask for one sealed against exec.
		fd, err = unix.MemfdCreate("moonring", flags|unix.MFD_NOEXEC_SEAL)
	}
	if err != nil {
		return -1, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("ftruncate memfd: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, Seals); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("seal memfd: %w", err)
	}
	return fd, nil
}

func closeFD(fd int) {
	if fd >= 0 {
		unix.Close(fd)
	}
}

// File returns a new descriptor of the memfd behind the live [AllocShared]
// allocation that holds [addr, addr+n), and the offset of addr in that file.
// The caller owns the descriptor (it stays valid after Free) and closes it.
// It fails with [ErrNotAllocated] when no shared allocation holds the whole
// range. File is safe for concurrent use.
func File(addr uintptr, n uint64) (*os.File, int64, error) {
	live.Lock()
	defer live.Unlock()
	for p, m := range live.m {
		if m.fd >= 0 && addr >= p && addr-p < uintptr(len(m.b)) && n <= uint64(len(m.b))-uint64(addr-p) {
			fd, err := unix.FcntlInt(uintptr(m.fd), unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				return nil, 0, fmt.Errorf("mem: file of %#x: %w", addr, err)
			}
			return os.NewFile(uintptr(fd), "moonring-memfd"), int64(addr - p), nil
		}
	}
	return nil, 0, fmt.Errorf("mem: file of %#x (%d bytes): %w", addr, n, ErrNotAllocated)
}

// Free unmaps a buffer that [Alloc] or [AllocShared] returned, and closes
// the memfd of a shared one (descriptors from [File] stay valid). b must
// start where Alloc's slice started and keep its capacity (its length may
// differ); anything else, including a second Free of the same buffer, fails
// with [ErrNotAllocated] and unmaps nothing. After Free returns nil, no one may touch the memory.
// Free is safe for concurrent use.
func Free(b []byte) error {
	p := base(b)
	live.Lock()
	defer live.Unlock()
	m, ok := live.m[p]
	if !ok || p == 0 || cap(b) != len(m.b) {
		return fmt.Errorf("mem: free %#x (cap %d): %w", p, cap(b), ErrNotAllocated)
	}
	if err := unix.Munmap(m.b); err != nil {
		return fmt.Errorf("mem: free %#x: %w", p, err)
	}
	closeFD(m.fd)
	delete(live.m, p)
	return nil
}

// IsAllocated reports whether addr lies inside a live allocation of [Alloc]
// (guarded buffers are not counted). It is safe for concurrent use; the
// answer may be stale once another goroutine frees the allocation.
func IsAllocated(addr uintptr) bool {
	live.Lock()
	defer live.Unlock()
	if _, ok := live.m[addr]; ok {
		return true
	}
	for p, m := range live.m {
		if addr >= p && addr-p < uintptr(len(m.b)) {
			return true
		}
	}
	return false
}

// AllocGuarded maps a buffer of exactly size bytes between two inaccessible
// (PROT_NONE) pages, and returns it with the function that unmaps it. The
// buffer's end touches the upper guard page, so an access just past it
// faults; its start is aligned only when size is a multiple of the page
// size. The capacity equals size, so append cannot run into the guard.
//
// It is meant for tests and fuzz targets that prove code never reads or
// writes outside a buffer. The buffer stays valid until free is called; a
// second call of free returns [ErrNotAllocated]. [Free] does not accept a
// guarded buffer. AllocGuarded and free are safe for concurrent use.
func AllocGuarded(size int) (buf []byte, free func() error, err error) {
	n, ok := roundUp(size)
	if !ok {
		return nil, nil, fmt.Errorf("mem: alloc guarded %d bytes: %w", size, ErrBadSize)
	}
	m, err := unix.Mmap(-1, 0, n+2*pageSize, unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, nil, fmt.Errorf("mem: alloc guarded %d bytes: %w", size, err)
	}
	end := pageSize + n
	if err := unix.Mprotect(m[pageSize:end], unix.PROT_READ|unix.PROT_WRITE); err != nil {
		unix.Munmap(m)
		return nil, nil, fmt.Errorf("mem: alloc guarded %d bytes: mprotect: %w", size, err)
	}
	var once sync.Mutex
	freed := false
	free = func() error {
		once.Lock()
		defer once.Unlock()
		if freed {
			return fmt.Errorf("mem: free guarded %#x: %w", base(m), ErrNotAllocated)
		}
		if err := unix.Munmap(m); err != nil {
			return fmt.Errorf("mem: free guarded %#x: %w", base(m), err)
		}
		freed = true
		return nil
	}
	return m[end-size : end : end], free, nil
}

// base is the address of b's first byte, 0 for a slice without backing
// memory. The memory is outside the Go heap, so the address is stable.
func base(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// numNodes counts the NUMA nodes in sysfs, once; 1 when sysfs does not say.
var numNodes = sync.OnceValue(func() int {
	ents, err := os.ReadDir("/sys/devices/system/node")
	if err != nil {
		return 1
	}
	n := 0
	for _, e := range ents {
		id, ok := strings.CutPrefix(e.Name(), "node")
		if _, err := strconv.ParseUint(id, 10, 32); ok && err == nil {
			n++
		}
	}
	return max(n, 1)
})

// mpolBind is MPOL_BIND of <linux/mempolicy.h>: allocate only on the nodes in
// the mask.
const mpolBind = 2

// maxNode bounds node numbers (the kernel's MAX_NUMNODES is at most 1024).
const maxNode = 1 << 10

// bind sets the memory policy of b's pages to node. Pages already faulted in
// keep their place; Alloc binds before anything touches them.
func bind(b []byte, node int) error {
	if node < 0 || node >= maxNode {
		return fmt.Errorf("mbind node %d: %w", node, unix.EINVAL)
	}
	mask := make([]uint64, node/64+1)
	mask[node/64] = 1 << (node % 64)
	// The kernel reads maxnode-1 bits of the mask (a historical off-by-one
	// that numactl also compensates for), so pass one more than its size.
	maxnode := uintptr(len(mask)*64 + 1)
	_, _, errno := unix.Syscall6(unix.SYS_MBIND, uintptr(unsafe.Pointer(unsafe.SliceData(b))), uintptr(len(b)),
		mpolBind, uintptr(unsafe.Pointer(&mask[0])), maxnode, 0)
	switch errno {
	case 0, unix.ENOSYS, unix.EPERM:
		return nil
	}
	return fmt.Errorf("mbind node %d: %w", node, errno)
}
