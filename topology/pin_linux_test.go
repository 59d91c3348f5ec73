package topology

import (
	"errors"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

func TestPinThread(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var old unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := unix.SchedSetaffinity(0, &old); err != nil {
			t.Errorf("restore affinity: %v", err)
		}
	}()
	// Pin to the last CPU we may use, so that on a multi-CPU machine the
	// thread most likely has to move.
	target := -1
	for c := range 1024 {
		if old.IsSet(c) {
			target = c
		}
	}
	if target < 0 {
		t.Skip("affinity mask beyond 1024 CPUs")
	}
	if err := PinThread([]int{target}); err != nil {
		t.Fatal(err)
	}
	var now unix.CPUSet
	if err := unix.SchedGetaffinity(0, &now); err != nil {
		t.Fatal(err)
	}
	if now.Count() != 1 || !now.IsSet(target) {
		t.Errorf("after PinThread([%d]) the mask holds %d CPUs", target, now.Count())
	}
	// sched_setaffinity migrates the calling thread before it returns.
	if got := CurrentCPU(); got != target {
		t.Errorf("CurrentCPU = %d after pinning to %d", got, target)
	}
}

func TestPinThreadRefusesBadLists(t *testing.T) {
	for _, cpus := range [][]int{nil, {-1}, {0, 1 << 20}} {
		if err := PinThread(cpus); !errors.Is(err, unix.EINVAL) {
			t.Errorf("PinThread(%v) = %v, want EINVAL", cpus, err)
		}
	}
}

func TestCurrentCPU(t *testing.T) {
	c := CurrentCPU()
	if c < 0 {
		t.Fatalf("CurrentCPU = %d", c)
	}
	topo, err := Discover()
	if err != nil {
		t.Fatal(err)
	}
	if topo.NodeOfCPU(c) < 0 {
		t.Errorf("CPU %d is on no node of %+v", c, topo.Nodes)
	}
}
