package storetest

import (
	"testing"

	"github.com/moonring/moonring/segtable"
)

// SharedChunks returns how many chunks of b are a's, by pointer (a chunk
// is named by the address of its first buffer, which two descriptors
// that hold the same chunk share), and how many b has: what a store's
// reader shares from one descriptor it hands out to the next. Both must
// be Chunked, else it fails t. Safe for concurrent use on descriptors
// nobody changes.
func SharedChunks(t testing.TB, a, b *segtable.SegmentDesc) (same, all int) {
	t.Helper()
	ia, ib := chunkIDs(t, a), chunkIDs(t, b)
	for seq, p := range ib {
		if ia[seq] == p {
			same++
		}
	}
	return same, len(ib)
}

// chunkIDs returns the identity of each chunk of d by seq: the address of
// its first buffer.
func chunkIDs(t testing.TB, d *segtable.SegmentDesc) map[uint64]*segtable.BufferDesc {
	t.Helper()
	if d.Chunked == nil {
		t.Fatalf("%q: a flat descriptor of %d buffers, not Chunked", d.Name, len(d.Buffers))
	}
	ids := map[uint64]*segtable.BufferDesc{}
	d.Chunked.EachChunk(func(info segtable.ChunkInfo, bufs []segtable.BufferDesc) bool {
		ids[info.Seq] = &bufs[0]
		return true
	})
	return ids
}
