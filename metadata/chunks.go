// chunks.go holds the per-chunk wire format that a metadata [Server] and
// its [HTTP] stores speak beside whole descriptors: a descriptor whose
// buffers come as copy-on-write chunks (segtable.SegmentDesc.Chunked)
// travels as its chunks, each under (name, epoch, seq) and sent once, and
// a header that lists them, so that a republish after one registration
// moves one or two chunks and the header, not every buffer.

package metadata

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"slices"

	"github.com/moonring/moonring/segtable"
)

const (
	// chunkLayout marks a header: the body that lists a descriptor's
	// chunks. A body without it is a whole descriptor.
	chunkLayout = "moonring-chunks/1"
	// headerChunks is the response header by which a server says it
	// takes and serves chunks ("1"); a client that gets a 404 or 405
	// without it from a chunk request speaks whole descriptors to that
	// server from then on.
	headerChunks = "Moonring-Chunks"
	// maxEntryChunks bounds the chunks a header may list (4M buffers in
	// full chunks).
	maxEntryChunks = 1 << 17
	// maxChunkBuffers bounds the buffers of one chunk (a publisher's hold
	// segtable.ChunkSize).
	maxChunkBuffers = 1024
	// chunkFetchBatch is how many chunks one GET of chunks asks for.
	chunkFetchBatch = 256
	// chunkPutTries bounds the header PUTs of one publish that find
	// chunks missing on the server (dropped as unreferenced meanwhile).
	chunkPutTries = 3
)

// errMissingChunks reports a header PUT that the server refused (412)
// because it does not hold every chunk the header lists; the answer names
// them.
var errMissingChunks = errors.New("the server lacks chunks the header lists")

// chunkHeader is the body of a header PUT and of a header GET. Layout
// comes first, so that isChunkHeader needs no decoding.
type chunkHeader struct {
	Layout string `json:"layout"`
	// Signed: Desc.Chunks of the flat descriptor are Chunks (with their
	// MACs); unsigned, the flat descriptor has none.
	Signed bool `json:"signed,omitempty"`
	// Desc is the descriptor without its buffers (Buffers, Chunks nil).
	Desc segtable.SegmentDesc `json:"desc"`
	// Chunks lists the chunks in address order.
	Chunks []headerChunk `json:"chunks"`
}

// headerChunk is one chunk a header lists: its sequence number, its
// number of buffers, the first 64 bits of the SHA-256 of its encoding
// and, signed, its MAC. The hash names the chunk on the server together
// with (epoch, seq) (a seq is a chunk's only within a publisher's
// ChunkList: a flat descriptor's chunks are numbered from 1 on every
// Signed Put), and lets a reader tell a chunk it holds from another of
// the same seq; it authenticates nothing (the MACs do).
type headerChunk struct {
	Seq uint64 `json:"s"`
	N   int    `json:"n"`
	Sum uint64 `json:"h"`
	MAC string `json:"m,omitempty"`
}

// missingJSON is the body of a 412 answer to a header PUT.
type missingJSON struct {
	Missing []uint64 `json:"missing"`
}

var chunkHeaderMark = []byte(`{"layout":"` + chunkLayout + `"`)

// isChunkHeader reports whether body is a header rather than a whole
// descriptor.
func isChunkHeader(body []byte) bool { return bytes.HasPrefix(body, chunkHeaderMark) }

// chunkSum returns the hash of a chunk's encoding a header lists.
func chunkSum(value []byte) uint64 {
	h := sha256.Sum256(value)
	return binary.BigEndian.Uint64(h[:8])
}

// parseChunkHeader decodes and checks a header of segment name.
func parseChunkHeader(name string, body []byte) (*chunkHeader, error) {
	h := new(chunkHeader)
	if err := json.Unmarshal(body, h); err != nil {
		return nil, fmt.Errorf("%w: header: %v", segtable.ErrBadDesc, err)
	}
	switch {
	case h.Layout != chunkLayout:
		return nil, fmt.Errorf("%w: layout %q", segtable.ErrBadDesc, h.Layout)
	case h.Desc.Buffers != nil || h.Desc.Chunks != nil:
		return nil, fmt.Errorf("%w: a header with buffers", segtable.ErrBadDesc)
	case len(h.Chunks) == 0:
		return nil, fmt.Errorf("%w: a header of no chunk", segtable.ErrBadDesc)
	case len(h.Chunks) > maxEntryChunks:
		return nil, fmt.Errorf("%w: a header of %d chunks, over %d", segtable.ErrBadDesc, len(h.Chunks), maxEntryChunks)
	}
	if err := h.Desc.Validate(); err != nil {
		return nil, err
	}
	if h.Desc.Name != name {
		return nil, fmt.Errorf("%w: header of segment %q under %q", segtable.ErrBadDesc, h.Desc.Name, name)
	}
	for _, c := range h.Chunks {
		if c.N < 1 || c.N > maxChunkBuffers {
			return nil, fmt.Errorf("%w: chunk %d of %d buffers", segtable.ErrBadDesc, c.Seq, c.N)
		}
	}
	return h, nil
}

// decodeChunkValue decodes and checks the encoding of one chunk: a JSON
// array of 1 to maxChunkBuffers buffers, each valid, sorted and not
// overlapping, encoded exactly as json.Marshal encodes them (so that the
// whole descriptor a server assembles is the flat one, byte for byte).
func decodeChunkValue(value []byte) ([]segtable.BufferDesc, error) {
	var bufs []segtable.BufferDesc
	if err := json.Unmarshal(value, &bufs); err != nil {
		return nil, fmt.Errorf("%w: chunk: %v", segtable.ErrBadDesc, err)
	}
	if len(bufs) < 1 || len(bufs) > maxChunkBuffers {
		return nil, fmt.Errorf("%w: chunk of %d buffers", segtable.ErrBadDesc, len(bufs))
	}
	d := segtable.SegmentDesc{Version: segtable.DescVersion, Name: "chunk", Buffers: bufs}
	if err := d.Validate(); err != nil {
		return nil, err
	}
	return bufs, nil
}

// canonicalChunk checks that value is what json.Marshal makes of bufs.
func canonicalChunk(value []byte, bufs []segtable.BufferDesc) error {
	c, err := json.Marshal(bufs)
	if err != nil {
		return fmt.Errorf("%w: chunk: %v", segtable.ErrBadDesc, err)
	}
	if !bytes.Equal(c, value) {
		return fmt.Errorf("%w: chunk not encoded as json.Marshal encodes it", segtable.ErrBadDesc)
	}
	return nil
}

// heldChunk is a chunk as a reader holds it.
type heldChunk struct {
	sum  uint64
	mac  string
	bufs []segtable.BufferDesc
}

// assembleChunks returns the flat descriptor of h with the buffers chunk
// returns for each chunk it lists: what UnmarshalDesc returns of the
// whole descriptor (sorted, validated). The buffers' Keys maps are
// copied, so that the result is the caller's own.
func assembleChunks(h *chunkHeader, chunk func(seq uint64) heldChunk) (*segtable.SegmentDesc, error) {
	d := h.Desc
	d.Endpoints = cloneStrings(h.Desc.Endpoints)
	d.Devices = slices.Clone(h.Desc.Devices)
	total := 0
	for _, c := range h.Chunks {
		total += c.N
	}
	d.Buffers = make([]segtable.BufferDesc, 0, total)
	if h.Signed {
		d.Chunks = make([]segtable.ChunkInfo, len(h.Chunks))
	}
	for i, c := range h.Chunks {
		bufs := chunk(c.Seq).bufs
		if len(bufs) != c.N {
			return nil, fmt.Errorf("%w: chunk %d holds %d buffers, its header says %d", segtable.ErrBadDesc, c.Seq, len(bufs), c.N)
		}
		for _, b := range bufs {
			b.Keys = cloneStrings(b.Keys)
			d.Buffers = append(d.Buffers, b)
		}
		if d.Chunks != nil {
			d.Chunks[i] = segtable.ChunkInfo{Seq: c.Seq, N: c.N, MAC: c.MAC}
		}
	}
	if !slices.IsSortedFunc(d.Buffers, func(a, b segtable.BufferDesc) int { return cmpUint(a.Addr, b.Addr) }) {
		slices.SortStableFunc(d.Buffers, func(a, b segtable.BufferDesc) int { return cmpUint(a.Addr, b.Addr) })
	}
	if err := d.Validate(); err != nil {
		return nil, err
	}
	return &d, nil
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func cloneStrings(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	c := make(map[string]string, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}
