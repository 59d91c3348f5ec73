package segtable

import (
	"fmt"
	"sort"
)

// A publisher's buffer list as copy-on-write chunks. An engine with n
// remote-accessible buffers republishes its descriptor after every
// registration; building, copying, signing and storing a flat list of n
// buffers each time made one registration O(n) and n of them O(n²). The
// list is instead kept as chunks of at most ChunkSize buffers, each
// immutable once made, in pages of at most pageSize chunks: a
// registration makes one new chunk (two when it splits a full one, one
// when it joins two small ones), one new page and a new array of pages,
// and every other page and chunk is shared, by pointer, with the
// descriptors published before. A full chunk or page splits where the
// new buffer goes when that is away from its ends, its larger side kept
// as a slice of what it held (neither ever changes), so that a split
// copies at most half; and deleting the buffer inserted last, with no
// change between, brings back the list before it (ChunkList.Delete).
// Signing (sign.go) follows the same chunks: a publish signs the new chunk
// and the header, and stores keep the chunks by pointer.

// ChunkSize bounds the buffers of one chunk: one that grows past it splits
// in two (see insert); one that shrinks under ChunkSize/4 joins a neighbour
// that has room. It is small enough that copying and signing a chunk cost
// little beside a registration, large enough that the pages of chunk
// pointers (copied on every change) stay short. A chunk of 128 buffers
// (5 KiB of BufferDesc) copied twice a register/unregister cycle was a
// third of the cycle's garbage beside 100k buffers, and the collector's
// work on it grew with the heap (BenchmarkScaleChurn); at 32 each
// descriptor lists four times as many chunks (ChunkInfo: about 1 % of a
// descriptor's size).
const ChunkSize = 32

// chunk is one run of a descriptor's buffers, in address order, never
// modified once made. A signed chunk carries its MAC and its element of
// the descriptor's set hash (sign.go).
type chunk struct {
	seq   uint64 // unique among the chunks a publisher made in an epoch
	first uint64 // bufs[0].Addr, beside the pointer: searches read no BufferDesc
	bufs  []BufferDesc
	mac   string         // "" when unsigned
	raws  []byte         // signed: the buffers' MACs, raw, one after another
	elem  [elemSize]byte // the set-hash element of a signed chunk
	// wire: made by a reader of what a networked store sent (MakeChunk),
	// with the MAC listed but neither raws nor elem, which only a key
	// holder can compute (VerifySince computes them).
	wire bool
}

// pageSize bounds the chunks of a page: the chunks are kept in pages, so
// that a change copies the page it touches and the short array of pages,
// not an array of every chunk (3,125 pointers at 100k buffers, twice per
// signed publish).
const pageSize = 64

// chunkPage is a run of chunks, never modified once made.
type chunkPage struct {
	chunks []*chunk
	first  uint64 // chunks[0].first
	n      int    // buffers
}

func newChunkPage(chunks []*chunk) *chunkPage {
	pg := &chunkPage{chunks: chunks, first: chunks[0].first}
	for _, c := range chunks {
		pg.n += len(c.bufs)
	}
	return pg
}

// BufferChunks is the buffers of a descriptor as chunks shared between
// successive descriptors of one publisher (see ChunkList). It is
// immutable: safe for concurrent use, and a SegmentDesc holds it by
// pointer (SegmentDesc.Chunked). Nothing ends its life but the garbage
// collector.
type BufferChunks struct {
	pages []*chunkPage
	n     int // buffers
	count int // chunks
	// signed: every chunk carries a MAC and acc is the XOR of their set
	// elements, under the key of the Signer that made the list.
	signed bool
	acc    [elemSize]byte
	// wire: joined by a reader (JoinChunks) from chunks a networked store
	// sent; acc is then not known, and the list is no SignChunks prevOut.
	wire bool
}

// newBufferChunks returns chunks in pages of half pageSize.
func newBufferChunks(chunks []*chunk) *BufferChunks {
	cs := &BufferChunks{count: len(chunks)}
	for lo := 0; lo < len(chunks); lo += pageSize / 2 {
		hi := min(lo+pageSize/2, len(chunks))
		pg := newChunkPage(chunks[lo:hi:hi])
		cs.pages = append(cs.pages, pg)
		cs.n += pg.n
	}
	return cs
}

// Len returns the number of buffers.
func (cs *BufferChunks) Len() int {
	if cs == nil {
		return 0
	}
	return cs.n
}

// Count returns the number of chunks.
func (cs *BufferChunks) Count() int {
	if cs == nil {
		return 0
	}
	return cs.count
}

// Signed reports whether a Signer signed the chunks.
func (cs *BufferChunks) Signed() bool { return cs != nil && cs.signed }

// each calls fn for every chunk in order.
func (cs *BufferChunks) each(fn func(*chunk)) {
	if cs == nil {
		return
	}
	for _, pg := range cs.pages {
		for _, c := range pg.chunks {
			fn(c)
		}
	}
}

// Buffers returns the buffers in address order: a new slice whose Keys
// maps are shared with the chunks and must not be modified.
func (cs *BufferChunks) Buffers() []BufferDesc {
	out := make([]BufferDesc, 0, cs.Len())
	cs.each(func(c *chunk) { out = append(out, c.bufs...) })
	return out
}

// Changed returns the range [lo, hi) of cs's chunks, by index in address
// order, that lie between the chunks it shares, by pointer, with since at
// its head and at its tail: what changed from since to cs, when cs is
// since changed (ChunkList makes each list from the one before). Both
// nil-safe; it compares pages, then the chunks of the pages that differ,
// and reads no chunk.
func (cs *BufferChunks) Changed(since *BufferChunks) (lo, hi int) {
	var a, b []*chunkPage
	if cs != nil {
		a = cs.pages
	}
	if since != nil {
		b = since.pages
	}
	pp, pq := commonEnds(a, b)
	for _, pg := range a[:pp] {
		lo += len(pg.chunks)
	}
	am, bm := pageChunks(a[pp:len(a)-pq]), pageChunks(b[pp:len(b)-pq])
	cp, cq := commonEnds(am, bm)
	return lo + cp, lo + len(am) - cq
}

// commonEnds returns how many elements a and b share, by identity, at
// their heads and then at their tails.
func commonEnds[T comparable](a, b []T) (p, q int) {
	for p < len(a) && p < len(b) && a[p] == b[p] {
		p++
	}
	for q < len(a)-p && q < len(b)-p && a[len(a)-1-q] == b[len(b)-1-q] {
		q++
	}
	return p, q
}

// pageChunks returns the chunks of pages, in order.
func pageChunks(pages []*chunkPage) []*chunk {
	var out []*chunk
	for _, pg := range pages {
		out = append(out, pg.chunks...)
	}
	return out
}

// infos returns the chunks as a descriptor publishes them (SegmentDesc.Chunks).
func (cs *BufferChunks) infos() []ChunkInfo {
	out := make([]ChunkInfo, 0, cs.Count())
	cs.each(func(c *chunk) { out = append(out, ChunkInfo{Seq: c.seq, N: len(c.bufs), MAC: c.mac}) })
	return out
}

// ChunkInfo is one chunk of a signed descriptor as published: N
// consecutive entries of SegmentDesc.Buffers, the sequence number the
// publisher gave the chunk, and the chunk's MAC (see Signer).
type ChunkInfo struct {
	Seq uint64 `json:"seq"`
	N   int    `json:"n"`
	MAC string `json:"mac,omitempty"`
}

// ChunkList is a publisher's list of buffers kept as BufferChunks: each
// change makes a new BufferChunks that shares every chunk the change did
// not touch with the one before. Chunks returns the current one.
//
// It is not safe for concurrent use: the caller serializes every call
// (what Chunks returned is immutable and may be shared). The zero value is
// empty and ready for use.
type ChunkList struct {
	cur *BufferChunks
	seq uint64 // the last chunk sequence number given
	// undo is the list before the last Insert, which made undoOf (the
	// current list while nothing changed since) by adding the buffer at
	// undoAddr: a Delete of that buffer makes undo current again (see
	// Delete). undoOf is nil when there is none.
	undo, undoOf *BufferChunks
	undoAddr     uint64
}

// String describes the list without its set-hash state (fmt would print
// the unexported fields, and the set elements are what make a signed
// header unforgeable).
func (cs BufferChunks) String() string {
	return fmt.Sprintf("BufferChunks{%d buffers, %d chunks, %d pages, signed %v}", cs.n, cs.count, len(cs.pages), cs.signed)
}

// GoString is String, for %#v.
func (cs BufferChunks) GoString() string { return cs.String() }

// String describes the list as BufferChunks.String does.
func (l *ChunkList) String() string { return "ChunkList(" + l.Chunks().String() + ")" }

// Chunks returns the current list, never nil. It stays as it is: later
// changes make new lists.
func (l *ChunkList) Chunks() *BufferChunks {
	if l.cur == nil {
		return noChunks
	}
	return l.cur
}

// noChunks is the empty list, shared: a BufferChunks never changes.
var noChunks = &BufferChunks{}

// Seq returns the last chunk sequence number the list gave: it grows with
// every change, so a publisher may use it as its descriptor's Rev.
func (l *ChunkList) Seq() uint64 { return l.seq }

// prepend returns a new chunk of b followed by c's buffers.
func (l *ChunkList) prepend(b BufferDesc, c *chunk) *chunk {
	nb := make([]BufferDesc, 0, len(c.bufs)+1)
	return l.newChunk(append(append(nb, b), c.bufs...))
}

func (l *ChunkList) newChunk(bufs []BufferDesc) *chunk {
	l.seq++
	return &chunk{seq: l.seq, first: bufs[0].Addr, bufs: bufs}
}

// locate returns the page and, in it, the chunk of the last chunk whose
// first address is at most addr, or p = -1.
func (cs *BufferChunks) locate(addr uint64) (p, c int) {
	p = sort.Search(len(cs.pages), func(i int) bool { return cs.pages[i].first > addr }) - 1
	if p < 0 {
		return -1, 0
	}
	pg := cs.pages[p]
	return p, sort.Search(len(pg.chunks), func(i int) bool { return pg.chunks[i].first > addr }) - 1
}

// Insert adds b, which must not be empty, overflow or overlap a buffer of
// the list (ErrBadDesc otherwise, and nothing changes).
func (l *ChunkList) Insert(b BufferDesc) error {
	old := l.cur
	if err := l.insert(b); err != nil {
		return err
	}
	l.undo, l.undoOf, l.undoAddr = old, l.cur, b.Addr
	return nil
}

func (l *ChunkList) insert(b BufferDesc) error {
	if b.Length == 0 || b.Addr+b.Length < b.Addr {
		return fmt.Errorf("%w: buffer [%#x, +%d)", ErrBadDesc, b.Addr, b.Length)
	}
	cs := l.Chunks()
	if len(cs.pages) == 0 {
		l.cur = newBufferChunks([]*chunk{l.newChunk([]BufferDesc{b})})
		return nil
	}
	p, ci := cs.locate(b.Addr)
	if p < 0 {
		p, ci = 0, 0 // before everything: the first chunk's head
	}
	pg := cs.pages[p]
	c := pg.chunks[ci]
	at := sort.Search(len(c.bufs), func(i int) bool { return c.bufs[i].Addr > b.Addr })
	// Its neighbours: the buffer before (in c, as c is the last chunk
	// that starts at or before b) and the one after (in c or the next).
	if at > 0 && c.bufs[at-1].Addr+c.bufs[at-1].Length > b.Addr {
		return fmt.Errorf("%w: buffer [%#x, +%d) overlaps another", ErrBadDesc, b.Addr, b.Length)
	}
	next, hasNext := uint64(0), true
	switch {
	case at < len(c.bufs):
		next = c.bufs[at].Addr
	case ci+1 < len(pg.chunks):
		next = pg.chunks[ci+1].first
	case p+1 < len(cs.pages):
		next = cs.pages[p+1].first
	default:
		hasNext = false
	}
	if hasNext && b.Addr+b.Length > next {
		return fmt.Errorf("%w: buffer [%#x, +%d) overlaps another", ErrBadDesc, b.Addr, b.Length)
	}
	var with []*chunk
	switch bufs := c.bufs; {
	case len(bufs) == ChunkSize && at == 0 && p == 0 && ci == 0:
		// Before everything, at a full first chunk: a chunk of its own
		// (registrations in falling address order below everything, as
		// mmap's top-down placement gives, fill chunks as rising ones
		// do), and past a full first page, a page of its own.
		one := l.newChunk([]BufferDesc{b})
		if len(pg.chunks) == pageSize {
			l.insertPage(0, newChunkPage([]*chunk{one}))
			return nil
		}
		l.replaceIn(0, 0, 0, []*chunk{one})
		return nil
	case len(bufs) == ChunkSize && at == len(bufs) && ci+1 < len(pg.chunks) && len(pg.chunks[ci+1].bufs) < ChunkSize:
		// Past the end of a full chunk, before one with room: at its
		// head (registrations in falling address order fill chunks too).
		l.replaceIn(p, ci+1, ci+2, []*chunk{l.prepend(b, pg.chunks[ci+1])})
		return nil
	case len(bufs) == ChunkSize && at == len(bufs) && ci == len(pg.chunks)-1 && len(pg.chunks) == pageSize:
		// Past the end of a full chunk that ends a full page: the next
		// page's first chunk when it has room, else a chunk at the head
		// of the next page when that has room, else a page of its own.
		if p+1 < len(cs.pages) {
			np := cs.pages[p+1]
			if len(np.chunks[0].bufs) < ChunkSize {
				l.replaceIn(p+1, 0, 1, []*chunk{l.prepend(b, np.chunks[0])})
				return nil
			}
			if len(np.chunks) < pageSize {
				l.replaceIn(p+1, 0, 0, []*chunk{l.newChunk([]BufferDesc{b})})
				return nil
			}
		}
		l.insertPage(p+1, newChunkPage([]*chunk{l.newChunk([]BufferDesc{b})}))
		return nil
	case len(bufs) == ChunkSize && at == len(bufs):
		// Past the end of a full chunk (registrations in address order):
		// a chunk of its own, which leaves c full rather than two halves.
		with = []*chunk{c, l.newChunk([]BufferDesc{b})}
	case len(bufs) == ChunkSize && min(at, len(bufs)-at) >= ChunkSize/4:
		// Inside a full chunk, away from its ends: split where b goes,
		// the larger side kept as it is (a slice of c's buffers, which
		// never change), b joining a copy of the smaller. Two halves
		// copied the whole chunk (1.8 KiB of BufferDesc, a register/
		// unregister cycle's largest garbage beside 100k buffers); this
		// copies at most half, and leaves two chunks as halves do.
		if at <= len(bufs)/2 {
			nb := make([]BufferDesc, 0, at+1)
			with = []*chunk{l.newChunk(append(append(nb, bufs[:at]...), b)), l.newChunk(bufs[at:len(bufs):len(bufs)])}
		} else {
			nb := make([]BufferDesc, 0, len(bufs)-at+1)
			with = []*chunk{l.newChunk(bufs[:at:at]), l.newChunk(append(append(nb, b), bufs[at:]...))}
		}
	default:
		nb := make([]BufferDesc, 0, len(bufs)+1)
		nb = append(append(append(nb, bufs[:at]...), b), bufs[at:]...)
		if len(nb) <= ChunkSize {
			with = []*chunk{l.newChunk(nb)}
			break
		}
		h := len(nb) / 2
		with = []*chunk{l.newChunk(nb[:h:h]), l.newChunk(nb[h:])}
	}
	l.replaceIn(p, ci, ci+1, with)
	return nil
}

// Delete removes the buffer that starts at addr and reports whether there
// was one. Deleting the buffer the last change inserted makes the list
// before that insertion current again, the very one (its chunks and
// pages, immutable, were published before and may be again), and makes
// no chunk: a buffer registered and unregistered again with no other
// change between costs one chunk made and copied, not two. Seq moves
// all the same, as with every change.
func (l *ChunkList) Delete(addr uint64) bool {
	if l.undoOf != nil && l.cur == l.undoOf && addr == l.undoAddr {
		l.cur, l.undo, l.undoOf = l.undo, nil, nil
		l.seq++
		return true
	}
	cs := l.Chunks()
	p, ci := cs.locate(addr)
	if p < 0 {
		return false
	}
	pg := cs.pages[p]
	c := pg.chunks[ci]
	at := sort.Search(len(c.bufs), func(i int) bool { return c.bufs[i].Addr >= addr })
	if at == len(c.bufs) || c.bufs[at].Addr != addr {
		return false
	}
	l.undo, l.undoOf = nil, nil // no longer current, and kept for nothing
	if len(c.bufs) == 1 {
		l.seq++ // no chunk made, but Seq (a publisher's Rev) moves with every change
		l.replaceIn(p, ci, ci+1, nil)
		return true
	}
	bufs := make([]BufferDesc, 0, len(c.bufs)-1)
	bufs = append(append(bufs, c.bufs[:at]...), c.bufs[at+1:]...)
	lo, hi := ci, ci+1
	if len(bufs) < ChunkSize/4 {
		// Join the smaller neighbour in the page if the two fit in a
		// chunk, so that deletions do not leave many small chunks behind.
		n := -1
		if ci > 0 {
			n = ci - 1
		}
		if ci+1 < len(pg.chunks) && (n < 0 || len(pg.chunks[ci+1].bufs) < len(pg.chunks[n].bufs)) {
			n = ci + 1
		}
		if n >= 0 && len(pg.chunks[n].bufs)+len(bufs) <= ChunkSize {
			nb := pg.chunks[n].bufs
			if n < ci {
				bufs = append(append(make([]BufferDesc, 0, len(nb)+len(bufs)), nb...), bufs...)
				lo = n
			} else {
				bufs = append(bufs, nb...)
				hi = n + 1
			}
		}
	}
	l.replaceIn(p, lo, hi, []*chunk{l.newChunk(bufs)})
	return true
}

// Reset replaces the list with bufs, which must be sorted by address, not
// empty, not overflowing and not overlapping (ErrBadDesc otherwise, and
// nothing changes). The chunks are filled to half of ChunkSize, so that
// the next registrations split none.
func (l *ChunkList) Reset(bufs []BufferDesc) error {
	if err := checkRun(bufs, 0, false); err != nil {
		return err
	}
	l.undo, l.undoOf = nil, nil
	var list []*chunk
	for lo := 0; lo < len(bufs); lo += ChunkSize / 2 {
		hi := min(lo+ChunkSize/2, len(bufs))
		list = append(list, l.newChunk(append([]BufferDesc(nil), bufs[lo:hi]...)))
	}
	l.cur = newBufferChunks(list)
	return nil
}

// NewBufferChunks returns bufs, which must pass Validate as a
// descriptor's Buffers (ErrBadDesc otherwise), as chunks of ChunkSize
// numbered from 1: the chunks of a publisher that keeps no ChunkList.
// bufs is copied, Keys maps included.
func NewBufferChunks(bufs []BufferDesc) (*BufferChunks, error) {
	if err := checkRun(bufs, 0, false); err != nil {
		return nil, err
	}
	var l ChunkList
	var list []*chunk
	for lo := 0; lo < len(bufs); lo += ChunkSize {
		hi := min(lo+ChunkSize, len(bufs))
		run := append([]BufferDesc(nil), bufs[lo:hi]...)
		for i := range run {
			run[i].Keys = cloneMap(run[i].Keys)
		}
		list = append(list, l.newChunk(run))
	}
	return newBufferChunks(list), nil
}

// insertPage makes the current list the old one with pg inserted as
// page p.
func (l *ChunkList) insertPage(p int, pg *chunkPage) {
	old := l.Chunks()
	cs := &BufferChunks{pages: make([]*chunkPage, 0, len(old.pages)+1), n: old.n + pg.n, count: old.count + len(pg.chunks)}
	cs.pages = append(append(append(cs.pages, old.pages[:p]...), pg), old.pages[p:]...)
	l.cur = cs
}

// replaceIn makes the current list the old one with chunks [lo, hi) of
// page p replaced by with. A page left with no chunk goes; one grown past
// pageSize splits in two; one shrunk under a quarter of it joins the
// smaller neighbour if the two fit in a page.
func (l *ChunkList) replaceIn(p, lo, hi int, with []*chunk) {
	old := l.Chunks()
	pg := old.pages[p]
	plo, phi := p, p+1
	if head, tail := pg.chunks[:lo:lo], pg.chunks[hi:len(pg.chunks):len(pg.chunks)]; len(head)+len(with)+len(tail) > pageSize &&
		min(len(head), len(tail)) >= pageSize/4 {
		// A full page split where the chunks change, its larger side
		// kept as it is (a slice of the page's chunks, which never
		// change), as a full chunk splits (insert).
		var pages [2]*chunkPage
		if len(head) >= len(tail) {
			c := append(append(make([]*chunk, 0, len(with)+len(tail)), with...), tail...)
			pages = [2]*chunkPage{newChunkPage(head), newChunkPage(c)}
		} else {
			c := append(append(make([]*chunk, 0, len(head)+len(with)), head...), with...)
			pages = [2]*chunkPage{newChunkPage(c), newChunkPage(tail)}
		}
		l.setPages(old, plo, phi, pages[:])
		return
	}
	chunks := make([]*chunk, 0, len(pg.chunks)-(hi-lo)+len(with))
	chunks = append(append(append(chunks, pg.chunks[:lo]...), with...), pg.chunks[hi:]...)
	if len(chunks) > 0 && len(chunks) < pageSize/4 {
		n := -1
		if p > 0 {
			n = p - 1
		}
		if p+1 < len(old.pages) && (n < 0 || len(old.pages[p+1].chunks) < len(old.pages[n].chunks)) {
			n = p + 1
		}
		if n >= 0 && len(old.pages[n].chunks)+len(chunks) <= pageSize {
			if n < p {
				chunks = append(append(make([]*chunk, 0, len(old.pages[n].chunks)+len(chunks)), old.pages[n].chunks...), chunks...)
				plo = n
			} else {
				chunks = append(chunks, old.pages[n].chunks...)
				phi = n + 1
			}
		}
	}
	var pages []*chunkPage
	switch {
	case len(chunks) > pageSize:
		h := len(chunks) / 2
		pages = []*chunkPage{newChunkPage(chunks[:h:h]), newChunkPage(chunks[h:])}
	case len(chunks) > 0:
		pages = []*chunkPage{newChunkPage(chunks)}
	}
	l.setPages(old, plo, phi, pages)
}

// setPages makes the current list old with its pages [plo, phi) replaced
// by pages.
func (l *ChunkList) setPages(old *BufferChunks, plo, phi int, pages []*chunkPage) {
	cs := &BufferChunks{pages: make([]*chunkPage, 0, len(old.pages)-(phi-plo)+len(pages)), n: old.n, count: old.count}
	cs.pages = append(append(append(cs.pages, old.pages[:plo]...), pages...), old.pages[phi:]...)
	for _, pg := range old.pages[plo:phi] {
		cs.n -= pg.n
		cs.count -= len(pg.chunks)
	}
	for _, pg := range pages {
		cs.n += pg.n
		cs.count += len(pg.chunks)
	}
	l.cur = cs
}

// checkRun checks that bufs are in address order, not empty, not
// overflowing and not overlapping each other or, when after is set, the
// end of what comes before them.
func checkRun(bufs []BufferDesc, end uint64, after bool) error {
	for i, b := range bufs {
		if b.Length == 0 || b.Addr+b.Length < b.Addr {
			return fmt.Errorf("%w: buffer %d has bad range [%#x, +%d)", ErrBadDesc, i, b.Addr, b.Length)
		}
		if (i > 0 || after) && b.Addr < end {
			return fmt.Errorf("%w: buffer %d overlaps or is out of order", ErrBadDesc, i)
		}
		end = b.Addr + b.Length
	}
	return nil
}
