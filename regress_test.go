package moonring_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/moonring/moonring"
)

// A request whose slices fail in a synchronous copy while later slices of
// it are still being added to the batch ends FAILED; it must not crash the
// poller (a released slot was dereferenced before the fix).
func TestSyncCopyFailsMidRequest(t *testing.T) {
	a := newEngine(t, t.Name()+"-a")
	b, err := moonring.New(moonring.Config{Name: t.Name() + "-b"})
	if err != nil {
		t.Fatal(err)
	}
	const size = 80 << 20 // 80 slices of 1 MiB: more than one batch of 64
	src, err := a.Alloc(size, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Free(src)
	dst, err := b.Alloc(size, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	a.RegisterLocalMemory(src, "cpu:0", false)
	b.RegisterLocalMemory(dst, "cpu:0", true)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	b.Close() // every copy to it now fails
	defer b.Free(dst)
	err = a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
		TargetOffset: uint64(moonring.AddressOf(dst)), Length: size})
	if err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("write to a closed engine: %v; want a failed request", err)
	}
	// The engine still works.
	if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: moonring.LocalSegmentID,
		TargetOffset: uint64(moonring.AddressOf(src[4096:])), Length: 4096}); err != nil {
		t.Fatalf("local write after: %v", err)
	}
}

// A notification belongs to its request only: the next request that gets
// the same slot sends none.
func TestNotifyFlagDoesNotLeak(t *testing.T) {
	a := newEngine(t, t.Name()+"-a")
	b := newEngine(t, t.Name()+"-b")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	src := make([]byte, 4096)
	dst := make([]byte, 4096)
	id, _ := a.RegisterLocalMemory(src, "cpu:0", false)
	b.RegisterLocalMemory(dst, "cpu:0", true)
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.NewRing(moonring.RingConfig{Entries: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for i, e := range []moonring.Entry{
		{Op: moonring.OpWrite, Flags: moonring.FlagNotify, Tag: 5, Length: 64, UserData: 1},
		{Op: moonring.OpRead, Length: 64, UserData: 2},
		{Op: moonring.OpWrite, Length: 64, UserData: 3},
	} {
		e.Segment, e.Buffer, e.Remote = seg, id, uint64(moonring.AddressOf(dst))
		if err := r.SubmitOne(&e); err != nil {
			t.Fatal(err)
		}
		if err := r.CQ().Wait(ctx, 1); err != nil {
			t.Fatal(err)
		}
		if c := r.Peek(); c.Err() != nil {
			t.Fatalf("request %d: %v", i, c.Err())
		}
		r.Advance(1)
	}
	if n := <-b.Notifications(); n.Tag != 5 {
		t.Fatalf("first notification has tag %d", n.Tag)
	}
	select {
	case n := <-b.Notifications():
		t.Fatalf("a request without FlagNotify sent %+v", n)
	default:
	}
}
