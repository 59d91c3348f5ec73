package metadata_test

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

// countTransport counts a client's requests by kind (reqKind of the path
// after /moonring/v1/segment) and the bytes of their answers.
type countTransport struct {
	mu    sync.Mutex
	reqs  map[string]int
	bytes map[string]int64
}

func (c *countTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err != nil {
		return nil, err
	}
	k := r.Method
	switch {
	case strings.HasSuffix(r.URL.Path, "/chunks"):
		k += " chunk"
	case strings.HasSuffix(r.URL.Path, "/header"):
		k += " header"
	}
	if resp.StatusCode == http.StatusNotModified {
		k += " 304"
	}
	c.mu.Lock()
	c.reqs[k]++
	c.bytes[k] += max(resp.ContentLength, 0)
	c.mu.Unlock()
	return resp, nil
}

func (c *countTransport) reset() (map[string]int, map[string]int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, b := c.reqs, c.bytes
	c.reqs, c.bytes = map[string]int{}, map[string]int64{}
	return r, b
}

// TestP2PChunks: a P2P store serves an engine's descriptor as a header
// and chunks beside the whole one (byte-equal to the flat Marshal); a
// peer's watch fetches, after a republish, the header and the chunk it
// lacks, not the whole descriptor.
func TestP2PChunks(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{})
	ct := &countTransport{reqs: map[string]int{}, bytes: map[string]int64{}}
	client := &http.Client{Transport: ct}
	t.Cleanup(client.CloseIdleConnections)
	b := newP2P(t, metadata.P2PConfig{Client: client})
	ctx := t.Context()
	l := chList(t, 10_000)
	d := chDesc(a.Name(), 1, l)
	if err := a.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	flat, _ := d.Marshal()
	if got := rawGet(t, "http://"+a.Name(), "/moonring/v1/segment"); !bytes.Equal(got, flat) {
		t.Fatalf("whole GET: %d bytes, not the flat descriptor's %d", len(got), len(flat))
	}
	got, err := b.Get(ctx, a.Name())
	if err != nil {
		t.Fatal(err)
	}
	sameJSON(t, "Get", got, d)
	ch, err := b.Watch(ctx, a.Name())
	if err != nil {
		t.Fatal(err)
	}
	sameJSON(t, "watch", next(t, ch).Desc, d)
	for i := range 3 {
		ct.reset()
		l.Insert(chBuffer(20_000 + i))
		d = chDesc(a.Name(), 1, l)
		if err := a.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		ev := next(t, ch)
		for ev.Desc.NumBuffers() != d.NumBuffers() {
			ev = next(t, ch)
		}
		sameJSON(t, "watch after a republish", ev.Desc, d)
		reqs, by := ct.reset()
		if reqs["GET"] != 0 || reqs["GET chunk"] < 1 || by["GET chunk"] > 8<<10 {
			t.Fatalf("republish %d: requests %v, bytes %v: want the header and one or two chunks", i, reqs, by)
		}
		t.Logf("republish %d: requests %v, bytes %v", i, reqs, by)
	}
	// A local watch and Get hand out flat copies.
	own, err := a.Get(ctx, a.Name())
	if err != nil || own.Chunked != nil {
		t.Fatalf("own Get: %v, Chunked %v", err, own.Chunked != nil)
	}
	sameJSON(t, "own Get", own, d)
	// A flat Put after chunks serves the flat one everywhere.
	f := testDesc(a.Name(), 1, "flat")
	if err := a.Put(ctx, f); err != nil {
		t.Fatal(err)
	}
	ev := next(t, ch)
	for ev.Desc.NumBuffers() != 1 {
		ev = next(t, ch)
	}
	sameJSON(t, "watch after a flat Put", ev.Desc, f)
}

// chunking is a store whose Puts hand the wrapped store Chunked
// descriptors, as an engine does: the suite's flat descriptors cut into
// chunks (a deep copy: the caller's stays the caller's).
type chunking struct{ metadata.Store }

func (c chunking) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil || d.Validate() != nil || d.Chunked != nil || len(d.Buffers) == 0 {
		return c.Store.Put(ctx, d)
	}
	cd := d.Clone()
	cs, err := segtable.NewBufferChunks(cd.Buffers)
	if err != nil {
		return c.Store.Put(ctx, d)
	}
	cd.Buffers, cd.Chunks, cd.Chunked = nil, nil, cs
	return c.Store.Put(ctx, cd)
}

// TestChunksSuite runs the store suite with Chunked Puts: through an HTTP
// store and its server, and through P2P, read locally and by a peer.
func TestChunksSuite(t *testing.T) {
	t.Run("HTTP", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) metadata.Store {
			_, url := startServer(t, metadata.ServerConfig{Dir: t.TempDir()})
			return chunking{newHTTP(t, url, 0)}
		})
	})
	t.Run("HTTPTwoClients", func(t *testing.T) {
		var url string
		storetest.RunOptions(t, func(t *testing.T) metadata.Store {
			_, url = startServer(t, metadata.ServerConfig{})
			return chunking{newHTTP(t, url, 0)}
		}, storetest.Options{Peer: func(t *testing.T, _ metadata.Store) metadata.Store { return newHTTP(t, url, 0) }})
	})
	own := func(s metadata.Store) string { return s.(chunking).Store.(*metadata.P2P).Name() }
	newStore := func(t *testing.T) metadata.Store { return chunking{newP2P(t, metadata.P2PConfig{})} }
	t.Run("P2PLocal", func(t *testing.T) {
		storetest.RunOptions(t, newStore, storetest.Options{OwnName: own})
	})
	t.Run("P2PRemote", func(t *testing.T) {
		storetest.RunOptions(t, newStore, storetest.Options{OwnName: own,
			Peer: func(t *testing.T, _ metadata.Store) metadata.Store { return newP2P(t, metadata.P2PConfig{}) }})
	})
}
