//go:build linux

package shm_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/transport"
)

// scaleWorld is a target transport with n buffers of one page each (one
// memfd, so each is reached through process_vm calls: no file per
// buffer), and an initiator transport, for the cost of opening and
// following a segment as its buffers grow.
type scaleWorld struct {
	init, targ *shm.Transport
	bufs       segtable.Buffers
	list       segtable.ChunkList
	mem        []byte
}

func newScaleWorld(tb testing.TB, n int) *scaleWorld {
	tb.Helper()
	w := &scaleWorld{}
	var err error
	if w.init, err = shm.New(shm.Config{}); err != nil {
		tb.Fatal(err)
	}
	if w.targ, err = shm.New(shm.Config{RevokeTimeout: 5 * time.Second}); err != nil {
		tb.Fatal(err)
	}
	if w.mem, err = mem.AllocShared((n+1)*4096, 0); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		w.init.Close()
		w.targ.Close()
		mem.Free(w.mem)
	})
	for i := range n {
		w.add(tb, i)
	}
	return w
}

// add registers page i of the memory with the target and lists it.
func (w *scaleWorld) add(tb testing.TB, i int) (*segtable.Buffer, segtable.Registration) {
	b, err := w.bufs.Register(w.mem[i*4096:(i+1)*4096], segtable.CPU(0), true)
	if err != nil {
		tb.Fatal(err)
	}
	r, err := w.targ.Register(b)
	if err != nil {
		tb.Fatal(err)
	}
	if err := w.list.Insert(segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length, Keys: map[string]string{shm.Name: r.Key}}); err != nil {
		tb.Fatal(err)
	}
	return b, r
}

// remove unregisters and unlists what add made.
func (w *scaleWorld) remove(tb testing.TB, b *segtable.Buffer, r segtable.Registration) {
	if err := w.targ.Unregister(b, r); err != nil {
		tb.Fatal(err)
	}
	if !w.list.Delete(uint64(b.Addr)) {
		tb.Fatal("not listed")
	}
	if _, err := w.bufs.Unregister(context.Background(), b.ID); err != nil {
		tb.Fatal(err)
	}
}

func (w *scaleWorld) desc() *segtable.SegmentDesc {
	return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "target", Epoch: 1,
		Endpoints: map[string]string{shm.Name: w.targ.Endpoint()}, Chunked: w.list.Chunks()}
}

// BenchmarkScaleOpen is the cost of opening a segment of n buffers over
// shm: a grant of each.
func BenchmarkScaleOpen(b *testing.B) {
	for _, n := range []int{100, 1000, 10000} {
		b.Run(fmt.Sprintf("buffers=%d", n), func(b *testing.B) {
			w := newScaleWorld(b, n)
			for b.Loop() {
				ep, err := w.init.Open(context.Background(), w.desc())
				if err != nil {
					b.Fatal(err)
				}
				if m, vm := ep.(*shm.Endpoint).Granted(); m+vm != n {
					b.Fatalf("%d granted, want %d", m+vm, n)
				}
				ep.Close()
			}
		})
	}
}

// BenchmarkScaleUpdate is the cost of a register/unregister cycle beside
// n buffers at the target and at a peer that follows it: the
// registration, the peer's Update and the new buffer's grant, the
// unregistration (a revoke the peer answers) and the peer's Update.
func BenchmarkScaleUpdate(b *testing.B) {
	for _, n := range []int{1, 100, 10000, 100000} {
		b.Run(fmt.Sprintf("buffers=%d", n), func(b *testing.B) {
			w := newScaleWorld(b, n)
			ep, err := w.init.Open(context.Background(), w.desc())
			if err != nil {
				b.Fatal(err)
			}
			defer ep.Close()
			first := true
			for b.Loop() {
				nb, r := w.add(b, n)
				ep.Update(w.desc())
				if first {
					// Granted walks every mapping: once, out of the loop's cost.
					if m, vm := ep.(*shm.Endpoint).Granted(); m+vm != n+1 {
						b.Fatalf("%d granted after a registration, want %d", m+vm, n+1)
					}
					first = false
				}
				w.remove(b, nb, r)
				ep.Update(w.desc())
			}
			if m, vm := ep.(*shm.Endpoint).Granted(); m+vm != n {
				b.Fatalf("%d granted after the cycles, want %d", m+vm, n)
			}
		})
	}
}

// TestUpdateFollowsChunks: a peer that follows a segment of many buffers
// over shm is granted each buffer a registration adds, moves bytes
// through it, and drops it when it is unregistered; and a cycle of both
// (the target's registration and revoke, the peer's two updates)
// allocates what the changed chunk needs, not a copy of every buffer of
// the segment (about 400 bytes a buffer before: a map of the granted
// addresses and the flattened descriptor on each update).
func TestUpdateFollowsChunks(t *testing.T) {
	const n = 3000
	w := newScaleWorld(t, n)
	e, err := w.init.Open(context.Background(), w.desc())
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ep := e.(*shm.Endpoint)
	granted := func(want int) {
		t.Helper()
		if m, vm := ep.Granted(); m+vm != want {
			t.Fatalf("%d granted, want %d", m+vm, want)
		}
	}
	granted(n)
	local := make([]byte, 4096)
	for i := range 3 {
		nb, r := w.add(t, n)
		ep.Update(w.desc())
		granted(n + 1)
		for j := range local {
			local[j] = byte(i*7 + j)
		}
		s := transport.Slice{Op: transport.Write, Local: unsafe.Pointer(&local[0]), Remote: uint64(nb.Addr), Length: 4096, Token: 1}
		if err := ep.Copy(&s); err != nil {
			t.Fatalf("cycle %d: a write to the new buffer: %v", i, err)
		}
		if !bytes.Equal(w.mem[n*4096:(n+1)*4096], local) {
			t.Fatalf("cycle %d: the new buffer does not hold what was written", i)
		}
		w.remove(t, nb, r)
		ep.Update(w.desc())
		granted(n)
		if err := ep.Copy(&s); !errors.Is(err, transport.ErrRange) {
			t.Fatalf("cycle %d: a write to the unregistered buffer: %v, want ErrRange", i, err)
		}
	}
	const cycles = 50
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	for range cycles {
		nb, r := w.add(t, n)
		ep.Update(w.desc())
		w.remove(t, nb, r)
		ep.Update(w.desc())
	}
	runtime.ReadMemStats(&m1)
	if per := (m1.TotalAlloc - m0.TotalAlloc) / cycles; per > 64<<10 {
		t.Fatalf("a cycle beside %d buffers allocated %d bytes: more than the changed chunk's tables", n, per)
	}
	granted(n)
}
