package tcp

import (
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// steadyPost is one 4 KiB slice at a time over an open endpoint: Post,
// then wait for its completion on a preallocated channel.
type steadyPost struct {
	ep    transport.Endpoint
	comp  chanCompleter
	s     []transport.Slice
	timer *time.Timer
	fails int
}

func newSteadyPost(t testing.TB, op transport.Op) *steadyPost {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 64<<10, 0), true)
	init := newSide(t, Config{Rails: 1})
	ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep.Close() })
	local := init.alloc(t, 4096, 7)
	sp := &steadyPost{ep: ep, comp: make(chanCompleter, 1), timer: time.NewTimer(hang)}
	sp.s = []transport.Slice{localSlice(op, local, remote.addr+4096, 1)}
	return sp
}

// one moves one slice; it counts failures rather than formatting them, so
// that only the transport's allocations are measured.
func (sp *steadyPost) one() {
	if n, err := sp.ep.Post(sp.comp, sp.s); n != 1 || err != nil {
		sp.fails++
		return
	}
	sp.timer.Reset(hang)
	select {
	case c := <-sp.comp:
		if c.err != nil {
			sp.fails++
		}
	case <-sp.timer.C:
		sp.fails++ // hang detector
	}
}

// TestPostAllocs: in steady state, a 4 KiB WRITE (and READ) posted and
// completed over an open endpoint allocates nothing, anywhere: AllocsPerRun
// counts the whole process, so the initiator's sender and receiver and the
// target's connection goroutine are measured too.
func TestPostAllocs(t *testing.T) {
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		sp := newSteadyPost(t, op)
		for range 200 { // warm up: connections, buffers, the runtime's caches
			sp.one()
		}
		allocs := testing.AllocsPerRun(500, sp.one)
		if sp.fails != 0 {
			t.Fatalf("op %d: %d slices failed or hung", op, sp.fails)
		}
		if allocs != 0 {
			t.Errorf("op %d: %v allocations per 4 KiB slice, want 0", op, allocs)
		}
	}
}

// BenchmarkPost4K measures one 4 KiB WRITE at a time, Post to completion
// (go test -bench Post4K -benchmem ./tcp/).
func BenchmarkPost4K(b *testing.B) {
	sp := newSteadyPost(b, transport.Write)
	b.ReportAllocs()
	for b.Loop() {
		sp.one()
	}
	if sp.fails != 0 {
		b.Fatalf("%d slices failed or hung", sp.fails)
	}
}
