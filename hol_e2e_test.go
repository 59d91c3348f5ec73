package moonring_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// TestTCPStoppedPeerHoldsOnlyItsOwn: of two target processes, one stops
// (SIGSTOP: its connection stays up and reads nothing, as a host cut off
// by a partition). A ring's WRITE to it fills its connection's queue and
// waits; the READs to the other target submitted behind it on the same
// ring complete at once, every byte checked, not at their deadline. Once
// the stopped target runs again its WRITE completes too, and reads back
// as written.
func TestTCPStoppedPeerHoldsOnlyItsOwn(t *testing.T) {
	const size = 4 << 20
	stopped := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size))
	healthy := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size))
	store := metadata.NewMemory()
	ds := []*struct {
		c    *child
		seg  moonring.SegmentID
		addr uint64
	}{{c: stopped}, {c: healthy}}
	for _, d := range ds {
		if err := store.Put(t.Context(), d.c.targetDesc(t)); err != nil {
			t.Fatal(err)
		}
	}
	// A request's deadline well past the test's waits, and a connection
	// queue of 4 slices of 64 KiB: a 1 MiB WRITE to the stopped target
	// leaves 12 slices its endpoint refuses.
	e, err := moonring.New(moonring.Config{Metadata: store, Timeout: 20 * time.Second,
		TCP: &tcp.Config{Key: childKey, Rails: 1, Depth: 4, SliceSize: 64 << 10, PeerTimeout: time.Minute, ResponseTimeout: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for _, d := range ds {
		desc := d.c.targetDesc(t)
		if d.seg, err = e.OpenSegment(t.Context(), desc.Name); err != nil {
			t.Fatal(err)
		}
		d.addr = desc.Buffers[0].Addr
	}
	local, err := e.Alloc(2<<20, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	defer e.Free(local)
	id, err := e.RegisterLocalMemory(local, "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	defer e.UnregisterLocalMemory(context.Background(), local)
	fill(local[:1<<20], 77)
	// Learn what the healthy target holds before the fault.
	want := make([]byte, 16*4096)
	if err := e.Transfer(t.Context(), moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(local) + 1<<20,
		TargetID: ds[1].seg, TargetOffset: ds[1].addr, Length: uint64(len(want))}); err != nil {
		t.Fatal(err)
	}
	copy(want, local[1<<20:])
	clear(local[1<<20:])

	r, err := e.NewRing(moonring.RingConfig{Entries: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := syscall.Kill(stopped.Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	cont := func() { syscall.Kill(stopped.Pid(), syscall.SIGCONT) }
	defer cont()
	waitState(t, stopped.Pid(), 'T')
	es := []moonring.Entry{{Op: moonring.OpWrite, Segment: ds[0].seg, Buffer: id, Local: 0, Remote: ds[0].addr, Length: 1 << 20, UserData: 1}}
	for i := range 16 {
		es = append(es, moonring.Entry{Op: moonring.OpRead, Segment: ds[1].seg, Buffer: id, Local: 1<<20 + uint64(i)*4096,
			Remote: ds[1].addr + uint64(i)*4096, Length: 4096, UserData: uint64(2 + i)})
	}
	for len(es) > 0 {
		n, err := r.Submit(es)
		if err != nil {
			t.Fatal(err)
		}
		es = es[n:]
	}
	// The 16 READs, while the stopped target holds the WRITE.
	ctx, cancel := context.WithTimeout(t.Context(), e2eHang)
	defer cancel()
	cs := make([]moonring.Completion, 17)
	got := 0
	for got < 16 {
		if err := r.CQ().Wait(ctx, 1); err != nil {
			t.Fatalf("%d of the healthy target's 16 READs completed: %v", got, err)
		}
		n := r.PeekBatch(cs[got:])
		for _, c := range cs[got : got+n] {
			if c.UserData == 1 {
				t.Fatalf("the stopped target's WRITE ended (%v) before it ran again", c.Status)
			}
			if c.Status != moonring.COMPLETED {
				t.Fatalf("READ %d from the healthy target: %v (%v); want COMPLETED while the other target is stopped", c.UserData, c.Status, c.Code)
			}
		}
		got += n
		r.Advance(n)
	}
	if !bytes.Equal(local[1<<20:1<<20+len(want)], want) {
		t.Fatal("the healthy target's READs differ from its buffer")
	}
	cont()
	if err := r.CQ().Wait(ctx, 1); err != nil {
		t.Fatalf("the WRITE to the target that ran again: %v", err)
	}
	if n := r.PeekBatch(cs[:1]); n != 1 || cs[0].UserData != 1 || cs[0].Status != moonring.COMPLETED {
		t.Fatalf("completion %+v; want the WRITE, COMPLETED", cs[0])
	}
	r.Advance(1)
	back := make([]byte, 1<<20)
	copy(back, local[:1<<20])
	clear(local[:1<<20])
	if err := e.Transfer(t.Context(), moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(local),
		TargetID: ds[0].seg, TargetOffset: ds[0].addr, Length: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(local[:1<<20], back) {
		t.Fatal("the stopped target's buffer does not hold the WRITE")
	}
}

// waitState waits until process pid is in state (a letter of
// /proc/PID/stat: 'T' stopped by a signal).
func waitState(t *testing.T, pid int, state byte) {
	t.Helper()
	deadline := time.Now().Add(e2eHang)
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			t.Fatal(err)
		}
		// pid (comm) state ...: comm may hold spaces, so after the last ')'.
		if i := bytes.LastIndexByte(b, ')'); i >= 0 && i+2 < len(b) && b[i+2] == state {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d not in state %c: %s", pid, state, b)
		}
		time.Sleep(time.Millisecond)
	}
}
