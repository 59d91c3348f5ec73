package mctcp_test

// alloc_test.go: in steady state a slice costs no allocation, on the
// initiator's Post path (Post, the sender's writev, the receiver's read,
// Complete) nor on the target serving it (both are in this process, and
// AllocsPerRun counts every goroutine's).

import (
	"context"
	"testing"
	"unsafe"

	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// tokenCh is a Completer that allocates nothing.
type tokenCh chan uint64

func (c tokenCh) Complete(token uint64, err error) {
	if err != nil {
		token = ^token
	}
	c <- token
}

// pair is an initiator's endpoint to a target with one registered buffer.
type pair struct {
	ep     transport.Endpoint
	remote uint64
	local  []byte
}

func newPair(t testing.TB, icfg, tcfg mctcp.Config, size int) *pair {
	t.Helper()
	return newPairWith(t, icfg, newT(t, tcfg), size)
}

// newPairWith is newPair with the target made already; it closes it.
func newPairWith(t testing.TB, icfg mctcp.Config, tt *mctcp.Transport, size int) *pair {
	t.Helper()
	it := newT(t, icfg)
	var bufs segtable.Buffers
	mem := make([]byte, size)
	b, err := bufs.Register(mem, "", true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tt.Register(b); err != nil {
		t.Fatal(err)
	}
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "pair", Endpoints: map[string]string{mctcp.Name: tt.Endpoint()},
		Buffers: []segtable.BufferDesc{{Addr: uint64(b.Addr), Length: b.Length}}}
	for k, v := range tt.ExtraEndpoints() {
		desc.Endpoints[k] = v
	}
	ep, err := it.Open(context.Background(), desc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ep.Close()
		it.Close()
		tt.Close()
		bufs.Unregister(context.Background(), b.ID)
	})
	return &pair{ep: ep, remote: uint64(b.Addr), local: make([]byte, size)}
}

func TestPostAllocs(t *testing.T) {
	for _, v := range []int{1, 2} {
		p := newPair(t, mctcp.Config{Rails: 1, Version: v}, mctcp.Config{}, 64<<10)
		c := make(tokenCh, 4)
		s := []transport.Slice{
			{Op: transport.Write, Local: unsafe.Pointer(&p.local[0]), Remote: p.remote, Length: 4096, Token: 1},
			{Op: transport.Read, Local: unsafe.Pointer(&p.local[8192]), Remote: p.remote, Length: 4096, Token: 2},
		}
		run := func() {
			if n, err := p.ep.Post(c, s); n != 2 || err != nil {
				t.Fatalf("Post = %d, %v", n, err)
			}
			for range 2 {
				if tok := <-c; tok > 2 {
					t.Fatalf("slice %d failed", ^tok)
				}
			}
		}
		for range 100 {
			run() // warm up: buffers, timers, the netpoller
		}
		if a := testing.AllocsPerRun(500, run); a > 0.05 {
			t.Errorf("version %d: %.2f allocations per WRITE+READ, want 0", v, a)
		}
	}
}
