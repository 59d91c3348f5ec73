package moonring_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/hugetest"
	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
)

// TestSHMTwoProcesses is TestTCPTwoProcesses with the shm transport
// installed on both sides: the engines find they share a host and the
// initiator maps the target's buffer (from Alloc) and copies into it.
func TestSHMTwoProcesses(t *testing.T) {
	e2eLeaks(t)
	const size = 4 << 20
	total := 3000
	if testing.Short() {
		total = 500
	}
	c := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size), "MOONRING_SHM=1")
	r := newRig(t, c, moonring.Config{TCP: &tcp.Config{Key: childKey}, SHM: &shm.Config{}}, 2*size, 3)
	if name, err := r.e.SegmentTransport(r.seg); err != nil || name != shm.Name {
		t.Fatalf("segment opened over %q (%v), want shm", name, err)
	}
	start := time.Now()
	r.rounds(total, 0, size, 0, 2*size, 1<<20)
	r.readBack(0, size, 0)
	t.Logf("%d requests and a read back in %v", total, time.Since(start))
}

// TestSHMHugeTLB: engines with Config.HugeTLB take their buffers from
// Alloc in reserved huge pages, the target's as a hugetlbfs memfd that the
// initiator maps over shm (its huge pages then count in the initiator's
// mappings too) and copies into; a size that is not a multiple of 2 MiB
// gets ordinary pages.
func TestSHMHugeTLB(t *testing.T) {
	e2eLeaks(t)
	const size = 4 << 20
	if why := hugetest.Need(size/mem.HugeTLBSize + 2*size/mem.HugeTLBSize); why != "" {
		t.Skip("SKIPPED: " + why)
	}
	c := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size), "MOONRING_SHM=1", "MOONRING_HUGETLB=1")
	if kb, err := hugetest.Mapped(c.Pid()); err != nil || kb != size>>10 {
		t.Fatalf("the target maps %d KiB of reserved huge pages (%v), want %d", kb, err, size>>10)
	}
	before, err := hugetest.Mapped(0)
	if err != nil {
		t.Fatal(err)
	}
	r := newRig(t, c, moonring.Config{TCP: &tcp.Config{Key: childKey}, SHM: &shm.Config{}, HugeTLB: true}, 2*size, 6)
	if kb, _ := hugetest.Mapped(0); kb-before != 2*size>>10 {
		t.Fatalf("the initiator maps %d KiB more of reserved huge pages, want its buffer's %d", kb-before, 2*size>>10)
	}
	if name, err := r.e.SegmentTransport(r.seg); err != nil || name != shm.Name {
		t.Fatalf("segment opened over %q (%v), want shm", name, err)
	}
	r.rounds(500, 0, size, 0, 2*size, 1<<20)
	r.readBack(0, size, 0)
	// The initiator maps the target's buffer now: those pages too.
	if kb, _ := hugetest.Mapped(0); kb-before != 3*size>>10 {
		t.Fatalf("with the target's buffer mapped, %d KiB more of reserved huge pages, want %d (its own and the target's)", kb-before, 3*size>>10)
	}
	odd, err := r.e.Alloc(size+4096, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	if kb, _ := hugetest.Mapped(0); kb-before != 3*size>>10 {
		t.Errorf("after an Alloc of 4 MiB and a page, %d KiB more of reserved huge pages, want still %d", kb-before, 3*size>>10)
	}
	if err := r.e.Free(odd); err != nil {
		t.Fatal(err)
	}
}

// TestSHMFallsBackToTCP: a target without shm (or one whose shm cannot be
// reached) is opened over TCP by an initiator that has both.
func TestSHMFallsBackToTCP(t *testing.T) {
	e2eLeaks(t)
	const size = 1 << 20
	c := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size))
	r := newRig(t, c, moonring.Config{TCP: &tcp.Config{Key: childKey}, SHM: &shm.Config{}}, 2*size, 4)
	if name, err := r.e.SegmentTransport(r.seg); err != nil || name != tcp.Name {
		t.Fatalf("segment opened over %q (%v), want tcp", name, err)
	}
	r.rounds(200, 0, size, 0, 2*size, 256<<10)
}

// TestSHMTargetKilled: the target dies with requests in flight over shm;
// every request ends within its deadline, none completes after the fault,
// and the engine closes cleanly.
func TestSHMTargetKilled(t *testing.T) {
	e2eLeaks(t)
	const size = 8 << 20
	c := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size), "MOONRING_SHM=1")
	r := newRig(t, c, moonring.Config{Timeout: e2eFaultTimeout, SHM: &shm.Config{}}, 40<<20, 5)
	if name, _ := r.e.SegmentTransport(r.seg); name != shm.Name {
		t.Fatalf("segment opened over %q, want shm", name)
	}
	r.e2eFault(size, c.KillWait)
	ctx, cancel := context.WithTimeout(context.Background(), e2eHang)
	defer cancel()
	if err := r.e.CloseSegment(ctx, r.seg); err != nil {
		t.Errorf("CloseSegment of the dead target: %v", err)
	}
}
