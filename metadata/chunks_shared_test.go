package metadata_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

// sameBuffers fails the test unless got holds the buffers of want, keys
// included (MACs aside: a Signed store's reader reads them signed).
func sameBuffers(t testing.TB, what string, got, want *segtable.SegmentDesc) {
	t.Helper()
	g, w := got.AllBuffers(), want.AllBuffers()
	if len(g) != len(w) {
		t.Fatalf("%s: %d buffers, want %d", what, len(g), len(w))
	}
	for i := range g {
		if !segtable.SameBuffer(&g[i], &w[i]) {
			t.Fatalf("%s: buffer %d is %+v, want %+v", what, i, g[i], w[i])
		}
	}
}

// mirrored returns how many entries a Mirror of b made from one of a
// makes: the buffers of the chunks b does not share with a.
func mirrored(a, b *segtable.SegmentDesc) int {
	conv := func(b *segtable.BufferDesc) (uint64, bool) { return b.Addr, true }
	m := segtable.NewMirror(nil, segtable.ChunksOf(a), conv)
	n := 0
	segtable.NewMirror(m, segtable.ChunksOf(b), func(b *segtable.BufferDesc) (uint64, bool) { n++; return conv(b) })
	return n
}

// testSharesChunks publishes a Chunked descriptor through pub and reads
// it through rd, a networked store (or a Signed one over it): successive
// Gets and a watch's events hand out descriptors that share every chunk
// a republish did not change, by pointer, with each other (a Get and the
// watch of the same name too), so that a Mirror of the next makes
// entries only for the chunks the republish made; a header of their own;
// no chunk shared across epochs (unsigned: the same seqs, the same
// bytes). name is the name pub publishes under; redo republishes under
// another epoch (nil: skipped).
func testSharesChunks(t *testing.T, pub, rd metadata.Store, name string, redo func(epoch uint64, d *segtable.SegmentDesc)) {
	ctx := t.Context()
	l := chList(t, 1000)
	if err := pub.Put(ctx, chDesc(name, 3, l)); err != nil {
		t.Fatal(err)
	}
	d1, err := rd.Get(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	sameBuffers(t, "Get", d1, chDesc(name, 3, l))
	ch, err := rd.Watch(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	e1 := next(t, ch).Desc
	if same, all := storetest.SharedChunks(t, d1, e1); same != all || all != l.Chunks().Count() {
		t.Fatalf("a Get and the first event share %d chunks of %d (%d published)", same, all, l.Chunks().Count())
	}
	d2, err := rd.Get(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if same, all := storetest.SharedChunks(t, d1, d2); same != all {
		t.Fatalf("two Gets share %d chunks of %d", same, all)
	}
	d2.Endpoints["tcp"] = "changed"
	if d3, err := rd.Get(ctx, name); err != nil || d3.Endpoints["tcp"] != "10.0.0.1:7000" || d1.Endpoints["tcp"] != "10.0.0.1:7000" {
		t.Fatalf("readers share a header: %v", err)
	}

	for i := range 3 {
		before := l.Chunks()
		if err := l.Insert(chBuffer(5000 + i)); err != nil {
			t.Fatal(err)
		}
		lo, hi := l.Chunks().Changed(before)
		want := chDesc(name, 3, l)
		if err := pub.Put(ctx, want); err != nil {
			t.Fatal(err)
		}
		e2 := next(t, ch).Desc
		for e2.NumBuffers() != want.NumBuffers() {
			e2 = next(t, ch).Desc
		}
		sameBuffers(t, "watch after a republish", e2, want)
		same, all := storetest.SharedChunks(t, e1, e2)
		if made := all - same; made < 1 || made > hi-lo {
			t.Fatalf("republish %d: the event shares %d chunks of %d with the one before; the republish made %d", i, same, all, hi-lo)
		}
		if n := mirrored(e1, e2); n < 1 || n > (hi-lo)*segtable.ChunkSize {
			t.Fatalf("republish %d: a Mirror made %d entries, for %d chunks made", i, n, hi-lo)
		}
		g, err := rd.Get(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if same, all := storetest.SharedChunks(t, e2, g); same != all {
			t.Fatalf("republish %d: a Get shares %d chunks of %d with the watch's event", i, same, all)
		}
		e1 = e2
	}
	if redo == nil {
		return
	}
	redo(4, chDesc(name, 4, l))
	ev := next(t, ch)
	for ev.Deleted || ev.Desc.Epoch != 4 {
		ev = next(t, ch)
	}
	if same, _ := storetest.SharedChunks(t, e1, ev.Desc); same != 0 {
		t.Fatalf("%d chunks shared across epochs", same)
	}
}

// TestHTTPSharesChunks: through the HTTP store and its server, unsigned
// and signed (whose reader checks each republish by its chunks made,
// and refuses a chunk forged among those it holds).
func TestHTTPSharesChunks(t *testing.T) {
	srv := mustServer(t, metadata.ServerConfig{})
	_, url := startCounted(t, srv, nil)
	t.Run("unsigned", func(t *testing.T) {
		pub := newHTTP(t, url, time.Minute)
		testSharesChunks(t, pub, newHTTP(t, url, time.Minute), "u", func(epoch uint64, d *segtable.SegmentDesc) {
			if err := pub.Delete(t.Context(), "u", 3); err != nil {
				t.Fatal(err)
			}
			if err := pub.Put(t.Context(), d); err != nil {
				t.Fatal(err)
			}
		})
	})
	t.Run("signed", func(t *testing.T) {
		rd := signedBy(t, newHTTP(t, url, time.Minute), "k")
		testSharesChunks(t, signedBy(t, newHTTP(t, url, time.Minute), "k"), rd, "s", nil)
		if r := rd.Refused(); r.Forged != 0 || r.Stale != 0 {
			t.Fatalf("refused %+v", r)
		}
		// A chunk forged under a new seq, its sum in a header that lists
		// every other chunk as before: the reader holds those, fetches the
		// forged one alone, and refuses it.
		var h chunkwire.Header
		if err := json.Unmarshal(rawGet(t, url, seg+"s/header"), &h); err != nil || !h.Signed {
			t.Fatalf("header: %v", err)
		}
		c := h.Chunks[len(h.Chunks)/2]
		var bufs [][]segtable.BufferDesc
		if err := json.Unmarshal(rawGet(t, url, fmt.Sprintf("%ss/chunks?epoch=3&seq=%d", seg, c.Seq)), &bufs); err != nil || len(bufs) != 1 {
			t.Fatalf("chunk GET: %v", err)
		}
		bufs[0][0].Keys = map[string]string{"tcp": "relay"}
		forged, _ := json.Marshal(bufs[0])
		seq := uint64(1 << 40)
		if code, msg := rawPut(t, url, fmt.Sprintf("%ss/chunks/3/%d", seg, seq), forged); code != 204 {
			t.Fatalf("forged chunk PUT: %d %s", code, msg)
		}
		h.Chunks[len(h.Chunks)/2] = chunkwire.Chunk{Seq: seq, N: c.N, Sum: chunkwire.Sum(forged), MAC: c.MAC}
		fh, _ := json.Marshal(h)
		if code, msg := rawPut(t, url, seg+"s/header", fh); code != 204 {
			t.Fatalf("forged header PUT: %d %s", code, msg)
		}
		if _, err := rd.Get(t.Context(), "s"); !errors.Is(err, metadata.ErrForged) {
			t.Fatalf("Get of a chunk forged among those held: %v, want ErrForged", err)
		}
	})
}

// TestP2PSharesChunks: through P2P stores, a peer's Gets and watch.
func TestP2PSharesChunks(t *testing.T) {
	t.Run("unsigned", func(t *testing.T) {
		a := newP2P(t, metadata.P2PConfig{})
		testSharesChunks(t, a, newP2P(t, metadata.P2PConfig{}), a.Name(), func(epoch uint64, d *segtable.SegmentDesc) {
			if err := a.Delete(t.Context(), a.Name(), 3); err != nil {
				t.Fatal(err)
			}
			if err := a.Put(t.Context(), d); err != nil {
				t.Fatal(err)
			}
		})
	})
	t.Run("signed", func(t *testing.T) {
		a := newP2P(t, metadata.P2PConfig{})
		rd := signedBy(t, newP2P(t, metadata.P2PConfig{}), "k")
		testSharesChunks(t, signedBy(t, a, "k"), rd, a.Name(), nil)
		if r := rd.Refused(); r.Forged != 0 || r.Stale != 0 {
			t.Fatalf("refused %+v", r)
		}
	})
}

// hostilePeer serves a header and chunks at a P2P store's paths, whatever
// they hold: a hostile peer.
type hostilePeer struct {
	mu     sync.Mutex
	header []byte
	chunks map[uint64][]byte
}

func (f *hostilePeer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	w.Header().Set("Moonring-Chunks", "1")
	switch r.URL.Path {
	case "/moonring/v1/segment/header":
		w.Header().Set("ETag", strconv.Itoa(len(f.header)))
		w.Write(f.header)
	case "/moonring/v1/segment/chunks":
		var vals []json.RawMessage
		for s := range strings.SplitSeq(r.URL.Query().Get("seq"), ",") {
			seq, _ := strconv.ParseUint(s, 10, 64)
			v, ok := f.chunks[seq]
			if !ok {
				http.NotFound(w, r)
				return
			}
			vals = append(vals, v)
		}
		json.NewEncoder(w).Encode(vals)
	default:
		http.NotFound(w, r)
	}
}

// serve makes f serve a header of name at epoch listing runs, each a
// chunk of the buffers given, numbered from seq; macs, when set, the
// MACs it lists.
func (f *hostilePeer) serve(t *testing.T, name string, epoch uint64, seq uint64, runs [][]segtable.BufferDesc, macs ...string) {
	t.Helper()
	h := chunkwire.Header{Layout: chunkwire.Layout, Desc: segtable.SegmentDesc{Version: segtable.DescVersion, Name: name, Epoch: epoch,
		Endpoints: map[string]string{"tcp": "10.0.0.1:7000"}}}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.chunks == nil {
		f.chunks = map[uint64][]byte{}
	}
	for i, bufs := range runs {
		v, err := chunkwire.Encode(bufs)
		if err != nil {
			t.Fatal(err)
		}
		f.chunks[seq+uint64(i)] = v
		c := chunkwire.Chunk{Seq: seq + uint64(i), N: len(bufs), Sum: chunkwire.Sum(v)}
		if i < len(macs) {
			c.MAC = macs[i]
		}
		h.Chunks = append(h.Chunks, c)
	}
	var err error
	if f.header, err = json.Marshal(&h); err != nil {
		t.Fatal(err)
	}
}

// TestP2PHostilePeer: what a peer serves as a header and chunks is
// checked as a descriptor is: chunks out of order or overlapping, a MAC
// listed unsigned, are refused (ErrBadDesc); a chunk of more buffers than
// a publisher's is read flat; a good header after them is read Chunked.
func TestP2PHostilePeer(t *testing.T) {
	f := &hostilePeer{}
	ts := httptest.NewServer(f)
	t.Cleanup(ts.Close)
	name := strings.TrimPrefix(ts.URL, "http://")
	rd := newP2P(t, metadata.P2PConfig{})
	ctx := t.Context()
	run := func(from, n int) []segtable.BufferDesc {
		var out []segtable.BufferDesc
		for i := range n {
			out = append(out, chBuffer(from+i))
		}
		return out
	}
	f.serve(t, name, 1, 1, [][]segtable.BufferDesc{run(0, 4), run(4, 4)})
	good, err := rd.Get(ctx, name)
	if err != nil || good.NumBuffers() != 8 || good.Chunked == nil {
		t.Fatalf("Get of a good header: %v", err)
	}
	for _, tc := range []struct {
		name string
		runs [][]segtable.BufferDesc
		macs []string
	}{
		{"chunks out of order", [][]segtable.BufferDesc{run(4, 4), run(0, 4)}, nil},
		{"chunks overlapping", [][]segtable.BufferDesc{run(0, 4), run(3, 4)}, nil},
		{"a chunk unsorted", [][]segtable.BufferDesc{append(run(4, 1), run(0, 1)...)}, nil},
		{"a MAC listed unsigned", [][]segtable.BufferDesc{run(0, 4)}, []string{"AAAAAAAAAAAAAAAAAAAAAA"}},
	} {
		// A seq the reader holds, listed with other bytes: fetched again.
		f.serve(t, name, 1, 1, tc.runs, tc.macs...)
		if d, err := rd.Get(ctx, name); !errors.Is(err, segtable.ErrBadDesc) {
			t.Errorf("Get of %s: %v, %v; want ErrBadDesc", tc.name, d, err)
		}
	}
	f.serve(t, name, 1, 10, [][]segtable.BufferDesc{run(0, segtable.ChunkSize+8)})
	if d, err := rd.Get(ctx, name); err != nil || d.Chunked != nil || d.NumBuffers() != segtable.ChunkSize+8 {
		t.Fatalf("Get of a chunk of %d buffers: %v, want it flat", segtable.ChunkSize+8, err)
	}
	f.serve(t, name, 1, 1, [][]segtable.BufferDesc{run(0, 4), run(4, 4)})
	if d, err := rd.Get(ctx, name); err != nil || d.Chunked == nil || d.NumBuffers() != 8 {
		t.Fatalf("Get of a good header again: %v", err)
	}
}
