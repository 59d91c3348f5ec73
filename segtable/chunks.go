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
// immutable once made: a registration makes one new chunk (two when it
// splits a full one, one when it joins two small ones) and a new array of
// chunk pointers, and every other chunk is shared, by pointer, with the
// descriptors published before. Signing (sign.go) follows the same
// chunks: a publish signs the new chunk and the header, and stores keep
// the chunks by pointer.

// ChunkSize bounds the buffers of one chunk: one that grows past it splits
// in two halves; one that shrinks under ChunkSize/4 joins a neighbour
// that has room. It is small enough that copying and signing a chunk cost
// little beside a registration, large enough that the array of chunk
// pointers (copied on every change) stays short.
const ChunkSize = 128

// chunk is one run of a descriptor's buffers, in address order, never
// modified once made. A signed chunk carries its MAC and its element of
// the descriptor's set hash (sign.go).
type chunk struct {
	seq   uint64 // unique among the chunks a publisher made in an epoch
	first uint64 // bufs[0].Addr, beside the pointer: searches read no BufferDesc
	bufs  []BufferDesc
	mac   string   // "" when unsigned
	raws  []byte   // signed: the buffers' MACs, raw, one after another
	elem  [32]byte // the set-hash element of a signed chunk
}

// BufferChunks is the buffers of a descriptor as chunks shared between
// successive descriptors of one publisher (see ChunkList). It is
// immutable: safe for concurrent use, and a SegmentDesc holds it by
// pointer (SegmentDesc.Chunked). Nothing ends its life but the garbage
// collector.
type BufferChunks struct {
	list []*chunk
	n    int
	// signed: every chunk carries a MAC and acc is the XOR of their set
	// elements, under the key of the Signer that made the list.
	signed bool
	acc    [32]byte
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
	return len(cs.list)
}

// Signed reports whether a Signer signed the chunks.
func (cs *BufferChunks) Signed() bool { return cs != nil && cs.signed }

// Buffers returns the buffers in address order: a new slice whose Keys
// maps are shared with the chunks and must not be modified.
func (cs *BufferChunks) Buffers() []BufferDesc {
	out := make([]BufferDesc, 0, cs.Len())
	if cs != nil {
		for _, c := range cs.list {
			out = append(out, c.bufs...)
		}
	}
	return out
}

// Changed returns the range [lo, hi) of cs's chunks that lie between the
// chunks it shares, by pointer, with since at its head and at its tail:
// what changed from since to cs, when cs is since changed (ChunkList
// makes each list from the one before). Both nil-safe; O(chunks), no
// chunk read.
func (cs *BufferChunks) Changed(since *BufferChunks) (lo, hi int) {
	var a, b []*chunk
	if cs != nil {
		a = cs.list
	}
	if since != nil {
		b = since.list
	}
	p := 0
	for p < len(a) && p < len(b) && a[p] == b[p] {
		p++
	}
	q := 0
	for q < len(a)-p && q < len(b)-p && a[len(a)-1-q] == b[len(b)-1-q] {
		q++
	}
	return p, len(a) - q
}

// infos returns the chunks as a descriptor publishes them (SegmentDesc.Chunks).
func (cs *BufferChunks) infos() []ChunkInfo {
	out := make([]ChunkInfo, len(cs.list))
	for i, c := range cs.list {
		out[i] = ChunkInfo{Seq: c.seq, N: len(c.bufs), MAC: c.mac}
	}
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
}

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

func (l *ChunkList) newChunk(bufs []BufferDesc) *chunk {
	l.seq++
	return &chunk{seq: l.seq, first: bufs[0].Addr, bufs: bufs}
}

// find returns the index of the last chunk whose first address is at most
// addr, or -1.
func (cs *BufferChunks) find(addr uint64) int {
	return sort.Search(len(cs.list), func(i int) bool { return cs.list[i].first > addr }) - 1
}

// Insert adds b, which must not be empty, overflow or overlap a buffer of
// the list (ErrBadDesc otherwise, and nothing changes).
func (l *ChunkList) Insert(b BufferDesc) error {
	if b.Length == 0 || b.Addr+b.Length < b.Addr {
		return fmt.Errorf("%w: buffer [%#x, +%d)", ErrBadDesc, b.Addr, b.Length)
	}
	cs := l.Chunks()
	if len(cs.list) == 0 {
		l.replace(0, 0, []*chunk{l.newChunk([]BufferDesc{b})})
		return nil
	}
	ci := max(cs.find(b.Addr), 0)
	c := cs.list[ci]
	at := sort.Search(len(c.bufs), func(i int) bool { return c.bufs[i].Addr > b.Addr })
	// Its neighbours: the buffer before (in c, as ci is the last chunk
	// that starts at or before b) and the one after (in c or the next).
	if at > 0 && c.bufs[at-1].Addr+c.bufs[at-1].Length > b.Addr {
		return fmt.Errorf("%w: buffer [%#x, +%d) overlaps another", ErrBadDesc, b.Addr, b.Length)
	}
	next := uint64(0)
	hasNext := true
	switch {
	case at < len(c.bufs):
		next = c.bufs[at].Addr
	case ci+1 < len(cs.list):
		next = cs.list[ci+1].first
	default:
		hasNext = false
	}
	if hasNext && b.Addr+b.Length > next {
		return fmt.Errorf("%w: buffer [%#x, +%d) overlaps another", ErrBadDesc, b.Addr, b.Length)
	}
	if len(c.bufs) == ChunkSize && at == len(c.bufs) {
		// Past the end of a full chunk (registrations in address order):
		// a chunk of its own, which leaves c full rather than two halves.
		l.replace(ci+1, ci+1, []*chunk{l.newChunk([]BufferDesc{b})})
		return nil
	}
	bufs := make([]BufferDesc, 0, len(c.bufs)+1)
	bufs = append(append(append(bufs, c.bufs[:at]...), b), c.bufs[at:]...)
	if len(bufs) <= ChunkSize {
		l.replace(ci, ci+1, []*chunk{l.newChunk(bufs)})
		return nil
	}
	h := len(bufs) / 2
	l.replace(ci, ci+1, []*chunk{l.newChunk(bufs[:h:h]), l.newChunk(bufs[h:])})
	return nil
}

// Delete removes the buffer that starts at addr and reports whether there
// was one.
func (l *ChunkList) Delete(addr uint64) bool {
	cs := l.Chunks()
	ci := cs.find(addr)
	if ci < 0 {
		return false
	}
	c := cs.list[ci]
	at := sort.Search(len(c.bufs), func(i int) bool { return c.bufs[i].Addr >= addr })
	if at == len(c.bufs) || c.bufs[at].Addr != addr {
		return false
	}
	if len(c.bufs) == 1 {
		l.replace(ci, ci+1, nil)
		return true
	}
	bufs := make([]BufferDesc, 0, len(c.bufs)-1)
	bufs = append(append(bufs, c.bufs[:at]...), c.bufs[at+1:]...)
	lo, hi := ci, ci+1
	if len(bufs) < ChunkSize/4 {
		// Join the smaller neighbour if the two fit in a chunk, so that
		// deletions do not leave many small chunks behind.
		n := -1
		if ci > 0 {
			n = ci - 1
		}
		if ci+1 < len(cs.list) && (n < 0 || len(cs.list[ci+1].bufs) < len(cs.list[n].bufs)) {
			n = ci + 1
		}
		if n >= 0 && len(cs.list[n].bufs)+len(bufs) <= ChunkSize {
			nb := cs.list[n].bufs
			if n < ci {
				bufs = append(append(make([]BufferDesc, 0, len(nb)+len(bufs)), nb...), bufs...)
				lo = n
			} else {
				bufs = append(bufs, nb...)
				hi = n + 1
			}
		}
	}
	l.replace(lo, hi, []*chunk{l.newChunk(bufs)})
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
	var list []*chunk
	for lo := 0; lo < len(bufs); lo += ChunkSize / 2 {
		hi := min(lo+ChunkSize/2, len(bufs))
		list = append(list, l.newChunk(append([]BufferDesc(nil), bufs[lo:hi]...)))
	}
	l.cur = &BufferChunks{list: list, n: len(bufs)}
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
	cs := &BufferChunks{n: len(bufs)}
	for lo := 0; lo < len(bufs); lo += ChunkSize {
		hi := min(lo+ChunkSize, len(bufs))
		run := append([]BufferDesc(nil), bufs[lo:hi]...)
		for i := range run {
			run[i].Keys = cloneMap(run[i].Keys)
		}
		cs.list = append(cs.list, l.newChunk(run))
	}
	return cs, nil
}

// replace makes the current list the old one with chunks [lo, hi)
// replaced by with.
func (l *ChunkList) replace(lo, hi int, with []*chunk) {
	old := l.Chunks()
	list := make([]*chunk, 0, len(old.list)-(hi-lo)+len(with))
	list = append(append(append(list, old.list[:lo]...), with...), old.list[hi:]...)
	n := old.n
	for _, c := range old.list[lo:hi] {
		n -= len(c.bufs)
	}
	for _, c := range with {
		n += len(c.bufs)
	}
	l.cur = &BufferChunks{list: list, n: n}
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
