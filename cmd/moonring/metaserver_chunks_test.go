package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// TestMetadataServerListChunks: --list prints the epoch and buffers of a
// descriptor the server keeps as chunks (a header file and chunk files).
func TestMetadataServerListChunks(t *testing.T) {
	metaNoKeyEnv(t)
	dir := t.TempDir()
	url, stop := startMetaServer(t, "--listen", "127.0.0.1:0", "--dir", dir)
	defer stop()
	h, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	var l segtable.ChunkList
	for i := range 100 {
		if err := l.Insert(segtable.BufferDesc{Addr: 0x100000 + uint64(i)*0x1000, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "k"}}); err != nil {
			t.Fatal(err)
		}
	}
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "engine-c", Epoch: 77, Endpoints: map[string]string{"tcp": "10.0.0.1:7001"},
		Rev: l.Seq(), Chunked: l.Chunks()}
	if err := h.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := run([]string{"metadata-server", "--list", "--dir", dir}, &out); err != nil {
		t.Fatal(err)
	}
	if text := out.String(); !strings.Contains(text, "engine-c") || !strings.Contains(text, "77") || !strings.Contains(text, "100") || !strings.Contains(text, "1 segments in") {
		t.Errorf("--list:\n%s\nwant engine-c, epoch 77, 100 buffers", text)
	}
}
