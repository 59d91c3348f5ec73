package metadata_test

import (
	"fmt"
	"testing"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// TestMemorySharesChunks: a Chunked descriptor comes back from Get and
// Watch with the publisher's chunks by pointer (no copy per buffer) and
// a header of the reader's own; through a signing store too, whose
// reader checks it.
func TestMemorySharesChunks(t *testing.T) {
	ctx := t.Context()
	inner := metadata.NewMemory()
	defer inner.Close()
	var l segtable.ChunkList
	for i := range 3 * segtable.ChunkSize {
		if err := l.Insert(segtable.BufferDesc{Addr: uint64(i) << 12, Length: 4096, Keys: map[string]string{"tcp": fmt.Sprint(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	d := &segtable.SegmentDesc{Version: 1, Name: "s", Epoch: 1, Endpoints: map[string]string{"tcp": "a:1"}, Chunked: l.Chunks(), Rev: l.Seq()}
	if err := inner.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	ch, err := inner.Watch(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	ev := <-ch
	got, err := inner.Get(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range []*segtable.SegmentDesc{got, ev.Desc} {
		if x.Chunked != l.Chunks() || x.Buffers != nil || x.NumBuffers() != 3*segtable.ChunkSize {
			t.Fatalf("handed out %v, %d buffers flat: not the chunks put", x.Chunked, len(x.Buffers))
		}
	}
	got.Endpoints["tcp"] = "changed"
	if again, _ := inner.Get(ctx, "s"); again.Endpoints["tcp"] != "a:1" || ev.Desc.Endpoints["tcp"] != "a:1" {
		t.Fatal("readers share a header")
	}

	pub, reader := signed(t, inner), signed(t, inner)
	if err := pub.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	rch, err := reader.Watch(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	stored := metadata.MemoryChunks(inner, "s")
	for i := range 5 {
		if i > 0 {
			l.Delete(uint64(i) << 12)
			if err := pub.Put(ctx, &segtable.SegmentDesc{Version: 1, Name: "s", Epoch: 1, Endpoints: map[string]string{"tcp": "a:1"}, Chunked: l.Chunks(), Rev: l.Seq()}); err != nil {
				t.Fatal(err)
			}
			stored = metadata.MemoryChunks(inner, "s")
		}
		ev := <-rch
		if ev.Deleted || ev.Desc.Chunked != stored || ev.Desc.NumBuffers() != 3*segtable.ChunkSize-i {
			t.Fatalf("publish %d: watch handed %+v", i, ev)
		}
		got, err := reader.Get(ctx, "s")
		if err != nil || got.Chunked != stored {
			t.Fatalf("publish %d: Get %v, %v", i, got, err)
		}
	}
	if r := reader.Refused(); r.Forged != 0 || r.Stale != 0 {
		t.Fatalf("refused %+v", r)
	}
}
