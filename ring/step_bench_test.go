package ring

import (
	"testing"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// BenchmarkStepWrite4KiB measures the poller's own work for one 4 KiB
// in-process WRITE: submit, step and reap on one goroutine, no hand-off.
func BenchmarkStepWrite4KiB(b *testing.B) {
	var bufs segtable.Buffers
	var segs segtable.Segments[transport.Endpoint]
	lt := local.New()
	defer lt.Close()
	src := make([]byte, 4096)
	dst := make([]byte, 4096)
	bs, _ := bufs.Register(src, "", false)
	bd, _ := bufs.Register(dst, "", false)
	defer bufs.Unregister(b.Context(), bs.ID)
	defer bufs.Unregister(b.Context(), bd.ID)
	for _, x := range []*segtable.Buffer{bs, bd} {
		reg, err := lt.Register(x)
		if err != nil {
			b.Fatal(err)
		}
		x.Regs[0].Store(&reg)
	}
	desc := &segtable.SegmentDesc{Version: 1, Name: "self", Buffers: []segtable.BufferDesc{{Addr: uint64(bd.Addr), Length: bd.Length}}}
	segs.SetLocal("self", desc, 0, 0, lt.Self())
	p := &Poller{bell: sq.NewDoorbell()} // never started: the benchmark steps the ring itself
	r, err := New(Config{Entries: 256}, &Tables{Buffers: &bufs, Segments: &segs}, p)
	if err != nil {
		b.Fatal(err)
	}
	e := sq.Entry{Op: sq.Write, Segment: segtable.LocalSegmentID, Buffer: bs.ID, Remote: uint64(bd.Addr), Length: 4096}
	es := make([]sq.Entry, 16)
	for i := range es {
		es[i] = e
	}
	cqes := make([]cq.Completion, 16)
	t := now() // the poller reads its clock every few rounds, not per request
	b.SetBytes(4096)
	for b.Loop() {
		if _, err := r.Submit(es[:1]); err != nil {
			b.Fatal(err)
		}
		r.step(t, false)
		if n := r.PeekBatch(cqes); n != 1 || cqes[0].Err() != nil {
			b.Fatalf("%d completions, %v", n, cqes[0].Err())
		}
		r.Advance(1)
	}
}

// BenchmarkCopy4KiB is the copy() that BenchmarkStepWrite4KiB performs.
func BenchmarkCopy4KiB(b *testing.B) {
	src := make([]byte, 4096)
	dst := make([]byte, 4096)
	b.SetBytes(4096)
	for b.Loop() {
		copy(dst, src)
	}
}
