package topology

import (
	"errors"
	"fmt"
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PinThread restricts the calling OS thread to the given CPUs
// (sched_setaffinity). It pins a thread, not a goroutine: the caller must
// hold the thread with runtime.LockOSThread before the call and for as long
// as the pinning matters, or the Go scheduler will move the goroutine to
// other, unpinned threads and leave a pinned thread behind for unrelated
// goroutines. The pinning lasts until the thread is pinned again or exits
// (a goroutine that returns while locked takes its thread with it).
//
// An empty list or a negative CPU number is refused with an error wrapping
// unix.EINVAL, as is a list holding no CPU the process may use; a retry does
// not help. PinThread is safe for concurrent use; each call affects only its
// own thread.
func PinThread(cpus []int) error {
	if len(cpus) == 0 {
		return fmt.Errorf("topology: pin thread: empty CPU list: %w", unix.EINVAL)
	}
	maxCPU := slices.Max(cpus)
	if slices.Min(cpus) < 0 || maxCPU >= maxCPUs {
		return fmt.Errorf("topology: pin thread to %v: %w", cpus, unix.EINVAL)
	}
	set := unix.NewCPUSet(maxCPU + 1)
	for _, c := range cpus {
		set.Set(c)
	}
	if err := unix.SchedSetaffinityDynamic(0, set); err != nil {
		return fmt.Errorf("topology: pin thread to %v: %w", cpus, err)
	}
	return nil
}

// CurrentCPU returns the CPU the calling thread runs on (getcpu), or -1 when
// the kernel does not say. The answer may be stale by the time it is used
// unless the thread is pinned to one CPU. It is safe for concurrent use.
func CurrentCPU() int {
	var cpu uint32
	// getcpu writes only to cpu; the node and the legacy cache arguments are nil.
	_, _, errno := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), 0, 0)
	if errno != 0 {
		return -1
	}
	return int(cpu)
}

// allowedCPUs returns the CPUs the process may run on, which is what a
// machine without NUMA information offers the engine. It asks for the
// affinity of the main thread rather than the calling one, which its caller
// may have pinned.
func allowedCPUs() []int {
	// Start at 1024 CPUs and grow: the kernel refuses a mask smaller than its
	// own with EINVAL.
	for n := 1024; n <= maxCPUs; n *= 2 {
		set := unix.NewCPUSet(n)
		err := unix.SchedGetaffinityDynamic(unix.Getpid(), set)
		if errors.Is(err, unix.EINVAL) {
			continue
		}
		if err != nil {
			break
		}
		var cpus []int
		for c := range n {
			if set.IsSet(c) {
				cpus = append(cpus, c)
			}
		}
		if len(cpus) > 0 {
			return cpus
		}
		break
	}
	return allCPUs()
}

// totalMemory is the machine's RAM, for the single-node fallback.
func totalMemory() uint64 {
	var si unix.Sysinfo_t
	if unix.Sysinfo(&si) != nil {
		return 0
	}
	return uint64(si.Totalram) * uint64(si.Unit)
}
