package metadata_test

import (
	"bytes"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

// startServer serves a metadata.Server made with cfg on loopback until the
// test ends and returns it and its URL.
func startServer(t *testing.T, cfg metadata.ServerConfig) (*metadata.Server, string) {
	t.Helper()
	srv, err := metadata.NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})
	return srv, hs.URL
}

// newHTTP returns a store of the server at url, closed when the test ends.
func newHTTP(t *testing.T, url string, ttl time.Duration) *metadata.HTTP {
	t.Helper()
	h, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url, TTL: ttl, PollInterval: testPoll})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// TestHTTP runs the suite against one client of a fresh server, and against
// two clients of one server (writes through one, reads through the other)
// keeping its file in a directory.
func TestHTTP(t *testing.T) {
	t.Run("One", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) metadata.Store {
			_, url := startServer(t, metadata.ServerConfig{})
			return newHTTP(t, url, 0)
		})
	})
	t.Run("Key", func(t *testing.T) {
		var url string
		storetest.RunOptions(t, func(t *testing.T) metadata.Store {
			_, url = startServer(t, metadata.ServerConfig{Key: []byte("k"), Dir: t.TempDir()})
			return signedBy(t, newHTTPKey(t, url, "k", 0, nil), "k")
		}, storetest.Options{
			Peer: func(t *testing.T, _ metadata.Store) metadata.Store {
				return signedBy(t, newHTTPKey(t, url, "k", 0, nil), "k")
			},
		})
	})
	t.Run("Peer", func(t *testing.T) {
		var url string
		storetest.RunOptions(t, func(t *testing.T) metadata.Store {
			_, url = startServer(t, metadata.ServerConfig{Dir: t.TempDir()})
			return newHTTP(t, url, 0)
		}, storetest.Options{
			Peer: func(t *testing.T, _ metadata.Store) metadata.Store { return newHTTP(t, url, 0) },
		})
	})
}

func TestHTTPConfig(t *testing.T) {
	for _, cfg := range []metadata.HTTPConfig{
		{},
		{URL: "localhost:80"},
		{URL: "ftp://h/"},
		{URL: "http://"},
		{URL: "http://h/?x=1"},
		{URL: "http://u:p@h/"},
		{URL: "http://h", TTL: time.Millisecond},
	} {
		if h, err := metadata.NewHTTP(cfg); err == nil {
			h.Close()
			t.Errorf("NewHTTP(%+v): no error", cfg)
		}
	}
	h, err := metadata.NewHTTP(metadata.HTTPConfig{URL: "http://10.0.0.1:8470/"})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if got := h.String(); got != "http http://10.0.0.1:8470" {
		t.Fatalf("String() = %q", got)
	}
	// A key sent in the clear beyond loopback is worth a warning.
	for url, warn := range map[string]bool{"http://10.0.0.1:8470": true, "https://10.0.0.1:8470": false, "http://127.0.0.1:8470": false, "http://localhost:1": false} {
		var logged syncBuffer
		h := newHTTPKey(t, url, "k", 0, slog.New(slog.NewTextHandler(&logged, nil)))
		h.Close()
		if got := strings.Contains(logged.String(), "in the clear"); got != warn {
			t.Errorf("NewHTTP(%s) with a key: warned %v, want %v: %q", url, got, warn, logged.String())
		}
	}
}

// A store whose owner stops renewing (its client closed, as when the engine
// dies) loses its descriptor within a few TTLs, and watchers see Deleted;
// the descriptor of an open client stays however long, and goes at Delete.
func TestHTTPExpiry(t *testing.T) {
	_, url := startServer(t, metadata.ServerConfig{})
	const ttl = 200 * time.Millisecond
	dead := newHTTP(t, url, ttl)
	// The live one renews every third of its TTL: a second, so that a
	// stall of a loaded machine (under -race) does not let it lapse.
	const liveTTL = time.Second
	live := newHTTP(t, url, liveTTL)
	reader := newHTTP(t, url, 0)
	ctx := t.Context()
	if err := dead.Put(ctx, testDesc("dead", 1, "d")); err != nil {
		t.Fatal(err)
	}
	if err := live.Put(ctx, testDesc("live", 2, "l")); err != nil {
		t.Fatal(err)
	}
	deadCh, err := reader.Watch(ctx, "dead")
	if err != nil {
		t.Fatal(err)
	}
	liveCh, err := reader.Watch(ctx, "live")
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, deadCh); ev.Deleted || ev.Desc.Epoch != 1 {
		t.Fatalf("first event of dead: %+v", ev)
	}
	if ev := next(t, liveCh); ev.Deleted || ev.Desc.Epoch != 2 {
		t.Fatalf("first event of live: %+v", ev)
	}
	start := time.Now()
	dead.Close()
	if ev := next(t, deadCh); !ev.Deleted || ev.Desc.Epoch != 1 {
		t.Fatalf("event after the owner stopped renewing: %+v, want Deleted", ev)
	}
	t.Logf("an unrenewed descriptor went in %v (TTL %v)", time.Since(start).Round(time.Millisecond), ttl)
	if _, err := reader.Get(ctx, "dead"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("Get of an expired descriptor: %v, want ErrNotFound", err)
	}

	// The live one outlives several TTLs (renewals change nothing a
	// watcher sees), then goes at Delete.
	time.Sleep(3 * liveTTL)
	select {
	case ev := <-liveCh:
		t.Fatalf("event %+v on a renewed descriptor", ev)
	default:
	}
	if d, err := reader.Get(ctx, "live"); err != nil || d.Epoch != 2 {
		t.Fatalf("Get(live) after %v: %+v, %v", 3*liveTTL, d, err)
	}
	if err := live.Delete(ctx, "live", 2); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, liveCh); !ev.Deleted {
		t.Fatalf("event after Delete: %+v", ev)
	}
	// Delete ended the renewal: nothing brings it back.
	time.Sleep(2 * ttl)
	if _, err := reader.Get(ctx, "live"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("Get after Delete and %v: %v, want ErrNotFound", 2*ttl, err)
	}
}

// A server that lost its descriptors (a restart without a directory) gets
// them back from the owners' renewals.
func TestHTTPRenewalRestores(t *testing.T) {
	srv, err := metadata.NewServer(metadata.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var cur sync.Mutex
	handler := http.Handler(srv)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cur.Lock()
		h := handler
		cur.Unlock()
		h.ServeHTTP(w, r)
	}))
	defer hs.Close()
	owner := newHTTP(t, hs.URL, 100*time.Millisecond)
	reader := newHTTP(t, hs.URL, 0)
	if err := owner.Put(t.Context(), testDesc("a", 3, "v")); err != nil {
		t.Fatal(err)
	}
	ch, err := reader.Watch(t.Context(), "a")
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 3 {
		t.Fatalf("first event %+v", ev)
	}
	srv.Close()
	srv2, err := metadata.NewServer(metadata.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv2.Close()
	cur.Lock()
	handler = srv2
	cur.Unlock()
	for { // the new server answers 404 until a renewal stores "a" again
		ev := next(t, ch)
		if !ev.Deleted && ev.Desc.Epoch == 3 && ev.Desc.Endpoints["tcp"] == "v" {
			break
		}
	}
}

// Two stores race to publish one name with different epochs: exactly one
// wins, the other gets ErrExists, and the loser renews nothing.
func TestHTTPPublishRace(t *testing.T) {
	_, url := startServer(t, metadata.ServerConfig{})
	a, b := newHTTP(t, url, 0), newHTTP(t, url, 0)
	ctx := t.Context()
	for round := range 20 {
		ea, eb := uint64(2*round+1), uint64(2*round+2)
		var errA, errB error
		var wg sync.WaitGroup
		start := make(chan struct{})
		wg.Go(func() { <-start; errA = a.Put(ctx, testDesc("contested", ea, "a")) })
		wg.Go(func() { <-start; errB = b.Put(ctx, testDesc("contested", eb, "b")) })
		close(start)
		wg.Wait()
		winner, want := a, ea
		switch {
		case errA == nil && errors.Is(errB, metadata.ErrExists):
		case errB == nil && errors.Is(errA, metadata.ErrExists):
			winner, want = b, eb
		default:
			t.Fatalf("round %d: Put errors %v and %v, want one nil and one ErrExists", round, errA, errB)
		}
		if err := errors.Join(errA, errB); !strings.Contains(err.Error(), "contested") {
			t.Errorf("error %q does not name the segment", err)
		}
		d, err := a.Get(ctx, "contested")
		if err != nil || d.Epoch != want {
			t.Fatalf("round %d: Get = %+v, %v; want epoch %d", round, d, err, want)
		}
		if err := winner.Delete(ctx, "contested", want); err != nil {
			t.Fatalf("round %d: winner's Delete: %v", round, err)
		}
	}
}

func TestHTTPErrors(t *testing.T) {
	_, url := startServer(t, metadata.ServerConfig{MaxTTL: time.Second})
	ctx := t.Context()
	h := newHTTP(t, url, 0) // 30s: more than the server takes
	err := h.Put(ctx, testDesc("a", 1, "x"))
	if !errors.Is(err, segtable.ErrBadDesc) || !strings.Contains(err.Error(), "Moonring-TTL") || !strings.Contains(err.Error(), h.String()) {
		t.Fatalf("Put with a TTL above the server's maximum: %v, want ErrBadDesc naming the header", err)
	}
	for _, name := range []string{"a/b", "..", ".", "a b", "a?b", "a#b", strings.Repeat("x", 256)} {
		if _, err := h.Get(ctx, name); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("Get(%q): %v, want ErrNotFound", name, err)
		}
		if _, err := h.Watch(ctx, name); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("Watch(%q): %v, want ErrNotFound", name, err)
		}
		if err := h.Delete(ctx, name, 0); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("Delete(%q): %v, want ErrNotFound", name, err)
		}
		if err := h.Put(ctx, testDesc(name, 1, "x")); !errors.Is(err, segtable.ErrBadDesc) {
			t.Errorf("Put(%q): %v, want ErrBadDesc", name, err)
		}
	}

	// A server that is down, or answers nonsense.
	down := newHTTP(t, "http://"+deadAddr(t), 0)
	_, err = down.Get(ctx, "a")
	if !errors.Is(err, metadata.ErrUnreachable) || !strings.Contains(err.Error(), down.String()) || !strings.Contains(err.Error(), `"a"`) {
		t.Fatalf("Get from a dead server: %v, want ErrUnreachable naming the store and the segment", err)
	}
	if err := down.Put(ctx, testDesc("a", 1, "x")); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Put to a dead server: %v, want ErrUnreachable", err)
	}
	broken := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/other") {
			body, _ := testDesc("someone-else", 1, "x").Marshal()
			w.Write(body)
			return
		}
		http.Error(w, "boom", http.StatusInternalServerError)
	}))
	defer broken.Close()
	bh := newHTTP(t, broken.URL, 0)
	if _, err := bh.Get(ctx, "a"); !errors.Is(err, metadata.ErrUnreachable) || !strings.Contains(err.Error(), "500") {
		t.Fatalf("Get from a failing server: %v, want ErrUnreachable with the status", err)
	}
	if _, err := bh.Get(ctx, "other"); !errors.Is(err, segtable.ErrBadDesc) {
		t.Fatalf("Get answered with another segment: %v, want ErrBadDesc", err)
	}
}

// A watched server that goes away: the watcher sees Deleted after the
// failed polls, and the descriptor again when it is back.
func TestHTTPWatchServerDown(t *testing.T) {
	srv, err := metadata.NewServer(metadata.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	var mu sync.Mutex
	down := false
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		d := down
		mu.Unlock()
		if d && r.Method == http.MethodGet {
			http.Error(w, "down", http.StatusBadGateway)
			return
		}
		srv.ServeHTTP(w, r)
	}))
	defer hs.Close()
	h := newHTTP(t, hs.URL, 0)
	if err := h.Put(t.Context(), testDesc("a", 1, "v")); err != nil {
		t.Fatal(err)
	}
	ch, err := h.Watch(t.Context(), "a")
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted {
		t.Fatalf("first event %+v", ev)
	}
	mu.Lock()
	down = true
	mu.Unlock()
	if ev := next(t, ch); !ev.Deleted || ev.Desc.Epoch != 1 {
		t.Fatalf("event of a server that stopped answering: %+v, want Deleted", ev)
	}
	mu.Lock()
	down = false
	mu.Unlock()
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 1 {
		t.Fatalf("event of a server back: %+v", ev)
	}
}

// Names with the characters a server allows travel through the URL intact.
func TestHTTPNames(t *testing.T) {
	_, url := startServer(t, metadata.ServerConfig{})
	h := newHTTP(t, url, 0)
	ctx := t.Context()
	for _, name := range []string{"[::1]:7000", "10.0.0.1:7000", "fe80::1%eth0", "a@b+c~d", "node_1.rack-2", strings.Repeat("x", 255)} {
		if err := h.Put(ctx, testDesc(name, 1, "v")); err != nil {
			t.Fatalf("Put(%q): %v", name, err)
		}
		if d, err := h.Get(ctx, name); err != nil || d.Name != name {
			t.Fatalf("Get(%q) = %+v, %v", name, d, err)
		}
		if err := h.Delete(ctx, name, 1); err != nil {
			t.Fatalf("Delete(%q): %v", name, err)
		}
	}
}

// newHTTPKey returns a store with key of the server at url, logging to
// logger (nil: discarded), closed when the test ends.
func newHTTPKey(t *testing.T, url, key string, ttl time.Duration, logger *slog.Logger) *metadata.HTTP {
	t.Helper()
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	var k []byte
	if key != "" {
		k = []byte(key)
	}
	h, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url, TTL: ttl, PollInterval: testPoll, Key: k, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// syncBuffer is a bytes.Buffer safe for concurrent use.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// waitFor polls cond until it holds, failing the test after hang.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hang)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %v", what, hang)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Against a server with the key, stores without it or with another are
// denied (ErrDenied) and change nothing, and the owner keeps its name
// alive through their attempts.
func TestHTTPOwner(t *testing.T) {
	srv, url := startServer(t, metadata.ServerConfig{Key: []byte("k")})
	ctx := t.Context()
	const ttl = 300 * time.Millisecond
	owner := newHTTPKey(t, url, "k", ttl, nil)
	none := newHTTPKey(t, url, "", 0, nil)
	other := newHTTPKey(t, url, "x", 0, nil)
	reader := newHTTP(t, url, 0)
	for _, s := range []*metadata.HTTP{none, other} {
		if err := s.Put(ctx, testDesc("squat", 1, "relay")); !errors.Is(err, metadata.ErrDenied) || !strings.Contains(err.Error(), "squat") {
			t.Fatalf("Put of a free name without the key: %v, want ErrDenied", err)
		}
	}
	if err := owner.Put(ctx, signedK(testDesc("a", 7, "owner"))); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*metadata.HTTP{none, other} {
		if err := s.Put(ctx, testDesc("a", 7, "relay")); !errors.Is(err, metadata.ErrDenied) {
			t.Fatalf("Put over the owner's without the key: %v, want ErrDenied", err)
		}
		if err := s.Delete(ctx, "a", 0); !errors.Is(err, metadata.ErrDenied) {
			t.Fatalf("Delete without the key: %v, want ErrDenied", err)
		}
	}
	time.Sleep(3 * ttl) // the owner renews through it all
	if d, err := reader.Get(ctx, "a"); err != nil || d.Endpoints["tcp"] != "owner" || d.Epoch != 7 {
		t.Fatalf("Get after the attempts: %+v, %v", d, err)
	}
	if _, err := reader.Get(ctx, "squat"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("Get of a squatted name: %v", err)
	}
	if st := srv.Stats(); st.Unauthenticated < 3 || st.Forbidden < 3 {
		t.Fatalf("Stats %+v", st)
	}
	if err := owner.Delete(ctx, "a", 7); err != nil {
		t.Fatal(err)
	}
}

// An owner whose renewals are denied (the server lost its entry and a
// stranger took the name) says so in its log, keeps trying, takes the name
// back once the stranger's entry is gone, and says that too.
func TestHTTPRenewalDenied(t *testing.T) {
	srv, err := metadata.NewServer(metadata.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var cur sync.Mutex
	handler := http.Handler(srv)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cur.Lock()
		h := handler
		cur.Unlock()
		h.ServeHTTP(w, r)
	}))
	defer hs.Close()
	var logged syncBuffer
	owner := newHTTPKey(t, hs.URL, "k", 100*time.Millisecond, slog.New(slog.NewTextHandler(&logged, nil)))
	reader := newHTTP(t, hs.URL, 0)
	if err := owner.Put(t.Context(), testDesc("a", 3, "owner")); err != nil {
		t.Fatal(err)
	}
	// The server restarts without its entries; a stranger takes the name
	// first, with the owner's epoch.
	srv.Close()
	srv2 := newServer(t, metadata.ServerConfig{})
	if w := request(t, srv2, "PUT", seg+"a", marshal(t, testDesc("a", 3, "relay")), "Moonring-Owner", token("x", "a"), "Moonring-TTL", "1"); w.Code != 204 {
		t.Fatalf("stranger's PUT: %d %s", w.Code, w.Body)
	}
	cur.Lock()
	handler = srv2
	cur.Unlock()
	waitFor(t, "the owner logs its denied renewals", func() bool { return strings.Contains(logged.String(), "renewal denied") })
	if n := strings.Count(logged.String(), "renewal denied"); n != 1 {
		t.Fatalf("denied renewals logged %d times, want once a minute:\n%s", n, logged.String())
	}
	// The stranger's entry expires; the owner's renewal stores its own.
	waitFor(t, "the owner takes its name back", func() bool {
		d, err := reader.Get(t.Context(), "a")
		return err == nil && d.Endpoints["tcp"] == "owner"
	})
	waitFor(t, "the owner logs that renewals succeed", func() bool { return strings.Contains(logged.String(), "renewals succeed again") })
}
