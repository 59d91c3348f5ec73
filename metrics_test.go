package moonring_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http/httptest"
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/moonring/moonring"
)

func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue next
				}
			}
			return value(m)
		}
	}
	t.Fatalf("no metric %s%v", name, labels)
	return 0
}

func value(m *dto.Metric) float64 {
	if c := m.GetCounter(); c != nil {
		return c.GetValue()
	}
	return m.GetGauge().GetValue()
}

// The collector reports what moved, per ring, from counters the pollers
// keep: a batch transfer and a ring request show up with their bytes.
func TestMetrics(t *testing.T) {
	a := newEngine(t, t.Name()+"-a")
	b := newEngine(t, t.Name()+"-b")
	reg := prometheus.NewRegistry()
	reg.MustRegister(a.Collector())
	ctx := context.Background()
	src := make([]byte, 3<<20)
	dst := make([]byte, 3<<20)
	id, _ := a.RegisterLocalMemory(src, "cpu:0", false)
	b.RegisterLocalMemory(dst, "cpu:0", true)
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
			TargetOffset: uint64(moonring.AddressOf(dst)), Length: 1 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	// One that fails: past the end of the peer's buffer.
	a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
		TargetOffset: uint64(moonring.AddressOf(dst)) + 3<<20 - 10, Length: 100})
	r, err := a.NewRing(moonring.RingConfig{Entries: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	r.SubmitOne(&moonring.Entry{Op: moonring.OpRead, Segment: seg, Buffer: id, Remote: uint64(moonring.AddressOf(dst)), Length: 4096})
	if err := r.CQ().Wait(ctx, 1); err != nil {
		t.Fatal(err)
	}
	r.Advance(1)

	if v := metricValue(t, reg, "moonring_requests_total", map[string]string{"ring": "batch/0", "status": "completed"}); v != 3 {
		t.Errorf("batch completed = %v; want 3", v)
	}
	if v := metricValue(t, reg, "moonring_requests_total", map[string]string{"ring": "batch/0", "status": "failed"}); v != 1 {
		t.Errorf("batch failed = %v; want 1", v)
	}
	if v := metricValue(t, reg, "moonring_bytes_total", map[string]string{"ring": "batch/0"}); v != 3<<20 {
		t.Errorf("batch bytes = %v; want %d", v, 3<<20)
	}
	if v := metricValue(t, reg, "moonring_bytes_total", map[string]string{"ring": "ring/1"}); v != 4096 {
		t.Errorf("ring bytes = %v; want 4096", v)
	}
	if v := metricValue(t, reg, "moonring_buffers_registered", nil); v != 1 {
		t.Errorf("buffers = %v; want 1", v)
	}
	if v := metricValue(t, reg, "moonring_segments_open", nil); v != 1 {
		t.Errorf("segments = %v; want 1", v)
	}
	if v := metricValue(t, reg, "moonring_poller_up_seconds_total", map[string]string{"node": "0"}); v <= 0 {
		t.Errorf("poller up = %v", v)
	}
	// Per peer, transport and op.
	if v := metricValue(t, reg, "moonring_peer_bytes_total", map[string]string{"ring": "batch/0", "segment": b.Name(), "transport": "local", "op": "write"}); v != 3<<20 {
		t.Errorf("peer write bytes = %v; want %d", v, 3<<20)
	}
	if v := metricValue(t, reg, "moonring_peer_requests_total", map[string]string{"ring": "ring/1", "segment": b.Name(), "op": "read", "status": "completed"}); v != 1 {
		t.Errorf("peer read requests = %v; want 1", v)
	}
	if v := metricValue(t, reg, "moonring_errors_total", map[string]string{"ring": "batch/0", "error": "remote range outside segment"}); v != 1 {
		t.Errorf("batch remote-range errors = %v; want 1", v)
	}
	// The latency histogram counts the completed requests.
	mfs, _ := reg.Gather()
	found := false
	for _, mf := range mfs {
		if mf.GetName() != "moonring_request_duration_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == "batch/0" {
				found = true
				if n := m.GetHistogram().GetSampleCount(); n != 3 {
					t.Errorf("batch latency samples = %d; want 3", n)
				}
			}
		}
	}
	if !found {
		t.Error("no latency histogram for batch/0")
	}
	// The handler serves the text format.
	rec := httptest.NewRecorder()
	a.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	if !strings.Contains(string(body), `moonring_bytes_total{ring="batch/0"} 3.145728e+06`) {
		t.Errorf("handler output lacks the batch bytes:\n%s", body)
	}
}

// TestSharedCopyMetric: the slices a copy worker moved are counted per
// ring. A 4 MiB WRITE in-process is 4 slices of 1 MiB, a batch the
// poller shares with its worker (one by default where GOMAXPROCS is 2 or
// more; none, and nothing counted, with CopyWorkers -1).
func TestSharedCopyMetric(t *testing.T) {
	for _, workers := range []int{0, -1} {
		a, err := moonring.New(moonring.Config{Name: fmt.Sprint(t.Name(), workers, "-a"), CopyWorkers: workers})
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		b := newEngine(t, fmt.Sprint(t.Name(), workers, "-b"))
		reg := prometheus.NewRegistry()
		reg.MustRegister(a.Collector())
		src, dst := make([]byte, 4<<20), make([]byte, 4<<20)
		a.RegisterLocalMemory(src, "cpu:0", false)
		b.RegisterLocalMemory(dst, "cpu:0", true)
		seg, err := a.OpenSegment(t.Context(), b.Name())
		if err != nil {
			t.Fatal(err)
		}
		fill(src, 9)
		for range 4 {
			if err := a.Transfer(t.Context(), moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
				TargetOffset: uint64(moonring.AddressOf(dst)), Length: 4 << 20}); err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(src, dst) {
			t.Fatal("bytes differ")
		}
		v := metricValue(t, reg, "moonring_shared_copy_slices_total", map[string]string{"ring": "batch/0"})
		switch {
		case workers < 0 && v != 0:
			t.Errorf("no workers: %v shared slices; want 0", v)
		case workers == 0 && runtime.GOMAXPROCS(0) > 1 && v == 0:
			t.Errorf("a copy worker: no shared slices")
		}
	}
}

// TestMetricsReopenedSegment: a ring keeps the counters of a closed
// segment until another takes its table index, so a segment closed and
// opened again can appear twice; the scrape adds them up rather than fail
// on a duplicate label set (every scrape then failed).
func TestMetricsReopenedSegment(t *testing.T) {
	a := newEngine(t, t.Name()+"-a")
	b := newEngine(t, t.Name()+"-b")
	c := newEngine(t, t.Name()+"-c")
	reg := prometheus.NewRegistry()
	reg.MustRegister(a.Collector())
	ctx := context.Background()
	src := make([]byte, 4096)
	a.RegisterLocalMemory(src, "cpu:0", false)
	dsts := map[*moonring.Engine][]byte{b: make([]byte, 4096), c: make([]byte, 4096)}
	for e, d := range dsts {
		e.RegisterLocalMemory(d, "cpu:0", true)
	}
	write := func(e *moonring.Engine) moonring.SegmentID {
		t.Helper()
		seg, err := a.OpenSegment(ctx, e.Name())
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
			TargetOffset: uint64(moonring.AddressOf(dsts[e])), Length: 4096}); err != nil {
			t.Fatal(err)
		}
		return seg
	}
	sb, sc := write(b), write(c)
	for _, s := range []moonring.SegmentID{sb, sc} {
		if err := a.CloseSegment(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	write(b) // may take the index c had, while b's old counters stay under its own
	if _, err := reg.Gather(); err != nil {
		t.Fatalf("scrape after a segment was opened again: %v", err)
	}
	if v := metricValue(t, reg, "moonring_peer_bytes_total", map[string]string{"ring": "batch/0", "segment": b.Name(), "op": "write"}); v != 2*4096 {
		t.Errorf("peer write bytes of the reopened segment = %v; want %d (both opens)", v, 2*4096)
	}
}
