//go:build !linux

package topology

import (
	"errors"
	"fmt"
)

// PinThread restricts the calling OS thread to the given CPUs. Only Linux
// supports it; elsewhere it returns an error wrapping errors.ErrUnsupported.
func PinThread(cpus []int) error {
	return fmt.Errorf("topology: pin thread: %w", errors.ErrUnsupported)
}

// CurrentCPU returns the CPU the calling thread runs on; -1 outside Linux.
func CurrentCPU() int { return -1 }

func allowedCPUs() []int { return allCPUs() }

func totalMemory() uint64 { return 0 }
