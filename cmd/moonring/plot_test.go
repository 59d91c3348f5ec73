package main

import (
	"image/png"
	"os"
	"strings"
	"testing"

	"gonum.org/v1/plot"
)

func tickLabels(t plot.Ticker, min, max float64) []string {
	var out []string
	for _, tk := range t.Ticks(min, max) {
		if tk.Label != "" {
			out = append(out, tk.Label)
		}
	}
	return out
}

// The plot's axes read in sizes and in µs/ms (they were log2 bytes and
// log10 µs), bandwidth starts at 0, and the title says what ran.
func TestPlotAxesAndTitle(t *testing.T) {
	run := &runInfo{Transport: "tcp", Batch: 32, Threads: 2, API: "batch", Mode: "bw", Host: "hostA", Date: "2026-12-01T16:30:00Z"}
	var rs []result
	for _, size := range []int{4 << 10, 64 << 10, 1 << 20, 16 << 20} {
		rs = append(rs, result{Transport: "tcp", Op: "write", BlockSize: size, GBps: 1 + float64(size>>20), P99us: float64(size) / 100})
	}
	bw, lat := makePlots(rs, run)
	if got := strings.Join(tickLabels(bw.X.Tick.Marker, bw.X.Min, bw.X.Max), ","); got != "4K,64K,1M,16M" {
		t.Errorf("size ticks %q; want 4K,64K,1M,16M", got)
	}
	if bw.Y.Min != 0 {
		t.Errorf("bandwidth axis from %v; want 0", bw.Y.Min)
	}
	if _, ok := bw.X.Scale.(plot.LogScale); !ok {
		t.Errorf("size axis scale %T; want a log scale of bytes", bw.X.Scale)
	}
	labels := tickLabels(lat.Y.Tick.Marker, lat.Y.Min, lat.Y.Max)
	joined := strings.Join(labels, ",")
	for _, want := range []string{"50 µs", "100 µs", "1 ms", "100 ms"} {
		if !strings.Contains(","+joined+",", ","+want+",") {
			t.Errorf("latency ticks %q lack %q", joined, want)
		}
	}
	for _, l := range labels {
		if strings.ContainsAny(l, "e^") {
			t.Errorf("latency tick %q is an exponent", l)
		}
	}
	if got := tickLabels(plot.TickerFunc(latencyTicks), 14, 17.5); len(got) < 3 {
		t.Errorf("latency ticks of 14..17.5 µs: %q; want some between", got)
	}
	title := plotTitle(run)
	for _, want := range []string{"tcp", "batch 32", "threads 2", "host hostA", "2026-12-01"} {
		if !strings.Contains(title, want) {
			t.Errorf("title %q lacks %q", title, want)
		}
	}
	if got := plotTitle(&runInfo{Transport: "shm", Mode: "lat", API: "ring", Host: "h", Date: "2026-12-01T00:00:00Z"}); !strings.Contains(got, "one request in flight") {
		t.Errorf("--lat title %q", got)
	}
	// It draws, with one size too.
	file := t.TempDir() + "/one.png"
	pf, err := openPlot(file)
	if err != nil {
		t.Fatal(err)
	}
	if err := pf.write(rs[:1], run); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := png.DecodeConfig(f); err != nil {
		t.Fatal(err)
	}
}
