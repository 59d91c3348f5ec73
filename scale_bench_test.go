package moonring_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/proccpu"
	"github.com/moonring/moonring/metadata"
)

// Cost growth with registered buffers, through the public API only: what
// one request costs as a target holds more buffers, what a register and
// unregister cost as calls go by, and what registering n buffers and
// closing the engine cost as n grows. BENCHMARKS.md has the curves and
// the commands.

const scaleBlock = 4 << 10

// scaleCounts are the registered-buffer counts of the curves;
// MOONRING_SCALE_MAX (a count) leaves out the larger ones.
func scaleCounts(b *testing.B, counts ...int) []int {
	limit := 1 << 30
	if s := os.Getenv("MOONRING_SCALE_MAX"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			b.Fatalf("MOONRING_SCALE_MAX=%q: %v", s, err)
		}
		limit = n
	}
	var out []int
	for _, n := range counts {
		if n <= limit {
			out = append(out, n)
		}
	}
	return out
}

// scaleTarget is an engine with n remote-accessible buffers of scaleBlock
// bytes, one after another in one allocation; the slice returned is that
// memory.
func scaleTarget(b *testing.B, name string, n int) (*moonring.Engine, []byte) {
	return scaleTargetHole(b, name, n, -1)
}

// scaleTargetHole is scaleTarget with n+1 blocks of memory, all but block
// hole registered (none left out when hole < 0: n blocks).
func scaleTargetHole(b *testing.B, name string, n, hole int) (*moonring.Engine, []byte) {
	t, err := moonring.New(moonring.Config{Name: name, Metadata: metadata.NewMemory()})
	if err != nil {
		b.Fatal(err)
	}
	blocks := n
	if hole >= 0 {
		blocks++
	}
	mem, err := t.Alloc(blocks*scaleBlock, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	specs := make([]moonring.BufferSpec, 0, n)
	for i := range blocks {
		if i != hole {
			specs = append(specs, moonring.BufferSpec{Buf: mem[i*scaleBlock : (i+1)*scaleBlock], Location: "cpu:0", Remote: true})
		}
	}
	if _, err := t.RegisterLocalMemoryBatch(specs); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		t.Close()
		t.Free(mem)
	})
	return t, mem
}

// BenchmarkScaleBuffers is 4 KiB WRITEs through a ring, 64 in flight,
// from an engine into another of the same process that has n buffers
// registered: to its last buffer, and to a random one each (a fixed
// sequence). BenchmarkScaleCopy is copy()'s own cost on the same memory,
// the baseline of the random case.
func BenchmarkScaleBuffers(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 100, 10000, 100000) {
		for _, to := range []string{"last", "random"} {
			b.Run(fmt.Sprintf("buffers=%d/to=%s", n, to), func(b *testing.B) {
				t, mem := scaleTarget(b, b.Name()+"-t", n)
				a, err := moonring.New(moonring.Config{Name: b.Name() + "-a", Metadata: t.Config().Metadata})
				if err != nil {
					b.Fatal(err)
				}
				defer a.Close()
				src := make([]byte, 64*scaleBlock)
				id, err := a.RegisterLocalMemory(src, "cpu:0", false)
				if err != nil {
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
				base := uint64(moonring.AddressOf(mem))
				dst := make([]uint64, 1<<16)
				rng := rand.New(rand.NewPCG(1, 2))
				for i := range dst {
					k := n - 1
					if to == "random" {
						k = rng.IntN(n)
					}
					dst[i] = base + uint64(k)*scaleBlock
				}
				cqes := make([]moonring.Completion, 256)
				inflight, i := 0, 0
				b.SetBytes(scaleBlock)
				b.ReportAllocs()
				for b.Loop() {
					for inflight >= 64 {
						inflight -= drainCQ(b, r, cqes)
					}
					e := moonring.Entry{Op: moonring.OpWrite, Segment: seg, Buffer: id, Local: uint64(i%64) * scaleBlock, Remote: dst[i&(len(dst)-1)], Length: scaleBlock}
					if err := r.SubmitOne(&e); err != nil {
						b.Fatal(err)
					}
					i++
					inflight++
					inflight -= drainCQ(b, r, cqes)
				}
				for inflight > 0 {
					inflight -= drainCQ(b, r, cqes)
				}
			})
		}
	}
}

// BenchmarkScaleCopy is copy() of 4 KiB into random blocks of n*4 KiB of
// memory (the sequence BenchmarkScaleBuffers uses): the cache misses that
// are the memory's, not the engine's.
func BenchmarkScaleCopy(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 100, 10000, 100000) {
		b.Run(fmt.Sprintf("buffers=%d", n), func(b *testing.B) {
			mem := make([]byte, n*scaleBlock)
			src := make([]byte, 64*scaleBlock)
			dst := make([]int, 1<<16)
			rng := rand.New(rand.NewPCG(1, 2))
			for i := range dst {
				dst[i] = rng.IntN(n) * scaleBlock
			}
			b.SetBytes(scaleBlock)
			i := 0
			for b.Loop() {
				d := dst[i&(len(dst)-1)]
				copy(mem[d:d+scaleBlock], src[(i%64)*scaleBlock:])
				i++
			}
		})
	}
}

// BenchmarkScaleChurn registers and unregisters one buffer, local-only or
// remote-accessible (each of those calls republishes the segment), over
// and over on an engine with n buffers registered: 100,000 cycles in one
// op (run it with -benchtime=1x; MOONRING_CHURN_CYCLES sets another
// count), for every kind (remote beside many ran 10,000 when its cycle
// took milliseconds; 10,000 cycles of a few KB beside 100k buffers now
// hold no collection of their 85 MB heap, and cpu-µs/cycle-all then left
// the collector's share out). It reports the time per cycle of the first and last 1,000 cycles and
// the live heap before and after (and the process's CPU time per cycle,
// which other load disturbs less): both stay flat, and so does the time
// per cycle from 1 to 100k buffers (each publish copies and, signed,
// signs one chunk of the descriptor, see segtable/chunks.go). A window
// of 1,000 cycles holds a collection or not (beside 100k buffers one
// comes every few thousand cycles), so it also reports the CPU time per
// cycle over all the cycles (cpu-µs/cycle-all: the collections' share
// included, in proportion) and the bytes allocated per cycle (B/cycle),
// of which the collections' share follows.
//
// The buffer churned is Go memory, which lies below the engine's Alloc'd
// memory, so below every buffer held: each change is at the head of the
// indexes. MOONRING_CHURN_MID=1 adds a kind, remote-mid, that churns a
// block of the held buffers' own memory in the middle of their range
// (its indexes' nodes there are full, where the head's are not).
func BenchmarkScaleChurn(b *testing.B) {
	cycles := 100000
	if s := os.Getenv("MOONRING_CHURN_CYCLES"); s != "" {
		var err error
		if cycles, err = strconv.Atoi(s); err != nil || cycles < 2000 {
			b.Fatalf("MOONRING_CHURN_CYCLES=%q: want a number of at least 2000", s)
		}
	}
	kinds := []string{"local", "remote"}
	if os.Getenv("MOONRING_CHURN_MID") != "" {
		kinds = append(kinds, "remote-mid")
	}
	for _, n := range scaleCounts(b, 1, 10000, 100000) {
		for _, how := range kinds {
			b.Run(fmt.Sprintf("buffers=%d/%s", n, how), func(b *testing.B) {
				var t *moonring.Engine
				buf := make([]byte, scaleBlock)
				if how == "remote-mid" {
					var mem []byte
					t, mem = scaleTargetHole(b, b.Name(), n, n/2)
					buf = mem[n/2*scaleBlock : (n/2+1)*scaleBlock]
				} else {
					t, _ = scaleTarget(b, b.Name(), n)
				}
				ctx := context.Background()
				cycle := func() {
					if _, err := t.RegisterLocalMemory(buf, "cpu:0", how != "local"); err != nil {
						b.Fatal(err)
					}
					if err := t.UnregisterLocalMemory(ctx, buf); err != nil {
						b.Fatal(err)
					}
				}
				heap := func() float64 {
					runtime.GC()
					var ms runtime.MemStats
					runtime.ReadMemStats(&ms)
					return float64(ms.HeapAlloc) / (1 << 20)
				}
				for b.Loop() {
					h0 := heap()
					var m0, m1 runtime.MemStats
					runtime.ReadMemStats(&m0)
					start, cpu := time.Now(), proccpu.Self()
					all := cpu
					for range 1000 {
						cycle()
					}
					first, firstCPU := time.Since(start), proccpu.Self()-cpu
					for range cycles - 2000 {
						cycle()
					}
					start, cpu = time.Now(), proccpu.Self()
					for range 1000 {
						cycle()
					}
					last, lastCPU := time.Since(start), proccpu.Self()-cpu
					allCPU := proccpu.Self() - all
					runtime.ReadMemStats(&m1)
					h1 := heap()
					b.ReportMetric(float64(first.Nanoseconds())/1e6, "µs/cycle-first1k")
					b.ReportMetric(float64(last.Nanoseconds())/1e6, "µs/cycle-last1k")
					b.ReportMetric(float64(firstCPU.Nanoseconds())/1e6, "cpu-µs/cycle-first1k")
					b.ReportMetric(float64(lastCPU.Nanoseconds())/1e6, "cpu-µs/cycle-last1k")
					b.ReportMetric(float64(allCPU.Nanoseconds())/1e3/float64(cycles), "cpu-µs/cycle-all")
					b.ReportMetric(float64(m1.TotalAlloc-m0.TotalAlloc)/float64(cycles), "B/cycle")
					b.ReportMetric(h0, "MiB-heap-start")
					b.ReportMetric(h1, "MiB-heap-end")
					b.ReportMetric(float64(cycles), "cycles")
				}
			})
		}
	}
}

// BenchmarkScaleRegister registers n buffers of 4 KiB one by one
// (local-only, and remote-accessible: each of those republishes the
// segment), or in one RegisterLocalMemoryBatch, then closes the engine;
// it reports both times. Remote one by one stops at 10k (the store
// copies the whole descriptor on every publish); MOONRING_SCALE_MAX
// bounds n.
func BenchmarkScaleRegister(b *testing.B) {
	for _, n := range scaleCounts(b, 1000, 10000, 100000) {
		for _, how := range []string{"local", "remote", "batch"} {
			if how == "remote" && n > 10000 && os.Getenv("MOONRING_SCALE_REMOTE_ALL") == "" {
				continue
			}
			b.Run(fmt.Sprintf("n=%d/%s", n, how), func(b *testing.B) {
				mem := make([]byte, n*scaleBlock)
				for b.Loop() {
					e, err := moonring.New(moonring.Config{Name: b.Name(), Metadata: metadata.NewMemory()})
					if err != nil {
						b.Fatal(err)
					}
					start := time.Now()
					if how == "batch" {
						specs := make([]moonring.BufferSpec, n)
						for i := range specs {
							specs[i] = moonring.BufferSpec{Buf: mem[i*scaleBlock : (i+1)*scaleBlock], Location: "cpu:0", Remote: true}
						}
						if _, err := e.RegisterLocalMemoryBatch(specs); err != nil {
							b.Fatal(err)
						}
					} else {
						for i := range n {
							if _, err := e.RegisterLocalMemory(mem[i*scaleBlock:(i+1)*scaleBlock], "cpu:0", how == "remote"); err != nil {
								b.Fatal(err)
							}
						}
					}
					reg := time.Since(start)
					start = time.Now()
					if err := e.Close(); err != nil {
						b.Fatal(err)
					}
					closed := time.Since(start)
					b.ReportMetric(float64(reg.Nanoseconds())/float64(n), "ns/register")
					b.ReportMetric(float64(reg.Milliseconds()), "ms-register")
					b.ReportMetric(float64(closed.Milliseconds()), "ms-close")
				}
			})
		}
	}
}
