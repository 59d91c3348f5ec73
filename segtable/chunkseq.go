package segtable

// EachChunk calls fn for every chunk of cs in address order, until fn
// returns false: info is the chunk as a signed descriptor publishes it
// (Seq, N and, when cs is signed, MAC; see ChunkInfo), bufs its buffers.
// bufs is the chunk's own slice, shared with every descriptor that holds
// the chunk: it must not be modified (its Keys maps included), and its
// capacity ends at its length, so an append copies. A chunk never changes
// once made, so a caller may take &bufs[0] with len(bufs) for the chunk's
// content while it holds bufs: two lists that hold the same chunk give the
// same pointer (a store that encodes chunks by sequence number keeps it to
// tell a chunk from another numbered alike, as a flat descriptor's chunks
// are, from 1, on every NewBufferChunks). The pointer alone is not the
// chunk: a chunk split keeps one side as a slice of the buffers it had,
// so two chunks may begin at the same BufferDesc, with other lengths (and
// sequence numbers). It reads no buffer: O(chunks). cs
// may be nil (no chunk). Safe for concurrent use, as cs is immutable.
func (cs *BufferChunks) EachChunk(fn func(info ChunkInfo, bufs []BufferDesc) bool) {
	if cs == nil {
		return
	}
	for _, pg := range cs.pages {
		for _, c := range pg.chunks {
			if !fn(ChunkInfo{Seq: c.seq, N: len(c.bufs), MAC: c.mac}, c.bufs[:len(c.bufs):len(c.bufs)]) {
				return
			}
		}
	}
}
