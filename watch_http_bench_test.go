package moonring_test

import (
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
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
	pubStore, peerStore := store(time.Second), store(time.Millisecond)
	defer pubStore.Close()
	defer peerStore.Close()
	peerRepublishThrough(b, n, "tcp", signed, "peer-republish-http", pubStore, peerStore, 60*time.Second)
}
