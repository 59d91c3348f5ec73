// http_chunks.go holds how an [HTTP] store publishes a descriptor whose
// buffers come as chunks (segtable.SegmentDesc.Chunked) to a server that
// takes them (chunks.go): the chunks not sent before in the epoch, then
// the header; and how its watches fetch a header and only the chunks they
// lack. Against a server that does not know these requests (an older
// one) it speaks whole descriptors, as before.

package metadata

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/segtable"
)

// errNoChunks reports a server that does not know the chunk requests
// (a 404 or 405 without headerChunks): the store speaks whole descriptors
// to it from then on.
var errNoChunks = errors.New("the server takes no chunks")

// sentChunk is one chunk as an HTTP store sends it, cached for the
// publishes of an epoch by seq: immutable once made.
type sentChunk struct {
	seq uint64
	// first is &bufs[0] of the chunk it encodes: a chunk is immutable, so
	// the same pointer is the same content (seq alone is not: a flat
	// descriptor's chunks are numbered from 1 on every Signed Put).
	first *segtable.BufferDesc
	n     int
	value []byte
	sum   uint64
}

// chunkPub is a publication of a Chunked descriptor: its header and the
// chunks it lists. Immutable once made.
type chunkPub struct {
	epoch  uint64
	header []byte
	chunks []*sentChunk
	bySeq  map[uint64]*sentChunk
}

// chunkedPub returns d, a Chunked descriptor, as a header and its chunks,
// taking the encodings of the chunks n sent in the epoch. n.sem is held.
func (h *HTTP) chunkedPub(n *httpName, d *segtable.SegmentDesc) (*chunkPub, error) {
	sent := n.sent
	if n.sentEpoch != d.Epoch {
		sent = nil
	}
	pub, _, err := newChunkPub(d, sent, serverMaxDesc)
	return pub, err
}

// newChunkPub returns d, a Chunked descriptor, as a header (also returned
// decoded) and its chunks, taking the encodings of those sent holds (by
// seq, the same chunk by pointer), made for d's epoch; a chunk or header
// over max bytes is segtable.ErrBadDesc.
func newChunkPub(d *segtable.SegmentDesc, sent map[uint64]*sentChunk, max int) (*chunkPub, *chunkHeader, error) {
	cs := d.Chunked
	if c := cs.Count(); c > maxEntryChunks {
		return nil, nil, fmt.Errorf("%w: %d chunks, more than the %d a header lists", segtable.ErrBadDesc, c, maxEntryChunks)
	}
	hd := chunkwire.NewHeader(d)
	pub := &chunkPub{epoch: d.Epoch, chunks: make([]*sentChunk, 0, cs.Count()), bySeq: make(map[uint64]*sentChunk, cs.Count())}
	var err error
	cs.EachChunk(func(info segtable.ChunkInfo, bufs []segtable.BufferDesc) bool {
		c := sent[info.Seq]
		if c == nil || c.first != &bufs[0] || c.n != len(bufs) {
			var v []byte
			if v, err = chunkwire.Encode(bufs); err != nil {
				return false
			}
			if len(v) > max {
				err = fmt.Errorf("%w: chunk %d encodes to %d bytes, over %d", segtable.ErrBadDesc, info.Seq, len(v), max)
				return false
			}
			c = &sentChunk{seq: info.Seq, first: &bufs[0], n: len(bufs), value: v, sum: chunkSum(v)}
		}
		if pub.bySeq[info.Seq] != nil {
			err = fmt.Errorf("%w: chunk %d twice", segtable.ErrBadDesc, info.Seq)
			return false
		}
		hd.Chunks = append(hd.Chunks, headerChunk{Seq: info.Seq, N: info.N, Sum: c.sum, MAC: info.MAC})
		pub.chunks = append(pub.chunks, c)
		pub.bySeq[info.Seq] = c
		return true
	})
	if err != nil {
		return nil, nil, err
	}
	if pub.header, err = json.Marshal(&hd); err != nil {
		return nil, nil, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err)
	}
	if len(pub.header) > max {
		return nil, nil, fmt.Errorf("%w: a header of %d bytes, over %d", segtable.ErrBadDesc, len(pub.header), max)
	}
	return pub, &hd, nil
}

// publishChunks sends pub: the chunks n has not sent in its epoch, then
// the header (a renewal when renew is set); when the server answers that
// it lacks chunks (it dropped them, or lost its state), it sends those
// and the header again, chunkPutTries times at most. It fails with
// errNoChunks when the server does not know these requests. n.sem is
// held.
func (h *HTTP) publishChunks(ctx context.Context, n *httpName, pub *chunkPub, renew bool) error {
	if n.sentEpoch != pub.epoch || n.sent == nil {
		n.sent, n.sentEpoch = make(map[uint64]*sentChunk, len(pub.chunks)), pub.epoch
	}
	for _, c := range pub.chunks {
		if n.sent[c.seq] != c {
			if err := h.putChunk(ctx, n, pub.epoch, c); err != nil {
				return err
			}
		}
	}
	for try := 1; ; try++ {
		missing, err := h.putHeader(ctx, n.name, pub.header, renew)
		if err == nil {
			n.sent = pub.bySeq // the server holds these, and drops the others
			return nil
		}
		if !errors.Is(err, errMissingChunks) || try >= chunkPutTries {
			return err
		}
		for _, seq := range missing {
			c := pub.bySeq[seq]
			if c == nil {
				return fmt.Errorf("%w: server asks for chunk %d, which the header does not list", ErrUnreachable, seq)
			}
			if err := h.putChunk(ctx, n, pub.epoch, c); err != nil {
				return err
			}
		}
	}
}

// noChunks reports whether resp is an older server's answer to a request
// it does not know.
func noChunks(resp *http.Response) bool {
	return (resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed) &&
		resp.Header.Get(headerChunks) == ""
}

// putChunk sends one chunk of n's name and records it sent. n.sem is held.
func (h *HTTP) putChunk(ctx context.Context, n *httpName, epoch uint64, c *sentChunk) error {
	hdr := http.Header{"Content-Type": {"application/json"}}
	h.owner(hdr, n.name)
	u := h.segmentURL(n.name) + "/chunks/" + strconv.FormatUint(epoch, 10) + "/" + strconv.FormatUint(c.seq, 10)
	resp, err := h.doURL(ctx, http.MethodPut, u, hdr, c.value)
	if err != nil {
		return err
	}
	if noChunks(resp) {
		answer(resp)
		return errNoChunks
	}
	if err := putErr(resp); err != nil {
		return err
	}
	n.sent[c.seq] = c
	return nil
}

// putHeader sends a header PUT, a renewal when renew is set; when the
// server lacks chunks the header lists, it returns their seqs with an
// error wrapping errMissingChunks.
func (h *HTTP) putHeader(ctx context.Context, name string, header []byte, renew bool) ([]uint64, error) {
	hdr := http.Header{"Content-Type": {"application/json"}}
	hdr.Set(headerTTL, h.ttlHeader)
	if renew {
		hdr.Set(headerRenew, "1")
	}
	h.owner(hdr, name)
	resp, err := h.doURL(ctx, http.MethodPut, h.segmentURL(name)+"/header", hdr, header)
	if err != nil {
		return nil, err
	}
	if noChunks(resp) {
		answer(resp)
		return nil, errNoChunks
	}
	if resp.StatusCode == http.StatusPreconditionFailed {
		defer resp.Body.Close()
		var m missingJSON
		if err := json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&m); err != nil || len(m.Missing) == 0 {
			return nil, fmt.Errorf("%w: a 412 that names no missing chunk", ErrUnreachable)
		}
		return m.Missing, fmt.Errorf("%w: %d", errMissingChunks, len(m.Missing))
	}
	return nil, putErr(resp)
}

// putErr maps the answer to a PUT (of a descriptor, a header or a
// chunk) to its error, nil for success, closing its body.
func putErr(resp *http.Response) error {
	switch resp.StatusCode {
	case http.StatusOK, http.StatusCreated, http.StatusNoContent:
		answer(resp)
		return nil
	case http.StatusConflict:
		return fmt.Errorf("%w: %s", ErrExists, answer(resp))
	case http.StatusBadRequest, http.StatusRequestEntityTooLarge:
		return fmt.Errorf("%w: server refused it: %s", segtable.ErrBadDesc, answer(resp))
	case http.StatusTooManyRequests:
		return fmt.Errorf("%w: %s", ErrQuota, answer(resp))
	}
	return deniedErr(resp)
}

// chunkWatch is what a reader of a descriptor that a server (or a P2P
// peer) serves as a header and chunks holds: the chunks of the last
// header it assembled, which the descriptors it hands out share
// (chunkwire.AssembleChunked), so that a republish costs a reader the
// chunks it made. Only its watch's goroutine (or one Get) touches it.
type chunkWatch struct {
	name string
	// base is the descriptor's URL: base+"/header" its header,
	// base+"/chunks" its chunks.
	base string
	// do sends a request.
	do func(ctx context.Context, method, u string, header http.Header, body []byte) (*http.Response, error)
	// whole fetches the whole descriptor (ifNoneMatch as fetch's).
	whole func(ctx context.Context, ifNoneMatch string) (peerAnswer, error)
	// flatReads, when set, is set once the other side answers that it
	// serves no header, and read to skip asking.
	flatReads *atomic.Bool
	max       int64  // bounds an answer's bytes
	who       string // "server" or "peer"
	flat      bool   // the other side serves no headers: whole descriptors
	// set is the chunks of the last header assembled (nil: none yet, or
	// the last answer was no header); cache is the store's, shared with
	// its Gets and other watches of the name: the base of a watch's first
	// assembly, and where each puts what it assembled.
	set   *chunkwire.Set
	cache *chunkwire.Cache
}

// chunkWatch returns a reader of the descriptor of name from h's server.
func (h *HTTP) chunkWatch(name string) *chunkWatch {
	return &chunkWatch{name: name, base: h.segmentURL(name), do: h.doURL, flatReads: &h.flatReads,
		whole: func(ctx context.Context, inm string) (peerAnswer, error) { return h.fetch(ctx, name, inm) },
		max:   serverMaxDesc, who: "server", cache: &h.chunks}
}

// fetch asks for the header of the descriptor (ifNoneMatch: the ETag
// held, or "") and the chunks the watch lacks, and returns the assembled
// descriptor, with the header as its body; a whole descriptor from a
// server that serves no header, or holds one not sent as chunks.
//
// A republish between the header and the chunks (the other side serves
// the chunks of its newest header only) makes it read the header again;
// after chunkPutTries such races in a row, which a publisher that
// republishes faster than a round trip wins every time, it reads the
// whole descriptor, one answer that cannot be torn. A reader of a busy
// publisher so gets a descriptor each poll; were the races counted as
// failed polls instead, it would report the publisher gone.
func (cw *chunkWatch) fetch(ctx context.Context, ifNoneMatch string) (peerAnswer, error) {
	if cw.flat || (cw.flatReads != nil && cw.flatReads.Load()) {
		return cw.whole(ctx, ifNoneMatch)
	}
	for range chunkPutTries {
		a, err := cw.fetchOnce(ctx, ifNoneMatch)
		if !errors.Is(err, errMissingChunks) {
			return a, err
		}
	}
	return cw.whole(ctx, ifNoneMatch)
}

func (cw *chunkWatch) fetchOnce(ctx context.Context, ifNoneMatch string) (peerAnswer, error) {
	hdr := http.Header{"Accept": {"application/json"}}
	if ifNoneMatch != "" {
		hdr.Set("If-None-Match", ifNoneMatch)
	}
	resp, err := cw.do(ctx, http.MethodGet, cw.base+"/header", hdr, nil)
	if err != nil {
		return peerAnswer{}, err
	}
	capable := resp.Header.Get(headerChunks) != ""
	switch {
	case resp.StatusCode == http.StatusNotModified && ifNoneMatch != "":
		resp.Body.Close()
		return peerAnswer{notModified: true}, nil
	case !capable && resp.StatusCode != http.StatusOK:
		// Not a server that serves headers (or not one at all): what a
		// whole GET answers is the answer. Only a 404 or 405 says for
		// sure that it knows no headers.
		if noChunks(resp) {
			cw.flat = true
			if cw.flatReads != nil {
				cw.flatReads.Store(true)
			}
		}
		answer(resp)
		return cw.whole(ctx, ifNoneMatch)
	case resp.StatusCode == http.StatusOK:
	case resp.StatusCode == http.StatusNotFound:
		answer(resp)
		cw.keep(nil)
		return peerAnswer{}, nil
	default:
		return peerAnswer{}, statusErr(resp)
	}
	etag := resp.Header.Get("ETag")
	body, err := readBody(resp, cw.max, cw.who)
	if err != nil {
		return peerAnswer{}, err
	}
	if !isChunkHeader(body) {
		cw.keep(nil)
		a, err := descAnswer(body, cw.name, etag, cw.who)
		if err != nil && !capable {
			return cw.whole(ctx, ifNoneMatch) // something else answered at that path
		}
		return a, err
	}
	ch, err := parseChunkHeader(cw.name, body)
	if err != nil {
		return peerAnswer{}, err
	}
	base := cw.set
	if base == nil && cw.cache != nil {
		base = cw.cache.Load(cw.name)
	}
	var want []headerChunk
	for _, c := range ch.Chunks {
		if !base.Has(ch.Desc.Epoch, c) {
			want = append(want, c)
		}
	}
	got := make(map[uint64]heldChunk, len(want))
	for len(want) > 0 {
		batch := want[:min(len(want), chunkFetchBatch)]
		want = want[len(batch):]
		if err := cw.fetchChunks(ctx, ch.Desc.Epoch, batch, got); err != nil {
			return peerAnswer{}, err
		}
	}
	d, next, err := chunkwire.AssembleChunked(ch, base, got)
	if err != nil {
		return peerAnswer{}, fmt.Errorf("%s's answer: %w", cw.who, err)
	}
	cw.keep(next)
	return peerAnswer{desc: d, body: body, etag: etag}, nil
}

// keep makes s the chunks the watch holds, and the store's cache's for
// the name (nil: none).
func (cw *chunkWatch) keep(s *chunkwire.Set) {
	cw.set = s
	if cw.cache != nil {
		cw.cache.Store(cw.name, s)
	}
}

// fetchChunks GETs the chunks of batch into got, checking each against
// its header. A chunk the server no longer lists (a republish came
// between the header and this request), or that is not the one listed,
// is errMissingChunks: the caller reads the header again.
func (cw *chunkWatch) fetchChunks(ctx context.Context, epoch uint64, batch []headerChunk, got map[uint64]heldChunk) error {
	var q strings.Builder
	q.WriteString("?epoch=")
	q.WriteString(strconv.FormatUint(epoch, 10))
	q.WriteString("&seq=")
	for i, c := range batch {
		if i > 0 {
			q.WriteByte(',')
		}
		q.WriteString(strconv.FormatUint(c.Seq, 10))
	}
	resp, err := cw.do(ctx, http.MethodGet, cw.base+"/chunks"+q.String(), http.Header{"Accept": {"application/json"}}, nil)
	if err != nil {
		return err
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound:
		answer(resp)
		return fmt.Errorf("%w: the server no longer lists them", errMissingChunks)
	default:
		return statusErr(resp)
	}
	body, err := readBody(resp, cw.max, cw.who)
	if err != nil {
		return err
	}
	var values []json.RawMessage
	if err := json.Unmarshal(body, &values); err != nil || len(values) != len(batch) {
		return fmt.Errorf("%w: %s's chunks: %d for %d asked (%v)", segtable.ErrBadDesc, cw.who, len(values), len(batch), err)
	}
	for i, c := range batch {
		v := values[i]
		if chunkSum(v) != c.Sum {
			return fmt.Errorf("%w: chunk %d is not the one listed", errMissingChunks, c.Seq)
		}
		bufs, err := decodeChunkValue(v)
		if err != nil {
			return fmt.Errorf("%s's chunk %d: %w", cw.who, c.Seq, err)
		}
		if len(bufs) != c.N {
			return fmt.Errorf("%w: %s's chunk %d holds %d buffers, its header says %d", segtable.ErrBadDesc, cw.who, c.Seq, len(bufs), c.N)
		}
		got[c.Seq] = heldChunk{Sum: c.Sum, MAC: c.MAC, Bufs: bufs}
	}
	return nil
}

// readBody reads a 200 answer's body, at most max bytes, and closes it.
func readBody(resp *http.Response, max int64, who string) ([]byte, error) {
	defer resp.Body.Close()
	if resp.ContentLength > max {
		return nil, fmt.Errorf("%w: %s's answer is %d bytes, more than %d", segtable.ErrBadDesc, who, resp.ContentLength, max)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, max+1))
	if err != nil {
		return nil, fmt.Errorf("%w: reading the answer: %w", ErrUnreachable, err)
	}
	if int64(len(body)) > max {
		return nil, fmt.Errorf("%w: %s's answer is more than %d bytes", segtable.ErrBadDesc, who, max)
	}
	return body, nil
}

// descAnswer decodes a whole descriptor of name read from who.
func descAnswer(body []byte, name, etag, who string) (peerAnswer, error) {
	d, err := segtable.UnmarshalDesc(body)
	if err != nil {
		return peerAnswer{}, fmt.Errorf("%s's answer: %w", who, err)
	}
	if d.Name != name {
		return peerAnswer{}, fmt.Errorf("%w: %s serves segment %q", segtable.ErrBadDesc, who, d.Name)
	}
	return peerAnswer{desc: d, body: slices.Clip(body), etag: etag}, nil
}
