package segtable

import "fmt"

// Chunks a reader makes of what a networked store sent. A store that
// moves a descriptor as its chunks (a header listing each chunk's seq and
// MAC, and each chunk's buffers) lets its reader keep the chunks it holds
// from one header to the next; made into chunks of the reader's own
// (MakeChunk) and joined into a descriptor's list (JoinChunks), the
// chunks a republish did not change are the same pointers in successive
// descriptors, as the in-process store's are, so that a signing reader
// (VerifySince) checks and a Mirror remakes only the chunks that changed.
// Such a chunk carries the MAC its header listed but not its element of
// the set hash, which only a key holder can compute: VerifySince computes
// it from the chunk's buffers where a publisher's chunk carries it.

// Chunk is one chunk of a descriptor's buffers that a reader made
// (MakeChunk), to join with others into a descriptor's BufferChunks
// (JoinChunks). A Chunk is a handle, copied and compared by value: two
// lists that hold the same Chunk hold the same chunk by pointer. The
// chunk it names is immutable, so a Chunk is safe for concurrent use;
// the zero Chunk names none. Nothing ends its life but the garbage
// collector.
type Chunk struct{ c *chunk }

// MakeChunk returns the chunk numbered seq (as its publisher numbered it)
// that holds bufs, with mac, its MAC as a signed header lists it ("" for
// an unsigned one). bufs must hold 1 to ChunkSize buffers, in address
// order, none empty, overflowing or overlapping another (ErrBadDesc
// otherwise): the checks Validate makes of a descriptor's buffers, for
// one chunk, and the bound of a publisher's chunks (ChunkList), which a
// Mirror's Pos relies on. MakeChunk keeps bufs: the caller hands them
// over and must not modify them, their Keys maps included, afterwards.
// Safe for concurrent use; the chunk lives as long as a list or a Chunk
// holds it.
func MakeChunk(seq uint64, bufs []BufferDesc, mac string) (Chunk, error) {
	if len(bufs) < 1 || len(bufs) > ChunkSize {
		return Chunk{}, fmt.Errorf("%w: chunk %d of %d buffers, not 1 to %d", ErrBadDesc, seq, len(bufs), ChunkSize)
	}
	if err := checkRun(bufs, 0, false); err != nil {
		return Chunk{}, fmt.Errorf("chunk %d: %w", seq, err)
	}
	return Chunk{&chunk{seq: seq, first: bufs[0].Addr, bufs: bufs[:len(bufs):len(bufs)], mac: mac, wire: true}}, nil
}

// JoinChunks returns chunks, in address order, as the buffers of a
// descriptor (SegmentDesc.Chunked): signed when its header says its
// chunks carry MACs (SegmentDesc.Chunks of the flat descriptor; a chunk
// with a MAC in an unsigned list is ErrBadDesc), each chunk after the
// one before it and not overlapping it, none the zero Chunk (ErrBadDesc
// otherwise). O(chunks), reading no buffer but each chunk's last.
//
// prev is the list the reader joined last for the same segment, or nil:
// each of its pages that holds exactly what chunks holds where it stands,
// by pointer, is the new list's too, so that a Mirror (and VerifySince,
// and Changed) finds the pages that did not change by pointer and a
// republish after one registration costs one or two pages, not every
// page, and several republishes read at once (a watch's coalesced
// events) as many. The pages made are of pageSize/4 to pageSize/2
// chunks (a neighbour of too short a run of changed chunks is made again
// with it). Any prev gives the same list, in content; only the sharing
// differs. Safe for concurrent use; the list returned is immutable, and
// nothing but the garbage collector ends it.
func JoinChunks(prev *BufferChunks, chunks []Chunk, signed bool) (*BufferChunks, error) {
	list := make([]*chunk, len(chunks))
	var end uint64
	for i, ch := range chunks {
		c := ch.c
		switch {
		case c == nil:
			return nil, fmt.Errorf("%w: chunk %d of the list is none", ErrBadDesc, i)
		case !signed && c.mac != "":
			return nil, fmt.Errorf("%w: chunk %d has a MAC in an unsigned list", ErrBadDesc, c.seq)
		case i > 0 && c.first < end:
			return nil, fmt.Errorf("%w: chunk %d overlaps or is out of order", ErrBadDesc, c.seq)
		}
		last := c.bufs[len(c.bufs)-1]
		end = last.Addr + last.Length
		list[i] = c
	}
	var old []*chunkPage
	if prev != nil {
		old = prev.pages
	}
	cs := &BufferChunks{count: len(list), signed: signed, wire: true}
	// One pass over both, in address order: a page of prev that holds
	// list's chunks where it stands is taken; the runs of chunks between
	// such pages are made into pages (flush).
	rs := 0 // the start of the run of chunks in no page taken
	flush := func(re int) {
		if re-rs < pageSize/4 && len(cs.pages) > 0 {
			// A short run takes in the page taken before it (pages
			// taken and runs alternate), so that pages do not shrink to
			// a chunk or two over many republishes.
			last := cs.pages[len(cs.pages)-1]
			cs.pages = cs.pages[:len(cs.pages)-1]
			rs -= len(last.chunks)
		}
		m := re - rs
		k := (m + pageSize/2 - 1) / (pageSize / 2)
		for i := range k {
			n := m / k
			if i < m%k {
				n++
			}
			cs.pages = append(cs.pages, newChunkPage(list[rs:rs+n:rs+n]))
			rs += n
		}
	}
	for i, j := 0, 0; i < len(list); {
		for j < len(old) && old[j].first < list[i].first {
			j++
		}
		if j == len(old) || !samePage(old[j], list, i) {
			i++
			continue
		}
		if i > rs && i-rs < pageSize/4 && len(cs.pages) == 0 {
			// A short run first in the list takes in the page after it.
			i += len(old[j].chunks)
			j++
			continue
		}
		if i > rs {
			flush(i)
		}
		cs.pages = append(cs.pages, old[j])
		i += len(old[j].chunks)
		j++
		rs = i
	}
	if rs < len(list) {
		flush(len(list))
	}
	for _, pg := range cs.pages {
		cs.n += pg.n
	}
	return cs, nil
}

// samePage reports whether pg holds list[at:], by pointer, at its head.
func samePage(pg *chunkPage, list []*chunk, at int) bool {
	if at < 0 || len(list)-at < len(pg.chunks) {
		return false
	}
	for i, c := range pg.chunks {
		if list[at+i] != c {
			return false
		}
	}
	return true
}
