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

func newSteadyPost(t testing.TB, op transport.Op) *steadyPost { return newSteadyBatch(t, op, 1) }

// newSteadyBatch is newSteadyPost with n 4 KiB slices posted at once, each
// on its own block: the frames go out pipelined, many to a writev.
func newSteadyBatch(t testing.TB, op transport.Op, n int) *steadyPost {
	return newSteadySized(t, op, n, 4096)
}

// newSteadySized is newSteadyBatch with slices of size bytes.
func newSteadySized(t testing.TB, op transport.Op, n, size int) *steadyPost {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, (n+1)*size, 0), true)
	init := newSide(t, Config{Rails: 1})
	ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep.Close() })
	local := init.alloc(t, n*size, 7)
	sp := &steadyPost{ep: ep, comp: make(chanCompleter, n), timer: time.NewTimer(hang)}
	for i := range n {
		sp.s = append(sp.s, localSlice(op, local[i*size:(i+1)*size], remote.addr+uint64(i+1)*uint64(size), uint64(i+1)))
	}
	return sp
}

// one moves the slices (one, or a batch) and waits for them; it counts
// failures rather than formatting them, so that only the transport's
// allocations are measured.
func (sp *steadyPost) one() {
	if n, err := sp.ep.Post(sp.comp, sp.s); n != len(sp.s) || err != nil {
		sp.fails++
		return
	}
	sp.timer.Reset(hang)
	for range sp.s {
		select {
		case c := <-sp.comp:
			if c.err != nil {
				sp.fails++
			}
		case <-sp.timer.C:
			sp.fails++ // hang detector
			return
		}
	}
}

// TestPostAllocs: in steady state, a 4 KiB WRITE (and READ) posted and
// completed over an open endpoint allocates nothing, anywhere: AllocsPerRun
// counts the whole process, so the initiator's sender and receiver and the
// target's connection goroutine are measured too. So do 64 slices posted
// at once (their frames gathered into writevs of up to 128 iovecs, their
// responses batched by the target): unix.Writev made its iovec array on the
// heap per call past eight iovecs, about one allocation per 17 requests in
// the 4 KiB WRITE benchmark.
func TestPostAllocs(t *testing.T) {
	for _, batch := range []int{1, 64} {
		for _, op := range []transport.Op{transport.Write, transport.Read} {
			sp := newSteadyBatch(t, op, batch)
			for range max(50, 200/batch) { // warm up: connections, buffers, the runtime's caches
				sp.one()
			}
			allocs := testing.AllocsPerRun(max(100, 500/batch), sp.one)
			if sp.fails != 0 {
				t.Fatalf("op %d, %d at a time: %d slices failed or hung", op, batch, sp.fails)
			}
			if allocs != 0 && countAllocs(t) {
				t.Errorf("op %d: %v allocations per batch of %d slices of 4 KiB, want 0", op, allocs, batch)
			}
		}
	}
}

// TestPostAllocsLarge: batches of 32 KiB slices allocate nothing either.
// Their WRITEs go out as group frames and the target reads their payloads
// straight into the buffer (group.go); their READs' answers are read by
// read plans (readplan.go), several to a readv.
func TestPostAllocsLarge(t *testing.T) {
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		sp := newSteadySized(t, op, 32, 32<<10)
		for range 50 {
			sp.one()
		}
		allocs := testing.AllocsPerRun(100, sp.one)
		if sp.fails != 0 {
			t.Fatalf("op %d: %d slices failed or hung", op, sp.fails)
		}
		if allocs != 0 && countAllocs(t) {
			t.Errorf("op %d: %v allocations per batch of 32 slices of 32 KiB, want 0", op, allocs)
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

// countAllocs reports whether allocations are counted in this build: not
// under -race, whose sync.Pool drops a quarter of what is put, at random
// and by design, so that the target's pooled buffers (server.go's ins and
// outs) are made again now and then. make test runs the tests that count
// them again without -race.
func countAllocs(t testing.TB) bool {
	if raceEnabled {
		t.Log("allocations not counted under -race (its sync.Pool drops items at random); make test counts them without it")
		return false
	}
	return true
}
