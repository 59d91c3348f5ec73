// p2p_watch.go holds the watches of a P2PStore: local ones of its own
// name, and polling ones of a peer's.

package mooncake

import (
	"bytes"
	"context"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// Watch returns a coalescing channel of the changes of name, closed when
// ctx is done or the store is closed: local for the store's own name,
// polled from the peer for another; see [P2PStore].
func (p *P2PStore) Watch(ctx context.Context, name string) (<-chan metadata.Event, error) {
	p.mu.Lock()
	if err := p.check(ctx, "watch", name); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	if name == p.name {
		defer p.mu.Unlock()
		return p.watchLocal(ctx), nil
	}
	p.remote.Add(1)
	p.mu.Unlock()

	wctx, stop := p.join(ctx)
	w := &peerWatch{p: p, name: name, ch: make(chan metadata.Event, 1)}
	if _, ok := peerAddr(name); !ok {
		w.fetch = func(context.Context) (*segtable.SegmentDesc, error) { return nil, nil }
	} else {
		w.fetch = func(ctx context.Context) (*segtable.SegmentDesc, error) { return p.fetch(ctx, name) }
	}
	w.step(wctx)
	if wctx.Err() != nil {
		stop()
		p.remote.Done()
		return nil, p.errorf("watch", name, p.ctxErr(ctx, wctx.Err()))
	}
	go w.run(wctx, stop)
	return w.ch, nil
}

// watchLocal registers a watch of the store's own name; p.mu is held.
func (p *P2PStore) watchLocal(ctx context.Context) <-chan metadata.Event {
	w := &localWatch{ch: make(chan metadata.Event, 1)}
	if p.desc != nil {
		w.ch <- metadata.Event{Desc: p.desc.Clone()}
	}
	p.watches[w] = struct{}{}
	// The function runs in its own goroutine, so it waits for mu if ctx is
	// already done; by then w is registered.
	w.stop = context.AfterFunc(ctx, func() { p.unwatch(w) })
	return w.ch
}

func (p *P2PStore) unwatch(w *localWatch) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.watches[w]; !ok {
		return // the store closed first
	}
	delete(p.watches, w)
	close(w.ch)
}

// peerWatch polls one peer. Only its goroutine (or Watch, before starting
// it) touches it.
type peerWatch struct {
	p     *P2PStore
	name  string
	fetch func(ctx context.Context) (*segtable.SegmentDesc, error)
	ch    chan metadata.Event // only this watch sends
	// last is a private copy of the descriptor last delivered, nil before
	// the first and after a Deleted; lastJSON its moonring JSON, to tell
	// changes apart.
	last     *segtable.SegmentDesc
	lastJSON []byte
	fails    int // polls failed in a row
}

func (w *peerWatch) run(ctx context.Context, stop func()) {
	defer w.p.remote.Done()
	defer close(w.ch)
	defer stop()
	t := time.NewTicker(w.p.poll)
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

// step polls once and delivers what changed.
func (w *peerWatch) step(ctx context.Context) {
	d, err := w.fetch(ctx)
	switch {
	case err != nil:
		if ctx.Err() != nil {
			return // the watch is ending; says nothing of the peer
		}
		if w.fails++; w.fails >= p2pGoneAfter {
			w.gone()
		}
	case d == nil:
		w.fails = 0
		w.gone()
	default:
		w.fails = 0
		js, err := d.Marshal()
		if err != nil {
			return
		}
		if w.last == nil || !bytes.Equal(js, w.lastJSON) {
			w.last, w.lastJSON = d.Clone(), js
			metadata.SendLatest(w.ch, metadata.Event{Desc: d})
		}
	}
}

// gone delivers Deleted once for the descriptor last delivered.
func (w *peerWatch) gone() {
	if w.last == nil {
		return
	}
	metadata.SendLatest(w.ch, metadata.Event{Desc: w.last, Deleted: true})
	w.last, w.lastJSON = nil, nil
}
