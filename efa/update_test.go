//go:build efa && cgo

package efa

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/moonring/moonring/segtable"
)

// keyWorld is a peer's segment of n buffers of a page each, listed in a
// copy-on-write ChunkList as a publisher keeps them, and an endpoint that
// follows it (keys only: Update with the same endpoint string touches no
// libfabric object).
type keyWorld struct {
	list segtable.ChunkList
	ep   *Endpoint
}

const keyBase = 1 << 32

func newKeyWorld(tb testing.TB, n int) *keyWorld {
	tb.Helper()
	w := &keyWorld{ep: &Endpoint{t: &Transport{virt: true}, name: "fi1/tcp/00"}}
	w.ep.peer.Store(&peer{})
	for i := range n {
		w.add(tb, i)
	}
	w.ep.Update(w.desc())
	return w
}

// add lists buffer i, with its key.
func (w *keyWorld) add(tb testing.TB, i int) uint64 {
	addr := uint64(keyBase + i*4096)
	k := remoteKey{key: uint64(i + 1), base: addr, length: 4096}
	if err := w.list.Insert(segtable.BufferDesc{Addr: addr, Length: 4096, Keys: map[string]string{Name: k.String()}}); err != nil {
		tb.Fatal(err)
	}
	return addr
}

func (w *keyWorld) desc() *segtable.SegmentDesc {
	return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "peer", Epoch: 1,
		Endpoints: map[string]string{Name: w.ep.name}, Chunked: w.list.Chunks()}
}

// TestUpdateFollowsChunks: an endpoint that follows a segment of many
// buffers finds the key of each buffer a registration adds, and none once
// it is unregistered; and a cycle of both (two republishes, two Updates)
// allocates what the changed chunk needs, not a table of every buffer
// (about 360 bytes a buffer before: the flattened descriptor, the keys,
// the ranges, and each key parsed again).
func TestUpdateFollowsChunks(t *testing.T) {
	const n = 3000
	w := newKeyWorld(t, n)
	find := func(addr uint64, want uint64) {
		t.Helper()
		kr, ok := w.ep.keys.Load().lookup(addr+100, 8)
		switch {
		case want == 0 && ok:
			t.Fatalf("a key for %#x, listed no more: %+v", addr, kr)
		case want != 0 && (!ok || !kr.ok || kr.addr != addr || kr.key != want):
			t.Fatalf("the key for %#x: %+v %v, want key %d", addr, kr, ok, want)
		}
	}
	for i := range 3 {
		addr := w.add(t, n)
		w.ep.Update(w.desc())
		find(addr, n+1)
		find(keyBase+uint64(i)*4096, uint64(i+1))
		if !w.list.Delete(addr) {
			t.Fatal("not listed")
		}
		w.ep.Update(w.desc())
		find(addr, 0)
		find(keyBase+(n-1)*4096, n)
	}
	const cycles = 50
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	for range cycles {
		addr := w.add(t, n)
		w.ep.Update(w.desc())
		w.list.Delete(addr)
		w.ep.Update(w.desc())
	}
	runtime.ReadMemStats(&m1)
	if per := (m1.TotalAlloc - m0.TotalAlloc) / cycles; per > 64<<10 {
		t.Fatalf("a cycle beside %d buffers allocated %d bytes: more than the changed chunk's tables", n, per)
	}
	find(keyBase+1234*4096, 1235)
}

// BenchmarkUpdateCycle is the cost of following a republish cycle beside
// n buffers: a buffer listed, the endpoint's Update, the buffer unlisted,
// the Update (the publisher's ChunkList changes included).
func BenchmarkUpdateCycle(b *testing.B) {
	for _, n := range []int{1, 10000, 100000} {
		b.Run(fmt.Sprintf("buffers=%d", n), func(b *testing.B) {
			w := newKeyWorld(b, n)
			b.ReportAllocs()
			for b.Loop() {
				addr := w.add(b, n)
				w.ep.Update(w.desc())
				w.list.Delete(addr)
				w.ep.Update(w.desc())
			}
		})
	}
}
