package metadata

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/moonring/moonring/segtable"
)

// pollWatch is a watch that polls an HTTP endpoint for one name with
// If-None-Match: the p2p store's watch of a peer and the HTTP store's watch
// of its server. Only its goroutine (or Watch, before starting it) touches
// it.
type pollWatch struct {
	// fetch asks for the descriptor (ifNoneMatch: the ETag held, or "").
	fetch func(ctx context.Context, ifNoneMatch string) (peerAnswer, error)
	poll  time.Duration
	done  func()     // the store's WaitGroup Done, when the watch ends
	ch    chan Event // only this watch sends, so SendLatest cannot block
	// last is a private copy of the descriptor last delivered (a Chunked
	// one's header; the chunks are shared, immutable), nil before the
	// first and after a Deleted; lastBody is its JSON, to tell changes
	// apart whatever ETags the other side sends.
	last     *segtable.SegmentDesc
	lastBody []byte
	etag     string // of last, for If-None-Match
	fails    int    // polls failed in a row
}

func (w *pollWatch) run(ctx context.Context, stop context.CancelFunc) {
	defer w.done()
	defer close(w.ch)
	defer stop()
	t := time.NewTicker(w.poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.step(ctx)
	}
}

// step polls once and delivers what changed: a new descriptor, or Deleted
// on a 404 or after p2pGoneAfter failed polls in a row.
func (w *pollWatch) step(ctx context.Context) {
	inm := ""
	if w.last != nil {
		inm = w.etag
	}
	a, err := w.fetch(ctx, inm)
	switch {
	case err != nil:
		if ctx.Err() != nil {
			return // the watch is ending; its failure says nothing of the other side
		}
		if w.fails++; w.fails >= p2pGoneAfter {
			w.gone()
		}
	case a.notModified:
		w.fails = 0
	case a.desc == nil:
		w.fails = 0
		w.gone()
	default:
		w.fails = 0
		// A new ETag is a new Put, even of the same descriptor, as Memory
		// delivers; the body tells changes apart for peers without ETags.
		changed := w.last == nil || a.etag != w.etag || !bytes.Equal(a.body, w.lastBody)
		w.etag = a.etag
		if changed {
			w.last, w.lastBody = a.desc.CloneShared(), a.body // a Chunked one shares its chunks
			SendLatest(w.ch, Event{Desc: a.desc})
		}
	}
}

// gone delivers Deleted once for the descriptor last delivered.
func (w *pollWatch) gone() {
	if w.last == nil {
		return
	}
	SendLatest(w.ch, Event{Desc: w.last, Deleted: true})
	w.last, w.lastBody, w.etag = nil, nil, ""
}

// readDesc reads a 200 answer's descriptor for name, from who ("peer",
// "server"), refusing bodies over max bytes and descriptors that do not
// validate or name another segment: nothing from the other side is trusted.
func readDesc(resp *http.Response, name string, max int64, who string) (peerAnswer, error) {
	if resp.ContentLength > max {
		return peerAnswer{}, fmt.Errorf("%w: %s's answer is %d bytes, more than %d", segtable.ErrBadDesc, who, resp.ContentLength, max)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, max+1))
	if err != nil {
		return peerAnswer{}, fmt.Errorf("%w: reading the answer: %w", ErrUnreachable, err)
	}
	if int64(len(body)) > max {
		return peerAnswer{}, fmt.Errorf("%w: %s's answer is more than %d bytes", segtable.ErrBadDesc, who, max)
	}
	d, err := segtable.UnmarshalDesc(body)
	if err != nil {
		return peerAnswer{}, fmt.Errorf("%s's answer: %w", who, err)
	}
	if d.Name != name {
		return peerAnswer{}, fmt.Errorf("%w: %s serves segment %q", segtable.ErrBadDesc, who, d.Name)
	}
	return peerAnswer{desc: d, body: body, etag: resp.Header.Get("ETag")}, nil
}
