package moonring_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
)

// Cost-growth curves of issue 19 beside those of scale_bench_test.go and
// storm_bench_test.go: the per-request cost as the open segments, the
// requests in flight and the batch size grow, through the public API
// only (in-process engines, 4 KiB WRITEs). scripts/bench-curves.sh runs
// them all, takes medians, normalizes each curve to its first point and
// plots it; BENCHMARKS.md ("Cost-growth curves") has the figures.
// MOONRING_SCALE_MAX (see scaleCounts) leaves out the larger points.

// curveWriter moves 4 KiB WRITEs through r to the segment seg at remote
// address dst, from the 64 blocks of the local buffer id, keeping up to
// depth of them in flight. While depth are out it blocks in the CQ's Wait
// rather than spin on it as BenchmarkScaleBuffers does: on a machine of
// two vCPUs a spinning caller takes the CPU the poller needs, and each
// request waits out a scheduling slice (measured here under other load:
// 2.7-4.5 µs a request at 64 in flight spinning against 0.24-0.34 µs
// waiting, 43-143 µs against 0.55-0.65 at one in flight). Every
// completion is checked.
type curveWriter struct {
	b        *testing.B
	r        *moonring.Ring
	seg      moonring.SegmentID
	id       moonring.BufferID
	dst      uint64
	dsts     []uint64 // when set, the i-th WRITE goes to dsts[i%len(dsts)] (a power of two) rather than dst
	length   uint64   // of each WRITE; 0 for scaleBlock
	depth    int
	inflight int
	i        int
	cqes     []moonring.Completion
}

// one submits one WRITE, first reaping until fewer than depth are out.
func (w *curveWriter) one() {
	for w.inflight >= w.depth {
		if err := w.r.CQ().Wait(context.Background(), 1); err != nil {
			w.b.Fatal(err)
		}
		w.inflight -= drainCQ(w.b, w.r, w.cqes)
	}
	dst := w.dst
	if w.dsts != nil {
		dst = w.dsts[w.i&(len(w.dsts)-1)]
	}
	n := w.length
	if n == 0 {
		n = scaleBlock
	}
	e := moonring.Entry{Op: moonring.OpWrite, Segment: w.seg, Buffer: w.id, Local: uint64(w.i%64) * scaleBlock, Remote: dst, Length: n}
	if err := w.r.SubmitOne(&e); err != nil {
		w.b.Fatal(err)
	}
	w.i++
	w.inflight++
	w.inflight -= drainCQ(w.b, w.r, w.cqes)
}

// drain reaps every WRITE still in flight.
func (w *curveWriter) drain() {
	for w.inflight > 0 {
		if err := w.r.CQ().Wait(context.Background(), 1); err != nil {
			w.b.Fatal(err)
		}
		w.inflight -= drainCQ(w.b, w.r, w.cqes)
	}
}

// settle moves WRITEs, 1,000 at a time after a pause of 5 ms (which lets
// background goroutines run), until three such rounds in a row allocate
// nothing in the whole process (at most 100 rounds): work an engine does
// in the background after a setup, such as a watch's first fetch of the
// target's descriptor (at 100k buffers a copy of about 48 MB,
// metadata.Memory.Watch), then lands before the timing, not in it.
func (w *curveWriter) settle() {
	var m0, m1 runtime.MemStats
	for i, clean := 0, 0; i < 100 && clean < 3; i++ {
		time.Sleep(5 * time.Millisecond)
		runtime.ReadMemStats(&m0)
		for range 1000 {
			w.one()
		}
		w.drain()
		runtime.ReadMemStats(&m1)
		if clean++; m1.Mallocs != m0.Mallocs {
			clean = 0
		}
	}
}

// curveInitiator is an engine on store with a local-only source buffer of
// 64 blocks and a ring of entries (CQ twice that), all closed in
// b.Cleanup.
func curveInitiator(b *testing.B, name string, store metadata.Store, entries int) (*moonring.Engine, moonring.BufferID, *moonring.Ring) {
	a, err := moonring.New(moonring.Config{Name: name, Metadata: store})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { a.Close() })
	id, err := a.RegisterLocalMemory(make([]byte, 64*scaleBlock), "cpu:0", false)
	if err != nil {
		b.Fatal(err)
	}
	r, err := a.NewRing(moonring.RingConfig{Entries: entries})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { r.Close() })
	return a, id, r
}

// BenchmarkScaleBuffersWaiting is BenchmarkScaleBuffers to the last
// buffer (4 KiB WRITEs, 64 in flight, into an engine of this process with
// n buffers: 1, 100, 10k, 100k) with a caller that waits on the CQ rather
// than spin (see curveWriter), and only once the engines' background work
// after the setup is over (see settle). ns/op is per request.
func BenchmarkScaleBuffersWaiting(b *testing.B) { scaleBuffersWaiting(b, false, scaleBlock) }

// BenchmarkScaleBuffersWaitingRandom is BenchmarkScaleBuffersWaiting to a
// random buffer each (a fixed sequence of 64Ki, as BenchmarkScaleBuffers
// to=random): the lookups of a buffer whose entries are not in the cache.
// It also pays the target memory's own cache misses, which
// BenchmarkScaleCopy measures apart.
func BenchmarkScaleBuffersWaitingRandom(b *testing.B) { scaleBuffersWaiting(b, true, scaleBlock) }

// BenchmarkScaleBuffersWaitingRandomSmall is
// BenchmarkScaleBuffersWaitingRandom with 8-byte WRITEs: the copy's
// cost, and its misses, down to a line of the target's memory, so that
// what grows with the buffers is the engine's.
func BenchmarkScaleBuffersWaitingRandomSmall(b *testing.B) { scaleBuffersWaiting(b, true, 8) }

func scaleBuffersWaiting(b *testing.B, random bool, length uint64) {
	for _, n := range scaleCounts(b, 1, 100, 10000, 100000) {
		b.Run(fmt.Sprintf("buffers=%d", n), func(b *testing.B) {
			t, mem := scaleTarget(b, b.Name()+"-t", n)
			a, id, r := curveInitiator(b, b.Name()+"-a", t.Config().Metadata, 256)
			seg, err := a.OpenSegment(b.Context(), t.Name())
			if err != nil {
				b.Fatal(err)
			}
			dst := uint64(moonring.AddressOf(mem[(n-1)*scaleBlock:]))
			w := &curveWriter{b: b, r: r, seg: seg, id: id, dst: dst, depth: 64, length: length, cqes: make([]moonring.Completion, 256)}
			if random {
				base := uint64(moonring.AddressOf(mem))
				rng := rand.New(rand.NewPCG(1, 2))
				w.dsts = make([]uint64, 1<<16)
				for i := range w.dsts {
					w.dsts[i] = base + uint64(rng.IntN(n))*scaleBlock
				}
			}
			w.settle()
			b.SetBytes(int64(length))
			b.ReportAllocs()
			for b.Loop() { // the buffers registered once
				w.one()
			}
			w.drain()
		})
	}
}

// BenchmarkScaleSegments is the per-request cost to one segment while n
// are open (1, 100, 1k, 10k): an initiator opens n segments, each of a
// distinct target engine of this process, then moves 4 KiB WRITEs, 64 in
// flight, to the last one opened (see curveWriter). ns/op is per request.
//
// The targets are small engines on one shared metadata.Memory store:
// MaxBatches 1 and NotifyQueue 1 (the default batch table and
// notification channel are about 240 KiB an engine, which is the
// engine's own cost, not the segment's), the local transport only, one
// remote-accessible buffer of 4 KiB each, all in one allocation. Each
// target costs its health manager's goroutine and, with the initiator's
// side of its segment (a watch goroutine, table entries), about 150 KiB
// of heap, most of it never touched (the process's RSS at 10k is about
// 450 MiB); the benchmark reports both per target (KiB-heap/target,
// goroutines/target) and the time to open them all (ms-open-all) and the
// last tenth of them (µs/open-last10%). Setting up 10k takes about 10 s
// here; MOONRING_SCALE_MAX bounds n.
func BenchmarkScaleSegments(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 100, 1000, 10000) {
		b.Run(fmt.Sprintf("segments=%d", n), func(b *testing.B) {
			store := metadata.NewMemory()
			b.Cleanup(func() { store.Close() })
			h0, g0 := heapNow(), runtime.NumGoroutine()
			mem := make([]byte, n*scaleBlock)
			targets := make([]*moonring.Engine, n)
			b.Cleanup(func() {
				for _, t := range targets {
					if t != nil {
						t.Close()
					}
				}
			})
			for i := range targets {
				t, err := moonring.New(moonring.Config{Name: fmt.Sprintf("%s-t%d", b.Name(), i), Metadata: store,
					MaxBatches: 1, NotifyQueue: 1, Transports: []string{"local"}})
				if err != nil {
					b.Fatalf("target %d of %d: %v", i, n, err)
				}
				targets[i] = t
				if _, err := t.RegisterLocalMemory(mem[i*scaleBlock:(i+1)*scaleBlock], "cpu:0", true); err != nil {
					b.Fatal(err)
				}
			}
			a, id, r := curveInitiator(b, b.Name()+"-a", store, 256)
			ctx := context.Background()
			var seg moonring.SegmentID
			start := time.Now()
			var tail time.Time
			k := max(1, n/10) // the last tenth
			for i, t := range targets {
				if i == n-k {
					tail = time.Now()
				}
				var err error
				if seg, err = a.OpenSegment(ctx, t.Name()); err != nil {
					b.Fatalf("open %d of %d: %v", i, n, err)
				}
			}
			all, last := time.Since(start), time.Since(tail)
			h1, g1 := heapNow(), runtime.NumGoroutine()
			dst := uint64(moonring.AddressOf(mem[(n-1)*scaleBlock:]))
			w := &curveWriter{b: b, r: r, seg: seg, id: id, dst: dst, depth: 64, cqes: make([]moonring.Completion, 256)}
			w.settle()
			b.SetBytes(scaleBlock)
			b.ReportAllocs()
			// b.Loop, so the targets are set up once: the 64 WRITEs still
			// out when it ends are reaped untimed.
			for b.Loop() {
				w.one()
			}
			w.drain()
			b.ReportMetric(float64(all.Microseconds())/1e3, "ms-open-all")
			b.ReportMetric(float64(last.Nanoseconds())/1e3/float64(k), "µs/open-last10%")
			b.ReportMetric(float64(h1-min(h0, h1))/float64(n)/1024, "KiB-heap/target")
			b.ReportMetric(float64(g1-g0)/float64(n), "goroutines/target")
		})
	}
}

// BenchmarkScaleDepth is the per-request cost as the requests in flight
// grow (1, 16, 64, 256, 4k, 64k, 100k; 64 is the other curves' depth):
// 4 KiB WRITEs through one ring into an engine of this process with one
// buffer, the caller keeping depth of them submitted and not yet reaped
// (see curveWriter). The ring's SQ is the smallest power of two that
// holds depth (at least 256, what the other curves use) and its CQ twice
// that. ns/op is per request, its time to be submitted, moved and reaped
// at that depth; req/s is the same figure inverted. Each point costs its
// ring (at 100k: 128Ki SQ entries of 64 bytes, 256Ki CQ entries of 24,
// an in-flight table of 128Ki); MOONRING_SCALE_MAX bounds depth.
func BenchmarkScaleDepth(b *testing.B) {
	for _, depth := range scaleCounts(b, 1, 16, 64, 256, 4096, 65536, 100000) {
		b.Run(fmt.Sprintf("depth=%d", depth), func(b *testing.B) {
			t, mem := scaleTarget(b, b.Name()+"-t", 1)
			entries := 256
			for entries < depth {
				entries <<= 1
			}
			a, id, r := curveInitiator(b, b.Name()+"-a", t.Config().Metadata, entries)
			seg, err := a.OpenSegment(b.Context(), t.Name())
			if err != nil {
				b.Fatal(err)
			}
			w := &curveWriter{b: b, r: r, seg: seg, id: id, dst: uint64(moonring.AddressOf(mem)), depth: depth, cqes: make([]moonring.Completion, 256)}
			w.settle()
			b.SetBytes(scaleBlock)
			b.ReportAllocs()
			b.ResetTimer()
			// b.N, not b.Loop: the WRITEs still out at the end are
			// reaped inside the timing (at 100k, a good part of a short
			// run), so the setup runs again for each b.N tried.
			for range b.N {
				w.one()
			}
			w.drain()
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
		})
	}
}

// BenchmarkScaleBatch is the per-task cost as a batch grows (1, 32, 1k,
// 32k, 1M tasks of 4 KiB): one op is AllocateBatchID, one SubmitTransfer
// of every task (WRITEs from the 64 blocks of a registered buffer named
// by address, as Mooncake names them, to the one buffer of an engine of
// this process), WaitBatch, GetBatchTransferStatus (every task checked)
// and FreeBatchID. ns/task and allocs/task are
// per task (ns/op and allocs/op per batch). The requests are built once
// per size (at 1M, about 100 MiB of TransferRequest); MOONRING_SCALE_MAX
// bounds the size.
func BenchmarkScaleBatch(b *testing.B) {
	for _, size := range scaleCounts(b, 1, 32, 1024, 32768, 1<<20) {
		b.Run(fmt.Sprintf("tasks=%d", size), func(b *testing.B) {
			t, mem := scaleTarget(b, b.Name()+"-t", 1)
			a, err := moonring.New(moonring.Config{Name: b.Name() + "-a", Metadata: t.Config().Metadata})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { a.Close() })
			src := make([]byte, 64*scaleBlock)
			if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
				b.Fatal(err)
			}
			seg, err := a.OpenSegment(b.Context(), t.Name())
			if err != nil {
				b.Fatal(err)
			}
			reqs := make([]moonring.TransferRequest, size)
			for i := range reqs {
				reqs[i] = moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src[(i%64)*scaleBlock:]),
					TargetID: seg, TargetOffset: uint64(moonring.AddressOf(mem)), Length: scaleBlock}
			}
			ctx := context.Background()
			sts := make([]moonring.TransferStatus, size)
			batch := func() {
				id, err := a.AllocateBatchID(size)
				if err != nil {
					b.Fatal(err)
				}
				if err := a.SubmitTransfer(id, reqs); err != nil {
					b.Fatal(err)
				}
				if err := a.WaitBatch(ctx, id); err != nil {
					b.Fatal(err)
				}
				if n, err := a.GetBatchTransferStatus(id, sts); err != nil || n != size {
					b.Fatalf("status of %d tasks: %d, %v", size, n, err)
				}
				for i := range sts {
					if sts[i].Status != moonring.COMPLETED {
						b.Fatalf("task %d: %+v", i, sts[i])
					}
				}
				if err := a.FreeBatchID(id); err != nil {
					b.Fatal(err)
				}
			}
			batch() // the batch ring made, the task table grown
			b.SetBytes(int64(size) * scaleBlock)
			b.ReportAllocs()
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			for b.Loop() {
				batch()
			}
			runtime.ReadMemStats(&m1)
			tasks := float64(b.N) * float64(size)
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/tasks, "ns/task")
			b.ReportMetric(float64(m1.Mallocs-m0.Mallocs)/tasks, "allocs/task")
		})
	}
}
