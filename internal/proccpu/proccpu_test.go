package proccpu

import (
	"os"
	"runtime"
	"testing"
	"time"
)

// burn spins for d of wall time on the calling goroutine.
func burn(d time.Duration) {
	for t0 := time.Now(); time.Since(t0) < d; {
	}
}

// TestCountsWork checks that each reading grows by about the CPU a spin
// used: Self and Thread at least most of it, Of (this process, through
// /proc) within its clock tick.
func TestCountsWork(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s0, t0 := Self(), Thread()
	p0, err := Of(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	burn(200 * time.Millisecond)
	s1, t1 := Self(), Thread()
	p1, err := Of(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// A shared machine may take the CPU away for part of the spin: the
	// readings are bounded below by a share of it, above by what passed.
	if d := t1 - t0; d < 20*time.Millisecond {
		t.Errorf("Thread grew %v over a 200 ms spin", d)
	}
	if d := s1 - s0; d < t1-t0 {
		t.Errorf("Self grew %v, less than this thread's %v", d, t1-t0)
	}
	if d := p1 - p0; d < t1-t0-2*clockTick || d > s1-s0+2*clockTick {
		t.Errorf("Of grew %v; Self %v, Thread %v", d, s1-s0, t1-t0)
	}
}

// TestOfMissing checks that a process that is not there is an error.
func TestOfMissing(t *testing.T) {
	if _, err := Of(1 << 30); err == nil {
		t.Fatal("Of(1<<30): no error")
	}
}
