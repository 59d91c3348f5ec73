package main

import (
	"context"
	"io"
	"regexp"
	"testing"
	"time"

	"github.com/moonring/moonring/mooncake"
)

// serve --buffers N serves N buffers, each published in the segment's
// descriptor (here as a Mooncake peer reads it off the RPC port) at the
// addresses serve's first line names; out-of-range counts are refused.
func TestServeBuffers(t *testing.T) {
	noKey(t)
	lines, stop := startServe(t, 2, "--mooncake", "--listen", "127.0.0.1:0", "--buffer-size", "64K", "--buffers", "3")
	defer stop()
	addrs := regexp.MustCompile(`at (0x[0-9a-f]+), (0x[0-9a-f]+), (0x[0-9a-f]+),`).FindStringSubmatch(lines[0])
	if addrs == nil {
		t.Fatalf("first line %q: want three buffer addresses", lines[0])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var c mooncake.RPCClient
	d, err := c.FetchDesc(ctx, segmentOf(t, lines[0]), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Buffers) != 3 {
		t.Fatalf("the descriptor has %d buffers, want 3", len(d.Buffers))
	}
	for _, b := range d.Buffers {
		if b.Length != 64<<10 {
			t.Errorf("buffer %+v: want 64 KiB", b)
		}
	}
	if err := stop(); err != nil {
		t.Fatalf("serve: %v", err)
	}
	for _, n := range []string{"0", "-1", "65"} {
		if err := serve([]string{"--listen", "127.0.0.1:0", "--buffer-size", "4K", "--buffers", n}, io.Discard, make(chan struct{})); err == nil {
			t.Errorf("serve --buffers %s: no error", n)
		}
	}
}
