package segtable_test

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/moonring/moonring/segtable"
)

type endpoint struct{ addr string }

func desc(name string, bufs ...segtable.BufferDesc) *segtable.SegmentDesc {
	return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: name, Buffers: bufs}
}

func TestSegments(t *testing.T) {
	var ss segtable.Segments[endpoint]
	if ss.Get(segtable.LocalSegmentID) != nil || ss.Get(1) != nil || ss.Find("a") != nil {
		t.Fatal("an empty table found something")
	}
	local := ss.SetLocal("me", desc("me"), 2, 4096, endpoint{"self"})
	if local.ID != segtable.LocalSegmentID || ss.Get(segtable.LocalSegmentID) != local {
		t.Fatalf("SetLocal: ID %d, Get(Local) %v", local.ID, ss.Get(segtable.LocalSegmentID))
	}
	if _, err := ss.Close(context.Background(), segtable.LocalSegmentID); !errors.Is(err, segtable.ErrNotFound) {
		t.Fatalf("Close(LocalSegmentID) = %v, want ErrNotFound", err)
	}
	if ss.Get(segtable.LocalSegmentID) != local {
		t.Fatal("a refused Close removed the local segment")
	}

	a, err := ss.Open("a", desc("a"), 1, 0, endpoint{"a:1"}, endpoint{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := ss.Open("b", desc("b"), 3, 1<<20, endpoint{"b:1"}, endpoint{})
	if err != nil {
		t.Fatal(err)
	}
	if a.ID == segtable.LocalSegmentID || b.ID == segtable.LocalSegmentID || a.ID == b.ID {
		t.Fatalf("Open gave IDs %#x and %#x", a.ID, b.ID)
	}
	if a.Name != "a" || a.Path().Endpoint.addr != "a:1" || a.Path().Transport != 1 || b.Path().SliceSize != 1<<20 || a.Desc().Name != "a" {
		t.Fatalf("Open stored %+v", a)
	}
	if ss.Get(a.ID) != a || ss.Get(b.ID) != b || ss.Find("a") != a || ss.Find("b") != b || ss.Find("me") != nil {
		t.Fatal("Get or Find does not return what Open gave")
	}
	var names []string
	ss.Each(func(s *segtable.Segment[endpoint]) { names = append(names, s.Name) })
	slices.Sort(names)
	if !slices.Equal(names, []string{"a", "b"}) {
		t.Fatalf("Each visited %v, want [a b] (the local segment is not among them)", names)
	}

	got, err := ss.Close(context.Background(), a.ID)
	if err != nil || got != a {
		t.Fatalf("Close(a) = %v, %v", got, err)
	}
	if ss.Get(a.ID) != nil || ss.Find("a") != nil || a.Acquire() {
		t.Fatal("a closed segment is still found or usable")
	}
	if _, err := ss.Close(context.Background(), a.ID); !errors.Is(err, segtable.ErrNotFound) {
		t.Fatalf("second Close = %v, want ErrNotFound", err)
	}
	// The slot is reused under a new ID; the old one stays dead.
	a2, err := ss.Open("a", desc("a"), 1, 0, endpoint{"a:2"}, endpoint{})
	if err != nil {
		t.Fatal(err)
	}
	if a2.ID == a.ID || ss.Get(a.ID) != nil || ss.Get(a2.ID) != a2 {
		t.Fatalf("reopened segment: old ID %#x, new ID %#x", a.ID, a2.ID)
	}
	for _, id := range []segtable.SegmentID{1, 1 << 20, ^segtable.SegmentID(0), a.ID ^ 1} {
		if s := ss.Get(id); s != nil && s.ID != id {
			t.Errorf("Get(%#x) = segment %#x", id, s.ID)
		}
	}
}

func TestSegmentCloseBusy(t *testing.T) {
	var ss segtable.Segments[endpoint]
	s, err := ss.Open("a", desc("a"), 0, 0, endpoint{}, endpoint{})
	if err != nil {
		t.Fatal(err)
	}
	if !s.Acquire() {
		t.Fatal("Acquire of an open segment failed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if _, err := ss.Close(ctx, s.ID); !errors.Is(err, segtable.ErrBusy) {
		t.Fatalf("Close with a reference held = %v, want ErrBusy", err)
	}
	if ss.Get(s.ID) != s || s.Closing() || !s.Acquire() || s.InUse() != 2 {
		t.Fatalf("after a failed Close: found %v, Closing %v, InUse %d", ss.Get(s.ID) == s, s.Closing(), s.InUse())
	}
	s.Release()
	done := make(chan error, 1)
	go func() {
		_, err := ss.Close(context.Background(), s.ID)
		done <- err
	}()
	waitRefused(t, s.Acquire, s.Release)
	s.Release()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(hang):
		t.Fatal("Close did not return after the last Release")
	}
	if ss.Get(s.ID) != nil {
		t.Fatal("closed segment still found")
	}
}

func TestSegmentsBusy(t *testing.T) {
	busy := true
	ss := segtable.Segments[endpoint]{Busy: func(*segtable.Segment[endpoint]) bool { return busy }}
	s, err := ss.Open("a", desc("a"), 0, 0, endpoint{}, endpoint{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if _, err := ss.Close(ctx, s.ID); !errors.Is(err, segtable.ErrBusy) || ss.Get(s.ID) != s {
		t.Fatalf("Close while Busy = %v, want ErrBusy and the segment kept", err)
	}
	busy = false
	if _, err := ss.Close(context.Background(), s.ID); err != nil || ss.Get(s.ID) != nil {
		t.Fatalf("Close once not Busy = %v", err)
	}
}

func TestSegmentResolve(t *testing.T) {
	var ss segtable.Segments[endpoint]
	s, err := ss.Open("a", desc("a", segtable.BufferDesc{Addr: 0x1000, Length: 0x100}), 0, 0, endpoint{}, endpoint{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		addr, n uint64
		want    int
	}{{0x1000, 0x100, 0}, {0x10ff, 1, 0}, {0x1000, 0, -1}, {0x1100, 1, -1}, {0xfff, 2, -1}} {
		if got := s.Resolve(c.addr, c.n); got != c.want {
			t.Errorf("Resolve(%#x, %d) = %d, want %d", c.addr, c.n, got, c.want)
		}
	}
	// A republished descriptor replaces the old one for later lookups.
	s.SetDesc(desc("a", segtable.BufferDesc{Addr: 0x1000, Length: 0x200}))
	if s.Resolve(0x1100, 1) != 0 || s.Desc().Buffers[0].Length != 0x200 {
		t.Fatal("SetDesc did not take effect")
	}
}

func TestSegmentIDsNeverReused(t *testing.T) {
	var ss segtable.Segments[endpoint]
	seen := map[segtable.SegmentID]bool{}
	var old []segtable.SegmentID
	for i := range 5000 {
		s, err := ss.Open("x", desc("x"), 0, 0, endpoint{}, endpoint{})
		if err != nil {
			t.Fatal(err)
		}
		if s.ID == segtable.LocalSegmentID || seen[s.ID] {
			t.Fatalf("open %d: ID %#x issued again", i, s.ID)
		}
		seen[s.ID] = true
		if i%1000 == 0 {
			old = append(old, s.ID)
		}
		if _, err := ss.Close(context.Background(), s.ID); err != nil {
			t.Fatal(err)
		}
		for _, id := range old {
			if ss.Get(id) != nil {
				t.Fatalf("open %d: closed ID %#x resolves", i, id)
			}
		}
	}
}

// TestFindSkipsClosing: a segment being closed is not found by name (an
// OpenSegment then opens a new one rather than return one about to go).
func TestFindSkipsClosing(t *testing.T) {
	var ss segtable.Segments[int]
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "peer", Epoch: 1}
	s, err := ss.Open("peer", desc, 0, 0, 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	if ss.Find("peer") != s {
		t.Fatal("the open segment is not found")
	}
	if !s.Acquire() {
		t.Fatal("Acquire on an open segment failed")
	}
	closed := make(chan error, 1)
	go func() {
		_, err := ss.Close(context.Background(), s.ID)
		closed <- err
	}()
	deadline := time.Now().Add(hang)
	for !s.Closing() {
		if time.Now().After(deadline) {
			t.Fatal("Close never began")
		}
		runtime.Gosched()
	}
	if f := ss.Find("peer"); f != nil {
		t.Fatalf("Find returned segment %d while it closes", f.ID)
	}
	s.Release()
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
}

// TestFindByName: Find answers from the name index through opens and
// closes, with several segments of one name (the newest open one wins).
func TestFindByName(t *testing.T) {
	var ss segtable.Segments[*endpoint]
	a1, _ := ss.Open("a", desc("a"), 1, 0, &endpoint{"a1"}, nil)
	b, _ := ss.Open("b", desc("b"), 1, 0, &endpoint{"b"}, nil)
	a2, _ := ss.Open("a", desc("a"), 1, 0, &endpoint{"a2"}, nil)
	if ss.Find("a") != a2 || ss.Find("b") != b || ss.Find("c") != nil {
		t.Fatal("Find after the opens")
	}
	if _, err := ss.Close(context.Background(), a2.ID); err != nil {
		t.Fatal(err)
	}
	if ss.Find("a") != a1 {
		t.Fatal("Find after closing the newer of two")
	}
	ss.Close(context.Background(), a1.ID)
	ss.Close(context.Background(), b.ID)
	if ss.Find("a") != nil || ss.Find("b") != nil {
		t.Fatal("Find after closing every segment")
	}
}

// BenchmarkFind is Find with n segments open: flat in n (it scanned them
// all).
func BenchmarkFind(b *testing.B) {
	for _, n := range []int{1, 100, 1000, 10000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			var ss segtable.Segments[*endpoint]
			for i := range n {
				name := "seg-" + strconv.Itoa(i)
				ss.Open(name, desc(name), 1, 0, &endpoint{name}, nil)
			}
			name := "seg-" + strconv.Itoa(n/2)
			for b.Loop() {
				if ss.Find(name) == nil {
					b.Fatal("not found")
				}
			}
		})
	}
}
