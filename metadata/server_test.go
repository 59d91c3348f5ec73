package metadata_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// request sends one request to h and returns the answer.
func request(t *testing.T, h http.Handler, method, path string, body []byte, header ...string) *httptest.ResponseRecorder {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	r := httptest.NewRequestWithContext(t.Context(), method, path, rd)
	for i := 0; i+1 < len(header); i += 2 {
		r.Header.Set(header[i], header[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

func marshal(t *testing.T, d *segtable.SegmentDesc) []byte {
	t.Helper()
	b, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func newServer(t *testing.T, cfg metadata.ServerConfig) *metadata.Server {
	t.Helper()
	s, err := metadata.NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

const seg = "/moonring/v1/segments/"

func TestServerProtocol(t *testing.T) {
	s := newServer(t, metadata.ServerConfig{MaxTTL: time.Minute})
	want := func(w *httptest.ResponseRecorder, code int, what string) {
		t.Helper()
		if w.Code != code {
			t.Fatalf("%s: %d %q, want %d", what, w.Code, w.Body.String(), code)
		}
	}
	want(request(t, s, "GET", seg+"a", nil), 404, "GET before PUT")
	want(request(t, s, "DELETE", seg+"a", nil), 404, "DELETE before PUT")

	put := request(t, s, "PUT", seg+"a", marshal(t, testDesc("a", 7, "v1")))
	want(put, 204, "PUT")
	etag := put.Header().Get("ETag")
	if !strings.HasPrefix(etag, `"7-`) {
		t.Fatalf("PUT's ETag %q", etag)
	}
	get := request(t, s, "GET", seg+"a", nil)
	want(get, 200, "GET")
	if get.Header().Get("ETag") != etag || get.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("GET headers %v", get.Header())
	}
	if d, err := segtable.UnmarshalDesc(get.Body.Bytes()); err != nil || d.Name != "a" || d.Epoch != 7 {
		t.Fatalf("GET body %q: %v", get.Body.String(), err)
	}
	for _, inm := range []string{etag, "W/" + etag, `"x", ` + etag, "*"} {
		w := request(t, s, "GET", seg+"a", nil, "If-None-Match", inm)
		want(w, 304, "GET If-None-Match "+inm)
		if w.Body.Len() != 0 {
			t.Fatalf("304 with a body %q", w.Body.String())
		}
	}
	want(request(t, s, "GET", seg+"a", nil, "If-None-Match", `"7-0"`), 200, "GET with a stale ETag")

	// Epochs.
	w := request(t, s, "PUT", seg+"a", marshal(t, testDesc("a", 8, "x")))
	want(w, 409, "PUT of another epoch")
	if !strings.Contains(w.Body.String(), "held by epoch 7") {
		t.Fatalf("409 says %q", w.Body.String())
	}
	// A renewal of the same epoch changes nothing visible.
	w = request(t, s, "PUT", seg+"a", marshal(t, testDesc("a", 7, "other body")), "Moonring-Renew", "1", "Moonring-TTL", "5")
	want(w, 204, "renewal")
	if w.Header().Get("ETag") != etag {
		t.Fatalf("renewal changed the ETag: %q, was %q", w.Header().Get("ETag"), etag)
	}
	if d, _ := segtable.UnmarshalDesc(request(t, s, "GET", seg+"a", nil).Body.Bytes()); d == nil || d.Endpoints["tcp"] != "v1" {
		t.Fatalf("renewal changed the descriptor: %+v", d)
	}
	// A republish does, even of the same descriptor.
	w = request(t, s, "PUT", seg+"a", marshal(t, testDesc("a", 7, "v1")))
	want(w, 204, "republish")
	if w.Header().Get("ETag") == etag {
		t.Fatal("republish kept the ETag")
	}
	want(request(t, s, "DELETE", seg+"a?epoch=6", nil), 409, "DELETE of another epoch")
	want(request(t, s, "DELETE", seg+"a?epoch=x", nil), 400, "DELETE with a bad epoch")
	want(request(t, s, "DELETE", seg+"a?epoch=7", nil), 204, "DELETE")
	want(request(t, s, "GET", seg+"a", nil), 404, "GET after DELETE")
	want(request(t, s, "PUT", seg+"b", marshal(t, testDesc("b", 1, "x"))), 204, "PUT of b")
	want(request(t, s, "DELETE", seg+"b", nil), 204, "DELETE without an epoch")

	// Refusals.
	for _, tc := range []struct {
		what, path string
		body       []byte
		header     []string
		code       int
	}{
		{"misnamed", seg + "a", marshal(t, testDesc("b", 1, "x")), nil, 400},
		{"garbage", seg + "a", []byte("{not json"), nil, 400},
		{"invalid", seg + "a", []byte(`{"version":1,"name":"a","buffers":[{"addr":1,"length":0}]}`), nil, 400},
		{"ttl text", seg + "a", marshal(t, testDesc("a", 1, "x")), []string{"Moonring-TTL", "soon"}, 400},
		{"ttl NaN", seg + "a", marshal(t, testDesc("a", 1, "x")), []string{"Moonring-TTL", "NaN"}, 400},
		{"ttl short", seg + "a", marshal(t, testDesc("a", 1, "x")), []string{"Moonring-TTL", "0.001"}, 400},
		{"ttl long", seg + "a", marshal(t, testDesc("a", 1, "x")), []string{"Moonring-TTL", "61"}, 400},
		{"ttl negative", seg + "a", marshal(t, testDesc("a", 1, "x")), []string{"Moonring-TTL", "-1"}, 400},
		{"renew", seg + "a", marshal(t, testDesc("a", 1, "x")), []string{"Moonring-Renew", "maybe"}, 400},
		{"huge", seg + "a", bytes.Repeat([]byte(" "), 16<<20+1), nil, 413},
		{"escaped slash", seg + "a%2Fb", marshal(t, testDesc("a/b", 1, "x")), nil, 400},
		{"dot dot", seg + "%2E%2E", marshal(t, testDesc("..", 1, "x")), nil, 400},
		{"space", seg + "a%20b", marshal(t, testDesc("a b", 1, "x")), nil, 400},
		{"long", seg + strings.Repeat("x", 256), marshal(t, testDesc(strings.Repeat("x", 256), 1, "x")), nil, 400},
	} {
		w := request(t, s, "PUT", tc.path, tc.body, tc.header...)
		if w.Code != tc.code {
			t.Errorf("PUT %s: %d %q, want %d", tc.what, w.Code, w.Body.String(), tc.code)
		}
	}
	if w := request(t, s, "GET", seg+"a", nil); w.Code != 404 {
		t.Fatalf("a refused PUT stored something: %d", w.Code)
	}
	want(request(t, s, "GET", seg+"a%2Fb", nil), 400, "GET of a bad name")
	want(request(t, s, "GET", seg+"a/b", nil), 404, "GET of a path below a segment")
	want(request(t, s, "POST", seg+"a", nil), 405, "POST")
	want(request(t, s, "GET", "/moonring/v1/healthz", nil), 200, "healthz")

	// A closed server refuses everything but healthz.
	want(request(t, s, "PUT", seg+"c", marshal(t, testDesc("c", 1, "x"))), 204, "PUT of c")
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	want(request(t, s, "GET", seg+"c", nil), 503, "GET after Close")
	want(request(t, s, "PUT", seg+"c", marshal(t, testDesc("c", 1, "x"))), 503, "PUT after Close")
	want(request(t, s, "DELETE", seg+"c", nil), 503, "DELETE after Close")
}

// A descriptor whose time to live passes without a PUT goes; one renewed
// stays.
func TestServerExpiry(t *testing.T) {
	s := newServer(t, metadata.ServerConfig{})
	body := marshal(t, testDesc("a", 1, "x"))
	if w := request(t, s, "PUT", seg+"a", body, "Moonring-TTL", "0.05"); w.Code != 204 {
		t.Fatalf("PUT: %d %s", w.Code, w.Body)
	}
	deadline := time.Now().Add(hang)
	for request(t, s, "GET", seg+"a", nil).Code != 404 {
		if time.Now().After(deadline) {
			t.Fatalf("descriptor with a TTL of 50ms still there after %v", hang)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// A renewal of a descriptor that expired stores it again.
	if w := request(t, s, "PUT", seg+"a", body, "Moonring-TTL", "30", "Moonring-Renew", "true"); w.Code != 204 {
		t.Fatalf("renewal after expiry: %d %s", w.Code, w.Body)
	}
	if w := request(t, s, "GET", seg+"a", nil); w.Code != 200 {
		t.Fatalf("GET after the renewal: %d", w.Code)
	}
}

// A server keeps its descriptors in its directory: a new server on the same
// directory serves them, with the same ETags, and their clocks restarted.
func TestServerPersistence(t *testing.T) {
	dir := t.TempDir()
	s1, url1 := startServer(t, metadata.ServerConfig{Dir: dir})
	h1 := newHTTP(t, url1, 0)
	ctx := t.Context()
	for _, d := range []*segtable.SegmentDesc{testDesc("a", 1, "a1"), testDesc("b", 2, "b1"), testDesc("gone", 3, "g")} {
		if err := h1.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	if err := h1.Delete(ctx, "gone", 3); err != nil {
		t.Fatal(err)
	}
	short := newHTTP(t, url1, 3*time.Second) // outlives the restart and three Gets on a loaded machine
	if err := short.Put(ctx, testDesc("short", 4, "s")); err != nil {
		t.Fatal(err)
	}
	etagA := request(t, s1, "GET", seg+"a", nil).Header().Get("ETag")
	h1.Close()
	short.Close() // stops renewing "short": it must expire after the restart too
	s1.Close()

	s2, url2 := startServer(t, metadata.ServerConfig{Dir: dir})
	h2 := newHTTP(t, url2, 0)
	for name, tag := range map[string]string{"a": "a1", "b": "b1", "short": "s"} {
		d, err := h2.Get(ctx, name)
		if err != nil || d.Endpoints["tcp"] != tag {
			t.Fatalf("after restart, Get(%q) = %+v, %v", name, d, err)
		}
	}
	if _, err := h2.Get(ctx, "gone"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("after restart, Get of a deleted name: %v", err)
	}
	if got := request(t, s2, "GET", seg+"a", nil).Header().Get("ETag"); got != etagA {
		t.Fatalf("ETag after restart %q, was %q", got, etagA)
	}
	// Nobody renews "short" any more: it goes within its TTL of the restart.
	ch, err := h2.Watch(ctx, "short")
	if err != nil {
		t.Fatal(err)
	}
	for ev := next(t, ch); !ev.Deleted; ev = next(t, ch) {
	}
	// A change after the restart gets an ETag never seen before, and is
	// kept as well.
	if err := h2.Put(ctx, testDesc("a", 1, "a2")); err != nil {
		t.Fatal(err)
	}
	if got := request(t, s2, "GET", seg+"a", nil).Header().Get("ETag"); got == etagA {
		t.Fatalf("republish after restart reused ETag %q", got)
	}
	h2.Close()
	s2.Close()
	s3 := newServer(t, metadata.ServerConfig{Dir: dir})
	if d, _ := segtable.UnmarshalDesc(request(t, s3, "GET", seg+"a", nil).Body.Bytes()); d == nil || d.Endpoints["tcp"] != "a2" {
		t.Fatalf("third server serves %+v", d)
	}
	if w := request(t, s3, "GET", seg+"short", nil); w.Code != 404 {
		t.Fatalf("third server serves an expired descriptor: %d", w.Code)
	}
	// One file per descriptor held, named by its name's hash, nothing
	// else.
	left, _ := filepath.Glob(filepath.Join(dir, "*"))
	slices.Sort(left)
	want := []string{filepath.Join(dir, entryFile("a")), filepath.Join(dir, entryFile("b"))}
	slices.Sort(want)
	if !slices.Equal(left, want) {
		t.Fatalf("directory holds %v, want %v", left, want)
	}
}

// entryFile is the name of a descriptor's file in a server's directory:
// "seg-" and the hex SHA-256 of its name.
func entryFile(name string) string {
	h := sha256.Sum256([]byte(name))
	return "seg-" + hex.EncodeToString(h[:]) + ".json"
}

// entryJSON is the content of an entry's file.
func entryJSON(t *testing.T, name string, rev uint64, ttl, owner string, d *segtable.SegmentDesc) string {
	t.Helper()
	o := ""
	if owner != "" {
		o = `,"owner":"` + owner + `"`
	}
	return fmt.Sprintf(`{"version":2,"name":%q,"rev":%d,"ttl":%q%s,"desc":%s}`, name, rev, ttl, o, marshal(t, d))
}

// A server refuses to start on a directory with a file it cannot read as
// what it should be, naming the file and leaving it alone: the legacy
// file of every descriptor, or an entry's. A valid legacy file is moved to
// a file per entry, once.
func TestServerBadFile(t *testing.T) {
	entry := `{"rev":5,"ttl":"30s","desc":` + string(marshal(t, testDesc("a", 1, "x"))) + `}`
	valid := `{"version":1,"rev":5,"segments":[` + entry + `]}`
	good := entryJSON(t, "a", 5, "30s", "", testDesc("a", 1, "x"))
	for what, file := range map[string]struct{ name, content string }{
		"garbage":        {"segments.json", "{not json"},
		"truncated":      {"segments.json", valid[:len(valid)-10]},
		"trailing":       {"segments.json", valid + "{}"},
		"version":        {"segments.json", `{"version":2,"segments":[]}`},
		"unknown":        {"segments.json", `{"version":1,"segments":[],"extra":1}`},
		"bad desc":       {"segments.json", `{"version":1,"segments":[{"rev":1,"ttl":"30s","desc":{"version":1,"name":""}}]}`},
		"bad name":       {"segments.json", `{"version":1,"segments":[{"rev":1,"ttl":"30s","desc":` + string(marshal(t, testDesc("a/b", 1, "x"))) + `}]}`},
		"bad ttl":        {"segments.json", `{"version":1,"segments":[{"rev":1,"ttl":"soon","desc":` + string(marshal(t, testDesc("a", 1, "x"))) + `}]}`},
		"duplicate":      {"segments.json", `{"version":1,"segments":[` + entry + `,` + entry + `]}`},
		"not a object":   {"segments.json", `[]`},
		"entry garbage":  {entryFile("a"), "{not json"},
		"entry trailing": {entryFile("a"), good + "{}"},
		"entry version":  {entryFile("a"), strings.Replace(good, `"version":2`, `"version":3`, 1)},
		"entry unknown":  {entryFile("a"), strings.Replace(good, `"rev"`, `"extra":1,"rev"`, 1)},
		"entry misfiled": {entryFile("b"), good},
		"entry misnamed": {entryFile("a"), entryJSON(t, "a", 5, "30s", "", testDesc("b", 1, "x"))},
		"entry bad name": {entryFile("a/b"), entryJSON(t, "a/b", 5, "30s", "", testDesc("a/b", 1, "x"))},
		"entry bad ttl":  {entryFile("a"), entryJSON(t, "a", 5, "-1s", "", testDesc("a", 1, "x"))},
		"entry owner":    {entryFile("a"), entryJSON(t, "a", 5, "30s", "abcd", testDesc("a", 1, "x"))},
		"entry desc":     {entryFile("a"), strings.Replace(good, `"version":1`, `"version":99`, 1)},
	} {
		dir := t.TempDir()
		path := filepath.Join(dir, file.name)
		if err := os.WriteFile(path, []byte(file.content), 0o644); err != nil {
			t.Fatal(err)
		}
		s, err := metadata.NewServer(metadata.ServerConfig{Dir: dir})
		if err == nil {
			s.Close()
			t.Errorf("%s: NewServer accepted %s holding %q", what, file.name, file.content)
			continue
		}
		if !strings.Contains(err.Error(), path) {
			t.Errorf("%s: error %q does not name the file", what, err)
		}
		if b, _ := os.ReadFile(path); string(b) != file.content {
			t.Errorf("%s: NewServer changed the file", what)
		}
	}

	// A valid legacy file: its entries get a file each, with their ETags,
	// and it goes; an entry already moved (a migration a crash cut short)
	// keeps its own file's version.
	dir := t.TempDir()
	legacy := `{"version":1,"rev":9,"segments":[` + entry + `,{"rev":6,"ttl":"30s","desc":` + string(marshal(t, testDesc("b", 2, "old"))) + `}]}`
	if err := os.WriteFile(filepath.Join(dir, "segments.json"), []byte(legacy), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, entryFile("b")), []byte(entryJSON(t, "b", 7, "30s", "", testDesc("b", 2, "moved"))), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ".seg-123.tmp"), []byte("half a write"), 0o644); err != nil {
		t.Fatal(err)
	}
	check := func(s *metadata.Server, when string) {
		t.Helper()
		if w := request(t, s, "GET", seg+"a", nil); w.Code != 200 || w.Header().Get("ETag") != `"1-5"` {
			t.Fatalf("%s: GET a: %d, ETag %q", when, w.Code, w.Header().Get("ETag"))
		}
		w := request(t, s, "GET", seg+"b", nil)
		if d, _ := segtable.UnmarshalDesc(w.Body.Bytes()); d == nil || d.Endpoints["tcp"] != "moved" || w.Header().Get("ETag") != `"2-7"` {
			t.Fatalf("%s: GET b: %d %q, ETag %q", when, w.Code, w.Body, w.Header().Get("ETag"))
		}
		left, _ := filepath.Glob(filepath.Join(dir, "*"))
		tmp, _ := filepath.Glob(filepath.Join(dir, ".*"))
		slices.Sort(left)
		want := []string{filepath.Join(dir, entryFile("a")), filepath.Join(dir, entryFile("b"))}
		slices.Sort(want)
		if !slices.Equal(left, want) || len(tmp) != 0 {
			t.Fatalf("%s: directory holds %v and %v, want %v", when, left, tmp, want)
		}
	}
	s := newServer(t, metadata.ServerConfig{Dir: dir})
	check(s, "after the move")
	s.Close()
	check(newServer(t, metadata.ServerConfig{Dir: dir}), "after a restart")

	// Dir is a file: no directory to keep anything in.
	if _, err := metadata.NewServer(metadata.ServerConfig{Dir: filepath.Join(dir, entryFile("a"))}); err == nil {
		t.Fatal("NewServer with a file as Dir: no error")
	}
	for _, cfg := range []metadata.ServerConfig{
		{MaxTTL: time.Millisecond},
		{MaxNames: -1},
		{MaxBytes: -1},
		{MaxDescriptor: -1},
		{MaxConns: -1},
		{MaxDescriptor: 2 << 20, MaxBytes: 1 << 20},
		{ReadTimeout: -time.Second},
	} {
		if s, err := metadata.NewServer(cfg); err == nil {
			s.Close()
			t.Errorf("NewServer(%+v): no error", cfg)
		}
	}
}

// A server whose files cannot be written refuses changes (500), keeps
// serving what it holds, and leaves no temporary file behind.
func TestServerUnwritableFile(t *testing.T) {
	dir := t.TempDir()
	s := newServer(t, metadata.ServerConfig{Dir: dir})
	if w := request(t, s, "PUT", seg+"a", marshal(t, testDesc("a", 1, "x"))); w.Code != 204 {
		t.Fatalf("PUT: %d", w.Code)
	}
	// A directory where an entry's file should be: the rename over it,
	// and its removal, fail, even for root.
	for _, name := range []string{"a", "b"} {
		file := filepath.Join(dir, entryFile(name))
		if err := os.RemoveAll(file); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(file, "x"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if w := request(t, s, "PUT", seg+"b", marshal(t, testDesc("b", 1, "x"))); w.Code != 500 {
		t.Fatalf("PUT that cannot be saved: %d, want 500", w.Code)
	}
	if w := request(t, s, "GET", seg+"b", nil); w.Code != 404 {
		t.Fatalf("a PUT that could not be saved was kept: %d", w.Code)
	}
	if w := request(t, s, "PUT", seg+"a", marshal(t, testDesc("a", 1, "y"))); w.Code != 500 {
		t.Fatalf("republish that cannot be saved: %d, want 500", w.Code)
	}
	if d, _ := segtable.UnmarshalDesc(request(t, s, "GET", seg+"a", nil).Body.Bytes()); d == nil || d.Endpoints["tcp"] != "x" {
		t.Fatalf("a republish that could not be saved was kept: %+v", d)
	}
	if w := request(t, s, "DELETE", seg+"a", nil); w.Code != 500 {
		t.Fatalf("DELETE that cannot be saved: %d, want 500", w.Code)
	}
	if w := request(t, s, "GET", seg+"a", nil); w.Code != 200 {
		t.Fatalf("a DELETE that could not be saved was kept: %d", w.Code)
	}
	if st := s.Stats(); st.Names != 1 {
		t.Fatalf("Stats after refused changes: %+v, want 1 name", st)
	}
	left, _ := filepath.Glob(filepath.Join(dir, ".*"))
	if len(left) != 0 {
		t.Fatalf("directory holds temporary files %v", left)
	}
}

// marshalSigned is marshal of d signed with the key "k".
func marshalSigned(t *testing.T, d *segtable.SegmentDesc) []byte {
	t.Helper()
	return marshal(t, signedK(d))
}

// signedK signs d with the key "k", which the tests' keyed servers hold (a
// server with a key keeps only descriptors signed with it; one without
// ignores the signature), and returns it.
func signedK(d *segtable.SegmentDesc) *segtable.SegmentDesc {
	s, _ := segtable.NewSigner([]byte("k"))
	for i := range d.Buffers {
		d.Buffers[i].MAC = ""
	}
	s.Sign(d)
	return d
}
