// Package chunkwire is the per-chunk format of a descriptor that the
// networked metadata stores share (the HTTP server and its store, p2p,
// etcd): a descriptor whose buffers come as copy-on-write chunks
// (segtable.SegmentDesc.Chunked) travels as its chunks, each the JSON of
// its buffers under (name, epoch, seq), and a header that lists them, so
// that a republish after one registration moves the chunks it made and
// the header, not every buffer. Where each store keeps the pieces is its
// own; what they hold, and how a reader checks and assembles them, is
// here, and so is what a reader keeps of the chunks it read (Set, Cache)
// to hand out descriptors that share the chunks a republish did not
// change (AssembleChunked).
package chunkwire

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"maps"
	"slices"

	"github.com/moonring/moonring/segtable"
)

const (
	// Layout marks a header. A body without it is a whole descriptor.
	Layout = "moonring-chunks/1"
	// MaxChunks bounds the chunks a header may list (4M buffers in full
	// chunks).
	MaxChunks = 1 << 17
	// MaxChunkBuffers bounds the buffers of one chunk (a publisher's
	// hold segtable.ChunkSize).
	MaxChunkBuffers = 1024
)

// Header is the body that lists a descriptor's chunks. Layout comes
// first, so that IsHeader needs no decoding.
type Header struct {
	Layout string `json:"layout"`
	// Signed: Desc.Chunks of the flat descriptor are Chunks (with their
	// MACs); unsigned, the flat descriptor has none.
	Signed bool `json:"signed,omitempty"`
	// Desc is the descriptor without its buffers (Buffers, Chunks nil).
	Desc segtable.SegmentDesc `json:"desc"`
	// Chunks lists the chunks in address order.
	Chunks []Chunk `json:"chunks"`
}

// Chunk is one chunk a header lists: its sequence number, its number of
// buffers, the Sum of its encoding and, signed, its MAC. The sum names the
// chunk together with (epoch, seq) (a seq is a chunk's only within a
// publisher's ChunkList: a flat descriptor's chunks are numbered from 1
// on every Signed Put), and lets a reader tell a chunk it holds from
// another of the same seq; it authenticates nothing (the MACs do).
type Chunk struct {
	Seq uint64 `json:"s"`
	N   int    `json:"n"`
	Sum uint64 `json:"h"`
	MAC string `json:"m,omitempty"`
}

// Held is a chunk as a reader holds it: the sum and MAC its header
// listed and its buffers, decoded, which nobody modifies once held (the
// descriptors assembled share them).
type Held struct {
	Sum  uint64
	MAC  string
	Bufs []segtable.BufferDesc
	// chunk is Bufs as a chunk of the descriptors AssembleChunked makes,
	// made by the first; zero before.
	chunk segtable.Chunk
}

// Matches reports whether h is the chunk c lists.
func (h Held) Matches(c Chunk) bool {
	return h.Sum == c.Sum && h.MAC == c.MAC && len(h.Bufs) == c.N
}

var mark = []byte(`{"layout":"` + Layout + `"`)

// IsHeader reports whether body is a header rather than a whole
// descriptor.
func IsHeader(body []byte) bool { return bytes.HasPrefix(body, mark) }

// NewHeader returns the header of d, a Chunked descriptor, with no chunk
// listed yet (the caller appends them as it encodes them).
func NewHeader(d *segtable.SegmentDesc) Header {
	h := Header{Layout: Layout, Signed: d.Chunked.Signed(), Desc: *d, Chunks: make([]Chunk, 0, d.Chunked.Count())}
	h.Desc.Buffers, h.Desc.Chunks, h.Desc.Chunked = nil, nil, nil
	return h
}

// Encode returns the encoding of a chunk's buffers.
func Encode(bufs []segtable.BufferDesc) ([]byte, error) {
	v, err := json.Marshal(bufs)
	if err != nil {
		return nil, fmt.Errorf("%w: chunk: %v", segtable.ErrBadDesc, err)
	}
	return v, nil
}

// Sum returns the sum of a chunk's encoding a header lists: the first 64
// bits of its SHA-256.
func Sum(value []byte) uint64 {
	h := sha256.Sum256(value)
	return binary.BigEndian.Uint64(h[:8])
}

// ParseHeader decodes and checks a header read under segment name: the
// layout, no buffers of its own, at most MaxChunks chunks of 1 to
// MaxChunkBuffers buffers each, a valid descriptor of that name.
func ParseHeader(name string, body []byte) (*Header, error) {
	h := new(Header)
	if err := json.Unmarshal(body, h); err != nil {
		return nil, fmt.Errorf("%w: header: %v", segtable.ErrBadDesc, err)
	}
	switch {
	case h.Layout != Layout:
		return nil, fmt.Errorf("%w: layout %q", segtable.ErrBadDesc, h.Layout)
	case h.Desc.Buffers != nil || h.Desc.Chunks != nil:
		return nil, fmt.Errorf("%w: a header with buffers", segtable.ErrBadDesc)
	case len(h.Chunks) > MaxChunks:
		return nil, fmt.Errorf("%w: a header of %d chunks, over %d", segtable.ErrBadDesc, len(h.Chunks), MaxChunks)
	}
	if err := h.Desc.Validate(); err != nil {
		return nil, err
	}
	if h.Desc.Name != name {
		return nil, fmt.Errorf("%w: the header of segment %q under %q", segtable.ErrBadDesc, h.Desc.Name, name)
	}
	for _, c := range h.Chunks {
		if c.N < 1 || c.N > MaxChunkBuffers {
			return nil, fmt.Errorf("%w: chunk %d of %d buffers", segtable.ErrBadDesc, c.Seq, c.N)
		}
	}
	return h, nil
}

// Decode decodes and checks the encoding of one chunk: a JSON array of 1
// to MaxChunkBuffers buffers, each valid, sorted and not overlapping.
func Decode(value []byte) ([]segtable.BufferDesc, error) {
	var bufs []segtable.BufferDesc
	if err := json.Unmarshal(value, &bufs); err != nil {
		return nil, fmt.Errorf("%w: chunk: %v", segtable.ErrBadDesc, err)
	}
	if len(bufs) < 1 || len(bufs) > MaxChunkBuffers {
		return nil, fmt.Errorf("%w: chunk of %d buffers", segtable.ErrBadDesc, len(bufs))
	}
	d := segtable.SegmentDesc{Version: segtable.DescVersion, Name: "chunk", Buffers: bufs}
	if err := d.Validate(); err != nil {
		return nil, err
	}
	return bufs, nil
}

// DecodeListed is Decode of the value read for chunk c of a header: its
// Sum and its number of buffers must be the ones c lists.
func DecodeListed(c Chunk, value []byte) (Held, error) {
	if sum := Sum(value); sum != c.Sum {
		return Held{}, fmt.Errorf("%w: chunk %d hashes to %#x, its header says %#x", segtable.ErrBadDesc, c.Seq, sum, c.Sum)
	}
	bufs, err := Decode(value)
	if err != nil {
		return Held{}, fmt.Errorf("chunk %d: %w", c.Seq, err)
	}
	if len(bufs) != c.N {
		return Held{}, fmt.Errorf("%w: chunk %d holds %d buffers, its header says %d", segtable.ErrBadDesc, c.Seq, len(bufs), c.N)
	}
	return Held{Sum: c.Sum, MAC: c.MAC, Bufs: bufs}, nil
}

// Assemble returns the flat descriptor of h with the buffers chunk
// returns for each chunk it lists: what segtable.UnmarshalDesc returns of
// the whole descriptor (sorted, validated). The buffers' Keys maps are
// copied when clone is set, so that the result is the caller's own.
func Assemble(h *Header, chunk func(seq uint64) Held, clone bool) (*segtable.SegmentDesc, error) {
	d := h.Desc
	d.Endpoints = maps.Clone(h.Desc.Endpoints)
	d.Devices = slices.Clone(h.Desc.Devices)
	total := 0
	for _, c := range h.Chunks {
		total += c.N
	}
	d.Buffers = make([]segtable.BufferDesc, 0, total)
	if h.Signed && len(h.Chunks) > 0 {
		d.Chunks = make([]segtable.ChunkInfo, len(h.Chunks))
	}
	for i, c := range h.Chunks {
		bufs := chunk(c.Seq).Bufs
		if len(bufs) != c.N {
			return nil, fmt.Errorf("%w: chunk %d holds %d buffers, its header says %d", segtable.ErrBadDesc, c.Seq, len(bufs), c.N)
		}
		for _, b := range bufs {
			if clone {
				b.Keys = maps.Clone(b.Keys)
			}
			d.Buffers = append(d.Buffers, b)
		}
		if d.Chunks != nil {
			d.Chunks[i] = segtable.ChunkInfo{Seq: c.Seq, N: c.N, MAC: c.MAC}
		}
	}
	byAddr := func(a, b segtable.BufferDesc) int { return cmp.Compare(a.Addr, b.Addr) }
	if !slices.IsSortedFunc(d.Buffers, byAddr) {
		slices.SortStableFunc(d.Buffers, byAddr)
	}
	if err := d.Validate(); err != nil {
		return nil, err
	}
	return &d, nil
}
