package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

// bench --lat: one request in flight, small blocks by default, the mean
// and percentiles of single requests; scripts read it with --json.
func TestBenchLatency(t *testing.T) {
	for _, api := range [][]string{nil, {"--ring"}} {
		var out bytes.Buffer
		args := append([]string{"bench", "--lat", "--json", "--protocol", "local", "--duration", "50ms", "--buffer-size", "1M"}, api...)
		if err := run(args, &out); err != nil {
			t.Fatalf("%v: %v", args, err)
		}
		var rs []result
		if err := json.Unmarshal(out.Bytes(), &rs); err != nil {
			t.Fatalf("--json: %v\n%s", err, out.String())
		}
		var blocks []string
		for _, r := range rs {
			if r.Op == "write" {
				blocks = append(blocks, r.Block)
			}
			if r.Mode != "lat" || r.Batch != 1 || r.Threads != 1 || r.Requests == 0 || r.MeanUs <= 0 || r.P50us <= 0 ||
				r.P50us > r.P99us || r.P99us > r.P999us || !r.Verified || r.Run == nil || r.Run.Mode != "lat" {
				t.Errorf("%v: row %+v; want one in flight, mean and ordered percentiles", api, r)
			}
		}
		if strings.Join(blocks, ",") != "8,64,512,4K" || len(rs) != 8 {
			t.Errorf("%v: %d rows, blocks %v; want write and read at 8,64,512,4K", api, len(rs), blocks)
		}
	}
	var out bytes.Buffer
	if err := run([]string{"bench", "--lat", "--protocol", "local", "--duration", "20ms", "--block-size", "8", "--operation", "read"}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "latency mode: one request in flight") || !strings.Contains(out.String(), "mean µs") {
		t.Errorf("table:\n%s\nwant the mode said and a mean column", out.String())
	}
	if err := run([]string{"bench", "--lat", "--batch-size", "8"}, &out); err == nil {
		t.Error("--lat --batch-size 8: no error")
	}
}

// The default mode says that its latency is queueing at its depth, and
// -h documents both modes.
func TestBenchLatencyExplained(t *testing.T) {
	var out bytes.Buffer
	if err := run([]string{"bench", "--protocol", "local", "--duration", "20ms", "--block-size", "4K", "--buffer-size", "1M", "--operation", "read"}, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"the p50 is queueing latency at 128 in flight", "4 batch(es) of 32 requests in flight per thread"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("bandwidth table:\n%s\nwant %q: its p50 is queueing at the default depth, which it names", out.String(), want)
		}
	}
	out.Reset()
	run([]string{"bench", "-h"}, &out)
	for _, want := range []string{"--lat", "one request in flight", "8,64,512,4K", "p999", "queueing latency"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("bench -h lacks %q", want)
		}
	}
}
