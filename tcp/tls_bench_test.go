package tcp

import (
	"bytes"
	"context"
	"fmt"
	"testing"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// BenchmarkTLS compares the plain transport with AutoTLS over loopback:
// pipelined WRITEs and READs of 64 KiB and 1 MiB (about 4 MiB in flight,
// spread over the default two rails), data checked after the timed loop.
// Both modes run in one invocation so that their ratio is a same-run
// figure:
//
//	go test -run '^$' -bench BenchmarkTLS -benchtime 1s -count 3 ./tcp/
func BenchmarkTLS(b *testing.B) {
	const arena = 16 << 20
	for _, mode := range []string{"plain", "tls"} {
		for _, op := range []transport.Op{transport.Write, transport.Read} {
			for _, size := range []int{64 << 10, 1 << 20} {
				name := fmt.Sprintf("%s/%s/%dKiB", mode, map[transport.Op]string{transport.Write: "WRITE", transport.Read: "READ"}[op], size>>10)
				b.Run(name, func(b *testing.B) {
					cfg := Config{AutoTLS: mode == "tls"}
					targ := newSide(b, cfg)
					remote := targ.register(b, targ.alloc(b, arena, 0), true)
					init := newSide(b, cfg)
					ep, err := init.tr.Open(context.Background(), targ.desc("", remote))
					if err != nil {
						b.Fatal(err)
					}
					defer ep.Close()
					local := init.alloc(b, arena, 0)
					testpattern.Fill(local, 1)
					testpattern.Fill(remote.mem, 2)
					slots := arena / size
					window := min(slots/2, max(4, (4<<20)/size))
					comp := make(chanCompleter, window)
					s := make([]transport.Slice, 1)
					b.SetBytes(int64(size))
					b.ResetTimer()
					posted, done := 0, 0
					for done < b.N {
						for posted-done < window && posted < b.N {
							off := (posted % slots) * size
							s[0] = localSlice(op, local[off:off+size], remote.addr+uint64(off), uint64(posted))
							s[0].Rail = uint16(posted)
							if k, err := ep.Post(comp, s); err != nil {
								b.Fatal(err)
							} else if k == 0 {
								break // the rails are full: wait for a completion
							}
							posted++
						}
						if c := <-comp; c.err != nil {
							b.Fatalf("slice %d: %v", c.token, c.err)
						}
						done++
					}
					b.StopTimer()
					b.ReportMetric(float64(size)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
					touched := min(b.N, slots) * size
					if !bytes.Equal(remote.mem[:touched], local[:touched]) {
						b.Fatalf("the %s moved other bytes", name)
					}
				})
			}
		}
	}
}
