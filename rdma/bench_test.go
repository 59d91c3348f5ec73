//go:build rdma && cgo

package rdma

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/moonring/moonring/transport"
)

// counter completes slices by counting them.
type counter struct {
	n   atomic.Int64
	err atomic.Pointer[error]
}

func (c *counter) Complete(_ uint64, err error) {
	if err != nil {
		e := err // only this copy escapes
		c.err.Store(&e)
	}
	c.n.Add(1)
}

// benchRDMA moves batches of 64 slices of size bytes, posting each batch
// with one Post and polling on the same goroutine, and reports the cgo
// calls per slice.
func benchRDMA(b *testing.B, op transport.Op) {
	for _, size := range []int{4 << 10, 64 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			const batch = 64
			w := newWorldPump(b, Config{QPsPerDevice: 1, Depth: 128}, batch*size, false)
			ep := w.open(b)
			var c counter
			s := make([]transport.Slice, batch)
			for i := range s {
				s[i] = w.slice(op, uint64(i*size), uint64(size), uint64(i+1))
			}
			st0 := w.init.Stats()
			b.SetBytes(int64(size))
			b.ResetTimer()
			posted := 0
			for posted < b.N {
				k := min(batch, b.N-posted)
				want := c.n.Load() + int64(k)
				rest := s[:k]
				for len(rest) > 0 {
					n, err := ep.Post(&c, rest)
					if err != nil {
						b.Fatal(err)
					}
					rest = rest[n:]
					if len(rest) > 0 {
						w.init.Poll()
					}
				}
				for c.n.Load() < want {
					if w.init.Poll() == 0 {
						runtime.Gosched()
					}
				}
				posted += k
			}
			b.StopTimer()
			if e := c.err.Load(); e != nil {
				b.Fatal(*e)
			}
			st := w.init.Stats()
			slices := float64(st.Slices - st0.Slices)
			b.ReportMetric(float64(st.PostCalls-st0.PostCalls)/slices, "posts/slice")
			b.ReportMetric(float64(st.PollCalls-st0.PollCalls)/slices, "polls/slice")
			b.ReportMetric(float64(st.EmptyPolls-st0.EmptyPolls)/slices, "emptypolls/slice")
		})
	}
}

func BenchmarkRDMAWrite(b *testing.B) { benchRDMA(b, transport.Write) }
func BenchmarkRDMARead(b *testing.B)  { benchRDMA(b, transport.Read) }

// The data path allocates nothing: a Post of 64 slices and the polls that
// complete them.
func TestPostPollAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("SKIP: the race detector allocates; make test-rdma runs this test without it")
	}
	w := newWorldPump(t, Config{QPsPerDevice: 2, Depth: 128}, 64<<12, false)
	ep := w.open(t)
	var c counter
	s := make([]transport.Slice, 64)
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		for i := range s {
			s[i] = w.slice(op, uint64(i<<12), 1<<12, uint64(i+1))
			s[i].Rail = uint16(i)
		}
		round := func() {
			want := c.n.Load() + int64(len(s))
			rest := s
			for len(rest) > 0 {
				n, err := ep.Post(&c, rest)
				if err != nil {
					t.Fatal(err)
				}
				rest = rest[n:]
			}
			for c.n.Load() < want {
				w.init.Poll()
			}
		}
		round() // connects nothing new, grows nothing later
		if a := testing.AllocsPerRun(20, round); a != 0 {
			t.Errorf("%v: %.1f allocations per Post of 64 slices and its polls; want 0", op, a)
		}
		if e := c.err.Load(); e != nil {
			t.Fatal(*e)
		}
	}
}
