package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// bench --mooncake starts a target in Mooncake mode and moves every step
// over Mooncake's TCP data protocol, the data checked.
func TestBenchMooncake(t *testing.T) {
	for _, r := range benchJSON(t, "--mooncake") {
		if r.Transport != "mooncake-tcp" {
			t.Errorf("step %+v: want mooncake-tcp", r)
		}
	}
}

// mooncakeHTTPMeta is Mooncake's HTTP metadata server protocol, as its
// example server speaks it: GET, PUT and DELETE of /metadata?key=K.
func mooncakeHTTPMeta(t *testing.T) string {
	var mu sync.Mutex
	kv := map[string][]byte{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.URL.Query().Get("key")
		mu.Lock()
		defer mu.Unlock()
		switch r.Method {
		case http.MethodGet:
			v, ok := kv[key]
			if !ok {
				http.Error(w, "metadata not found", http.StatusNotFound)
				return
			}
			w.Write(v)
		case http.MethodPut:
			b, _ := io.ReadAll(r.Body)
			kv[key] = b
			io.WriteString(w, "metadata updated")
		case http.MethodDelete:
			if _, ok := kv[key]; !ok {
				http.Error(w, "metadata not found", http.StatusNotFound)
				return
			}
			delete(kv, key)
			io.WriteString(w, "metadata deleted")
		default:
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL + "/metadata"
}

// serve --mooncake is a target Mooncake engines reach: with P2PHANDSHAKE
// (named by its RPC port) and with Mooncake's HTTP metadata server, a
// bench --mooncake --segment writes its pattern into the buffer, then
// WRITEs and READs with every byte checked.
func TestServeMooncake(t *testing.T) {
	noKey(t)
	for _, meta := range []string{"p2p", mooncakeHTTPMeta(t)} {
		t.Run(strings.SplitN(meta, ":", 2)[0], func(t *testing.T) {
			lines, stop := startServe(t, 2, "--mooncake", "--mooncake-metadata", meta, "--listen", "127.0.0.1:0", "--buffer-size", "4M")
			defer stop()
			if !strings.Contains(lines[0], "mooncake rpc 127.0.0.1:") || !strings.Contains(lines[0], "(no authentication)") {
				t.Fatalf("first line %q: want the Mooncake ports and the warning", lines[0])
			}
			name := segmentOf(t, lines[0])
			var out bytes.Buffer
			args := []string{"bench", "--json", "--mooncake", "--mooncake-metadata", meta, "--segment", name, "--duration", "50ms", "--block-size", "4K,64K", "--buffer-size", "4M"}
			if err := run(args, &out); err != nil {
				t.Fatalf("moonring %s: %v", strings.Join(args, " "), err)
			}
			var rs []result
			if err := json.Unmarshal(out.Bytes(), &rs); err != nil || len(rs) != 4 {
				t.Fatalf("%d rows, %v:\n%s", len(rs), err, out.String())
			}
			for _, r := range rs {
				if r.Transport != "mooncake-tcp" || !r.Verified || r.Requests == 0 {
					t.Errorf("row %+v: want verified requests over mooncake-tcp", r)
				}
			}
			if err := stop(); err != nil {
				t.Fatalf("serve: %v", err)
			}
		})
	}
}

// The Mooncake flags go with --mooncake, and --mooncake with what it uses.
func TestMooncakeFlags(t *testing.T) {
	var out bytes.Buffer
	for _, args := range [][]string{
		{"serve", "--mooncake-rpc", "127.0.0.1:0"},
		{"serve", "--mooncake", "--metadata", "http://127.0.0.1:1"},
		{"serve", "--mooncake", "--mooncake-metadata", "redis://x"},
		{"bench", "--mooncake-metadata", "p2p"},
		{"bench", "--mooncake", "--protocol", "shm"},
		{"bench", "--mooncake", "--tls"},
	} {
		if err := run(args, &out); err == nil {
			t.Errorf("moonring %v: no error", args)
		}
	}
	out.Reset()
	run([]string{"serve", "-h"}, &out)
	if !strings.Contains(out.String(), "NO authentication") || !strings.Contains(out.String(), "P2PHANDSHAKE") {
		t.Errorf("serve -h does not explain --mooncake:\n%s", out.String())
	}
}

// The one-way checks with another program: serve --fill-seed holds a
// seeded pattern that bench --expect-seed READs and checks, bench
// --write-seed WRITEs another that serve --check-seed finds at shutdown;
// a wrong seed fails either side.
func TestSeedChecks(t *testing.T) {
	noKey(t)
	b := make([]byte, 21)
	seedPattern(b, 3)
	if seedDiff(b, 3) != -1 || seedDiff(b, 4) != 0 {
		t.Fatal("seedDiff does not tell the pattern from another")
	}
	b[19] ^= 1
	if got := seedDiff(b, 3); got != 19 {
		t.Fatalf("seedDiff = %d, want 19", got)
	}
	lines, stop := startServe(t, 2, "--mooncake", "--listen", "127.0.0.1:0", "--buffer-size", "4M", "--fill-seed", "5", "--check-seed", "6")
	name := segmentOf(t, lines[0])
	var out bytes.Buffer
	check := func(args ...string) error {
		return run(append([]string{"bench", "--mooncake", "--segment", name, "--buffer-size", "4M"}, args...), &out)
	}
	if err := check("--expect-seed", "7"); err == nil || !strings.Contains(err.Error(), "differs from pattern 7 at byte 0") {
		t.Fatalf("--expect-seed of the wrong seed: %v", err)
	}
	if err := check("--expect-seed", "5", "--write-seed", "6"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "holds pattern 5: ok") {
		t.Errorf("bench printed %q", out.String())
	}
	if err := stop(); err != nil {
		t.Fatalf("serve --check-seed 6 after the WRITE of pattern 6: %v", err)
	}
	_, stop = startServe(t, 1, "--mooncake", "--listen", "127.0.0.1:0", "--buffer-size", "1M", "--check-seed", "6")
	if err := stop(); err == nil || !strings.Contains(err.Error(), "differs from pattern 6") {
		t.Fatalf("serve --check-seed with nothing written: %v", err)
	}
}
