package tcp

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// BenchmarkHighUnderBulk measures a high-class 4 KiB READ, one at a time,
// Post to completion, while low-class 1 MiB WRITEs keep the endpoint's
// rails full (8 in flight over the default 2 rails), and reports its
// median and 99th percentile beside those of the same READ on the idle
// endpoint, measured first in the same run, and of a normal-class READ
// under the same bulk (which takes a rail, behind the WRITEs: what the
// express lane saves; at most 200 of them). ns/op is the high-class
// READ's mean under bulk. go test -run '^$' -bench HighUnderBulk
// -benchtime 2000x -count 3 ./tcp/
func BenchmarkHighUnderBulk(b *testing.B) {
	const bulk, inflight = 1 << 20, 8
	targ := newSide(b, Config{})
	remote := targ.register(b, targ.alloc(b, inflight*bulk+4096, 0), true)
	init := newSide(b, Config{})
	ep, err := init.tr.Open(context.Background(), targ.desc("", remote))
	if err != nil {
		b.Fatal(err)
	}
	defer ep.Close()
	e := ep.(*Endpoint)
	waitFor(b, "the rails up", func() bool { return railsUp(e) })
	local := init.alloc(b, inflight*bulk+8192, 1)
	read := localSlice(transport.Read, local[inflight*bulk:inflight*bulk+4096], remote.addr+inflight*bulk, 0)
	read.Class = transport.ClassHigh
	comp := make(chanCompleter, 1)
	timer := time.NewTimer(hang)
	one := func(s transport.Slice) time.Duration {
		start := time.Now()
		if k, err := ep.Post(comp, []transport.Slice{s}); k != 1 || err != nil {
			b.Fatalf("Post: %d, %v", k, err)
		}
		timer.Reset(hang)
		select {
		case c := <-comp:
			if c.err != nil {
				b.Fatalf("READ: %v", c.err)
			}
		case <-timer.C:
			b.Fatal("hang: a READ did not complete")
		}
		return time.Since(start)
	}
	one(read) // starts the express lane
	expressUp(b, e)
	n := b.N
	idle := make([]time.Duration, 0, n)
	for range n {
		idle = append(idle, one(read))
	}

	// The bulk: a goroutine keeps inflight WRITEs out until stop.
	stop := make(chan struct{})
	ended := make(chan struct{})
	var moved atomic.Int64
	var failed atomic.Value
	bulkComp := make(chanCompleter, inflight)
	go func() {
		defer close(ended)
		post := func(tok uint64) bool {
			i := tok % inflight
			s := localSlice(transport.Write, local[i*bulk:(i+1)*bulk], remote.addr+i*bulk, tok)
			s.Class = transport.ClassLow
			if k, err := ep.Post(bulkComp, []transport.Slice{s}); k != 1 || err != nil {
				failed.Store(fmt.Sprintf("bulk Post: %d, %v", k, err))
				return false
			}
			return true
		}
		out := 0
		for tok := range uint64(inflight) {
			if post(tok) {
				out++
			}
		}
		for out > 0 {
			select {
			case c := <-bulkComp:
				out--
				if c.err != nil {
					failed.Store(fmt.Sprintf("bulk WRITE: %v", c.err))
					continue
				}
				moved.Add(bulk)
				select {
				case <-stop:
					continue
				default:
				}
				if post(c.token + inflight) {
					out++
				}
			case <-time.After(hang):
				failed.Store("hang: the bulk WRITEs")
				return
			}
		}
	}()
	waitFor(b, "the bulk going", func() bool { return moved.Load() >= 2*inflight*bulk })
	under := make([]time.Duration, 0, n)
	start, before := time.Now(), moved.Load()
	b.ResetTimer()
	for range n {
		under = append(under, one(read))
	}
	b.StopTimer()
	rate := float64(moved.Load()-before) / time.Since(start).Seconds()
	normalRead := read
	normalRead.Class = transport.ClassNormal
	normal := make([]time.Duration, 0, min(n, 200))
	for range cap(normal) {
		normal = append(normal, one(normalRead))
	}
	close(stop)
	<-ended
	if f := failed.Load(); f != nil {
		b.Fatal(f)
	}
	pct := func(d []time.Duration, p int) float64 {
		slices.Sort(d)
		return float64(d[(len(d)-1)*p/100].Nanoseconds()) / 1e3
	}
	b.ReportMetric(pct(idle, 50), "idle-p50-us")
	b.ReportMetric(pct(idle, 99), "idle-p99-us")
	b.ReportMetric(pct(under, 50), "high-p50-us")
	b.ReportMetric(pct(under, 99), "high-p99-us")
	b.ReportMetric(pct(normal, 50), "normal-p50-us")
	b.ReportMetric(pct(normal, 99), "normal-p99-us")
	b.ReportMetric(rate/(1<<20), "bulk-MiB/s")
}
