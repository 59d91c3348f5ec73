package moonring_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
)

// keyedEngine starts an engine on store with TCP only and key as the
// deployment's segment key.
func keyedEngine(t *testing.T, store metadata.Store, name string, key []byte) *moonring.Engine {
	t.Helper()
	e, err := moonring.New(moonring.Config{Name: name, Metadata: store, Key: key, Transports: []string{"tcp"}, TCP: &tcp.Config{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// TestSignedDescriptors: an engine with a key publishes a descriptor that
// verifies under it; a peer with the key opens it and moves bytes; a peer
// with another key, and any peer once the descriptor has been changed in
// the store (its tcp endpoint pointed at a relay), refuses it; a forged
// update under an open segment does not move its endpoint; the refusals
// are counted in the metrics.
func TestSignedDescriptors(t *testing.T) {
	store := metadata.NewMemory()
	key := []byte("deployment key")
	target := keyedEngine(t, store, "signed-target", key)
	buf := make([]byte, 1<<16)
	fill(buf, 3)
	if _, err := target.RegisterLocalMemory(buf, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	published, err := store.Get(ctx, "signed-target")
	if err != nil {
		t.Fatal(err)
	}
	s, _ := segtable.NewSigner(key)
	if err := s.Verify(published); err != nil || published.NumBuffers() != 1 {
		t.Fatalf("published descriptor: %v (%d buffers)", err, published.NumBuffers())
	}

	// Another key: the descriptor is absent to it.
	other := keyedEngine(t, store, "signed-other", []byte("another key"))
	if _, err := other.OpenSegment(ctx, "signed-target"); !errors.Is(err, metadata.ErrNotFound) || !errors.Is(err, metadata.ErrForged) {
		t.Fatalf("OpenSegment with another key: %v, want ErrNotFound and ErrForged", err)
	}

	// A relay that took the store: peers do not go there.
	var relayed atomic.Int32
	relay, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer relay.Close()
	go func() {
		for {
			c, err := relay.Accept()
			if err != nil {
				return
			}
			relayed.Add(1)
			c.Close()
		}
	}()
	forged := published.Clone()
	forged.Endpoints[tcp.Name] = relay.Addr().String()
	replace := func(d *segtable.SegmentDesc) {
		t.Helper()
		if err := store.Delete(ctx, d.Name, 0); err != nil {
			t.Fatal(err)
		}
		if err := store.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	replace(forged)
	ini := keyedEngine(t, store, "signed-initiator", key)
	if _, err := ini.OpenSegment(ctx, "signed-target"); !errors.Is(err, metadata.ErrForged) {
		t.Fatalf("OpenSegment of a descriptor pointed at a relay: %v, want ErrForged", err)
	}
	replace(published)
	seg, err := ini.OpenSegment(ctx, "signed-target")
	if err != nil {
		t.Fatal(err)
	}
	back := make([]byte, len(buf))
	if _, err := ini.RegisterLocalMemory(back, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	read := func() {
		t.Helper()
		clear(back)
		if err := ini.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(back), TargetID: seg,
			TargetOffset: uint64(moonring.AddressOf(buf)), Length: uint64(len(buf))}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(back, buf) {
			t.Fatal("read: data differs")
		}
	}
	read()

	// A forged update under the open segment: the watch refuses it and
	// the segment stays where it was.
	reg := prometheus.NewRegistry()
	reg.MustRegister(ini.Collector())
	refused := func() float64 {
		return metricValue(t, reg, "moonring_refused_total", map[string]string{"what": "descriptor", "reason": "forged"})
	}
	before := refused()
	replace(forged)
	for deadline := time.Now().Add(10 * time.Second); refused() == before; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the forged update was never counted")
		}
	}
	read()
	if n := relayed.Load(); n != 0 {
		t.Fatalf("the relay got %d connections", n)
	}
	if !strings.Contains(ini.Config().String(), "descriptors signed: true") {
		t.Fatalf("Config.String does not say descriptors are signed:\n%s", ini.Config())
	}
}

// TestRefusalMetrics: what the TCP transport refuses shows in the engine's
// metrics, by reason.
func TestRefusalMetrics(t *testing.T) {
	e := keyedEngine(t, metadata.NewMemory(), "refusal-metrics", []byte("k"))
	reg := prometheus.NewRegistry()
	reg.MustRegister(e.Collector())
	addr := e.Transport(tcp.Name).(*tcp.Transport).Addr()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(bytes.Repeat([]byte("GET / HTTP/1.0\r\n"), 64)) // not a hello
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if metricValue(t, reg, "moonring_refused_total", map[string]string{"what": "tcp", "reason": "bad_hello"}) >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a bad hello was not counted in moonring_refused_total")
		}
	}
}

// TestServedMetrics: a target counts what it served each peer.
func TestServedMetrics(t *testing.T) {
	p := newTCPPair(t, 1<<16)
	if err := p.ini.Transfer(t.Context(), p.write()); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(p.tgt.Collector())
	if n := metricValue(t, reg, "moonring_served_bytes_total", map[string]string{"transport": "tcp", "op": "write"}); n != 1<<16 {
		t.Fatalf("served write bytes %v, want %d", n, 1<<16)
	}
	if n := metricValue(t, reg, "moonring_served_requests_total", map[string]string{"transport": "tcp", "op": "write", "status": "completed"}); n < 1 {
		t.Fatalf("served writes %v", n)
	}
}
