package etcd_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

// TestEtcdSharesChunks: a reader's successive Gets and a watch's events
// of a descriptor written in the per-chunk layout share every chunk a
// republish did not change, by pointer (a Get and the watch too), so
// that a Mirror of the next makes entries only for the chunks made; a
// header of their own; nothing shared across epochs (unsigned: the same
// seqs and bytes). Signed, the reader checks each republish by its
// chunks made, and refuses a chunk forged in etcd among those it holds.
func TestEtcdSharesChunks(t *testing.T) {
	srv := etcdtest.Start(t)
	ep := srv.Endpoint()
	for _, signed := range []bool{false, true} {
		t.Run(fmt.Sprintf("signed=%v", signed), func(t *testing.T) {
			prefix := etcdPrefix()
			var pub, rd metadata.Store = newEtcd(t, ep, prefix, 0), newEtcd(t, ep, prefix, 0)
			if signed {
				var err error
				if pub, err = metadata.NewSigned(pub, []byte("k"), nil); err != nil {
					t.Fatal(err)
				}
				if rd, err = metadata.NewSigned(rd, []byte("k"), nil); err != nil {
					t.Fatal(err)
				}
			}
			ctx := t.Context()
			l := testList(t, 1000)
			if err := pub.Put(ctx, chunkedDesc("s", 7, l)); err != nil {
				t.Fatal(err)
			}
			d1, err := rd.Get(ctx, "s")
			if err != nil {
				t.Fatal(err)
			}
			ch, err := rd.Watch(ctx, "s")
			if err != nil {
				t.Fatal(err)
			}
			e1 := next(t, ch).Desc
			if same, all := storetest.SharedChunks(t, d1, e1); same != all || all != l.Chunks().Count() || e1.NumBuffers() != 1000 {
				t.Fatalf("a Get and the first event share %d chunks of %d (%d published)", same, all, l.Chunks().Count())
			}
			d2, err := rd.Get(ctx, "s")
			if err != nil {
				t.Fatal(err)
			}
			if same, all := storetest.SharedChunks(t, d1, d2); same != all {
				t.Fatalf("two Gets share %d chunks of %d", same, all)
			}
			d2.Endpoints["tcp"] = "changed"
			if d3, err := rd.Get(ctx, "s"); err != nil || d3.Endpoints["tcp"] != "10.0.0.1:7000" {
				t.Fatalf("readers share a header: %v", err)
			}
			for i := range 3 {
				before := l.Chunks()
				if err := l.Insert(testBuffer(5000 + i)); err != nil {
					t.Fatal(err)
				}
				lo, hi := l.Chunks().Changed(before)
				want := chunkedDesc("s", 7, l)
				if err := pub.Put(ctx, want); err != nil {
					t.Fatal(err)
				}
				e2 := next(t, ch).Desc
				for e2.NumBuffers() != want.NumBuffers() {
					e2 = next(t, ch).Desc
				}
				for j, b := range e2.AllBuffers() {
					if w := want.AllBuffers()[j]; !segtable.SameBuffer(&b, &w) {
						t.Fatalf("republish %d: buffer %d is %+v, want %+v", i, j, b, w)
					}
				}
				same, all := storetest.SharedChunks(t, e1, e2)
				if made := all - same; made < 1 || made > hi-lo {
					t.Fatalf("republish %d: the event shares %d chunks of %d with the one before; the republish made %d", i, same, all, hi-lo)
				}
				conv := func(b *segtable.BufferDesc) (uint64, bool) { return b.Addr, true }
				m := segtable.NewMirror(nil, e1.Chunked, conv)
				n := 0
				segtable.NewMirror(m, e2.Chunked, func(b *segtable.BufferDesc) (uint64, bool) { n++; return conv(b) })
				if n < 1 || n > (hi-lo)*segtable.ChunkSize {
					t.Fatalf("republish %d: a Mirror made %d entries, for %d chunks made", i, n, hi-lo)
				}
				g, err := rd.Get(ctx, "s")
				if err != nil {
					t.Fatal(err)
				}
				if same, all := storetest.SharedChunks(t, e2, g); same != all {
					t.Fatalf("republish %d: a Get shares %d chunks of %d with the watch's event", i, same, all)
				}
				e1 = e2
			}
			if !signed {
				if err := pub.Delete(ctx, "s", 7); err != nil {
					t.Fatal(err)
				}
				if err := pub.Put(ctx, chunkedDesc("s", 8, l)); err != nil {
					t.Fatal(err)
				}
				ev := next(t, ch)
				for ev.Deleted || ev.Desc.Epoch != 8 {
					ev = next(t, ch)
				}
				if same, _ := storetest.SharedChunks(t, e1, ev.Desc); same != 0 {
					t.Fatalf("%d chunks shared across epochs", same)
				}
				return
			}
			if r := rd.(*metadata.Signed).Refused(); r.Forged != 0 || r.Stale != 0 {
				t.Fatalf("refused %+v", r)
			}
			// A chunk forged under a new seq, its sum in a header that
			// lists every other chunk as before.
			raw := rawEtcd(t, ep)
			hresp, err := raw.Get(ctx, prefix+"s")
			if err != nil || len(hresp.Kvs) != 1 {
				t.Fatalf("raw Get of the header: %v", err)
			}
			var h chunkwire.Header
			if err := json.Unmarshal(hresp.Kvs[0].Value, &h); err != nil || !h.Signed {
				t.Fatalf("header: %v", err)
			}
			c := h.Chunks[len(h.Chunks)/2]
			dir := fmt.Sprintf("%s%d/s/7/", chunkSubtree(prefix), len("s"))
			cresp, err := raw.Get(ctx, fmt.Sprint(dir, c.Seq))
			if err != nil || len(cresp.Kvs) != 1 {
				t.Fatalf("raw Get of chunk %d: %v", c.Seq, err)
			}
			var bufs []segtable.BufferDesc
			if err := json.Unmarshal(cresp.Kvs[0].Value, &bufs); err != nil {
				t.Fatal(err)
			}
			bufs[0].Keys = map[string]string{"tcp": "relay"}
			forged, _ := json.Marshal(bufs)
			seq := uint64(1 << 40)
			if _, err := raw.Put(ctx, fmt.Sprint(dir, seq), string(forged)); err != nil {
				t.Fatal(err)
			}
			h.Chunks[len(h.Chunks)/2] = chunkwire.Chunk{Seq: seq, N: c.N, Sum: chunkwire.Sum(forged), MAC: c.MAC}
			hb, _ := json.Marshal(&h)
			if _, err := raw.Put(ctx, prefix+"s", string(hb)); err != nil {
				t.Fatal(err)
			}
			if _, err := rd.Get(ctx, "s"); !errors.Is(err, metadata.ErrForged) {
				t.Fatalf("Get of a chunk forged among those held: %v, want ErrForged", err)
			}
			ev := next(t, ch)
			for !ev.Deleted {
				ev = next(t, ch)
			}
		})
	}
}
