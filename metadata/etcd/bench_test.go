package etcd_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/segtable"
)

// BenchmarkEtcdRepublish measures one register-and-republish cycle of an
// engine beside n remote-accessible buffers against a real etcd (one
// member, on this host): a ChunkList.Insert and a Put of the descriptor,
// in the flat layout (Config.FlatLayout: the whole descriptor per
// publish) and in the per-chunk one (the chunks made and the header).
// wire-B/op is what the store sent to etcd per cycle (the requests'
// protobuf sizes), reqs/op its requests. A flat descriptor over etcd's
// request limit cannot be published at all: that case reports it and
// skips.
func BenchmarkEtcdRepublish(b *testing.B) {
	srv := etcdtest.Start(b)
	ep := srv.Endpoint()
	for _, n := range []int{1_000, 10_000, 100_000} {
		for _, layout := range []string{"flat", "chunks"} {
			b.Run(fmt.Sprintf("n=%d/layout=%s", n, layout), func(b *testing.B) {
				var w wire
				s := newCounted(b, ep, etcdPrefix(), &w, layout == "flat")
				ctx := b.Context()
				l := testList(b, n)
				d := chunkedDesc("bench", 1, l)
				if err := s.Put(ctx, d); err != nil {
					if errors.Is(err, segtable.ErrBadDesc) {
						flat, _ := d.Marshal()
						b.Skipf("%d buffers, %d bytes flat: the first Put fails: %v", n, len(flat), err)
					}
					b.Fatal(err)
				}
				w.reset()
				b.ResetTimer()
				for i := range b.N {
					if err := l.Insert(testBuffer(n + 1 + i)); err != nil {
						b.Fatal(err)
					}
					if err := s.Put(ctx, chunkedDesc("bench", 1, l)); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				b.ReportMetric(float64(w.sent.Load())/float64(b.N), "wire-B/op")
				b.ReportMetric(float64(w.reqs.Load())/float64(b.N), "reqs/op")
			})
		}
	}
}
