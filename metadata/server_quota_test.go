package metadata_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
)

// padded returns a valid descriptor of name whose JSON is about n bytes.
func padded(t *testing.T, name string, epoch uint64, n int) []byte {
	t.Helper()
	d := testDesc(name, epoch, "x")
	d.Endpoints["pad"] = ""
	d.Endpoints["pad"] = strings.Repeat("p", max(n-len(marshal(t, d)), 0))
	return marshal(t, d)
}

// Each limit of a server is hit with its status, changes nothing, and is
// counted; what stays under the limits goes through.
func TestServerQuotas(t *testing.T) {
	var logged bytes.Buffer
	s := newServer(t, metadata.ServerConfig{
		MaxDescriptor: 1000, MaxNames: 3, MaxBytes: 2500,
		Logf: func(f string, a ...any) { fmt.Fprintf(&logged, f+"\n", a...) },
	})
	want := func(w interface{ Result() *http.Response }, code int, what string) {
		t.Helper()
		if r := w.Result(); r.StatusCode != code {
			b, _ := io.ReadAll(r.Body)
			t.Fatalf("%s: %d %q, want %d", what, r.StatusCode, b, code)
		}
	}
	if n := len(padded(t, "a", 1, 1000)); n != 1000 {
		t.Fatalf("padded to %d bytes", n)
	}
	want(request(t, s, "PUT", seg+"big", padded(t, "big", 1, 1001)), 413, "PUT over MaxDescriptor")
	want(request(t, s, "PUT", seg+"a", padded(t, "a", 1, 1000)), 204, "PUT at MaxDescriptor")
	want(request(t, s, "PUT", seg+"b", padded(t, "b", 1, 1000)), 204, "PUT of b")
	w := request(t, s, "PUT", seg+"c", padded(t, "c", 1, 600))
	want(w, 429, "PUT past MaxBytes")
	if !strings.Contains(w.Body.String(), "MaxBytes") {
		t.Fatalf("429 says %q", w.Body)
	}
	want(request(t, s, "PUT", seg+"c", padded(t, "c", 1, 400)), 204, "PUT up to MaxBytes")
	w = request(t, s, "PUT", seg+"d", padded(t, "d", 1, 100))
	want(w, 429, "PUT past MaxNames")
	if !strings.Contains(w.Body.String(), "MaxNames") {
		t.Fatalf("429 says %q", w.Body)
	}
	// Replacing a name is no new name, and a smaller descriptor frees
	// bytes.
	want(request(t, s, "PUT", seg+"a", padded(t, "a", 1, 300)), 204, "replacement at MaxNames")
	want(request(t, s, "PUT", seg+"c", padded(t, "c", 1, 1000)), 204, "replacement into the freed bytes")
	want(request(t, s, "PUT", seg+"c", padded(t, "c", 1, 1000), "Moonring-Renew", "1"), 204, "renewal at the limits")
	want(request(t, s, "DELETE", seg+"b", nil), 204, "DELETE")
	want(request(t, s, "PUT", seg+"d", padded(t, "d", 1, 100)), 204, "PUT after a DELETE")
	for _, name := range []string{"big", "b"} {
		if w := request(t, s, "GET", seg+name, nil); w.Code != 404 {
			t.Fatalf("GET %s: %d", name, w.Code)
		}
	}
	st := s.Stats()
	if st.TooLarge != 1 || st.TooManyBytes != 1 || st.TooManyNames != 1 || st.Names != 3 {
		t.Fatalf("Stats %+v", st)
	}
	if st.Bytes < 1300 || st.Bytes > 1500 {
		t.Fatalf("Stats.Bytes %d, want about 1400", st.Bytes)
	}
	for _, what := range []string{"(413)", "MaxNames", "MaxBytes"} {
		if !strings.Contains(logged.String(), what) {
			t.Errorf("log %q does not tell of %s", logged.String(), what)
		}
	}
}

// A refusal logs at most a line every ten seconds per kind, and says how
// many it left out.
func TestServerRefusalLogBounded(t *testing.T) {
	var lines []string
	s := newServer(t, metadata.ServerConfig{Key: []byte("k"), Logf: func(f string, a ...any) { lines = append(lines, fmt.Sprintf(f, a...)) }})
	for range 1000 {
		request(t, s, "DELETE", seg+"a", nil)
	}
	if len(lines) != 1 || !strings.Contains(lines[0], "(401)") {
		t.Fatalf("1000 refusals logged %d lines: %q", len(lines), lines)
	}
	if st := s.Stats(); st.Unauthenticated != 1000 {
		t.Fatalf("Stats %+v, want 1000 unauthenticated", st)
	}
}

// servePublic serves s as `moonring metadata-server` does: its HTTPServer
// on its LimitListener, on loopback, until the test ends.
func servePublic(t *testing.T, s *metadata.Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := s.HTTPServer()
	done := make(chan struct{})
	go func() { hs.Serve(s.LimitListener(ln)); close(done) }()
	t.Cleanup(func() { hs.Close(); <-done })
	return ln.Addr().String()
}

// Idle connections cannot lock clients out: past MaxConns a new one takes
// the place of the oldest idle one, which is closed and counted; when every
// place is taken by a connection in a request, the new one is closed at
// once and counted. One source cannot take more than MaxConnsPerHost.
func TestServerConnLimit(t *testing.T) {
	s := newServer(t, metadata.ServerConfig{MaxConns: 3, ReadHeaderTimeout: 2 * time.Second})
	addr := servePublic(t, s)
	dial := func() net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	waitStats := func(what string, ok func(metadata.ServerStats) bool) {
		t.Helper()
		for deadline := time.Now().Add(hang); !ok(s.Stats()); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: Stats %+v", what, s.Stats())
			}
		}
	}
	var idle []net.Conn
	for range 3 {
		idle = append(idle, dial())
	}
	waitStats("the idle connections accepted", func(st metadata.ServerStats) bool { return st.Conns == 3 })
	// A client past the cap is served; the oldest idle connection goes.
	resp, err := http.Get("http://" + addr + "/moonring/v1/healthz")
	if err != nil {
		t.Fatalf("a client past MaxConns idle connections: %v", err)
	}
	resp.Body.Close()
	idle[0].SetDeadline(time.Now().Add(hang))
	if _, err := idle[0].Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("the oldest idle connection: %v, want EOF (evicted)", err)
	}
	waitStats("one connection evicted", func(st metadata.ServerStats) bool { return st.ConnsEvicted >= 1 })
	// Every place in a request (a PUT whose body has not come): the new
	// one is refused. (A header begun is not a request yet: slow headers
	// are evicted like idle connections.) The server must have read the
	// PUTs' headers before the new one comes, which takes it a moment:
	// tried with longer waits until it has.
	http.DefaultClient.CloseIdleConnections()
	for _, c := range idle[1:] {
		c.Close()
	}
	waitStats("the connections gone", func(st metadata.ServerStats) bool { return st.Conns == 0 })
	put := "PUT /moonring/v1/segments/slow%d HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
	n := 0
	for wait := 20 * time.Millisecond; s.Stats().ConnsRefused == 0; wait *= 2 {
		if wait > 5*time.Second {
			t.Fatalf("no connection refused with every place in a request: Stats %+v", s.Stats())
		}
		for s.Stats().Conns < 3 {
			n++
			fmt.Fprintf(dial(), put, n)
			time.Sleep(wait) // its header read: its handler waits for the body
		}
		extra := dial()
		extra.SetDeadline(time.Now().Add(hang))
		extra.Read(make([]byte, 1)) // closed at once when refused
	}
}

// rawRequest sends req on a new connection to addr and returns the status
// line of the answer.
func rawRequest(t *testing.T, addr, req string) string {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(hang))
	go io.WriteString(c, req) // the server may answer before it has read it all
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	return strings.TrimSpace(line)
}

// Through HTTPServer: a header over MaxHeaderBytes is refused (431), and a
// body over MaxDescriptor (413) whether or not it says its length, after
// a credential check that reads none of it.
func TestServerRequestLimits(t *testing.T) {
	s := newServer(t, metadata.ServerConfig{MaxDescriptor: 1000, MaxHeaderBytes: 1024})
	addr := servePublic(t, s)
	if got := rawRequest(t, addr, "GET /moonring/v1/healthz HTTP/1.1\r\nHost: x\r\nX-Pad: "+strings.Repeat("p", 8<<10)+"\r\n\r\n"); !strings.Contains(got, " 431 ") {
		t.Fatalf("header of 8 KiB: %q, want 431", got)
	}
	if got := rawRequest(t, addr, "GET /moonring/v1/healthz HTTP/1.1\r\nHost: x\r\nX-Pad: "+strings.Repeat("p", 512)+"\r\n\r\n"); !strings.Contains(got, " 200 ") {
		t.Fatalf("header of 512 bytes: %q, want 200", got)
	}
	big := padded(t, "a", 1, 5000)
	if got := rawRequest(t, addr, fmt.Sprintf("PUT %sa HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", seg, len(big), big)); !strings.Contains(got, " 413 ") {
		t.Fatalf("PUT of 5000 bytes: %q, want 413", got)
	}
	chunked := fmt.Sprintf("PUT %sa HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", seg, len(big), big)
	if got := rawRequest(t, addr, chunked); !strings.Contains(got, " 413 ") {
		t.Fatalf("chunked PUT of 5000 bytes: %q, want 413", got)
	}
	if st := s.Stats(); st.TooLarge != 2 || st.Names != 0 {
		t.Fatalf("Stats %+v", st)
	}
}

// With a directory, a PUT writes its own entry's file and no other.
func TestServerPersistPerEntry(t *testing.T) {
	dir := t.TempDir()
	s := newServer(t, metadata.ServerConfig{Dir: dir})
	if w := request(t, s, "PUT", seg+"a", padded(t, "a", 1, 100)); w.Code != 204 {
		t.Fatalf("PUT a: %d", w.Code)
	}
	fa := filepath.Join(dir, entryFile("a"))
	before, err := os.Stat(fa)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		if w := request(t, s, "PUT", seg+"b", padded(t, "b", 1, 100+i)); w.Code != 204 {
			t.Fatalf("PUT b: %d", w.Code)
		}
	}
	if w := request(t, s, "DELETE", seg+"b", nil); w.Code != 204 {
		t.Fatalf("DELETE b: %d", w.Code)
	}
	after, err := os.Stat(fa)
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(before, after) || !after.ModTime().Equal(before.ModTime()) {
		t.Fatal("changes of b rewrote a's file")
	}
	if _, err := os.Stat(filepath.Join(dir, entryFile("b"))); !os.IsNotExist(err) {
		t.Fatalf("b's file after its DELETE: %v", err)
	}
}

// While the bodies of PUTs being read add up to 32 MaxDescriptors (clients
// that send headers and then nothing), another PUT is refused at once
// (503) and counted; once they go, PUTs are served again.
func TestServerBusy(t *testing.T) {
	s := newServer(t, metadata.ServerConfig{MaxDescriptor: 1000})
	addr := servePublic(t, s)
	var holders []net.Conn
	defer func() {
		for _, c := range holders {
			c.Close()
		}
	}()
	for i := range 32 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		holders = append(holders, c)
		fmt.Fprintf(c, "PUT %sh%d HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", seg, i)
	}
	body := padded(t, "a", 1, 500)
	put := fmt.Sprintf("PUT %sa HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", seg, len(body), body)
	waitFor(t, "a PUT refused while 32 bodies are being read", func() bool { return strings.Contains(rawRequest(t, addr, put), " 503 ") })
	if st := s.Stats(); st.Busy == 0 {
		t.Fatalf("Stats %+v", st)
	}
	for _, c := range holders {
		c.Close()
	}
	holders = nil
	waitFor(t, "a PUT served once the readers went", func() bool { return strings.Contains(rawRequest(t, addr, put), " 204 ") })
}
