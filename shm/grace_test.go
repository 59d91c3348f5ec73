//go:build linux

package shm

import (
	"context"
	"encoding/hex"
	"errors"
	"testing"
	"time"

	"github.com/moonring/moonring/segtable"
)

// grantRaw asks the target over c (a raw connection past its hello) for
// b with key, and fails unless it is granted.
func grantRaw(t *testing.T, c interface {
	Write([]byte) (int, error)
	Read([]byte) (int, error)
}, b *segtable.Buffer, key string) {
	t.Helper()
	var k [16]byte
	h, err := hex.DecodeString(key)
	if err != nil || len(h) != 16 {
		t.Fatalf("key %q: %v", key, err)
	}
	copy(k[:], h)
	var buf [maxMsg + 1]byte
	m := msg{typ: msgGrant, seq: 1, a: uint64(b.Addr), b: b.Length, key: k, flags: flagVM}
	if _, err := c.Write(m.encode(buf[:])); err != nil {
		t.Fatal(err)
	}
	n, err := c.Read(buf[:])
	if err != nil {
		t.Fatal(err)
	}
	var ack msg
	if err := decode(buf[:n], &ack); err != nil || ack.typ != msgGrantAck || ack.status != statusOK {
		t.Fatalf("grant: %+v, %v", ack, err)
	}
}

// TestUnregisterContext: a peer that took a buffer and never answers its
// revoke holds Unregister for RevokeTimeout, but UnregisterContext only
// until its ctx ends; the peer is then cut, and the error says the caller
// gave up. Close afterwards, with that peer and another silent one still
// connected and nothing left to revoke, does not wait on them either.
func TestUnregisterContext(t *testing.T) {
	tr, err := New(Config{RevokeTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	var bufs segtable.Buffers
	b, err := bufs.Register(make([]byte, 1<<16), segtable.CPU(0), true)
	if err != nil {
		t.Fatal(err)
	}
	defer bufs.Unregister(context.Background(), b.ID)
	reg, err := tr.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	holder := dialRaw(t, tr, true)
	grantRaw(t, holder, b, reg.Key)

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err = tr.UnregisterContext(ctx, b, reg)
	took := time.Since(start)
	if took > 5*time.Second {
		t.Fatalf("UnregisterContext took %v with a ctx of 200ms (RevokeTimeout a minute)", took)
	}
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, segtable.ErrBusy) {
		t.Fatalf("UnregisterContext past a silent holder: %v; want ErrBusy and the ctx's error", err)
	}
	waitClosed(t, holder, "the holder after the caller gave up")
	silent := dialRaw(t, tr, true) // logged in, holds nothing, answers nothing

	start = time.Now()
	done := make(chan error, 1)
	go func() { done <- tr.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("hang: Close with no buffer left waits on a peer that does not answer revokes")
	}
	waitClosed(t, silent, "a silent peer at Close")
}
