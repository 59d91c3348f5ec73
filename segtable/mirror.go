package segtable

import (
	"cmp"
	"slices"
)

// Tables that follow a descriptor's chunks. A peer's tables of a
// segment's buffers (the engine's packed starts for Resolve, a
// transport's keys) were rebuilt from every buffer on each republish:
// O(n) a registration at the publisher, for every peer that watches it.
// A Mirror keeps them in the shape of the descriptor's chunks
// (BufferChunks: pages of chunks of buffers, each immutable once made):
// an entry table per chunk and a page of those per page, and an update
// from one descriptor to the next makes tables only for the chunks that
// are not the last one's, by pointer (what SignChunks and VerifySince
// skip), reuses every other, and remakes the short arrays over the pages.

// Pos is a buffer's position in a Mirror, and so in its descriptor's
// chunks: the page, the chunk in the page and the buffer in the chunk,
// packed. Two Mirrors of the same descriptor give a buffer the same Pos,
// so a Pos one found is a hint for the other's At (the index a request
// carries from the engine's Resolve to the local transport,
// transport.Slice.RemoteIndex): checked against the address, never
// trusted. NoPos names nothing.
type Pos = uint32

const (
	posChunkBits = 5 // ChunkSize buffers
	posPageBits  = 6 // pageSize chunks
	// NoPos is a Pos that names no buffer (past 2^21 pages).
	NoPos Pos = 1<<32 - 1
)

// The bounds the packing needs.
const (
	_ = uint(1<<posChunkBits - ChunkSize)
	_ = uint(1<<posPageBits - pageSize)
)

func makePos(p, c, i int) Pos {
	if p >= 1<<(32-posPageBits-posChunkBits) {
		return NoPos
	}
	return Pos(p)<<(posPageBits+posChunkBits) | Pos(c)<<posChunkBits | Pos(i)
}

// Mirror is a table of entries of type T, one per buffer of a
// descriptor that conv kept (see NewMirror; an entry holds what its
// user checks a range against, the buffer's start and length), in the
// shape of the
// descriptor's chunks, with lock-free lookups by address and by Pos. It
// is immutable: safe for concurrent use, shared by pointer (an
// atomic.Pointer swapped on each update, as the flat tables were), and
// the garbage collector ends it. Lookups allocate nothing.
type Mirror[T any] struct {
	src    *BufferChunks
	pages  []*mirrorPage[T]
	firsts []uint64 // pages[i]'s first address
	bases  []int    // the descriptor's buffers before pages[i]
	n      int      // the descriptor's buffers
}

// mirrorPage follows one page of the descriptor's chunks.
type mirrorPage[T any] struct {
	src    *chunkPage
	chunks []mirrorChunk[T] // by value: a lookup loads one pointer less
	firsts []uint64         // chunks[i]'s first address (its first buffer's, kept or not)
	bases  []int            // the page's buffers before chunks[i]
}

// mirrorChunk is the entries of one chunk's buffers that conv kept. Its
// arrays are shared by the Mirrors that reuse it (copied by value into
// each page that holds it).
type mirrorChunk[T any] struct {
	src    *chunk
	starts []uint64 // the kept buffers' addresses
	items  []T
}

// ChunksOf returns d's buffers as chunks: d.Chunked, or for a flat d (one
// read as a whole document: from an older server or peer, or Mooncake's;
// the networked stores hand out a descriptor read as chunks Chunked, see
// JoinChunks) its Buffers cut into chunks that share their
// BufferDescs (O(n), made anew each call: a Mirror updated from it
// rebuilds every table, as a flat descriptor always did). A flat d whose
// Buffers are not in address order (which SegmentDesc's contract asks
// for, and Validate checks; a descriptor made by hand may break it) is
// cut from a sorted copy, so that a Mirror of it finds every buffer.
func ChunksOf(d *SegmentDesc) *BufferChunks {
	if d.Chunked != nil {
		return d.Chunked
	}
	if len(d.Buffers) == 0 {
		return noChunks
	}
	bufs := d.Buffers
	byAddr := func(a, b BufferDesc) int { return cmp.Compare(a.Addr, b.Addr) }
	if !slices.IsSortedFunc(bufs, byAddr) {
		bufs = slices.Clone(bufs)
		slices.SortFunc(bufs, byAddr)
	}
	list := make([]*chunk, 0, (len(bufs)+ChunkSize-1)/ChunkSize)
	for lo := 0; lo < len(bufs); lo += ChunkSize {
		hi := min(lo+ChunkSize, len(bufs))
		list = append(list, &chunk{first: bufs[lo].Addr, bufs: bufs[lo:hi:hi]})
	}
	return newBufferChunks(list)
}

// NewMirror returns the Mirror of cs, made from old, the Mirror of an
// earlier descriptor (nil: none): the tables of the chunks cs shares
// with old's, by pointer, are old's, and conv makes the others' entries,
// one per buffer it keeps (ok true), in address order. A republish after
// one registration among n buffers then costs one or two chunks' entries
// and arrays of O(n/2048) over the pages, not n entries. Any old gives
// the same answers (only the cost differs); conv must be the same
// function of a buffer for every Mirror in the chain. Safe for
// concurrent use.
func NewMirror[T any](old *Mirror[T], cs *BufferChunks, conv func(b *BufferDesc) (T, bool)) *Mirror[T] {
	if cs == nil {
		cs = noChunks
	}
	var oldPages []*mirrorPage[T]
	var oldSrc []*chunkPage
	if old != nil {
		oldPages, oldSrc = old.pages, old.src.pages
	}
	a := cs.pages
	pp, pq := commonEnds(a, oldSrc)
	m := &Mirror[T]{src: cs, pages: make([]*mirrorPage[T], 0, len(a)), firsts: make([]uint64, len(a)), bases: make([]int, len(a)), n: cs.n}
	m.pages = append(m.pages, oldPages[:pp]...)
	var reuse []mirrorChunk[T] // the replaced pages' chunks, in address order
	for _, mp := range oldPages[pp : len(oldPages)-pq] {
		reuse = append(reuse, mp.chunks...)
	}
	j := 0
	for _, pg := range a[pp : len(a)-pq] {
		mp := &mirrorPage[T]{src: pg, chunks: make([]mirrorChunk[T], len(pg.chunks)), firsts: make([]uint64, len(pg.chunks)), bases: make([]int, len(pg.chunks))}
		nb := 0
		for i, c := range pg.chunks {
			for j < len(reuse) && reuse[j].src.first < c.first {
				j++
			}
			if j < len(reuse) && reuse[j].src == c {
				mp.chunks[i] = reuse[j]
			} else {
				mp.chunks[i] = newMirrorChunk(c, conv)
			}
			mp.firsts[i], mp.bases[i] = c.first, nb
			nb += len(c.bufs)
		}
		m.pages = append(m.pages, mp)
	}
	m.pages = append(m.pages, oldPages[len(oldPages)-pq:]...)
	nb := 0
	for i, mp := range m.pages {
		m.firsts[i], m.bases[i] = mp.src.first, nb
		nb += mp.src.n
	}
	return m
}

func newMirrorChunk[T any](c *chunk, conv func(*BufferDesc) (T, bool)) mirrorChunk[T] {
	mc := mirrorChunk[T]{src: c, starts: make([]uint64, 0, len(c.bufs)), items: make([]T, 0, len(c.bufs))}
	for i := range c.bufs {
		if v, ok := conv(&c.bufs[i]); ok {
			mc.starts = append(mc.starts, c.bufs[i].Addr)
			mc.items = append(mc.items, v)
		}
	}
	return mc
}

// Len returns the number of the descriptor's buffers (kept or not).
func (m *Mirror[T]) Len() int { return m.n }

// Floor returns the entry of the last kept buffer that starts at or
// below addr and its Pos; nil when none may hold addr (every kept buffer
// starts above it, or the buffer of the descriptor that would hold it
// was not kept). The caller checks the range against the entry (which
// holds the buffer's start: conv put it there). Three searches: the
// pages' first addresses, the page's chunks', the chunk's buffers'.
func (m *Mirror[T]) Floor(addr uint64) (v *T, pos Pos) {
	p := floorIndex(m.firsts, addr)
	if p < 0 {
		return nil, NoPos
	}
	mp := m.pages[p]
	c := floorIndex(mp.firsts, addr)
	mc := &mp.chunks[c] // c >= 0: mp.firsts[0] is m.firsts[p]
	i := floorIndex(mc.starts, addr)
	if i < 0 {
		return nil, NoPos // the chunk's buffer at addr, if any, was not kept
	}
	return &mc.items[i], makePos(p, c, i)
}

// At returns the entry at pos, or nil when pos names none (it may name
// another buffer than the caller's: a hint is checked against the
// address). Three dependent loads: the page, the chunk, the entry.
func (m *Mirror[T]) At(pos Pos) *T {
	p := int(pos >> (posPageBits + posChunkBits))
	if p >= len(m.pages) {
		return nil
	}
	mp := m.pages[p]
	c := int(pos >> posChunkBits & (1<<posPageBits - 1))
	if c >= len(mp.chunks) {
		return nil
	}
	mc := &mp.chunks[c]
	i := int(pos & (1<<posChunkBits - 1))
	if i >= len(mc.items) {
		return nil
	}
	return &mc.items[i]
}

// Buffer returns the descriptor's buffer at index i in address order
// (kept or not), or nil: a search of the pages' and the page's chunks'
// buffer counts. The BufferDesc is the descriptor's, not to be modified.
func (m *Mirror[T]) Buffer(i int) *BufferDesc {
	if i < 0 || i >= m.n {
		return nil
	}
	p := floorIndex(m.bases, i)
	mp := m.pages[p]
	c := floorIndex(mp.bases, i-m.bases[p])
	return &mp.chunks[c].src.bufs[i-m.bases[p]-mp.bases[c]]
}

// Index returns the index in address order of the buffer at pos, or -1:
// Pos to the descriptor's flat order (for a Mirror that keeps every
// buffer).
func (m *Mirror[T]) Index(pos Pos) int {
	if m.At(pos) == nil {
		return -1
	}
	p, c := int(pos>>(posPageBits+posChunkBits)), int(pos>>posChunkBits&(1<<posPageBits-1))
	return m.bases[p] + m.pages[p].bases[c] + int(pos&(1<<posChunkBits-1))
}
