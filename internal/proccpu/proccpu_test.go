package proccpu

import (
	"os"
	"runtime"
	"testing"
	"time"
)

// TestCountsWork checks that each reading grows by about the CPU a spin
// used: the spin runs until this thread's own reading grew by 50 ms (on a
// loaded machine that takes longer than 50 ms of wall time), then Self
// must have grown at least as much and Of (this process, through /proc)
// as much within its clock tick.
func TestCountsWork(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s0, t0 := Self(), Thread()
	p0, err := Of(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); Thread()-t0 < 50*time.Millisecond; {
		if time.Now().After(deadline) {
			t.Fatalf("Thread grew %v in 30 s of spinning", Thread()-t0)
		}
	}
	s1, t1 := Self(), Thread()
	p1, err := Of(os.Getpid())
	if err != nil {
		t.Fatal(err)
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
