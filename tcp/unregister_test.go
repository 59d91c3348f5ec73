package tcp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/moonring/moonring/segtable"
)

// TestUnregisterContext: a frame that holds a buffer (a peer in the middle
// of its payload) holds Unregister for up to a minute, but
// UnregisterContext only until its ctx ends; the buffer stays registered
// then, and a later Unregister once the frame is done drops it.
func TestUnregisterContext(t *testing.T) {
	tr, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	var bufs segtable.Buffers
	b, err := bufs.Register(make([]byte, 4096), segtable.CPU(0), true)
	if err != nil {
		t.Fatal(err)
	}
	defer bufs.Unregister(context.Background(), b.ID)
	reg, err := tr.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	r := tr.regs.Values()[0]
	if !r.ref.Acquire() {
		t.Fatal("a fresh region refuses a reference")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = tr.UnregisterContext(ctx, b, reg)
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("UnregisterContext took %v past a ctx of 100ms", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("UnregisterContext with a frame in the buffer: %v; want the ctx's error", err)
	}
	// No new frame finds the buffer, though the drain gave up (it was
	// served again with its old key until Close: the review's finding).
	if tr.regs.Len() != 0 {
		t.Fatal("the buffer is still served after an unregister that gave up")
	}
	r.ref.Release() // the frame in flight ends
	if err := tr.Unregister(b, reg); !errors.Is(err, segtable.ErrNotFound) {
		t.Fatalf("a second Unregister: %v, want ErrNotFound", err)
	}
}
