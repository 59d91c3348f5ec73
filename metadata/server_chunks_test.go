package metadata_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// chBuffer is the i-th buffer of an engine in these tests.
func chBuffer(i int) segtable.BufferDesc {
	return segtable.BufferDesc{Addr: 0x100000 + uint64(i)*0x1000, Length: 4096, Location: "cpu:0",
		Keys: map[string]string{"tcp": fmt.Sprintf("key-%d", i)}}
}

// chList returns a ChunkList of n buffers, inserted as an engine
// registers them.
func chList(t testing.TB, n int) *segtable.ChunkList {
	t.Helper()
	l := new(segtable.ChunkList)
	for i := range n {
		if err := l.Insert(chBuffer(i)); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

// chDesc returns the descriptor an engine publishes with l.
func chDesc(name string, epoch uint64, l *segtable.ChunkList) *segtable.SegmentDesc {
	return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: name, Epoch: epoch,
		Endpoints: map[string]string{"tcp": "10.0.0.1:7000"}, Rev: l.Seq(), Chunked: l.Chunks()}
}

// sameJSON fails the test unless got encodes as want does, byte for byte.
func sameJSON(t testing.TB, what string, got, want *segtable.SegmentDesc) {
	t.Helper()
	if got == nil {
		t.Fatalf("%s: no descriptor", what)
	}
	g, err := got.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	w, err := want.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(g, w) {
		t.Fatalf("%s: descriptor of %d buffers (%d bytes) differs from the one of %d published (%d bytes)",
			what, got.NumBuffers(), len(g), want.NumBuffers(), len(w))
	}
}

// counter counts the requests a handler serves, by kind ("PUT chunk",
// "PUT header", "GET header", "GET chunks", "PUT", "GET", ...), and the
// bytes of their bodies both ways.
type counter struct {
	h        http.Handler
	mu       sync.Mutex
	reqs     map[string]int
	in, out  atomic.Int64
	chunkIn  atomic.Int64 // bytes of chunk PUTs
	chunkOut atomic.Int64 // bytes of chunk GETs' answers
}

func reqKind(r *http.Request) string {
	p := strings.TrimPrefix(r.URL.Path, "/moonring/v1/segments/")
	switch {
	case strings.Contains(p, "/chunks"):
		return r.Method + " chunk"
	case strings.HasSuffix(p, "/header"):
		return r.Method + " header"
	}
	return r.Method
}

type countWriter struct {
	http.ResponseWriter
	n *atomic.Int64
	m *atomic.Int64
}

func (w countWriter) Write(b []byte) (int, error) {
	w.n.Add(int64(len(b)))
	if w.m != nil {
		w.m.Add(int64(len(b)))
	}
	return w.ResponseWriter.Write(b)
}

func (c *counter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	k := reqKind(r)
	c.mu.Lock()
	c.reqs[k]++
	c.mu.Unlock()
	if r.ContentLength > 0 {
		c.in.Add(r.ContentLength)
		if k == "PUT chunk" {
			c.chunkIn.Add(r.ContentLength)
		}
	}
	cw := countWriter{ResponseWriter: w, n: &c.out}
	if k == "GET chunk" {
		cw.m = &c.chunkOut
	}
	c.h.ServeHTTP(cw, r)
}

// reset zeroes the counts and returns those before.
func (c *counter) reset() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := c.reqs
	c.reqs = map[string]int{}
	c.in.Store(0)
	c.out.Store(0)
	c.chunkIn.Store(0)
	c.chunkOut.Store(0)
	return r
}

func (c *counter) count(kind string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reqs[kind]
}

// startCounted serves srv through a counter (and wrap, if not nil, around
// it) and returns the counter and the URL.
func startCounted(t testing.TB, srv *metadata.Server, wrap func(http.Handler) http.Handler) (*counter, string) {
	t.Helper()
	c := &counter{h: srv, reqs: map[string]int{}}
	var h http.Handler = c
	if wrap != nil {
		h = wrap(c)
	}
	hs := httptest.NewServer(h)
	t.Cleanup(hs.Close)
	return c, hs.URL
}

func mustServer(t testing.TB, cfg metadata.ServerConfig) *metadata.Server {
	t.Helper()
	s, err := metadata.NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// oldServer answers the chunk and header requests as a server that does
// not know them: a plain 404.
func oldServer(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if k := reqKind(r); strings.HasSuffix(k, " chunk") || strings.HasSuffix(k, " header") {
			http.NotFound(w, r)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// rawGet returns the body of a GET of path, failing unless it is 200.
func rawGet(t *testing.T, url, path string) []byte {
	t.Helper()
	resp, err := http.Get(url + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: %s %s", path, resp.Status, b.String())
	}
	return b.Bytes()
}

// rawPut sends a PUT of body to path and returns its status and answer.
func rawPut(t *testing.T, url, path string, body []byte, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPut, url+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String()
}

// rawHeader is a header of chunks as the server serves it, for tests
// that forge one.
type rawHeader struct {
	Layout string          `json:"layout"`
	Signed bool            `json:"signed"`
	Desc   json.RawMessage `json:"desc"`
	Chunks []struct {
		S uint64 `json:"s"`
		N int    `json:"n"`
		H uint64 `json:"h"`
		M string `json:"m"`
	} `json:"chunks"`
}

func sum64(v []byte) uint64 {
	h := sha256.Sum256(v)
	return binary.BigEndian.Uint64(h[:8])
}

// TestHTTPChunksLarge publishes 100k buffers (7.9 MB flat, past the
// server's default MaxDescriptor) as chunks, reads them back byte-equal,
// then republishes after one Insert: one or two chunks and the header
// travel, and a watch fetches only the chunks it lacks.
func TestHTTPChunksLarge(t *testing.T) {
	const n = 100_000
	srv := mustServer(t, metadata.ServerConfig{})
	c, url := startCounted(t, srv, nil)
	pub := newHTTP(t, url, time.Minute)
	ctx := t.Context()
	l := chList(t, n)
	d := chDesc("big", 1, l)
	if err := pub.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	flat, _ := d.Marshal()
	if got := rawGet(t, url, seg+"big"); !bytes.Equal(got, flat) {
		t.Fatalf("GET serves %d bytes, not the flat descriptor's %d", len(got), len(flat))
	}
	rd := newHTTP(t, url, time.Minute)
	got, err := rd.Get(ctx, "big")
	if err != nil {
		t.Fatal(err)
	}
	sameJSON(t, "Get", got, d)
	ch, err := rd.Watch(ctx, "big")
	if err != nil {
		t.Fatal(err)
	}
	sameJSON(t, "watch", next(t, ch).Desc, d)
	if st := srv.Stats(); st.Chunks != l.Chunks().Count() {
		t.Fatalf("server holds %d chunks, want %d", st.Chunks, l.Chunks().Count())
	}

	for i := range 3 {
		c.reset()
		if err := l.Insert(chBuffer(n + 10 + i)); err != nil {
			t.Fatal(err)
		}
		d = chDesc("big", 1, l)
		if err := pub.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		if k := c.count("PUT chunk"); k < 1 || k > 2 {
			t.Fatalf("republish %d: %d chunk PUTs, want 1 or 2", i, k)
		}
		if k := c.count("PUT header"); k != 1 {
			t.Fatalf("republish %d: %d header PUTs", i, k)
		}
		if b := c.chunkIn.Load(); b > 8<<10 {
			t.Fatalf("republish %d: %d bytes of chunks sent", i, b)
		}
		ev := next(t, ch)
		for ev.Desc.NumBuffers() != d.NumBuffers() {
			ev = next(t, ch)
		}
		sameJSON(t, "watch after a republish", ev.Desc, d)
		if k, b := c.count("GET chunk"), c.chunkOut.Load(); k < 1 || b > 8<<10 {
			t.Fatalf("republish %d: the watch fetched %d bytes of chunks in %d GETs", i, b, k)
		}
		if k := c.count("GET"); k != 0 {
			t.Fatalf("republish %d: %d whole GETs", i, k)
		}
		in, out := c.in.Load(), c.out.Load()
		t.Logf("republish %d: requests %v, %d bytes in, %d out", i, c.reset(), in, out)
	}
	if st := srv.Stats(); st.Chunks != l.Chunks().Count() {
		t.Fatalf("server holds %d chunks after republishes, want %d (the replaced ones dropped)", st.Chunks, l.Chunks().Count())
	}
}

// TestHTTPChunksSigned publishes through Signed: an engine's chunks, and
// flat descriptors (chunks renumbered from 1 on every Put), read back
// through Get and a watch; a forged chunk uploaded directly, with a header
// that lists it, is refused by the signed reader.
func TestHTTPChunksSigned(t *testing.T) {
	srv := mustServer(t, metadata.ServerConfig{})
	_, url := startCounted(t, srv, nil)
	ctx := t.Context()
	wr := signedBy(t, newHTTP(t, url, time.Minute), "k")
	rd := signedBy(t, newHTTP(t, url, time.Minute), "k")
	l := chList(t, 500)
	d := chDesc("s", 3, l)
	if err := wr.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	ch, err := rd.Watch(ctx, "s")
	if err != nil {
		t.Fatal(err)
	}
	ev := next(t, ch)
	if ev.Deleted || ev.Desc.NumBuffers() != 500 {
		t.Fatalf("watch: %+v", ev)
	}
	for i := range 3 {
		l.Insert(chBuffer(1000 + i))
		if err := wr.Put(ctx, chDesc("s", 3, l)); err != nil {
			t.Fatal(err)
		}
		got, err := rd.Get(ctx, "s")
		if err != nil {
			t.Fatal(err)
		}
		if got.NumBuffers() != 501+i || got.MAC == "" {
			t.Fatalf("Get: %d buffers, MAC %q", got.NumBuffers(), got.MAC)
		}
		ev := next(t, ch)
		for !ev.Deleted && ev.Desc.NumBuffers() != 501+i {
			ev = next(t, ch)
		}
		if ev.Deleted {
			t.Fatal("watch: refused a signed republish")
		}
	}
	// Flat descriptors: Signed cuts them into chunks numbered from 1.
	for i := range 3 {
		f := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "f", Epoch: 9, Endpoints: map[string]string{"tcp": "x"}}
		for j := range 40 + i*7 {
			f.Buffers = append(f.Buffers, chBuffer(j*2+i))
		}
		if err := wr.Put(ctx, f); err != nil {
			t.Fatal(err)
		}
		got, err := rd.Get(ctx, "f")
		if err != nil {
			t.Fatal(err)
		}
		if got.NumBuffers() != len(f.Buffers) || got.AllBuffers()[0].Addr != f.Buffers[0].Addr {
			t.Fatalf("flat Put %d: read %d buffers from %#x", i, got.NumBuffers(), got.AllBuffers()[0].Addr)
		}
	}

	// A forged chunk under a listed seq, and a header listing it.
	hdr := rawGet(t, url, seg+"s/header")
	var h rawHeader
	if err := json.Unmarshal(hdr, &h); err != nil || !h.Signed || len(h.Chunks) == 0 {
		t.Fatalf("header %.200s: %v", hdr, err)
	}
	first := h.Chunks[0]
	old := rawGet(t, url, fmt.Sprintf("%schunks?epoch=3&seq=%d", seg+"s/", first.S))
	var bufs [][]segtable.BufferDesc
	if err := json.Unmarshal(old, &bufs); err != nil || len(bufs) != 1 {
		t.Fatalf("chunk GET %.200s: %v", old, err)
	}
	bufs[0][0].Keys = map[string]string{"tcp": "forged"}
	forged, _ := json.Marshal(bufs[0])
	if code, msg := rawPut(t, url, fmt.Sprintf("%ss/chunks/3/%d", seg, first.S), forged); code != 204 {
		t.Fatalf("forged chunk PUT: %d %s", code, msg)
	}
	h.Chunks[0].H = sum64(forged)
	fh, _ := json.Marshal(h)
	if code, msg := rawPut(t, url, seg+"s/header", fh); code != 204 {
		t.Fatalf("forged header PUT: %d %s", code, msg)
	}
	if _, err := rd.Get(ctx, "s"); !errors.Is(err, metadata.ErrForged) {
		t.Fatalf("Get of a forged chunk: %v, want ErrForged", err)
	}
	ev = next(t, ch)
	for !ev.Deleted {
		ev = next(t, ch)
	}
}

// TestHTTPChunksKeyServer: a server with the key checks what a header
// assembles, and refuses a forged chunk.
func TestHTTPChunksKeyServer(t *testing.T) {
	srv := mustServer(t, metadata.ServerConfig{Key: []byte("k")})
	_, url := startCounted(t, srv, nil)
	ctx := t.Context()
	wr := signedBy(t, newHTTPKey(t, url, "k", time.Minute, nil), "k")
	l := chList(t, 300)
	if err := wr.Put(ctx, chDesc("s", 3, l)); err != nil {
		t.Fatal(err)
	}
	l.Insert(chBuffer(5000))
	if err := wr.Put(ctx, chDesc("s", 3, l)); err != nil {
		t.Fatal(err)
	}
	// Unsigned chunks are refused as the whole descriptor is.
	un := newHTTPKey(t, url, "k", time.Minute, nil)
	if err := un.Put(ctx, chDesc("s", 3, l)); !errors.Is(err, metadata.ErrDenied) {
		t.Fatalf("unsigned Put to a server with the key: %v, want ErrDenied", err)
	}
	rd := signedBy(t, newHTTP(t, url, time.Minute), "k")
	got, err := rd.Get(ctx, "s")
	if err != nil || got.NumBuffers() != 301 {
		t.Fatalf("Get: %v", err)
	}
}

// TestHTTPChunksCompat: an old client (whole documents) against the new
// server, and a new client against a server that does not know the chunk
// requests.
func TestHTTPChunksCompat(t *testing.T) {
	ctx := t.Context()
	t.Run("OldClient", func(t *testing.T) {
		srv := mustServer(t, metadata.ServerConfig{})
		_, url := startCounted(t, srv, nil)
		l := chList(t, 100)
		d := chDesc("a", 1, l)
		flat, _ := d.Marshal()
		if code, msg := rawPut(t, url, seg+"a", flat); code != 204 {
			t.Fatalf("whole PUT: %d %s", code, msg)
		}
		if got := rawGet(t, url, seg+"a"); !bytes.Equal(got, flat) {
			t.Fatal("whole GET differs")
		}
		// A new client's watch of a whole document; then the new client
		// publishes chunks, and the old client reads them whole.
		rd := newHTTP(t, url, time.Minute)
		ch, err := rd.Watch(ctx, "a")
		if err != nil {
			t.Fatal(err)
		}
		sameJSON(t, "watch of a whole PUT", next(t, ch).Desc, d)
		l.Insert(chBuffer(900))
		d = chDesc("a", 1, l)
		if err := newHTTP(t, url, time.Minute).Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		flat, _ = d.Marshal()
		if got := rawGet(t, url, seg+"a"); !bytes.Equal(got, flat) {
			t.Fatal("whole GET of chunks differs")
		}
		sameJSON(t, "watch", next(t, ch).Desc, d)
		// An old client's whole PUT replaces the chunks.
		d.Chunked = nil
		d.Buffers = []segtable.BufferDesc{chBuffer(1)}
		if code, msg := rawPut(t, url, seg+"a", marshal(t, d)); code != 204 {
			t.Fatalf("whole PUT over chunks: %d %s", code, msg)
		}
		if st := srv.Stats(); st.Chunks != 0 {
			t.Fatalf("%d chunks left after a whole PUT", st.Chunks)
		}
		sameJSON(t, "watch of a whole PUT over chunks", next(t, ch).Desc, d)
	})
	t.Run("OldServer", func(t *testing.T) {
		srv := mustServer(t, metadata.ServerConfig{})
		c, url := startCounted(t, srv, oldServer)
		st := newHTTP(t, url, time.Minute)
		l := chList(t, 100)
		d := chDesc("a", 1, l)
		if err := st.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		got, err := st.Get(ctx, "a")
		if err != nil {
			t.Fatal(err)
		}
		sameJSON(t, "Get", got, d)
		ch, err := newHTTP(t, url, time.Minute).Watch(ctx, "a")
		if err != nil {
			t.Fatal(err)
		}
		sameJSON(t, "watch", next(t, ch).Desc, d)
		c.reset()
		l.Insert(chBuffer(900))
		d = chDesc("a", 1, l)
		if err := st.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		if k := c.count("PUT chunk"); k != 0 {
			t.Fatalf("%d chunk PUTs after the server refused the first", k)
		}
		sameJSON(t, "watch after a republish", next(t, ch).Desc, d)
	})
}

// TestHTTPChunksBounds: sizes, counts and quotas refuse chunks and
// headers with the errors whole descriptors get.
func TestHTTPChunksBounds(t *testing.T) {
	ctx := t.Context()
	t.Run("HeaderOverMaxDescriptor", func(t *testing.T) {
		srv := mustServer(t, metadata.ServerConfig{MaxDescriptor: 4096})
		_, url := startCounted(t, srv, nil)
		err := newHTTP(t, url, time.Minute).Put(ctx, chDesc("a", 1, chList(t, 5000)))
		if !errors.Is(err, segtable.ErrBadDesc) {
			t.Fatalf("Put: %v, want ErrBadDesc", err)
		}
		if srv.Stats().TooLarge == 0 {
			t.Fatal("not counted")
		}
	})
	t.Run("MaxChunked", func(t *testing.T) {
		srv := mustServer(t, metadata.ServerConfig{MaxChunked: 50 << 10})
		_, url := startCounted(t, srv, nil)
		err := newHTTP(t, url, time.Minute).Put(ctx, chDesc("a", 1, chList(t, 2000)))
		if !errors.Is(err, segtable.ErrBadDesc) {
			t.Fatalf("Put: %v, want ErrBadDesc", err)
		}
	})
	t.Run("MaxBytes", func(t *testing.T) {
		srv := mustServer(t, metadata.ServerConfig{MaxDescriptor: 32 << 10, MaxBytes: 64 << 10})
		_, url := startCounted(t, srv, nil)
		err := newHTTP(t, url, time.Minute).Put(ctx, chDesc("a", 1, chList(t, 2000)))
		if !errors.Is(err, metadata.ErrQuota) {
			t.Fatalf("Put: %v, want ErrQuota", err)
		}
		if st := srv.Stats(); st.Bytes > 64<<10 {
			t.Fatalf("holds %d bytes", st.Bytes)
		}
	})
	t.Run("Requests", func(t *testing.T) {
		srv := mustServer(t, metadata.ServerConfig{MaxDescriptor: 8 << 20})
		_, url := startCounted(t, srv, nil)
		good, _ := json.Marshal([]segtable.BufferDesc{chBuffer(1)})
		for _, tc := range []struct {
			what, path string
			body       []byte
			code       int
		}{
			{"not canonical", seg + "a/chunks/1/1", append([]byte(" "), good...), 400},
			{"empty", seg + "a/chunks/1/1", []byte("[]"), 400},
			{"unsorted", seg + "a/chunks/1/1", mustJSON(t, []segtable.BufferDesc{chBuffer(2), chBuffer(1)}), 400},
			{"bad seq", seg + "a/chunks/1/x", good, 400},
			{"bad name", seg + "a%2Fb/chunks/1/1", good, 400},
			{"too many buffers", seg + "a/chunks/1/1", mustJSON(t, bufsN(1025)), 400},
			{"header of no chunk", seg + "a/header", []byte(`{"layout":"moonring-chunks/1","desc":{"version":1,"name":"a","epoch":1,"endpoints":null,"buffers":null},"chunks":[]}`), 400},
			{"header of another name", seg + "a/header", []byte(`{"layout":"moonring-chunks/1","desc":{"version":1,"name":"b","epoch":1,"endpoints":null,"buffers":null},"chunks":[{"s":1,"n":1,"h":1}]}`), 400},
			{"header of too many chunks", seg + "a/header", tooManyChunks(), 400},
		} {
			if code, msg := rawPut(t, url, tc.path, tc.body); code != tc.code {
				t.Errorf("%s: %d %s, want %d", tc.what, code, msg, tc.code)
			}
		}
		// A header listing chunks the server lacks names them.
		code, msg := rawPut(t, url, seg+"a/header", []byte(`{"layout":"moonring-chunks/1","desc":{"version":1,"name":"a","epoch":1,"endpoints":null,"buffers":null},"chunks":[{"s":7,"n":1,"h":1},{"s":8,"n":1,"h":2}]}`))
		if code != 412 || !strings.Contains(msg, `"missing":[7,8]`) {
			t.Fatalf("header of missing chunks: %d %s", code, msg)
		}
		if st := srv.Stats(); st.Chunks != 0 || st.Names != 0 {
			t.Fatalf("after refusals: %+v", st)
		}
	})
	t.Run("Owner", func(t *testing.T) {
		srv := mustServer(t, metadata.ServerConfig{})
		_, url := startCounted(t, srv, nil)
		own := newHTTPKey(t, url, "k1", time.Minute, nil)
		l := chList(t, 100)
		if err := own.Put(ctx, chDesc("a", 1, l)); err != nil {
			t.Fatal(err)
		}
		good, _ := json.Marshal([]segtable.BufferDesc{chBuffer(1)})
		if code, msg := rawPut(t, url, seg+"a/chunks/1/99", good); code != 401 {
			t.Fatalf("chunk PUT without the owner token: %d %s", code, msg)
		}
		if code, msg := rawPut(t, url, seg+"a/chunks/1/99", good, "Moonring-Owner", token("k2", "a")); code != 403 {
			t.Fatalf("chunk PUT with another token: %d %s", code, msg)
		}
		if code, msg := rawPut(t, url, seg+"a/chunks/2/99", good, "Moonring-Owner", token("k1", "a")); code != 409 {
			t.Fatalf("chunk PUT of another epoch: %d %s", code, msg)
		}
		other := newHTTPKey(t, url, "k2", time.Minute, nil)
		if err := other.Put(ctx, chDesc("a", 1, l)); !errors.Is(err, metadata.ErrDenied) {
			t.Fatalf("Put by another owner: %v, want ErrDenied", err)
		}
		if err := newHTTPKey(t, url, "k1", time.Minute, nil).Put(ctx, chDesc("a", 2, l)); !errors.Is(err, metadata.ErrExists) {
			t.Fatalf("Put of another epoch: %v, want ErrExists", err)
		}
	})
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func bufsN(n int) []segtable.BufferDesc {
	out := make([]segtable.BufferDesc, n)
	for i := range out {
		out[i] = chBuffer(i)
	}
	return out
}

func tooManyChunks() []byte {
	var b bytes.Buffer
	b.WriteString(`{"layout":"moonring-chunks/1","desc":{"version":1,"name":"a","epoch":1,"endpoints":null,"buffers":null},"chunks":[`)
	for i := range 1<<17 + 1 {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"s":%d,"n":1,"h":1}`, i)
	}
	b.WriteString("]}")
	return b.Bytes()
}

// TestHTTPChunksCollected: chunks uploaded and never listed go after the
// pending time; those a republish no longer lists go with it; a Delete
// and an expiry take every chunk.
func TestHTTPChunksCollected(t *testing.T) {
	defer metadata.SetPendingTTL(50 * time.Millisecond)()
	srv := mustServer(t, metadata.ServerConfig{})
	_, url := startCounted(t, srv, nil)
	good, _ := json.Marshal([]segtable.BufferDesc{chBuffer(1)})
	for i := range 5 {
		if code, msg := rawPut(t, url, fmt.Sprintf("%sp%d/chunks/1/1", seg, i), good); code != 204 {
			t.Fatalf("chunk PUT: %d %s", code, msg)
		}
	}
	if st := srv.Stats(); st.Chunks != 5 || st.Bytes != int64(5*len(good)) {
		t.Fatalf("after uploads: %+v", st)
	}
	waitFor(t, "pending chunks collected", func() bool { st := srv.Stats(); return st.Chunks == 0 && st.Bytes == 0 })

	ctx := t.Context()
	st := newHTTP(t, url, 200*time.Millisecond)
	l := chList(t, 200)
	if err := st.Put(ctx, chDesc("a", 1, l)); err != nil {
		t.Fatal(err)
	}
	if err := st.Delete(ctx, "a", 1); err != nil {
		t.Fatal(err)
	}
	if s := srv.Stats(); s.Chunks != 0 || s.Bytes != 0 {
		t.Fatalf("after Delete: %+v", s)
	}
	if err := st.Put(ctx, chDesc("a", 1, l)); err != nil {
		t.Fatal(err)
	}
	st.Close()
	waitFor(t, "expiry takes the chunks", func() bool { s := srv.Stats(); return s.Chunks == 0 && s.Bytes == 0 && s.Names == 0 })
}

// TestHTTPChunksRestart: a server restarted from its directory keeps a
// descriptor sent as chunks (and a republish's), and removes chunk files
// no entry lists.
func TestHTTPChunksRestart(t *testing.T) {
	dir := t.TempDir()
	ctx := t.Context()
	srv, err := metadata.NewServer(metadata.ServerConfig{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	st, err := metadata.NewHTTP(metadata.HTTPConfig{URL: hs.URL, TTL: time.Minute, Key: []byte("k")})
	if err != nil {
		t.Fatal(err)
	}
	l := chList(t, 2000)
	if err := st.Put(ctx, chDesc("a", 1, l)); err != nil {
		t.Fatal(err)
	}
	l.Insert(chBuffer(9000))
	d := chDesc("a", 1, l)
	if err := st.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	good, _ := json.Marshal([]segtable.BufferDesc{chBuffer(1)})
	if code, msg := rawPut(t, hs.URL, seg+"b/chunks/1/1", good); code != 204 {
		t.Fatalf("chunk PUT: %d %s", code, msg)
	}
	etag := func(url string) string {
		resp, err := http.Get(url + seg + "a")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.Header.Get("ETag")
	}
	before := etag(hs.URL)
	st.Close()
	hs.Close()
	srv.Close()
	files, _ := filepath.Glob(filepath.Join(dir, "chk-*"))
	if len(files) != l.Chunks().Count()+1 {
		t.Fatalf("%d chunk files, want %d", len(files), l.Chunks().Count()+1)
	}

	srv2 := mustServer(t, metadata.ServerConfig{Dir: dir})
	_, url := startCounted(t, srv2, nil)
	flat, _ := d.Marshal()
	if got := rawGet(t, url, seg+"a"); !bytes.Equal(got, flat) {
		t.Fatal("the restarted server serves another descriptor")
	}
	if e := etag(url); e != before {
		t.Fatalf("ETag %s after the restart, %s before", e, before)
	}
	files, _ = filepath.Glob(filepath.Join(dir, "chk-*"))
	if len(files) != l.Chunks().Count() {
		t.Fatalf("%d chunk files after the restart, want %d", len(files), l.Chunks().Count())
	}
	// The owner binding came back with the entry.
	if code, _ := rawPut(t, url, seg+"a/chunks/1/5", good); code != 401 {
		t.Fatalf("chunk PUT without the token after the restart: %d", code)
	}
	// A republish against the restarted server: it holds the chunks
	// already, the store sends what it made.
	st2 := newHTTPKey(t, url, "k", time.Minute, nil)
	l.Insert(chBuffer(9001))
	if err := st2.Put(ctx, chDesc("a", 1, l)); err != nil {
		t.Fatal(err)
	}
}

// TestHTTPChunksRenewalRestores: a server that lost its state (restarted
// without a directory) gets the descriptor back from the next renewal:
// the header, the chunks it asks for, the header again.
func TestHTTPChunksRenewalRestores(t *testing.T) {
	var cur atomic.Pointer[metadata.Server]
	first := mustServer(t, metadata.ServerConfig{})
	cur.Store(first)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { cur.Load().ServeHTTP(w, r) }))
	t.Cleanup(hs.Close)
	st := newHTTP(t, hs.URL, 300*time.Millisecond)
	l := chList(t, 500)
	d := chDesc("a", 1, l)
	if err := st.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	second := mustServer(t, metadata.ServerConfig{})
	cur.Store(second)
	waitFor(t, "the renewal restores the descriptor", func() bool { return second.Stats().Names == 1 })
	if st := second.Stats(); st.Chunks != l.Chunks().Count() {
		t.Fatalf("restored with %d chunks, want %d", st.Chunks, l.Chunks().Count())
	}
	flat, _ := d.Marshal()
	if got := rawGet(t, hs.URL, seg+"a"); !bytes.Equal(got, flat) {
		t.Fatal("restored descriptor differs")
	}
}
