package moonring_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/proccpu"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// BenchmarkPublish is one register/unregister cycle of a remote-accessible
// buffer (each republishes the segment) with n buffers already registered,
// unsigned and signed (Config.Key) in the same run: what signing adds to a
// publish. The engine publishes its buffers as copy-on-write chunks, which
// the signing store and the Memory store keep by pointer: a cycle copies
// and signs one chunk and the header, so its cost does not grow with n.
// MOONRING_SCALE_MAX bounds n. Beside the wall time it reports the
// process's CPU time per cycle (cpu-ns/op), which other load on the
// machine disturbs less.
func BenchmarkPublish(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 1000, 10000, 100000) {
		for _, mode := range []string{"unsigned", "signed"} {
			b.Run(fmt.Sprintf("buffers=%d/%s", n, mode), func(b *testing.B) {
				cfg := moonring.Config{Metadata: metadata.NewMemory(), TCP: &tcp.Config{Key: []byte("bench key")}}
				if mode == "unsigned" {
					cfg.TCP.Key = nil // the TCP transport's open mode; nothing signed
				}
				e, err := moonring.New(cfg)
				if err != nil {
					b.Fatal(err)
				}
				defer e.Close()
				const size = 4096
				mem := make([]byte, (n+1)*size)
				specs := make([]moonring.BufferSpec, n)
				for i := range specs {
					specs[i] = moonring.BufferSpec{Buf: mem[i*size : (i+1)*size], Location: "cpu:0", Remote: true}
				}
				if _, err := e.RegisterLocalMemoryBatch(specs); err != nil {
					b.Fatal(err)
				}
				last := mem[n*size:]
				ctx := context.Background()
				b.ReportAllocs()
				cpu0 := proccpu.Self()
				for b.Loop() {
					if _, err := e.RegisterLocalMemory(last, "cpu:0", true); err != nil {
						b.Fatal(err)
					}
					if err := e.UnregisterLocalMemory(ctx, last); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64((proccpu.Self()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
			})
		}
	}
}
