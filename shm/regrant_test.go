//go:build linux

package shm

import (
	"context"
	"errors"
	"testing"

	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/segtable"
)

// setRevoked marks the target's registration of reg as being withdrawn
// (on), or not: the state in which the target refuses its grant.
func setRevoked(tr *Transport, reg segtable.Registration, on bool) {
	tr.mu.Lock()
	tr.byHandle[reg.Handle].revoked = on
	tr.mu.Unlock()
}

// TestRefusedGrantAskedAgain: a buffer whose grant the target refused
// when the peer opened the segment is asked for again at the next
// update, though its chunk of the descriptor did not change (the update
// asks for the changed chunks' buffers): as every ungranted buffer was
// asked for before the peer kept a Mirror.
func TestRefusedGrantAskedAgain(t *testing.T) {
	init, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer init.Close()
	targ, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer targ.Close()
	const n = 3 * segtable.ChunkSize
	m, err := mem.AllocShared((n+1)*4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free(m)
	var bufs segtable.Buffers
	var list segtable.ChunkList
	var regs []segtable.Registration
	add := func(i int) {
		b, err := bufs.Register(m[i*4096:(i+1)*4096], segtable.CPU(0), true)
		if err != nil {
			t.Fatal(err)
		}
		r, err := targ.Register(b)
		if err != nil {
			t.Fatal(err)
		}
		regs = append(regs, r)
		if err := list.Insert(segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length, Keys: map[string]string{Name: r.Key}}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		add(i)
	}
	desc := func() *segtable.SegmentDesc {
		return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "target", Epoch: 1,
			Endpoints: map[string]string{Name: targ.Endpoint()}, Chunked: list.Chunks()}
	}
	setRevoked(targ, regs[1], true) // in the first chunk
	e, err := init.Open(context.Background(), desc())
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ep := e.(*Endpoint)
	if m, vm := ep.Granted(); m+vm != n-1 {
		t.Fatalf("%d granted at the open, want %d (one refused)", m+vm, n-1)
	}
	setRevoked(targ, regs[1], false)
	add(n) // the last chunk changes, not the first
	ep.Update(desc())
	if m, vm := ep.Granted(); m+vm != n+1 {
		t.Fatalf("%d granted after the update, want %d: the refused buffer was not asked for again", m+vm, n+1)
	}
}

// TestNoBufferInASharedTail: a buffer may not be registered in the last
// page of the file of a buffer that peers have mapped whole, also while
// that registration drains and the same buffer is registered again (the
// new registration, never granted whole, is not shared; the old one is).
func TestNoBufferInASharedTail(t *testing.T) {
	tr, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	m, err := mem.AllocShared(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free(m)
	var first, again segtable.Buffers
	a, err := first.Register(m[:100], segtable.CPU(0), true)
	if err != nil {
		t.Fatal(err)
	}
	ra, err := tr.Register(a)
	if err != nil {
		t.Fatal(err)
	}
	tr.mu.Lock()
	key := tr.byHandle[ra.Handle].key
	tr.mu.Unlock()
	if r, st, whole := tr.grant(uint64(a.Addr), a.Length, &key); st != statusOK || !whole || r.file == nil {
		t.Fatalf("grant: status %d, whole %v: want the file handed out whole", st, whole)
	}
	setRevoked(tr, ra, true) // its Unregister waits for the peers
	a2, err := again.Register(m[:100], segtable.CPU(0), true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Register(a2); err != nil {
		t.Fatal(err)
	}
	tail, err := again.Register(m[1024:1124], segtable.CPU(0), true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Register(tail); !errors.Is(err, segtable.ErrOverlap) {
		t.Fatalf("a buffer in the shared file's tail: %v, want ErrOverlap", err)
	}
}
