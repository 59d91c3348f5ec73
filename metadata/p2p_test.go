package metadata_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

// testPoll keeps remote watches quick; the suite makes no timed assertions.
const testPoll = 5 * time.Millisecond

// hang bounds waits for an event in these tests; it is not a speed
// requirement.
const hang = 30 * time.Second

func newP2P(t *testing.T, cfg metadata.P2PConfig) *metadata.P2P {
	t.Helper()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = testPoll
	}
	p, err := metadata.NewP2P(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func p2pOwnName(s metadata.Store) string { return s.(*metadata.P2P).Name() }

// TestP2P runs the suite against the local path (the store reads its own
// segment) and the remote path (a second store reads it over HTTP). A p2p
// store publishes only its own name, hence OwnName.
func TestP2P(t *testing.T) {
	newStore := func(t *testing.T) metadata.Store { return newP2P(t, metadata.P2PConfig{}) }
	t.Run("Local", func(t *testing.T) {
		storetest.RunOptions(t, newStore, storetest.Options{OwnName: p2pOwnName})
	})
	t.Run("Remote", func(t *testing.T) {
		storetest.RunOptions(t, newStore, storetest.Options{
			OwnName: p2pOwnName,
			Peer: func(t *testing.T, _ metadata.Store) metadata.Store {
				return newP2P(t, metadata.P2PConfig{})
			},
		})
	})
}

func testDesc(name string, epoch uint64, tag string) *segtable.SegmentDesc {
	return &segtable.SegmentDesc{
		Version:   segtable.DescVersion,
		Name:      name,
		Epoch:     epoch,
		Endpoints: map[string]string{"tcp": tag},
		Buffers:   []segtable.BufferDesc{{Addr: 0x1000, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "k"}}},
	}
}

func next(t *testing.T, ch <-chan metadata.Event) metadata.Event {
	t.Helper()
	select {
	case ev, ok := <-ch:
		if !ok {
			t.Fatal("watch closed early")
		}
		return ev
	case <-time.After(hang):
		t.Fatalf("no event within %v", hang)
	}
	panic("unreachable")
}

func TestP2PRemoteLifecycle(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{})
	b := newP2P(t, metadata.P2PConfig{})
	ctx := t.Context()
	if err := a.Put(ctx, testDesc(a.Name(), 1, "v1")); err != nil {
		t.Fatal(err)
	}
	d, err := b.Get(ctx, a.Name())
	if err != nil || d.Name != a.Name() || d.Endpoints["tcp"] != "v1" {
		t.Fatalf("B.Get(A) = %+v, %v", d, err)
	}
	ch, err := b.Watch(ctx, a.Name())
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Endpoints["tcp"] != "v1" {
		t.Fatalf("first event %+v, want v1", ev)
	}
	if err := a.Put(ctx, testDesc(a.Name(), 1, "v2")); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Endpoints["tcp"] != "v2" {
		t.Fatalf("event after republish %+v, want v2", ev)
	}
	if err := a.Delete(ctx, a.Name(), 1); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); !ev.Deleted || ev.Desc.Epoch != 1 {
		t.Fatalf("event after delete %+v, want Deleted epoch 1", ev)
	}
	if _, err := b.Get(ctx, a.Name()); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("B.Get after delete: %v, want ErrNotFound", err)
	}

	// The engine dies with its segment published: B must see it go.
	if err := a.Put(ctx, testDesc(a.Name(), 2, "w1")); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 2 {
		t.Fatalf("event after the new epoch %+v", ev)
	}
	addr := a.Name()
	a.Close()
	if ev := next(t, ch); !ev.Deleted || ev.Desc.Epoch != 2 {
		t.Fatalf("event after the peer died %+v, want Deleted epoch 2", ev)
	}
	_, err = b.Get(ctx, addr)
	if !errors.Is(err, metadata.ErrUnreachable) || !strings.Contains(err.Error(), addr) || !strings.Contains(err.Error(), b.String()) {
		t.Fatalf("Get of a dead peer: %v, want ErrUnreachable naming the store and %s", err, addr)
	}
}

// TestP2PWatchRestart: a peer dies with its segment published, and the
// watch sees it go; it restarts under the same name with a new epoch, and
// the watch sees it back. The name is a front's address that forwards to
// whichever process serves it, so the restart needs no port of the dead
// one's: listening again on that port (as this test did) fails whenever
// the kernel has handed it out meanwhile, a client's ephemeral port say,
// and the test then skipped.
func TestP2PWatchRestart(t *testing.T) {
	fr := newFront(t)
	a := behind(t, fr)
	b := newP2P(t, metadata.P2PConfig{})
	ctx := t.Context()
	name := a.Name()
	if name != fr.addr() {
		t.Fatalf("name %s, want the front's %s", name, fr.addr())
	}
	if err := a.Put(ctx, testDesc(name, 2, "w1")); err != nil {
		t.Fatal(err)
	}
	ch, err := b.Watch(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 2 {
		t.Fatalf("first event %+v, want epoch 2", ev)
	}
	a.Close()
	if ev := next(t, ch); !ev.Deleted || ev.Desc.Epoch != 2 {
		t.Fatalf("event after the peer died %+v, want Deleted epoch 2", ev)
	}
	if _, err := b.Get(ctx, name); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Get of the dead peer: %v, want ErrUnreachable", err)
	}
	a2 := behind(t, fr)
	if err := a2.Put(ctx, testDesc(name, 3, "x1")); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 3 || ev.Desc.Endpoints["tcp"] != "x1" {
		t.Fatalf("event after the restart %+v, want epoch 3", ev)
	}
}

// behind starts a p2p store named by fr's address on a port of its own,
// and points fr at it.
func behind(t *testing.T, fr *front) *metadata.P2P {
	t.Helper()
	var err error
	for range 10 { // a port just freed may be taken again before the store listens
		addr := deadAddr(t)
		var p *metadata.P2P
		if p, err = metadata.NewP2P(metadata.P2PConfig{Listen: addr, Advertise: fr.addr(), PollInterval: testPoll}); err == nil {
			t.Cleanup(func() { p.Close() })
			fr.to(addr)
			return p
		}
	}
	t.Fatalf("no free port for the store behind the front: %v", err)
	return nil
}

// front is a stable address before a p2p endpoint that moves: it forwards
// each connection to the address it is pointed at, and closes it when
// nothing answers there.
type front struct {
	ln      net.Listener
	backend atomic.Pointer[string]
	mu      sync.Mutex
	conns   map[net.Conn]bool // nil once closed
	wg      sync.WaitGroup
}

func newFront(t *testing.T) *front {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &front{ln: ln, conns: map[net.Conn]bool{}}
	f.wg.Add(1)
	go f.accept()
	t.Cleanup(f.close)
	return f
}

func (f *front) addr() string { return f.ln.Addr().String() }

func (f *front) to(backend string) { f.backend.Store(&backend) }

func (f *front) accept() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		f.wg.Add(1)
		go f.forward(c)
	}
}

// track records c to be closed by close, or closes it and reports false
// when the front is closed.
func (f *front) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.conns == nil {
		c.Close()
		return false
	}
	f.conns[c] = true
	return true
}

func (f *front) forward(c net.Conn) {
	defer f.wg.Done()
	defer c.Close()
	b := f.backend.Load()
	if !f.track(c) || b == nil {
		return
	}
	s, err := net.DialTimeout("tcp", *b, hang)
	if err != nil || !f.track(s) {
		return
	}
	defer s.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		io.Copy(s, c)
		s.Close()
	}()
	io.Copy(c, s)
	c.Close()
	<-done
}

// close stops the front and its connections and waits for its goroutines.
func (f *front) close() {
	f.ln.Close()
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.conns = nil
	f.mu.Unlock()
	f.wg.Wait()
}

// A peer that never answered a descriptor gets no Deleted, however long it
// stays down; the watch stays open until its context ends.
func TestP2PWatchUnreachableFromStart(t *testing.T) {
	b := newP2P(t, metadata.P2PConfig{})
	dead := deadAddr(t)
	ctx, cancel := context.WithCancel(t.Context())
	ch, err := b.Watch(ctx, dead)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * testPoll) // lets polls fail; any event would be wrong
	select {
	case ev := <-ch:
		t.Fatalf("event %+v from a peer that never answered", ev)
	default:
	}
	cancel()
	if _, ok := <-ch; ok {
		t.Fatal("event after cancel")
	}
}

// deadAddr returns a loopback address nobody listens on (for the moment).
func deadAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestP2POwnership(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{})
	ctx := t.Context()
	err := a.Put(ctx, testDesc("10.0.0.1:7000", 1, "x"))
	if !errors.Is(err, metadata.ErrNotOwner) || !strings.Contains(err.Error(), "10.0.0.1:7000") {
		t.Fatalf("Put of another name: %v, want ErrNotOwner", err)
	}
	if err := a.Delete(ctx, "10.0.0.1:7000", 0); !errors.Is(err, metadata.ErrNotOwner) {
		t.Fatalf("Delete of another name: %v, want ErrNotOwner", err)
	}
	if _, err := a.Get(ctx, a.Name()); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("refused Put published something: %v", err)
	}
}

func TestP2PBadNames(t *testing.T) {
	b := newP2P(t, metadata.P2PConfig{})
	for _, name := range []string{"no-port", "host:0", "host:99999", ":80", "a/b:80", "u@h:80", "h:80/x", "h?x:80"} {
		if _, err := b.Get(t.Context(), name); !errors.Is(err, metadata.ErrNotFound) || !strings.Contains(err.Error(), "host:port") {
			t.Errorf("Get(%q): %v, want ErrNotFound about host:port", name, err)
		}
		if _, err := b.Watch(t.Context(), name); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("Watch(%q): %v, want ErrNotFound", name, err)
		}
	}
}

// fakePeer serves handler on loopback and returns its name.
func fakePeer(t *testing.T, handler http.HandlerFunc) string {
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

func TestP2PRefusesBadPeers(t *testing.T) {
	b := newP2P(t, metadata.P2PConfig{})
	huge := func(w http.ResponseWriter, _ *http.Request) {
		chunk := []byte(strings.Repeat(" ", 1<<20))
		for range 17 {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}
	cases := []struct {
		name    string
		handler http.HandlerFunc
		want    error
		msg     string
	}{
		{"garbage", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "{not json") }, segtable.ErrBadDesc, "peer's answer"},
		{"invalid", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, `{"version":1,"name":""}`) }, segtable.ErrBadDesc, "empty name"},
		{"other name", func(w http.ResponseWriter, _ *http.Request) {
			body, _ := testDesc("10.9.9.9:1", 1, "x").Marshal()
			w.Write(body)
		}, segtable.ErrBadDesc, `serves segment "10.9.9.9:1"`},
		{"huge chunked", huge, segtable.ErrBadDesc, "more than"},
		{"huge declared", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", fmt.Sprint(32<<20))
			huge(w, r)
		}, segtable.ErrBadDesc, "more than"},
		{"500", func(w http.ResponseWriter, _ *http.Request) { http.Error(w, "boom", 500) }, metadata.ErrUnreachable, "500"},
		{"redirect", func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, "http://10.9.9.9/", http.StatusFound)
		}, metadata.ErrUnreachable, "302"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			name := fakePeer(t, tc.handler)
			d, err := b.Get(t.Context(), name)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), name) {
				t.Fatalf("Get = %+v, %v; want %v mentioning %q and %s", d, err, tc.want, tc.msg, name)
			}
			if d != nil {
				t.Fatalf("Get returned %+v with its error", d)
			}
		})
	}
}

// A peer that serves a descriptor, then breaks: the watcher gets Deleted
// after the failed polls, and the descriptor again once the peer mends.
func TestP2PWatchBrokenPeer(t *testing.T) {
	var broken atomic.Bool
	var name string
	name = fakePeer(t, func(w http.ResponseWriter, _ *http.Request) {
		if broken.Load() {
			http.Error(w, "boom", 500)
			return
		}
		body, _ := testDesc(name, 4, "v").Marshal()
		w.Write(body) // no ETag: the watch compares bodies
	})
	b := newP2P(t, metadata.P2PConfig{})
	ch, err := b.Watch(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 4 {
		t.Fatalf("first event %+v", ev)
	}
	broken.Store(true)
	if ev := next(t, ch); !ev.Deleted || ev.Desc.Epoch != 4 {
		t.Fatalf("event of a broken peer %+v, want Deleted", ev)
	}
	broken.Store(false)
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 4 {
		t.Fatalf("event of a mended peer %+v", ev)
	}
}

func TestP2PServesETag(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{})
	url := "http://" + a.Name() + "/moonring/v1/segment"
	get := func(inm string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(t.Context(), "GET", url, nil)
		if inm != "" {
			req.Header.Set("If-None-Match", inm)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp, string(body)
	}
	if resp, _ := get(""); resp.StatusCode != 404 {
		t.Fatalf("before Put: %s, want 404", resp.Status)
	}
	if err := a.Put(t.Context(), testDesc(a.Name(), 7, "v1")); err != nil {
		t.Fatal(err)
	}
	resp, body := get("")
	etag := resp.Header.Get("ETag")
	if resp.StatusCode != 200 || !strings.HasPrefix(etag, `"7-`) || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("after Put: %s, ETag %q, type %q", resp.Status, etag, resp.Header.Get("Content-Type"))
	}
	if d, err := segtable.UnmarshalDesc([]byte(body)); err != nil || d.Name != a.Name() {
		t.Fatalf("served %q: %v", body, err)
	}
	for _, inm := range []string{etag, "W/" + etag, `"x", ` + etag, "*"} {
		if resp, body := get(inm); resp.StatusCode != 304 || body != "" {
			t.Fatalf("If-None-Match %s: %s %q, want 304", inm, resp.Status, body)
		}
	}
	if err := a.Put(t.Context(), testDesc(a.Name(), 7, "v2")); err != nil {
		t.Fatal(err)
	}
	resp, _ = get(etag)
	if resp.StatusCode != 200 || resp.Header.Get("ETag") == etag {
		t.Fatalf("after republish with the old ETag: %s, ETag %q", resp.Status, resp.Header.Get("ETag"))
	}
	if err := a.Delete(t.Context(), a.Name(), 7); err != nil {
		t.Fatal(err)
	}
	if resp, _ := get(etag); resp.StatusCode != 404 {
		t.Fatalf("after Delete: %s, want 404", resp.Status)
	}
	hresp, err := http.Get("http://" + a.Name() + "/moonring/v1/healthz")
	if err != nil {
		t.Fatal(err)
	}
	hbody, _ := io.ReadAll(hresp.Body)
	hresp.Body.Close()
	if hresp.StatusCode != 200 || string(hbody) != "ok" {
		t.Fatalf("healthz: %s %q", hresp.Status, hbody)
	}
	http.DefaultClient.CloseIdleConnections()
}

// A watcher's polls carry If-None-Match and an unchanged peer answers 304:
// a fake peer in front of a real store counts both.
func TestP2PWatchPollsWithETag(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{})
	var full, notModified atomic.Int64
	proxyName := ""
	proxyName = fakePeer(t, func(w http.ResponseWriter, r *http.Request) {
		req, _ := http.NewRequestWithContext(r.Context(), "GET", "http://"+a.Name()+r.URL.Path, nil)
		req.Header = r.Header.Clone()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			http.Error(w, err.Error(), 502)
			return
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode == 304 {
			notModified.Add(1)
		} else {
			full.Add(1)
		}
		// Serve a's descriptor under the proxy's name.
		body = []byte(strings.ReplaceAll(string(body), a.Name(), proxyName))
		w.Header().Set("ETag", resp.Header.Get("ETag"))
		w.WriteHeader(resp.StatusCode)
		w.Write(body)
	})
	t.Cleanup(http.DefaultClient.CloseIdleConnections)
	if err := a.Put(t.Context(), testDesc(a.Name(), 1, "v1")); err != nil {
		t.Fatal(err)
	}
	b := newP2P(t, metadata.P2PConfig{})
	ch, err := b.Watch(t.Context(), proxyName)
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Desc.Endpoints["tcp"] != "v1" {
		t.Fatalf("first event %+v", ev)
	}
	deadline := time.Now().Add(hang)
	for notModified.Load() < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("no 304s: %d full answers, %d not modified", full.Load(), notModified.Load())
		}
		time.Sleep(testPoll)
	}
	if n := full.Load(); n != 1 {
		t.Fatalf("%d full answers for an unchanged descriptor, want 1", n)
	}
	if err := a.Put(t.Context(), testDesc(a.Name(), 1, "v2")); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Desc.Endpoints["tcp"] != "v2" {
		t.Fatalf("event after republish %+v", ev)
	}
}

func TestP2PAdvertise(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{})
	host, port, err := net.SplitHostPort(a.Name())
	if err != nil || host != "127.0.0.1" || port == "0" {
		t.Fatalf("default Name %q", a.Name())
	}
	if a.String() != "p2p "+a.Name() {
		t.Fatalf("String %q", a.String())
	}
	all := newP2P(t, metadata.P2PConfig{Listen: "0.0.0.0:0"})
	host, port, err = net.SplitHostPort(all.Name())
	if ip := net.ParseIP(host); err != nil || ip == nil || ip.IsUnspecified() || port == "0" {
		t.Fatalf("Name %q of a store listening on all interfaces", all.Name())
	}
	// Reachable at the advertised address.
	if err := all.Put(t.Context(), testDesc(all.Name(), 1, "v")); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Get(t.Context(), all.Name()); err != nil {
		t.Fatalf("Get at the advertised address: %v", err)
	}
	adv := newP2P(t, metadata.P2PConfig{Advertise: "engine-7.example:0"})
	if _, port, _ := net.SplitHostPort(adv.Name()); !strings.HasPrefix(adv.Name(), "engine-7.example:") || port == "0" {
		t.Fatalf("Name %q with Advertise engine-7.example:0", adv.Name())
	}
	if _, err := metadata.NewP2P(metadata.P2PConfig{Advertise: "no-port"}); err == nil {
		t.Fatal("NewP2P with a bad Advertise succeeded")
	}
	if _, err := metadata.NewP2P(metadata.P2PConfig{TLS: &tls.Config{}}); err == nil {
		t.Fatal("NewP2P with a TLS config without certificate succeeded")
	}
}

func TestP2PExtraHandler(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "metrics at "+r.URL.Path)
	})})
	defer http.DefaultClient.CloseIdleConnections()
	resp, err := http.Get("http://" + a.Name() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "metrics at /metrics" {
		t.Fatalf("extra handler: %q", body)
	}
}

func TestP2PTLS(t *testing.T) {
	cfg := selfSigned(t)
	a := newP2P(t, metadata.P2PConfig{TLS: cfg})
	b := newP2P(t, metadata.P2PConfig{TLS: cfg})
	if err := a.Put(t.Context(), testDesc(a.Name(), 1, "v1")); err != nil {
		t.Fatal(err)
	}
	if d, err := b.Get(t.Context(), a.Name()); err != nil || d.Endpoints["tcp"] != "v1" {
		t.Fatalf("Get over TLS: %+v, %v", d, err)
	}
	// A plain-HTTP store cannot read it.
	plain := newP2P(t, metadata.P2PConfig{})
	if _, err := plain.Get(t.Context(), a.Name()); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("plain Get of a TLS peer: %v, want ErrUnreachable", err)
	}
}

// selfSigned returns a TLS config that serves a certificate for 127.0.0.1
// and trusts only it.
func selfSigned(t *testing.T) *tls.Config {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "moonring test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key, Leaf: cert}},
		RootCAs:      pool,
		MinVersion:   tls.VersionTLS13,
	}
}

// holdConns opens n TCP connections to addr that send nothing; the
// test's cleanup closes them.
func holdConns(t *testing.T, addr string, n int) []net.Conn {
	t.Helper()
	var cs []net.Conn
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		cs = append(cs, c)
	}
	return cs
}

// closedByServer reports whether the server closed c (a read ends without
// data within 200 ms).
func closedByServer(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	var b [1]byte
	_, err := c.Read(b[:])
	var ne net.Error
	return err != nil && !(errors.As(err, &ne) && ne.Timeout())
}

// waitP2PStats polls p's counters until ok says yes, failing after hang.
func waitP2PStats(t *testing.T, p *metadata.P2P, what string, ok func(metadata.P2PStats) bool) metadata.P2PStats {
	t.Helper()
	for deadline := time.Now().Add(hang); ; time.Sleep(5 * time.Millisecond) {
		st := p.Stats()
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: stats %+v", what, st)
		}
	}
}

// TestP2PConnLimits: more idle connections than the endpoint's bounds,
// held open, do not lock a peer out: the oldest idle ones are closed to
// make room (counted), and a peer's Get is served. (Before, there was no
// bound: every connection held a goroutine and a descriptor until its
// header timeout, and as many as a peer cared to open.)
func TestP2PConnLimits(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  metadata.P2PConfig
	}{
		{"MaxConns", metadata.P2PConfig{MaxConns: 4, MaxConnsPerHost: 100}},
		{"MaxConnsPerHost", metadata.P2PConfig{MaxConns: 100, MaxConnsPerHost: 4}},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.ReadHeaderTimeout = time.Minute // the idle ones are not timed out meanwhile
			a := newP2P(t, c.cfg)
			ctx := context.Background()
			if err := a.Put(ctx, testDesc(a.Name(), 1, "x")); err != nil {
				t.Fatal(err)
			}
			idle := holdConns(t, a.Name(), 12)
			st := waitP2PStats(t, a, "12 idle connections, 4 kept", func(s metadata.P2PStats) bool { return s.Evicted >= 8 && s.Conns == 4 })
			closed := 0
			for _, c := range idle {
				if closedByServer(c) {
					closed++
				}
			}
			if closed < 8 {
				t.Errorf("%d of 12 idle connections closed; want the 8 oldest", closed)
			}
			b := newP2P(t, metadata.P2PConfig{})
			d, err := b.Get(ctx, a.Name())
			if err != nil || d.Name != a.Name() {
				t.Fatalf("a peer's Get past the idle connections: %v, %v", d, err)
			}
			if after := a.Stats(); after.Evicted <= st.Evicted || after.Conns > 4 {
				t.Errorf("stats %+v after the peer's Get (before %+v): want one more eviction, 4 connections at most", after, st)
			}
		})
	}
}

// TestP2PConnRefused: when every connection is in the middle of a request,
// a new one past MaxConns is closed at once and counted; once the requests
// end, peers are served again.
func TestP2PConnRefused(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	a := newP2P(t, metadata.P2PConfig{MaxConns: 2, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
	})})
	if err := a.Put(context.Background(), testDesc(a.Name(), 1, "x")); err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	done := make(chan error, 2)
	for range 2 {
		go func() {
			resp, err := client.Get("http://" + a.Name() + "/slow")
			if err == nil {
				resp.Body.Close()
			}
			done <- err
		}()
	}
	for range 2 {
		select {
		case <-entered:
		case <-time.After(hang):
			t.Fatal("the slow requests did not arrive")
		}
	}
	c := holdConns(t, a.Name(), 1)[0]
	waitP2PStats(t, a, "a connection past MaxConns, both in a request", func(s metadata.P2PStats) bool { return s.Refused == 1 })
	if !closedByServer(c) {
		t.Error("the refused connection is still open")
	}
	close(release)
	for range 2 {
		if err := <-done; err != nil {
			t.Errorf("a slow request: %v", err)
		}
	}
	waitP2PStats(t, a, "the slow requests' connections gone", func(s metadata.P2PStats) bool { return s.Conns == 0 })
	b := newP2P(t, metadata.P2PConfig{})
	if _, err := b.Get(context.Background(), a.Name()); err != nil {
		t.Fatalf("Get after the requests ended: %v", err)
	}
}

// TestP2PSlowHeaders: a connection that sends part of a request's headers
// and stops is closed after ReadHeaderTimeout, as configured.
func TestP2PSlowHeaders(t *testing.T) {
	a := newP2P(t, metadata.P2PConfig{ReadHeaderTimeout: 100 * time.Millisecond})
	c := holdConns(t, a.Name(), 1)[0]
	if _, err := io.WriteString(c, "GET /moonring/v1/segment HTTP/1.1\r\nHost: x\r\n"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(hang))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("a slow request's connection: %v; want it closed", err)
	}
	if took := time.Since(start); took > 3*time.Second { // the old fixed 5 s
		t.Errorf("closed after %v; want ReadHeaderTimeout's 100ms (and some)", took)
	}
}
