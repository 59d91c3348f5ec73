package segtable_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/moonring/moonring/segtable"
)

// TestDescList: a segment with a DescList resolves against the list's
// entries, and its Desc is the header with them, built once per change.
func TestDescList(t *testing.T) {
	var ss segtable.Segments[int]
	hdr := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "self", Epoch: 7}
	s := ss.SetLocal("self", hdr, 0, 0, 0)
	l := new(segtable.DescList)
	s.SetList(l)
	bd := func(addr, n uint64) segtable.BufferDesc {
		return segtable.BufferDesc{Addr: addr, Length: n, Location: "cpu:0", Keys: map[string]string{"local": "k"}}
	}
	l.Put(3, bd(0x3000, 0x100), true)
	l.Put(1, bd(0x1000, 0x100), false)
	l.Put(2, bd(0x2000, 0x100), true)
	d := s.Desc()
	if d.Name != "self" || d.Epoch != 7 || len(d.Buffers) != 3 || d.Buffers[0].Addr != 0x1000 || d.Buffers[2].Addr != 0x3000 {
		t.Fatalf("Desc = %+v", d)
	}
	if err := d.Validate(); err != nil {
		t.Fatal(err)
	}
	if s.Desc() != d {
		t.Error("Desc built again without a change")
	}
	for _, c := range []struct {
		addr, n uint64
		want    int
	}{{0x1000, 1, 0}, {0x20ff, 1, 1}, {0x3000, 0x100, 2}, {0x3000, 0x101, -1}, {0x1100, 1, -1}, {0xfff, 1, -1}, {0x2000, 0, -1}} {
		if got := s.Resolve(c.addr, c.n); got != c.want {
			t.Errorf("Resolve(%#x, %d) = %d, want %d", c.addr, c.n, got, c.want)
		}
		if got := d.Find(c.addr, c.n); c.n > 0 && got != c.want {
			t.Errorf("the flat descriptor's Find(%#x, %d) = %d, want %d", c.addr, c.n, got, c.want)
		}
	}
	if got := l.Buffers(true); len(got) != 2 || got[0].Addr != 0x2000 || got[1].Addr != 0x3000 {
		t.Errorf("remote buffers = %+v", got)
	}
	// A buffer whose table entry went while its Delete is still to come,
	// and memory meeting it registered meanwhile: the stale entry goes.
	l.Put(4, bd(0x1f80, 0x100), true)
	l.Delete(2, 0x2000) // its own Delete comes late: nothing to drop
	d = s.Desc()
	if len(d.Buffers) != 3 || d.Buffers[1].Addr != 0x1f80 || d.Validate() != nil {
		t.Fatalf("after an overlapping Put: %+v", d.Buffers)
	}
	l.Delete(1, 0x1000)
	l.Delete(9, 0x3000) // another buffer's ID: stays
	if got := s.Desc().Buffers; len(got) != 2 || got[0].Addr != 0x1f80 || got[1].Addr != 0x3000 {
		t.Fatalf("after Deletes: %+v", got)
	}
	hdr2 := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "self", Epoch: 7, Endpoints: map[string]string{"tcp": "x"}}
	s.SetDesc(hdr2)
	if d := s.Desc(); d.Endpoints["tcp"] != "x" || len(d.Buffers) != 2 {
		t.Fatalf("after a new header: %+v", d)
	}
	l.Reset(nil, nil, nil)
	if d := s.Desc(); len(d.Buffers) != 0 || d.Buffers == nil || s.Resolve(0x3000, 1) != -1 {
		t.Fatalf("after Reset: %+v", d)
	}
}

// TestResolveMatchesFind: a segment's Resolve, on its packed copy of the
// descriptor's ranges, answers as the descriptor's own Find.
func TestResolveMatchesFind(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 3))
	var ss segtable.Segments[int]
	for round := range 50 {
		d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "peer"}
		addr := uint64(rng.IntN(64))
		for range rng.IntN(40) {
			n := uint64(1 + rng.IntN(64))
			d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: addr, Length: n})
			addr += n + uint64(rng.IntN(3))*uint64(rng.IntN(64))
		}
		if err := d.Validate(); err != nil {
			t.Fatal(err)
		}
		s, err := ss.Open(fmt.Sprint("peer", round), d, 0, 0, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		var a, n uint64
		for range 500 {
			if rng.IntN(3) > 0 { // else the range before again, or a neighbour: the last hit's
				a, n = uint64(rng.IntN(int(addr)+70)), uint64(rng.IntN(80))
			} else if rng.IntN(2) == 0 {
				a += uint64(rng.IntN(16))
			}
			want := d.Find(a, n)
			if n == 0 {
				want = -1
			}
			if got := s.Index(s.Resolve(a, n)); got != want {
				t.Fatalf("round %d: Resolve(%d, %d) = %d, Find %d (%+v)", round, a, n, got, want, d.Buffers)
			}
		}
	}
}

// TestResolveLastHitChecked: the buffer a recent search found is tried
// first, and only taken when it holds the range, in the descriptor of
// now: after a republish moved the buffers, the old index names another
// range (or none), and Resolve searches again.
func TestResolveLastHitChecked(t *testing.T) {
	desc := func(starts ...uint64) *segtable.SegmentDesc {
		d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "peer"}
		for _, a := range starts {
			d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: a, Length: 0x100})
		}
		if err := d.Validate(); err != nil {
			t.Fatal(err)
		}
		return d
	}
	var ss segtable.Segments[int]
	s, err := ss.Open("peer", desc(0x1000, 0x2000, 0x3000, 0x4000), 0, 0, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	check := func(addr, n uint64, want int) {
		t.Helper()
		if got := s.Resolve(addr, n); got != want {
			t.Fatalf("Resolve(%#x, %d) = %d; want %d", addr, n, got, want)
		}
	}
	for range 500 { // a miss moves the hint one time in 16: now it is 2 (but for 1e-14)
		check(0x3010, 16, 2)
	}
	check(0x30f8, 16, -1) // past its end: not taken on the last hit's word
	check(0x2ff8, 16, -1) // before its start
	check(0x3000, 0x100, 2)
	// Republished: index 2 is now [0x5000, 0x5100), and 0x3000 is buffer 1.
	s.SetDesc(desc(0x1000, 0x3000, 0x5000))
	check(0x3010, 16, 1)
	check(0x5010, 16, 2)
	s.SetDesc(desc(0x1000)) // the last hit's index is past the end
	check(0x5010, 16, -1)
	check(0x1000, 1, 0)
	check(0x1000, 0, -1) // empty
}

// BenchmarkResolve is one lookup of a random address among n buffers of 4
// KiB, each way a request's range is looked up: the peer's descriptor
// searched as it was (SegmentDesc.Find over 56-byte BufferDescs, the
// baseline), a segment's Resolve (packed starts), the engine's own
// segment's (a DescList) and Buffers.Find (Sorted).
func BenchmarkResolve(b *testing.B) {
	for _, n := range []int{1, 100, 10000, 100000} {
		d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "peer"}
		var l segtable.DescList
		var bs segtable.Buffers
		mem := make([]byte, n*4096)
		base := uint64(uintptr(unsafe.Pointer(&mem[0])))
		for i := range n {
			bd := segtable.BufferDesc{Addr: base + uint64(i)*4096, Length: 4096, Location: "cpu:0", Keys: map[string]string{"local": "1"}}
			d.Buffers = append(d.Buffers, bd)
			l.Put(segtable.BufferID(i+1), bd, true)
			if _, err := bs.Register(mem[i*4096:(i+1)*4096], "cpu:0", true); err != nil {
				b.Fatal(err)
			}
		}
		var ss segtable.Segments[int]
		s, _ := ss.Open("peer", d, 0, 0, 0, 0)
		self := ss.SetLocal("self", d, 0, 0, 0)
		self.SetList(&l)
		addrs := make([]uint64, 1<<16)
		rng := rand.New(rand.NewPCG(1, 2))
		for i := range addrs {
			addrs[i] = base + uint64(rng.IntN(n))*4096 + 64
		}
		for _, c := range []struct {
			name string
			find func(addr uint64) int
		}{
			{"desc.Find", func(a uint64) int { return d.Find(a, 64) }},
			{"Segment.Resolve", func(a uint64) int { return s.Resolve(a, 64) }},
			{"self.Resolve", func(a uint64) int { return self.Resolve(a, 64) }},
			{"Buffers.Find", func(a uint64) int {
				if bs.Find(uintptr(a), 64) == nil {
					return -1
				}
				return 0
			}},
		} {
			b.Run(fmt.Sprintf("buffers=%d/%s", n, c.name), func(b *testing.B) {
				i := 0
				for b.Loop() {
					if c.find(addrs[i&(len(addrs)-1)]) < 0 {
						b.Fatal("not found")
					}
					i++
				}
			})
		}
		all, _ := bs.UnregisterAll(context.Background())
		if len(all) != n {
			b.Fatal(len(all))
		}
	}
}
