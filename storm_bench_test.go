package moonring_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// The open storm (issue 19): n engines open one target over TCP at the same
// moment, through the public API. It is how a prefill fleet finds a decode
// node after a restart: Mooncake's took about 96 s for 240 peers (its PR
// #2793). BENCHMARKS.md has the figures and the command.

// BenchmarkOpenStorm makes a target and n initiator engines in this process
// (MOONRING_STORM_PEERS, default 1000; each with the TCP transport, one
// rail, one shared metadata store and segment key), then releases them all
// at once: each opens the target and moves one 4 KiB READ, so its
// connection is up and proven. It reports the time until the last one is
// done, the per-peer open time's p50 and p99, and what the peers cost the
// process while they stay connected and idle: heap and goroutines per peer
// (both sides, since both are in this process) and the target's TCP
// connections. Each peer connects from 127.0.0.1, so the target's
// per-source handshake bound is lifted (MaxHandshakesPerSource -1: a
// fleet's peers come from their own hosts); its bound on handshakes in
// all (MaxHandshakes, 64) stays as it is.
func BenchmarkOpenStorm(b *testing.B) {
	n := 1000
	if s := os.Getenv("MOONRING_STORM_PEERS"); s != "" {
		var err error
		if n, err = strconv.Atoi(s); err != nil || n < 1 {
			b.Fatalf("MOONRING_STORM_PEERS=%q: want a count", s)
		}
	}
	for b.Loop() {
		stormOnce(b, n)
	}
}

func stormOnce(b *testing.B, n int) {
	key := []byte("open storm key")
	store := metadata.NewMemory()
	defer store.Close()
	target, err := moonring.New(moonring.Config{Name: "storm-target", Metadata: store, Key: key, Transports: []string{"tcp"},
		TCP: &tcp.Config{MaxHandshakesPerSource: -1}})
	if err != nil {
		b.Fatal(err)
	}
	defer target.Close()
	mem, err := target.Alloc(1<<20, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	defer target.Free(mem)
	if _, err := target.RegisterLocalMemory(mem, "cpu:0", true); err != nil {
		b.Fatal(err)
	}
	base := uint64(moonring.AddressOf(mem))

	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	peers := make([]*moonring.Engine, n)
	rings := make([]*moonring.Ring, n)
	bufs := make([][]byte, n)
	ids := make([]moonring.BufferID, n)
	defer func() {
		for _, p := range peers {
			if p != nil {
				p.Close()
			}
		}
	}()
	for i := range peers {
		p, err := moonring.New(moonring.Config{Name: fmt.Sprintf("storm-peer-%d", i), Metadata: store, Key: key, Transports: []string{"tcp"},
			TCP: &tcp.Config{Rails: 1}})
		if err != nil {
			b.Fatalf("peer %d of %d: %v", i, n, err)
		}
		peers[i] = p
		bufs[i] = make([]byte, 4096)
		if ids[i], err = p.RegisterLocalMemory(bufs[i], "cpu:0", false); err != nil {
			b.Fatal(err)
		}
		// A small ring of its own: the batch API's rings are sized for
		// thousands of tasks, which is the peer's own cost, not the
		// connection's.
		if rings[i], err = p.NewRing(moonring.RingConfig{Entries: 4}); err != nil {
			b.Fatal(err)
		}
	}
	h0, g0 := heap(), runtime.NumGoroutine()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	took := make([]time.Duration, n)
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, p := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			t0 := time.Now()
			seg, err := p.OpenSegment(ctx, "storm-target")
			if err == nil {
				err = rings[i].SubmitOne(&moonring.Entry{Op: moonring.OpRead, Segment: seg, Buffer: ids[i], Remote: base, Length: 4096})
			}
			if err == nil {
				err = rings[i].CQ().Wait(ctx, 1)
			}
			if err == nil {
				var c [1]moonring.Completion
				if rings[i].PeekBatch(c[:]) != 1 {
					err = fmt.Errorf("no completion after Wait")
				} else {
					err = c[0].Err()
				}
			}
			took[i], errs[i] = time.Since(t0), err
		}()
	}
	t0 := time.Now()
	close(start)
	wg.Wait()
	all := time.Since(t0)
	for i, err := range errs {
		if err != nil {
			b.Fatalf("peer %d: %v", i, err)
		}
	}
	h1, g1 := heap(), runtime.NumGoroutine()
	slices.Sort(took)
	b.ReportMetric(all.Seconds(), "s-all-open")
	b.ReportMetric(float64(took[n/2].Microseconds())/1e3, "ms-open-p50")
	b.ReportMetric(float64(took[n*99/100].Microseconds())/1e3, "ms-open-p99")
	b.ReportMetric(float64(h1-min(h0, h1))/float64(n)/1024, "KiB-heap/peer")
	b.ReportMetric(float64(g1-g0)/float64(n), "goroutines/peer")
	b.ReportMetric(float64(n), "peers")
}
