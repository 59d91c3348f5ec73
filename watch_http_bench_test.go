package moonring_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"runtime"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// BenchmarkPeerRepublishHTTP is BenchmarkPeerRepublish through a
// metadata server (in the process, on loopback) rather than the Memory
// store: the publisher's HTTP store sends the chunks made and the
// header, the peer's polls the header every millisecond and fetches the
// chunks it lacks, and the peer's descriptor then goes through the same
// check (signed) and Updates. cpu-ns/op is the process's CPU per
// register/unregister cycle (both engines, both stores, the server, and
// the peer's polls of an unchanged header, some 1,000 a second, which
// the wall time between changes adds), what one registration costs
// with a peer that watches it through the server. MOONRING_SCALE_MAX
// bounds n.
func BenchmarkPeerRepublishHTTP(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 10000, 100000) {
		for _, mode := range []string{"unsigned", "signed"} {
			b.Run(fmt.Sprintf("buffers=%d/tcp/%s", n, mode), func(b *testing.B) {
				peerRepublishHTTP(b, n, mode == "signed")
			})
		}
	}
}

func peerRepublishHTTP(b *testing.B, n int, signed bool) {
	srv, err := metadata.NewServer(metadata.ServerConfig{})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Close()
	hs := httptest.NewServer(srv)
	defer hs.Close()
	store := func(poll time.Duration) metadata.Store {
		s, err := metadata.NewHTTP(metadata.HTTPConfig{URL: hs.URL, TTL: time.Minute, PollInterval: poll})
		if err != nil {
			b.Fatal(err)
		}
		return s
	}
	var key []byte
	if signed {
		key = []byte("bench key")
	}
	pubStore, peerStore := store(time.Second), store(time.Millisecond)
	defer pubStore.Close()
	defer peerStore.Close()
	name := "peer-republish-http"
	t, err := moonring.New(moonring.Config{Name: name, Metadata: pubStore, Key: key, TCP: &tcp.Config{Key: key}})
	if err != nil {
		b.Fatal(err)
	}
	defer t.Close()
	mem, err := t.Alloc((n+1)*scaleBlock, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	defer t.Free(mem)
	specs := make([]moonring.BufferSpec, n)
	for i := range specs {
		specs[i] = moonring.BufferSpec{Buf: mem[i*scaleBlock : (i+1)*scaleBlock], Location: "cpu:0", Remote: true}
	}
	if _, err := t.RegisterLocalMemoryBatch(specs); err != nil {
		b.Fatal(err)
	}
	a, err := moonring.New(moonring.Config{Name: name + "-a", Metadata: peerStore, Key: key, TCP: &tcp.Config{Key: key}, Transports: []string{"tcp"}})
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	seg, err := a.OpenSegment(b.Context(), name)
	if err != nil {
		b.Fatal(err)
	}
	last := mem[n*scaleBlock:]
	ctx := context.Background()
	applied := func(want int) {
		deadline := time.Now().Add(60 * time.Second)
		for spins := 0; moonring.PeerBuffers(a, seg) != want; spins++ {
			if time.Now().After(deadline) {
				b.Fatalf("the peer did not apply a descriptor of %d buffers (has %d)", want, moonring.PeerBuffers(a, seg))
			}
			if spins < 50 {
				runtime.Gosched()
			} else {
				time.Sleep(20 * time.Microsecond)
			}
		}
	}
	applied(n)
	time.Sleep(50 * time.Millisecond)
	b.ReportAllocs()
	cpu0 := cpuTime()
	for b.Loop() {
		if _, err := t.RegisterLocalMemory(last, "cpu:0", true); err != nil {
			b.Fatal(err)
		}
		applied(n + 1)
		if err := t.UnregisterLocalMemory(ctx, last); err != nil {
			b.Fatal(err)
		}
		applied(n)
	}
	b.ReportMetric(float64((cpuTime()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
}
