package moonring_test

import (
	"fmt"
	"testing"

	"github.com/moonring/moonring"
)

// drainCQ reaps every ready completion and fails the benchmark on an error.
func drainCQ(b *testing.B, r *moonring.Ring, cqes []moonring.Completion) int {
	n := r.PeekBatch(cqes)
	for i := range n {
		if err := cqes[i].Err(); err != nil {
			b.Fatalf("completion %d: %v", cqes[i].UserData, err)
		}
	}
	r.Advance(n)
	return n
}

// BenchmarkRingNop submits Nops in batches and reaps their completions
// through the poller: the cost of the ring itself.
func BenchmarkRingNop(b *testing.B) {
	for _, batch := range []int{1, 32} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			e := newEngine(b, b.Name())
			r, err := e.NewRing(moonring.RingConfig{Entries: 1024})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			es := make([]moonring.Entry, batch)
			cqes := make([]moonring.Completion, 1024)
			inflight := 0
			b.ReportAllocs()
			for b.Loop() {
				todo := es
				for len(todo) > 0 {
					if inflight+len(todo) <= 1024 {
						n, _ := r.Submit(todo)
						todo = todo[n:]
						inflight += n
					}
					inflight -= drainCQ(b, r, cqes)
				}
			}
			for inflight > 0 {
				inflight -= drainCQ(b, r, cqes)
			}
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "req/s")
		})
	}
}

// BenchmarkChanBaseline hands requests to a goroutine and completions back
// through buffered channels: the same hand-off as BenchmarkRingNop.
func BenchmarkChanBaseline(b *testing.B) {
	for _, batch := range []int{1, 32} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			sub := make(chan moonring.Entry, 1024)
			done := make(chan moonring.Completion, 2048)
			go func() {
				for e := range sub {
					done <- moonring.Completion{UserData: e.UserData, Status: moonring.COMPLETED}
				}
				close(done)
			}()
			inflight := 0
			reap := func() {
				for {
					select {
					case <-done:
						inflight--
					default:
						return
					}
				}
			}
			for b.Loop() {
				for i := 0; i < batch; i++ {
					for inflight >= 1024 {
						reap()
					}
					sub <- moonring.Entry{UserData: uint64(i)}
					inflight++
				}
				reap()
			}
			close(sub)
			for range done {
			}
			b.ReportMetric(float64(b.N*batch)/b.Elapsed().Seconds(), "req/s")
		})
	}
}

var sizes = []struct {
	name  string
	bytes int
	depth int
}{
	{"4KiB", 4 << 10, 32},
	{"64KiB", 64 << 10, 16},
	{"1MiB", 1 << 20, 4},
	{"64MiB", 64 << 20, 2},
}

// BenchmarkLocalWrite writes from one engine's buffer into another
// engine's of the same process through a ring, with depth requests in
// flight.
func BenchmarkLocalWrite(b *testing.B) {
	for _, sz := range sizes {
		b.Run("size="+sz.name, func(b *testing.B) {
			a := newEngine(b, b.Name()+"-a")
			t := newEngine(b, b.Name()+"-t")
			src, err := a.Alloc(sz.bytes, "cpu:0")
			if err != nil {
				b.Fatal(err)
			}
			defer a.Free(src)
			dst, err := t.Alloc(sz.bytes, "cpu:0")
			if err != nil {
				b.Fatal(err)
			}
			defer t.Free(dst)
			fill(src, 3)
			id, err := a.RegisterLocalMemory(src, "cpu:0", false)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := t.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
				b.Fatal(err)
			}
			seg, err := a.OpenSegment(b.Context(), t.Name())
			if err != nil {
				b.Fatal(err)
			}
			r, err := a.NewRing(moonring.RingConfig{Entries: 256})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			e := moonring.Entry{Op: moonring.OpWrite, Segment: seg, Buffer: id, Remote: uint64(moonring.AddressOf(dst)), Length: uint64(sz.bytes)}
			cqes := make([]moonring.Completion, 256)
			inflight := 0
			b.SetBytes(int64(sz.bytes))
			b.ReportAllocs()
			for b.Loop() {
				for inflight >= sz.depth {
					inflight -= drainCQ(b, r, cqes)
				}
				if err := r.SubmitOne(&e); err != nil {
					b.Fatal(err)
				}
				inflight++
				inflight -= drainCQ(b, r, cqes)
			}
			for inflight > 0 {
				inflight -= drainCQ(b, r, cqes)
			}
			b.ReportMetric(float64(b.N)*float64(sz.bytes)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

// BenchmarkCopyBaseline is copy() of the sizes BenchmarkLocalWrite moves,
// between the same kind of memory.
func BenchmarkCopyBaseline(b *testing.B) {
	a := newEngine(b, b.Name())
	for _, sz := range sizes {
		b.Run("size="+sz.name, func(b *testing.B) {
			src, err := a.Alloc(sz.bytes, "cpu:0")
			if err != nil {
				b.Fatal(err)
			}
			defer a.Free(src)
			dst, err := a.Alloc(sz.bytes, "cpu:0")
			if err != nil {
				b.Fatal(err)
			}
			defer a.Free(dst)
			fill(src, 3)
			b.SetBytes(int64(sz.bytes))
			for b.Loop() {
				copy(dst, src)
			}
			b.ReportMetric(float64(b.N)*float64(sz.bytes)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}
