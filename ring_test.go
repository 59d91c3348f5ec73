package moonring_test

import (
	"context"
	"runtime"
	"testing"

	"github.com/moonring/moonring"
)

// ringRoundTrip submits es and spins on Peek until as many completions came
// back, the way an event loop reaps: no blocking call. It returns the first
// completion that failed, if any. es must fit in the ring's SQ.
func ringRoundTrip(r *moonring.Ring, es []moonring.Entry) (bad moonring.Completion, ok bool) {
	if _, err := r.Submit(es); err != nil {
		return moonring.Completion{Code: moonring.Code(255)}, false
	}
	ok = true
	for got := 0; got < len(es); {
		c := r.Peek()
		if c == nil {
			runtime.Gosched()
			continue
		}
		if c.Err() != nil && ok {
			bad, ok = *c, false
		}
		r.Advance(1)
		got++
	}
	return bad, ok
}

// TestRingAllocs: a 4 KiB WRITE submitted, moved by the poller and reaped
// allocates nothing, whichever way it goes: to the engine's own segment,
// to another engine's through the in-process transport (its synchronous
// Copier path), and through a transport that completes through the
// Completer (the path of every remote transport).
func TestRingAllocs(t *testing.T) {
	for _, path := range []string{"local segment", "other engine", "completer"} {
		t.Run(path, func(t *testing.T) {
			var (
				a, b     *moonring.Engine
				src, dst []byte
				srcID    moonring.BufferID
				seg      = moonring.LocalSegmentID
				err      error
			)
			if path == "completer" {
				// The pair registered its buffers before opening the
				// segment: a buffer registered later reaches the opener's
				// cached descriptor only through the store's watch.
				p := newFaultPair(t, moonring.Config{}, 4096)
				a, src, srcID, dst, seg = p.a, p.src, p.srcID, p.dst, p.seg
			} else {
				a, b = startEngine(t, moonring.Config{}), startEngine(t, moonring.Config{})
				src, dst = make([]byte, 4096), make([]byte, 4096)
				fill(src, 3)
				if srcID, err = a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
					t.Fatal(err)
				}
				if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
					t.Fatal(err)
				}
				if path == "other engine" {
					if seg, err = a.OpenSegment(context.Background(), b.Name()); err != nil {
						t.Fatal(err)
					}
				} else {
					dst = make([]byte, 4096)
					if _, err := a.RegisterLocalMemory(dst, "cpu:0", false); err != nil {
						t.Fatal(err)
					}
				}
			}
			r, err := a.NewRing(moonring.RingConfig{Entries: 8})
			if err != nil {
				t.Fatal(err)
			}
			es := []moonring.Entry{{Op: moonring.OpWrite, Segment: seg, Buffer: srcID, Remote: uint64(moonring.AddressOf(dst)), Length: 4096, UserData: 1}}
			for i := 0; i < 100; i++ { // warm up: first-use allocations are fine
				if c, ok := ringRoundTrip(r, es); !ok {
					t.Fatalf("warm-up write: %v", c.Err())
				}
			}
			if string(dst) != string(src) {
				t.Fatal("data differs")
			}
			var failed error
			allocs := testing.AllocsPerRun(500, func() {
				if c, ok := ringRoundTrip(r, es); !ok && failed == nil {
					failed = c.Err()
				}
			})
			if failed != nil {
				t.Fatalf("write: %v", failed)
			}
			if allocs != 0 {
				t.Fatalf("Submit -> poller -> reap of a 4 KiB WRITE: %v allocations per request, want 0", allocs)
			}
		})
	}
}

// TestRingReadWrite moves data both ways through a ring and checks it, with
// requests cut into many slices.
func TestRingReadWrite(t *testing.T) {
	a := startEngine(t, moonring.Config{SliceSize: 4096})
	b := startEngine(t, moonring.Config{})
	src := make([]byte, 1<<20)
	back := make([]byte, 1<<20)
	dst := make([]byte, 1<<20+100)
	fill(src, 9)
	srcID, err := a.RegisterLocalMemory(src, "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	backID, err := a.RegisterLocalMemory(back, "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	seg, err := a.OpenSegment(context.Background(), b.Name())
	if err != nil {
		t.Fatal(err)
	}
	r, err := a.NewRing(moonring.RingConfig{Entries: 16})
	if err != nil {
		t.Fatal(err)
	}
	remote := uint64(moonring.AddressOf(dst)) + 7
	var ws, rs []moonring.Entry
	for i, n := range []uint64{1, 4095, 4096 + 1023, 4096 + 1024, 100000, 1<<20 - 200000} {
		off := uint64(i) * 200000
		if off+n > 1<<20 {
			n = 1<<20 - off
		}
		ws = append(ws, moonring.Entry{Op: moonring.OpWrite, Segment: seg, Buffer: srcID, Local: off, Remote: remote + off, Length: n, UserData: uint64(i)})
		rs = append(rs, moonring.Entry{Op: moonring.OpRead, Segment: seg, Buffer: backID, Local: off, Remote: remote + off, Length: n, UserData: 100 + uint64(i)})
	}
	if c, ok := ringRoundTrip(r, ws); !ok {
		t.Fatalf("writes: %d failed: %v", c.UserData, c.Err())
	}
	for _, e := range ws {
		if string(dst[7+e.Local:7+e.Local+e.Length]) != string(src[e.Local:e.Local+e.Length]) {
			t.Fatalf("write %d: data differs", e.UserData)
		}
	}
	if c, ok := ringRoundTrip(r, rs); !ok {
		t.Fatalf("reads: %d failed: %v", c.UserData, c.Err())
	}
	for _, e := range rs {
		if string(back[e.Local:e.Local+e.Length]) != string(src[e.Local:e.Local+e.Length]) {
			t.Fatalf("read %d: data differs", e.UserData)
		}
	}
	for i := 0; i < 7; i++ {
		if dst[i] != 0 {
			t.Fatalf("byte %d before the written range changed", i)
		}
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
}
