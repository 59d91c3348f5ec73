package segtable_test

import (
	"testing"

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
