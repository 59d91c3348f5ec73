// chunks.go holds the per-chunk wire format that a metadata [Server] and
// its [HTTP] stores speak beside whole descriptors: a descriptor whose
// buffers come as copy-on-write chunks (segtable.SegmentDesc.Chunked)
// travels as its chunks, each under (name, epoch, seq) and sent once, and
// a header that lists them, so that a republish after one registration
// moves one or two chunks and the header, not every buffer.

package metadata

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/segtable"
)

const (
	chunkLayout     = chunkwire.Layout
	maxEntryChunks  = chunkwire.MaxChunks
	maxChunkBuffers = chunkwire.MaxChunkBuffers
	// headerChunks is the response header by which a server says it
	// takes and serves chunks ("1"); a client that gets a 404 or 405
	// without it from a chunk request speaks whole descriptors to that
	// server from then on.
	headerChunks = "Moonring-Chunks"
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

// The format's pieces (package chunkwire, shared with the etcd store).
type (
	chunkHeader = chunkwire.Header
	headerChunk = chunkwire.Chunk
	heldChunk   = chunkwire.Held
)

// missingJSON is the body of a 412 answer to a header PUT.
type missingJSON struct {
	Missing []uint64 `json:"missing"`
}

// isChunkHeader reports whether body is a header rather than a whole
// descriptor.
func isChunkHeader(body []byte) bool { return chunkwire.IsHeader(body) }

// chunkSum returns the sum of a chunk's encoding a header lists.
func chunkSum(value []byte) uint64 { return chunkwire.Sum(value) }

// parseChunkHeader decodes and checks a header of segment name
// (chunkwire.ParseHeader), which must list a chunk.
func parseChunkHeader(name string, body []byte) (*chunkHeader, error) {
	h, err := chunkwire.ParseHeader(name, body)
	if err == nil && len(h.Chunks) == 0 {
		err = fmt.Errorf("%w: a header of no chunk", segtable.ErrBadDesc)
	}
	return h, err
}

// decodeChunkValue decodes and checks the encoding of one chunk
// (chunkwire.Decode).
func decodeChunkValue(value []byte) ([]segtable.BufferDesc, error) { return chunkwire.Decode(value) }

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

// chunkQuery reads the epoch and the chunk numbers of a GET of chunks
// (?epoch=E&seq=S1,S2,..., at most chunkFetchBatch), or answers 400 and
// reports false.
func chunkQuery(w http.ResponseWriter, r *http.Request) (epoch uint64, seqs []uint64, ok bool) {
	q := r.URL.Query()
	epoch, err := strconv.ParseUint(q.Get("epoch"), 10, 64)
	if err != nil {
		http.Error(w, "bad epoch", http.StatusBadRequest)
		return 0, nil, false
	}
	list := strings.Split(q.Get("seq"), ",")
	if len(list) > chunkFetchBatch {
		http.Error(w, fmt.Sprintf("more than %d chunks asked for", chunkFetchBatch), http.StatusBadRequest)
		return 0, nil, false
	}
	seqs = make([]uint64, len(list))
	for i, v := range list {
		if seqs[i], err = strconv.ParseUint(v, 10, 64); err != nil {
			http.Error(w, fmt.Sprintf("bad chunk sequence number %q", v), http.StatusBadRequest)
			return 0, nil, false
		}
	}
	return epoch, seqs, true
}

// writeChunks answers a GET of chunks with the JSON array of n chunks'
// encodings, value(i) the i-th, and etag.
func writeChunks(w http.ResponseWriter, etag string, n int, value func(i int) []byte) {
	size := 2
	for i := range n {
		size += len(value(i)) + 1
	}
	b := make([]byte, 0, size)
	b = append(b, '[')
	for i := range n {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, value(i)...)
	}
	b = append(b, ']')
	h := w.Header()
	h.Set("ETag", etag)
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.Write(b)
}
