package moonring_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moonring/moonring"
)

// Tasks of every class in one SubmitTransfer run on the batch rings of
// their classes, and complete with their bytes; a class out of range is
// refused.
func TestBatchClasses(t *testing.T) {
	a := newEngine(t, t.Name()+"-a")
	b := newEngine(t, t.Name()+"-b")
	src := make([]byte, 6<<16)
	dst := make([]byte, len(src))
	fill(src, 7)
	if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	classes := []moonring.Class{moonring.ClassHigh, moonring.ClassLow, moonring.ClassNormal, moonring.ClassHigh, moonring.ClassLow, moonring.ClassLow}
	var reqs []moonring.TransferRequest
	for i, c := range classes {
		off := uint64(i) << 16
		reqs = append(reqs, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src) + uintptr(off), TargetID: seg,
			TargetOffset: uint64(moonring.AddressOf(dst)) + off, Length: 1 << 16, Class: c})
	}
	id, err := a.AllocateBatchID(len(reqs) + 1)
	if err != nil {
		t.Fatal(err)
	}
	defer a.FreeBatchID(id)
	if err := a.SubmitTransfer(id, reqs); err != nil {
		t.Fatal(err)
	}
	if err := a.WaitBatch(ctx, id); err != nil {
		t.Fatal(err)
	}
	for i := range reqs {
		st, err := a.GetTransferStatus(id, i)
		if err != nil || st.Status != moonring.COMPLETED {
			t.Fatalf("task %d (%v): %+v, %v", i, classes[i], st, err)
		}
	}
	if string(src) != string(dst) {
		t.Fatal("data differs")
	}
	bad := reqs[0]
	bad.Class = 3
	if err := a.SubmitTransfer(id, []moonring.TransferRequest{bad}); !errors.Is(err, moonring.ErrInvalid) {
		t.Fatalf("class 3: %v, want ErrInvalid", err)
	}
	if _, err := a.NewRing(moonring.RingConfig{Class: 3}); err == nil {
		t.Fatal("NewRing took class 3")
	}
	// The batch rings of each class are in the metrics.
	reg := prometheus.NewRegistry()
	if err := reg.Register(a.Collector()); err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"batch/0": 1, "batch/0/high": 2, "batch/0/low": 3}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "moonring_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ring, status string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "ring":
					ring = l.GetValue()
				case "status":
					status = l.GetValue()
				}
			}
			if status == "completed" && strings.HasPrefix(ring, "batch/") {
				if m.GetCounter().GetValue() != want[ring] {
					t.Errorf("%s completed %v, want %v", ring, m.GetCounter().GetValue(), want[ring])
				}
				delete(want, ring)
			}
		}
	}
	if len(want) > 0 {
		t.Errorf("no metrics for rings %v", want)
	}
}

// A high-class task can be canceled: CancelTransfer finds its ring.
func TestCancelHighClassTask(t *testing.T) {
	a := newEngine(t, t.Name())
	buf := make([]byte, 4096)
	if _, err := a.RegisterLocalMemory(buf, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	id, err := a.AllocateBatchID(1)
	if err != nil {
		t.Fatal(err)
	}
	defer a.FreeBatchID(id)
	req := moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(buf), TargetID: moonring.LocalSegmentID,
		TargetOffset: uint64(moonring.AddressOf(buf)), Length: 4096, Class: moonring.ClassHigh}
	if err := a.SubmitTransfer(id, []moonring.TransferRequest{req}); err != nil {
		t.Fatal(err)
	}
	if err := a.CancelTransfer(id, 0); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := a.WaitBatch(ctx, id); err != nil {
		t.Fatal(err)
	}
	if st, _ := a.GetTransferStatus(id, 0); st.Status != moonring.COMPLETED && st.Status != moonring.CANCELED {
		t.Fatalf("status %v", st.Status)
	}
}

// Requests of every class allocate nothing, also while rings of the other
// classes share their poller (holding and promotion are plain fields).
func TestClassAllocs(t *testing.T) {
	a := newEngine(t, t.Name())
	src := make([]byte, 4096)
	dst := make([]byte, 4096)
	srcID, err := a.RegisterLocalMemory(src, "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	var rings []*moonring.Ring
	for _, c := range []moonring.Class{moonring.ClassLow, moonring.ClassHigh, moonring.ClassNormal} {
		r, err := a.NewRing(moonring.RingConfig{Entries: 8, Class: c})
		if err != nil {
			t.Fatal(err)
		}
		rings = append(rings, r)
	}
	es := []moonring.Entry{{Op: moonring.OpWrite, Segment: moonring.LocalSegmentID, Buffer: srcID, Remote: uint64(moonring.AddressOf(dst)), Length: 4096, UserData: 1}}
	for _, r := range rings {
		for range 100 {
			if c, ok := ringRoundTrip(r, es); !ok {
				t.Fatalf("warm-up: %v", c.Err())
			}
		}
	}
	var bad error
	allocs := testing.AllocsPerRun(500, func() {
		for _, r := range rings {
			if c, ok := ringRoundTrip(r, es); !ok && bad == nil {
				bad = c.Err()
			}
		}
	})
	if bad != nil {
		t.Fatal(bad)
	}
	if allocs != 0 {
		t.Fatalf("%v allocations per three requests of three classes, want 0", allocs)
	}
}

// Config.PromoteAfter reaches the configuration the engine runs with, and
// its default is the ring's.
func TestPromoteAfterConfig(t *testing.T) {
	if s := (moonring.Config{}).String(); !strings.Contains(s, "promote after: 1ms\n") {
		t.Fatalf("default configuration:\n%s", s)
	}
	if s := (moonring.Config{PromoteAfter: 5 * time.Millisecond}).String(); !strings.Contains(s, "promote after: 5ms\n") {
		t.Fatalf("PromoteAfter 5 ms:\n%s", s)
	}
}
