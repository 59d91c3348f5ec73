// p2p_chunks.go holds how a [P2P] store serves a descriptor whose buffers
// come as chunks (segtable.SegmentDesc.Chunked) as a header and chunks
// (the format of chunks.go, as a metadata Server serves them), so that a
// peer's watch fetches after a republish the header and the chunks it
// lacks, not every buffer; the whole descriptor is still served, made
// from the chunks when first asked for.

package metadata

import (
	"context"
	"fmt"
	"net/http"

	"github.com/moonring/moonring/segtable"
)

// Paths of a P2P store's descriptor as a header and chunks.
const (
	p2pHeaderPath = p2pSegmentPath + "/header"
	p2pChunksPath = p2pSegmentPath + "/chunks"
)

// putChunked publishes d, a Chunked descriptor, as Put does, keeping it as
// a header and chunks: the encodings of the chunks the last publish of
// the epoch made are kept (by seq and chunk pointer), so a republish
// encodes the chunks it made, and the whole descriptor is made when a
// peer first asks for it.
func (p *P2P) putChunked(ctx context.Context, d *segtable.SegmentDesc) error {
	p.mu.Lock()
	prev := p.pub
	p.mu.Unlock()
	var sent map[uint64]*sentChunk
	if prev != nil && prev.epoch == d.Epoch {
		sent = prev.bySeq
	}
	pub, hd, err := newChunkPub(d, sent, p2pMaxDesc)
	if err != nil {
		return p.errorf("put", d.Name, err)
	}
	pre, post, err := wholeParts(hd)
	if err != nil {
		return p.errorf("put", d.Name, err)
	}
	return p.publish(ctx, d.CloneShared(), nil, pub, pre, post)
}

// wholeBody returns what serveSegment serves: the whole descriptor, made
// from the chunks (and kept) when published as chunks, and its ETag; nil
// when none is published.
func (p *P2P) wholeBody() ([]byte, string) {
	p.mu.Lock()
	body, etag, pub, pre, post := p.body, p.etag, p.pub, p.pre, p.post
	p.mu.Unlock()
	if body != nil || pub == nil {
		return body, etag
	}
	body = joinWhole(pre, post, len(pub.chunks), func(i int) []byte { return pub.chunks[i].value })
	p.mu.Lock()
	if p.pub == pub && p.body == nil {
		p.body = body
	}
	p.mu.Unlock()
	return body, etag
}

// serveHeader answers GET /moonring/v1/segment/header: the header of a
// descriptor published as chunks, the whole descriptor otherwise, 304 or
// 404 as serveSegment does.
func (p *P2P) serveHeader(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	pub, etag := p.pub, p.etag
	p.mu.Unlock()
	var body []byte
	if pub != nil {
		body = pub.header
	} else {
		body, etag = p.wholeBody()
	}
	serveBody(w, r, body, etag)
}

// serveChunks answers GET /moonring/v1/segment/chunks?epoch=E&seq=S1,..:
// at most chunkFetchBatch chunks the published header lists, a JSON
// array of their encodings, as a metadata Server does; 404 when it lists
// none of that epoch and seq.
func (p *P2P) serveChunks(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Cache-Control", "no-cache")
	h.Set(headerChunks, "1")
	epoch, seqs, ok := chunkQuery(w, r)
	if !ok {
		return
	}
	p.mu.Lock()
	pub, etag := p.pub, p.etag
	p.mu.Unlock()
	if pub == nil || pub.epoch != epoch {
		http.Error(w, fmt.Sprintf("no chunk of epoch %d published", epoch), http.StatusNotFound)
		return
	}
	chunks := make([]*sentChunk, len(seqs))
	for i, seq := range seqs {
		if chunks[i] = pub.bySeq[seq]; chunks[i] == nil {
			http.Error(w, fmt.Sprintf("no chunk %d published", seq), http.StatusNotFound)
			return
		}
	}
	writeChunks(w, etag, len(chunks), func(i int) []byte { return chunks[i].value })
}

// chunkWatch returns a reader of the descriptor of name from the peer at
// u (its segment URL).
func (p *P2P) chunkWatch(u, name string) *chunkWatch {
	return &chunkWatch{name: name, base: u, do: p.doURL,
		whole: func(ctx context.Context, inm string) (peerAnswer, error) { return p.fetch(ctx, u, name, inm) },
		max:   p2pMaxDesc, who: "peer", cache: &p.chunks}
}

// doURL sends a request to a peer and returns the response, whose body
// the caller closes, or an error wrapping ErrUnreachable.
func (p *P2P) doURL(ctx context.Context, method, u string, header http.Header, _ []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	return resp, nil
}
