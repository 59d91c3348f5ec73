package moonring_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// BenchmarkPublish is one register/unregister cycle of a remote-accessible
// buffer (each republishes the segment) with n buffers already registered,
// unsigned and signed (Config.Key) in the same run: what signing adds to a
// publish. The buffers of a signed descriptor keep their MACs across
// republishes, so a cycle signs one buffer and hashes the others' MACs.
func BenchmarkPublish(b *testing.B) {
	for _, n := range []int{1, 1000, 10000} {
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
				b.ResetTimer()
				for b.Loop() {
					if _, err := e.RegisterLocalMemory(last, "cpu:0", true); err != nil {
						b.Fatal(err)
					}
					if err := e.UnregisterLocalMemory(ctx, last); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
