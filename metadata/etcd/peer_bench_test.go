package etcd_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/proccpu"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/segtable"
)

// BenchmarkEtcdPeerRepublish is a register/unregister cycle of a
// publisher beside n buffers, in the per-chunk layout, as a peer that
// watches the name takes it: its store's watch reads the header and the
// chunks it lacks, a reader (signed: metadata.Signed, checking each
// descriptor) hands it on, and the peer makes its table of the buffers
// (a segtable.Mirror, made from the last one, as Segment.SetDesc does).
// Each step is timed until the peer has the descriptor. cpu-ns/op is
// the process's CPU per cycle (the publisher's store, the peer's, the
// peer's checks and tables; etcd itself is another process): what one
// registration costs a peer that watches through etcd.
func BenchmarkEtcdPeerRepublish(b *testing.B) {
	srv := etcdtest.Start(b)
	ep := srv.Endpoint()
	for _, n := range []int{1_000, 10_000, 100_000} {
		for _, mode := range []string{"unsigned", "signed"} {
			b.Run(fmt.Sprintf("n=%d/%s", n, mode), func(b *testing.B) {
				prefix := etcdPrefix()
				var w wire
				var pub, rd metadata.Store = newCounted(b, ep, prefix, &w, false), newCounted(b, ep, prefix, &w, false)
				if mode == "signed" {
					var err error
					if pub, err = metadata.NewSigned(pub, []byte("k"), nil); err != nil {
						b.Fatal(err)
					}
					if rd, err = metadata.NewSigned(rd, []byte("k"), nil); err != nil {
						b.Fatal(err)
					}
				}
				ctx := b.Context()
				l := testList(b, n)
				if err := pub.Put(ctx, chunkedDesc("bench", 1, l)); err != nil {
					b.Fatal(err)
				}
				ch, err := rd.Watch(ctx, "bench")
				if err != nil {
					b.Fatal(err)
				}
				conv := func(b *segtable.BufferDesc) (uint64, bool) { return b.Addr, true }
				var m *segtable.Mirror[uint64]
				take := func(want int) {
					for {
						select {
						case ev, ok := <-ch:
							if !ok {
								b.Fatal("watch closed")
							}
							if ev.Deleted {
								b.Fatalf("watch: deleted (refused?)")
							}
							m = segtable.NewMirror(m, segtable.ChunksOf(ev.Desc), conv)
							if m.Len() == want {
								return
							}
						case <-time.After(30 * time.Second):
							b.Fatalf("the peer did not take a descriptor of %d buffers", want)
						}
					}
				}
				take(n)
				extra := testBuffer(n + 1)
				b.ReportAllocs()
				cpu0 := proccpu.Self()
				for b.Loop() {
					if err := l.Insert(extra); err != nil {
						b.Fatal(err)
					}
					if err := pub.Put(ctx, chunkedDesc("bench", 1, l)); err != nil {
						b.Fatal(err)
					}
					take(n + 1)
					l.Delete(extra.Addr)
					if err := pub.Put(ctx, chunkedDesc("bench", 1, l)); err != nil {
						b.Fatal(err)
					}
					take(n)
				}
				b.ReportMetric(float64((proccpu.Self()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
			})
		}
	}
}
