package metadata_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// BenchmarkHTTPRepublish measures one register-and-republish cycle of an
// engine beside n remote-accessible buffers against a metadata server
// (loopback; dir=disk: its Dir on this host's disk, every change synced;
// dir=none: in memory): a ChunkList.Insert and an HTTP
// store's Put, with the whole document (layout=flat: the server answers
// the chunk requests 404, as an older one does, and the store falls back)
// and as chunks (layout=chunks: the chunks made and the header). The
// server's MaxDescriptor is raised to 16 MiB so that the flat layout can
// publish 100k buffers at all (7.9 MB; the default, 1 MiB, refuses past
// some 13k). wire-B/op is what the store sent per cycle (request bodies),
// reqs/op its requests; a watcher polls the segment meanwhile and
// watch-B/op is what it received (answers' bodies).
func BenchmarkHTTPRepublish(b *testing.B) {
	for _, dir := range []string{"disk", "none"} {
		for _, n := range []int{1_000, 10_000, 100_000} {
			for _, layout := range []string{"flat", "chunks"} {
				b.Run(fmt.Sprintf("dir=%s/n=%d/layout=%s", dir, n, layout), func(b *testing.B) {
					cfg := metadata.ServerConfig{MaxDescriptor: 16 << 20}
					if dir == "disk" {
						cfg.Dir = b.TempDir()
					}
					srv := mustServer(b, cfg)
					wrap := oldServer
					if layout == "chunks" {
						wrap = nil
					}
					c, url := startCounted(b, srv, wrap)
					st, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url, TTL: time.Minute})
					if err != nil {
						b.Fatal(err)
					}
					defer st.Close()
					rd, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url, TTL: time.Minute, PollInterval: time.Millisecond})
					if err != nil {
						b.Fatal(err)
					}
					defer rd.Close()
					ctx := b.Context()
					l := chList(b, n)
					if err := st.Put(ctx, chDesc("bench", 1, l)); err != nil {
						if errors.Is(err, segtable.ErrBadDesc) {
							b.Skipf("the first Put fails: %v", err)
						}
						b.Fatal(err)
					}
					ch, err := rd.Watch(ctx, "bench")
					if err != nil {
						b.Fatal(err)
					}
					<-ch
					c.reset()
					b.ResetTimer()
					for i := range b.N {
						if err := l.Insert(chBuffer(n + 1 + i)); err != nil {
							b.Fatal(err)
						}
						if err := st.Put(ctx, chDesc("bench", 1, l)); err != nil {
							b.Fatal(err)
						}
					}
					b.StopTimer()
					want := n + b.N
					for ev := range ch {
						if ev.Desc.NumBuffers() == want {
							break
						}
					}
					c.mu.Lock()
					reqs := 0
					for k, v := range c.reqs {
						if k[0] == 'P' {
							reqs += v
						}
					}
					c.mu.Unlock()
					b.ReportMetric(float64(c.in.Load())/float64(b.N), "wire-B/op")
					b.ReportMetric(float64(reqs)/float64(b.N), "reqs/op")
					b.ReportMetric(float64(c.out.Load())/float64(b.N), "watch-B/op")
				})
			}
		}
	}
}
