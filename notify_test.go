package moonring_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
)

// testNotify writes with a notification from a to b's buffer and checks
// that b hears of it only with the bytes already in place.
func testNotify(t *testing.T, a, b *moonring.Engine) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	src := make([]byte, 300<<10)
	dst := make([]byte, len(src))
	fill(src, 9)
	if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	// Batch API: a message.
	msg := []byte("layer 7 of request 42 is in place")
	err = a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
		TargetOffset: uint64(moonring.AddressOf(dst)), Length: uint64(len(src)), Notify: &moonring.Notify{Tag: 77, Msg: msg}})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-b.Notifications():
		if n.From != a.Name() || n.Tag != 77 || !bytes.Equal(n.Msg, msg) {
			t.Fatalf("notification %+v; want from %s, tag 77, %q", n, a.Name(), msg)
		}
		if !bytes.Equal(dst, src) {
			t.Fatal("notified before the bytes were in place")
		}
	case <-ctx.Done():
		t.Fatal("no notification")
	}
	// Ring API: a tag.
	r, err := a.NewRing(moonring.RingConfig{Entries: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	id, _ := a.RegisterLocalMemory(make([]byte, 64), "cpu:0", false)
	err = r.SubmitOne(&moonring.Entry{Op: moonring.OpWrite, Flags: moonring.FlagNotify, Tag: 5, Segment: seg, Buffer: id,
		Remote: uint64(moonring.AddressOf(dst)), Length: 64, UserData: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.CQ().Wait(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if c := r.Peek(); c.Err() != nil {
		t.Fatalf("notify write: %v", c.Err())
	}
	r.Advance(1)
	select {
	case n := <-b.Notifications():
		if n.Tag != 5 || len(n.Msg) != 0 {
			t.Fatalf("notification %+v; want tag 5, no message", n)
		}
	default:
		t.Fatal("the write completed before its notification was queued")
	}
	// A notification on a read is refused.
	err = a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(src), TargetID: seg,
		TargetOffset: uint64(moonring.AddressOf(dst)), Length: 8, Notify: &moonring.Notify{Tag: 1}})
	if !errors.Is(err, moonring.ErrInvalid) {
		t.Fatalf("notify on a read: %v; want ErrInvalid", err)
	}
}

func TestNotifyInProcess(t *testing.T) {
	testNotify(t, newEngine(t, t.Name()+"-a"), newEngine(t, t.Name()+"-b"))
}

func TestNotifyTCP(t *testing.T) {
	store := metadata.NewMemory()
	mk := func(name string) *moonring.Engine {
		e, err := moonring.New(moonring.Config{Name: name, Metadata: store, Transports: []string{"tcp"}, TCP: &tcp.Config{}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	testNotify(t, mk(t.Name()+"-a"), mk(t.Name()+"-b"))
}

// Over shm (engines of one process, the Go-memory buffers reached through
// process_vm calls) the notification rides the control socket.
func TestNotifySHM(t *testing.T) {
	store := metadata.NewMemory()
	mk := func(name string) *moonring.Engine {
		e, err := moonring.New(moonring.Config{Name: name, Metadata: store, Transports: []string{"shm"}, SHM: &shm.Config{}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	testNotify(t, mk(t.Name()+"-a"), mk(t.Name()+"-b"))
}

// A full notification queue fails the sender's request after its retries,
// and nothing is lost from what was queued.
func TestNotifyQueueFull(t *testing.T) {
	a := newEngine(t, t.Name()+"-a")
	b, err := moonring.New(moonring.Config{Name: t.Name() + "-b", NotifyQueue: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := context.Background()
	src := make([]byte, 64)
	dst := make([]byte, 64)
	a.RegisterLocalMemory(src, "cpu:0", false)
	b.RegisterLocalMemory(dst, "cpu:0", true)
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	req := moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
		TargetOffset: uint64(moonring.AddressOf(dst)), Length: 8, Notify: &moonring.Notify{Tag: 1}}
	if err := a.Transfer(ctx, req); err != nil {
		t.Fatal(err)
	}
	req.Notify = &moonring.Notify{Tag: 2}
	if err := a.Transfer(ctx, req); !errors.Is(err, moonring.ErrTransport) {
		t.Fatalf("second notification into a full queue: %v; want ErrTransport", err)
	}
	if n := <-b.Notifications(); n.Tag != 1 {
		t.Fatalf("queued notification has tag %d; want 1", n.Tag)
	}
}
