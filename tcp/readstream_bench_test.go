package tcp

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/proccpu"
	"github.com/moonring/moonring/transport"
)

// BenchmarkReadStream keeps depth READs of a block size in flight over one
// endpoint (the default rails) between random blocks of two 64 MiB
// buffers, target and initiator in this process: the transport alone, as
// the KV pattern's READs (32 KiB) and its contig row's (1 MiB) reach it.
// cpu-ms/GB is this process's CPU (both sides) per GB moved.
//
//	go test -run '^$' -bench ReadStream -benchtime 4s ./tcp/
func BenchmarkReadStream(b *testing.B) {
	for _, sz := range []struct {
		size, depth int
	}{{32 << 10, 256}, {1 << 20, 16}} {
		b.Run(fmt.Sprintf("size=%dK", sz.size>>10), func(b *testing.B) {
			const span = 64 << 20
			targ := newSide(b, Config{})
			remote := targ.register(b, targ.alloc(b, span, 3), true)
			init := newSide(b, Config{})
			local := init.alloc(b, span, 0)
			ep, err := init.tr.Open(b.Context(), targ.desc("", remote))
			if err != nil {
				b.Fatal(err)
			}
			defer ep.Close()
			blocks := span / sz.size
			rng := rand.New(rand.NewPCG(1, 2))
			comp := make(chanCompleter, sz.depth)
			sl := make([]transport.Slice, 0, sz.depth)
			post := func(tok uint64) {
				d, s := rng.IntN(blocks), rng.IntN(blocks)
				sl = append(sl, localSlice(transport.Read, local[d*sz.size:(d+1)*sz.size], remote.addr+uint64(s*sz.size), tok))
			}
			flush := func() {
				for len(sl) > 0 {
					k, err := ep.Post(comp, sl)
					if err != nil {
						b.Fatal(err)
					}
					sl = sl[:copy(sl, sl[k:])]
					if len(sl) > 0 {
						time.Sleep(10 * time.Microsecond)
					}
				}
			}
			b.SetBytes(int64(sz.size))
			b.ResetTimer()
			cpu0 := proccpu.Self()
			inflight, sent := 0, 0
			for ; sent < min(sz.depth, b.N); sent++ {
				post(uint64(sent))
				inflight++
			}
			flush()
			for inflight > 0 {
				x := <-comp
				if x.err != nil {
					b.Fatal(x.err)
				}
				inflight--
				if sent < b.N {
					post(uint64(sent))
					sent++
					inflight++
				}
				if len(comp) == 0 || len(sl) >= 16 {
					flush()
				}
			}
			cpu := proccpu.Self() - cpu0
			gb := float64(b.N) * float64(sz.size) / 1e9
			b.ReportMetric(gb/b.Elapsed().Seconds(), "GB/s")
			b.ReportMetric(cpu.Seconds()*1e3/gb, "cpu-ms/GB")
		})
	}
}
