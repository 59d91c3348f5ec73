package metadata_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// TestKeyServerChecksRepublishes: a server with the key takes signed
// republishes sent as chunks, each checked from the chunks it checked
// before; a chunk forged under a listed number, with a header that lists
// it and a valid owner token, is refused (403) and changes nothing: the
// next signed republish is taken and reads back whole, signatures and all.
func TestKeyServerChecksRepublishes(t *testing.T) {
	srv := mustServer(t, metadata.ServerConfig{Key: []byte("k")})
	_, url := startCounted(t, srv, nil)
	ctx := t.Context()
	wr := signedBy(t, newHTTPKey(t, url, "k", time.Minute, nil), "k")
	rd := signedBy(t, newHTTP(t, url, time.Minute), "k")
	l := chList(t, 300)
	if err := wr.Put(ctx, chDesc("s", 3, l)); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		l.Insert(chBuffer(5000 + i))
		if err := wr.Put(ctx, chDesc("s", 3, l)); err != nil {
			t.Fatalf("republish %d: %v", i, err)
		}
	}

	hdr := rawGet(t, url, seg+"s/header")
	var h rawHeader
	if err := json.Unmarshal(hdr, &h); err != nil || !h.Signed || len(h.Chunks) < 2 {
		t.Fatalf("header %.200s: %v", hdr, err)
	}
	last := len(h.Chunks) - 1
	c := h.Chunks[last]
	body := rawGet(t, url, fmt.Sprintf("%ss/chunks?epoch=3&seq=%d", seg, c.S))
	var bufs [][]segtable.BufferDesc
	if err := json.Unmarshal(body, &bufs); err != nil || len(bufs) != 1 {
		t.Fatalf("chunk GET %.200s: %v", body, err)
	}
	bufs[0][0].Keys = map[string]string{"tcp": "forged"}
	forged, _ := json.Marshal(bufs[0])
	const forgedSeq = 1 << 40
	own := []string{"Moonring-Owner", token("k", "s")}
	if code, msg := rawPut(t, url, fmt.Sprintf("%ss/chunks/3/%d", seg, uint64(forgedSeq)), forged, own...); code != 204 {
		t.Fatalf("forged chunk PUT: %d %s", code, msg)
	}
	h.Chunks[last].S, h.Chunks[last].H = forgedSeq, sum64(forged)
	fh, _ := json.Marshal(h)
	if code, msg := rawPut(t, url, seg+"s/header", fh, own...); code != 403 {
		t.Fatalf("header listing a forged chunk: %d %s, want 403", code, msg)
	}

	l.Insert(chBuffer(6000))
	if err := wr.Put(ctx, chDesc("s", 3, l)); err != nil {
		t.Fatalf("a signed republish after a forged one: %v", err)
	}
	got, err := rd.Get(ctx, "s")
	if err != nil || got.NumBuffers() != 304 {
		t.Fatalf("Get: %v (%v buffers)", err, got)
	}
	if ks := got.AllBuffers()[0].Keys["tcp"]; ks == "forged" {
		t.Fatal("the forged key was kept")
	}
}

// BenchmarkKeyServerRepublish is a signed republish after one
// registration among n buffers, sent as chunks to a server with the key,
// which checks what it keeps: the writer's signing of the changed chunk,
// its PUTs, and the server's check.
func BenchmarkKeyServerRepublish(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			srv := mustServer(b, metadata.ServerConfig{Key: []byte("k"), MaxDescriptor: 16 << 20})
			_, url := startCounted(b, srv, nil)
			st, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url, TTL: time.Minute, Key: []byte("k")})
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			wr, err := metadata.NewSigned(st, []byte("k"), nil)
			if err != nil {
				b.Fatal(err)
			}
			ctx := b.Context()
			l := chList(b, n)
			if err := wr.Put(ctx, chDesc("bench", 1, l)); err != nil {
				if errors.Is(err, segtable.ErrBadDesc) {
					b.Skipf("the first Put fails: %v", err)
				}
				b.Fatal(err)
			}
			i := 0
			for b.Loop() {
				if err := l.Insert(chBuffer(n + 1 + i)); err != nil {
					b.Fatal(err)
				}
				i++
				if err := wr.Put(ctx, chDesc("bench", 1, l)); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
