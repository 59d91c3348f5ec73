package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

func httpGet(t *testing.T, url string, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// serve's /metrics has the engine's counters, its refusals, the Go
// runtime's and the process's; /healthz says it serves, and bench reads
// the target's pid there. (It had three gauges, and no /healthz.)
func TestServeMetricsAndHealth(t *testing.T) {
	t.Setenv(keyEnv, "a key of the deployment")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tcpAddr := ln.Addr().String()
	ln.Close()
	var warn syncBuffer
	stderr = &warn
	defer func() { stderr = os.Stderr }()
	lines, stop := startServe(t, 1, "--listen", "127.0.0.1:0", "--tcp-listen", tcpAddr, "--buffer-size", "4M")
	defer stop()
	name := segmentOf(t, lines[0])

	code, body := httpGet(t, "http://"+name+"/healthz")
	var h healthInfo
	if code != http.StatusOK || json.Unmarshal([]byte(body), &h) != nil || h.Status != "ok" || h.PID != os.Getpid() || h.Segment != name {
		t.Errorf("/healthz: %d %q; want 200 and the segment and pid", code, body)
	}

	var out bytes.Buffer
	if err := run([]string{"bench", "--segment", name, "--duration", "50ms", "--block-size", "4K", "--buffer-size", "4M", "--operation", "write"}, &out); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("to %s (pid %d)", name, os.Getpid()); !strings.Contains(out.String(), want) {
		t.Errorf("bench's header lacks %q:\n%s", want, out.String())
	}

	c, err := net.Dial("tcp", tcpAddr)
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte(strings.Repeat("not a hello ", 16)))
	io.Copy(io.Discard, c)
	c.Close()

	want := []string{"moonring_buffers_registered 1", "go_goroutines", "go_memstats_heap_alloc_bytes", "process_open_fds",
		"process_resident_memory_bytes", `moonring_refused_total{reason="bad_hello",what="tcp"} 1`, `moonring_serve_endpoint_connections{endpoint="p2p"}`}
	var metrics string
	for deadline := time.Now().Add(5 * time.Second); ; {
		_, metrics = httpGet(t, "http://"+name+"/metrics")
		missing := 0
		for _, w := range want {
			if !strings.Contains(metrics, w) {
				missing++
			}
		}
		if missing == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, w := range want {
		if !strings.Contains(metrics, w) {
			t.Errorf("/metrics lacks %q", w)
		}
	}
	if stop() != nil {
		t.Fatal("serve failed")
	}
}

// metadata-server --list lists the segments kept in --dir; a running one
// lists its own at GET /moonring/v1/segments when its metadata.Server can.
func TestMetadataServerList(t *testing.T) {
	metaNoKeyEnv(t)
	dir := t.TempDir()
	url, stop := startMetaServer(t, "--listen", "127.0.0.1:0", "--dir", dir)
	defer stop()
	h, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	for _, name := range []string{"engine-b", "engine-a"} {
		d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: name, Epoch: 42, Endpoints: map[string]string{"tcp": "10.0.0.1:7001"},
			Buffers: []segtable.BufferDesc{{Addr: 0x1000, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "k"}}}}
		if err := h.Put(t.Context(), d); err != nil {
			t.Fatal(err)
		}
	}
	var out bytes.Buffer
	if err := run([]string{"metadata-server", "--list", "--dir", dir}, &out); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	if a, b := strings.Index(text, "engine-a"), strings.Index(text, "engine-b"); a < 0 || b < a || !strings.Contains(text, "2 segments in") || !strings.Contains(text, "42") {
		t.Errorf("--list:\n%s\nwant engine-a then engine-b, epoch 42, 2 segments", text)
	}
	if err := run([]string{"metadata-server", "--list"}, &out); err == nil || !strings.Contains(err.Error(), "GET http://ADDR/moonring/v1/segments") {
		t.Errorf("--list without --dir: %v", err)
	}
	if code, body := httpGet(t, url+segmentsPath); code != http.StatusOK || body != "engine-a\nengine-b\n" {
		t.Errorf("GET %s: %d %q, want the two names", segmentsPath, code, body)
	}
	// The protocol's own paths are still served.
	if code, _ := httpGet(t, url+segmentsPath+"/engine-a"); code != http.StatusOK {
		t.Errorf("GET of a descriptor: %d", code)
	}
}

// metadata-server -h says what the descriptors it holds give away, and
// what an --insecure segment publishes.
func TestMetadataServerHelpSaysWhatItHolds(t *testing.T) {
	var out bytes.Buffer
	if err := run([]string{"metadata-server", "-h"}, &out); err != nil {
		t.Fatal(err)
	}
	text := strings.Join(strings.Fields(out.String()), " ")
	for _, want := range []string{"buffer keys", "must still prove the segment key", "--insecure", "publishes what opens it", "/moonring/v1/segments"} {
		if !strings.Contains(text, want) {
			t.Errorf("metadata-server -h lacks %q:\n%s", want, out.String())
		}
	}
}
