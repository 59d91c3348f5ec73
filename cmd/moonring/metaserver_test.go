package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// startMetaServer runs `moonring metadata-server` through run in a
// goroutine and returns its URL (loopback, whatever address it bound) and a
// function that stops it and returns run's error.
func startMetaServer(t *testing.T, args ...string) (string, func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	saved := metaServerCtx
	metaServerCtx = ctx
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := run(append([]string{"metadata-server"}, args...), pw)
		pw.Close()
		done <- err
	}()
	stop := func() error {
		cancel()
		select {
		case err := <-done:
			metaServerCtx = saved
			return err
		case <-time.After(30 * time.Second):
			t.Fatal("metadata-server did not stop within 30s of its context's end")
		}
		return nil
	}
	line, err := bufio.NewReader(pr).ReadString('\n')
	go io.Copy(io.Discard, pr) // anything more must not block the server
	if err != nil {
		t.Fatalf("metadata-server printed %q, then: %v (run: %v)", line, err, stop())
	}
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "metadata-server listening on http://")
	if !ok {
		stop()
		t.Fatalf("metadata-server printed %q", line)
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		stop()
		t.Fatalf("address %q: %v", addr, err)
	}
	return "http://127.0.0.1:" + port, stop
}

func TestMetadataServer(t *testing.T) {
	dir := t.TempDir()
	url, stop := startMetaServer(t, "--listen", ":0", "--dir", dir)
	h, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url})
	if err != nil {
		stop()
		t.Fatal(err)
	}
	ctx := t.Context()
	d := &segtable.SegmentDesc{
		Version:   segtable.DescVersion,
		Name:      "engine-a",
		Epoch:     42,
		Endpoints: map[string]string{"tcp": "10.0.0.1:7001"},
		Buffers:   []segtable.BufferDesc{{Addr: 0x1000, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "k"}}},
	}
	err = h.Put(ctx, d)
	var got *segtable.SegmentDesc
	if err == nil {
		got, err = h.Get(ctx, "engine-a")
	}
	h.Close()
	if serr := stop(); serr != nil {
		t.Fatalf("metadata-server: %v", serr)
	}
	if err != nil || got.Epoch != 42 || got.Endpoints["tcp"] != "10.0.0.1:7001" {
		t.Fatalf("Put and Get through metadata-server: %+v, %v", got, err)
	}
	if kept, _ := filepath.Glob(filepath.Join(dir, "seg-*.json")); len(kept) != 1 {
		t.Fatalf("files kept: %v, want one", kept)
	}

	// A restart on the same directory serves the descriptor.
	url, stop = startMetaServer(t, "--listen", "127.0.0.1:0", "--dir", dir)
	defer stop()
	h2, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	if got, err := h2.Get(ctx, "engine-a"); err != nil || got.Epoch != 42 {
		t.Fatalf("after a restart: %+v, %v", got, err)
	}
	if _, err := h2.Get(ctx, "engine-b"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("Get of a name never put: %v", err)
	}
}

func TestMetadataServerBadInput(t *testing.T) {
	corrupt := t.TempDir()
	if err := os.WriteFile(filepath.Join(corrupt, "seg-0.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"--bogus"},
		{"--listen"},
		{"--listen", "nowhere"},
		{"--listen", "127.0.0.1:0", "extra"},
		{"--listen", "127.0.0.1:0", "--max-ttl", "1ms"},
		{"--listen", "127.0.0.1:0", "--dir", corrupt},
	} {
		var out bytes.Buffer
		err := run(append([]string{"metadata-server"}, args...), &out)
		if err == nil {
			t.Errorf("metadata-server %q: no error", args)
			continue
		}
		if strings.Contains(err.Error(), "\n") {
			t.Errorf("metadata-server %q: error of more than one line: %q", args, err)
		}
		if out.Len() != 0 {
			t.Errorf("metadata-server %q printed %q", args, out.String())
		}
	}
	var out bytes.Buffer
	if err := run([]string{"metadata-server", "-h"}, &out); err != nil || !strings.Contains(out.String(), "-listen") {
		t.Fatalf("metadata-server -h: %v, printed %q", err, out.String())
	}
}
