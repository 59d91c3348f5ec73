package metadata_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// TestSignedRefusesRollback: an older republish of the same epoch, which
// verifies (the key holder signed it), is refused by a reader that saw a
// newer one: a buffer withdrawn since does not come back. Get reports it
// absent (ErrNotFound, ErrStale); a watch skips it and keeps the newer.
func TestSignedRefusesRollback(t *testing.T) {
	ctx := t.Context()
	inner := metadata.NewMemory()
	pub, reader := signed(t, inner), signed(t, inner)
	var l segtable.ChunkList
	var revs []*segtable.SegmentDesc
	for i := range 3 {
		if err := l.Insert(segtable.BufferDesc{Addr: uint64(i+1) << 20, Length: 64, Keys: map[string]string{"tcp": fmt.Sprint(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		if i > 0 {
			l.Delete(uint64(i) << 20) // withdrawn
		}
		d := &segtable.SegmentDesc{Version: 1, Name: "r", Epoch: 4, Endpoints: map[string]string{"tcp": "a:1"}, Chunked: l.Chunks(), Rev: l.Seq()}
		if err := pub.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		raw, err := inner.Get(ctx, "r")
		if err != nil {
			t.Fatal(err)
		}
		revs = append(revs, raw)
	}
	ch, err := reader.Watch(ctx, "r")
	if err != nil {
		t.Fatal(err)
	}
	if ev := <-ch; ev.Deleted || ev.Desc.NumBuffers() != 1 || ev.Desc.Rev != revs[2].Rev {
		t.Fatalf("watch: %+v", ev)
	}
	got, err := reader.Get(ctx, "r")
	if err != nil || got.NumBuffers() != 1 {
		t.Fatalf("Get: %v, %v", got, err)
	}
	for _, old := range revs[:2] {
		if err := inner.Put(ctx, old); err != nil { // a replay by whoever can write the store
			t.Fatal(err)
		}
		if _, err := reader.Get(ctx, "r"); !errors.Is(err, metadata.ErrStale) || !errors.Is(err, metadata.ErrNotFound) {
			t.Fatalf("Get of a replayed Rev %d: %v, want ErrStale and ErrNotFound", old.Rev, err)
		}
	}
	select {
	case ev := <-ch:
		t.Fatalf("watch handed on %+v after replays", ev)
	case <-time.After(50 * time.Millisecond):
	}
	// Two Gets and the watch's: one or two, since a watch hands on only
	// the latest of events it has not read yet (on a busy machine the two
	// replays come as one), perhaps late: wait, with a hang bound.
	for deadline := time.Now().Add(20 * time.Second); reader.Refused().Stale < 3; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("refusals %+v", reader.Refused())
		}
	}
	// The publisher goes on: its next Rev is above the replays.
	if err := pub.Put(ctx, &segtable.SegmentDesc{Version: 1, Name: "r", Epoch: 4, Endpoints: map[string]string{"tcp": "a:1"}, Chunked: l.Chunks(), Rev: l.Seq()}); err != nil {
		t.Fatal(err)
	}
	if ev := <-ch; ev.Deleted || ev.Desc.Rev <= revs[2].Rev {
		t.Fatalf("watch after a new publish: %+v", ev)
	}
	// A Delete and a Put again in the epoch: the Rev still grows.
	if err := pub.Delete(ctx, "r", 4); err != nil {
		t.Fatal(err)
	}
	if err := pub.Put(ctx, &segtable.SegmentDesc{Version: 1, Name: "r", Epoch: 4, Endpoints: map[string]string{"tcp": "a:1"}}); err != nil {
		t.Fatal(err)
	}
	if d, err := reader.Get(ctx, "r"); err != nil || d.NumBuffers() != 0 {
		t.Fatalf("Get after a Delete and a Put: %v, %v", d, err)
	}
}

// TestSignedChunkedShares: a Signed store over Memory keeps the chunks a
// republish did not change, by pointer: the store's descriptor after one
// registration among many shares all chunks but one or two with the one
// before (what makes a republish cost the same whatever the number of
// buffers), and what readers get verifies and equals the list.
func TestSignedChunkedShares(t *testing.T) {
	ctx := t.Context()
	inner := metadata.NewMemory()
	pub, reader := signed(t, inner), signed(t, inner)
	var l segtable.ChunkList
	for i := range 1000 {
		if err := l.Insert(segtable.BufferDesc{Addr: uint64(i) << 12, Length: 4096, Keys: map[string]string{"tcp": fmt.Sprint(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	put := func() *segtable.BufferChunks {
		t.Helper()
		if err := pub.Put(ctx, &segtable.SegmentDesc{Version: 1, Name: "s", Epoch: 1, Chunked: l.Chunks(), Rev: l.Seq()}); err != nil {
			t.Fatal(err)
		}
		return metadata.MemoryChunks(inner, "s")
	}
	a := put()
	if err := l.Insert(segtable.BufferDesc{Addr: 500<<12 + 2048, Length: 64}); !errors.Is(err, segtable.ErrBadDesc) {
		t.Fatalf("overlap: %v", err)
	}
	l.Delete(500 << 12)
	b := put()
	changed := func(a, b *segtable.BufferChunks) int { lo, hi := b.Changed(a); return hi - lo }
	if !a.Signed() || !b.Signed() || changed(a, b) != 1 || a.Count() != b.Count() {
		t.Fatalf("a republish after one change made %d new chunks of %d", changed(a, b), b.Count())
	}
	d, err := reader.Get(ctx, "s")
	if err != nil || d.NumBuffers() != 999 {
		t.Fatalf("Get: %d buffers, %v", d.NumBuffers(), err)
	}
}
