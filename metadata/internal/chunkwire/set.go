package chunkwire

import (
	"fmt"
	"maps"
	"slices"
	"sync"
	"weak"

	"github.com/moonring/moonring/segtable"
)

// A reader's chunks from one header to the next. Assemble builds a flat
// descriptor, every buffer appended and its Keys map copied: O(buffers)
// at every reader for every republish, and its peer's check and tables
// (segtable.Signer.VerifySince, segtable.Mirror), finding no chunk they
// had before, start again from every buffer. AssembleChunked keeps each
// chunk a reader holds as a chunk of its own (segtable.MakeChunk), made
// once, and hands out descriptors whose Chunked lists share it for as
// long as headers list it unchanged, so that a republish costs its
// readers the chunks it made, as through the in-process store.

// Set is the chunks a reader holds of one name: those of the last header
// it assembled, of one epoch, by seq (each with its segtable.Chunk once
// made), and the list joined of them. A Set is immutable: safe for
// concurrent use, a new header makes a new one. A nil *Set holds nothing.
// What it holds lives as long as the Set and the descriptors that share
// it.
type Set struct {
	epoch uint64
	held  map[uint64]Held
	list  *segtable.BufferChunks // nil when the last assembly was flat
	n     int                    // buffers of the chunks held
}

// Has reports whether s holds chunk c of a header of epoch: the same
// seq, sum, MAC and number of buffers, in the same epoch (a seq names a
// chunk only within its publisher's epoch).
func (s *Set) Has(epoch uint64, c Chunk) bool {
	if s == nil || s.epoch != epoch {
		return false
	}
	hc, ok := s.held[c.Seq]
	return ok && hc.Matches(c)
}

// Len returns the number of buffers of the chunks s holds.
func (s *Set) Len() int {
	if s == nil {
		return 0
	}
	return s.n
}

// AssembleChunked returns the descriptor of h, a Chunked one: a header of
// the caller's own (Endpoints, Devices copied) whose Chunked list holds,
// for each chunk h lists, the chunk of got (fetched for h, checked
// against it: DecodeListed) or else the one s holds (Has), and the Set
// the next assembly of the name takes. A chunk s holds is the same
// segtable.Chunk in the result as in every descriptor assembled from s
// before, so that a reader's check (segtable.Signer.VerifySince) and
// tables (segtable.Mirror) of a republish cost the chunks it made; every
// chunk is made (segtable.MakeChunk) once. A chunk neither got nor held,
// a chunk that does not match its listing, chunks out of order or
// overlapping, a MAC listed in an unsigned header: segtable.ErrBadDesc.
// A header that lists a chunk of more than segtable.ChunkSize buffers
// (not a ChunkList's) is assembled flat (Assemble, with Keys maps of the
// caller's own), as a peer's Mirror could not hold it.
//
// The result's Chunked list is shared with the descriptors assembled
// before and after it: the caller may change the header but never what
// the list holds (see metadata.Store). AssembleChunked takes over got's
// buffers. s is not changed.
func AssembleChunked(h *Header, s *Set, got map[uint64]Held) (*segtable.SegmentDesc, *Set, error) {
	epoch := h.Desc.Epoch
	if s != nil && s.epoch != epoch {
		s = nil
	}
	next := &Set{epoch: epoch, held: make(map[uint64]Held, len(h.Chunks))}
	helds := make([]Held, len(h.Chunks))
	flat := false
	for i, c := range h.Chunks {
		hc, ok := got[c.Seq]
		if !ok && s != nil {
			if x, held := s.held[c.Seq]; held && x.Matches(c) {
				hc, ok = x, true
			}
		}
		switch {
		case !ok:
			return nil, nil, fmt.Errorf("%w: chunk %d neither read nor held", segtable.ErrBadDesc, c.Seq)
		case !hc.Matches(c):
			return nil, nil, fmt.Errorf("%w: chunk %d is not the one listed", segtable.ErrBadDesc, c.Seq)
		case c.N > segtable.ChunkSize:
			flat = true
		}
		if next.held[c.Seq] = hc; len(next.held) != i+1 {
			return nil, nil, fmt.Errorf("%w: chunk %d listed twice", segtable.ErrBadDesc, c.Seq)
		}
		helds[i] = hc
		next.n += c.N
	}
	if flat {
		d, err := Assemble(h, func(seq uint64) Held { return next.held[seq] }, true)
		if err != nil {
			return nil, nil, err
		}
		return d, next, nil
	}
	list := make([]segtable.Chunk, len(h.Chunks))
	for i, c := range h.Chunks {
		hc := &helds[i]
		if hc.chunk == (segtable.Chunk{}) {
			var err error
			if hc.chunk, err = segtable.MakeChunk(c.Seq, hc.Bufs, c.MAC); err != nil {
				return nil, nil, err
			}
			next.held[c.Seq] = *hc
		}
		list[i] = hc.chunk
	}
	var prev *segtable.BufferChunks
	if s != nil {
		prev = s.list
	}
	cs, err := segtable.JoinChunks(prev, list, h.Signed)
	if err != nil {
		return nil, nil, err
	}
	next.list = cs
	d := h.Desc
	d.Endpoints = maps.Clone(h.Desc.Endpoints)
	d.Devices = slices.Clone(h.Desc.Devices)
	d.Buffers, d.Chunks, d.Chunked = nil, nil, cs
	if err := d.Validate(); err != nil {
		return nil, nil, err
	}
	return &d, next, nil
}

// Cache holds a Set per name for the reads of a store that keep nothing
// of their own (its Gets), and that its watches share, so that
// successive reads of a name share the chunks that did not change with
// each other and with the watches' events. It keeps the chunks of at
// most MaxBuffers buffers alive in all: a Set that would take it past
// starts that afresh. Past it, and for a name no read has stored since,
// it still finds a Set that something else keeps alive (a watch's),
// through a weak pointer: a long-lived reader holds no more of the
// segments it once read than that. Safe for concurrent use; the zero
// value is empty and ready. What it keeps alive lives until Store
// replaces or drops it, or the Cache goes.
type Cache struct {
	mu    sync.Mutex
	sets  map[string]*Set // kept alive, MaxBuffers in all
	n     int             // buffers
	weak  map[string]weak.Pointer[Set]
	prune int // len(weak) at which Store next drops the names whose Set is gone
}

// MaxBuffers bounds the buffers of the chunks a Cache keeps alive (some
// 100 to 300 bytes each with their keys): about one descriptor of 100k
// buffers. A watch keeps its own Set besides, which the Cache finds too.
const MaxBuffers = 1 << 17

// Load returns the Set held for name, or nil.
func (c *Cache) Load(name string) *Set {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s := c.sets[name]; s != nil {
		return s
	}
	return c.weak[name].Value()
}

// Store holds s for name in place of what was held (nil: nothing is);
// past MaxBuffers, s alone.
// Of two reads of a name that race, the last to store wins: either Set is
// a valid base for the next read.
func (c *Cache) Store(name string, s *Set) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.sets[name]; ok {
		c.n -= old.Len()
		delete(c.sets, name)
	}
	delete(c.weak, name)
	if s == nil {
		return
	}
	if c.weak == nil {
		c.weak = make(map[string]weak.Pointer[Set])
	}
	if len(c.weak) >= c.prune {
		for k, w := range c.weak {
			if w.Value() == nil {
				delete(c.weak, k)
			}
		}
		c.prune = max(2*len(c.weak), 64)
	}
	c.weak[name] = weak.Make(s)
	if c.n+s.Len() > MaxBuffers {
		clear(c.sets)
		c.n = 0
	}
	if c.sets == nil {
		c.sets = make(map[string]*Set)
	}
	c.sets[name] = s
	c.n += s.Len()
}
