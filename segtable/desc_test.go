package segtable_test

import (
	"bytes"
	"errors"
	"math"
	"math/rand/v2"
	"reflect"
	"strconv"
	"testing"

	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/segtable"
)

const top = math.MaxUint64

func TestValidate(t *testing.T) {
	buf := func(addr, n uint64) segtable.BufferDesc { return segtable.BufferDesc{Addr: addr, Length: n} }
	for _, c := range []struct {
		name string
		d    segtable.SegmentDesc
		ok   bool
	}{
		{"minimal", segtable.SegmentDesc{Version: 1, Name: "a"}, true},
		{"version 0", segtable.SegmentDesc{Version: 0, Name: "a"}, false},
		{"newer version", segtable.SegmentDesc{Version: segtable.DescVersion + 1, Name: "a"}, false},
		{"negative version", segtable.SegmentDesc{Version: -1, Name: "a"}, false},
		{"no name", segtable.SegmentDesc{Version: 1}, false},
		{"two buffers", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(0, 16), buf(32, 16)}}, true},
		{"adjacent", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(0, 16), buf(16, 16)}}, true},
		{"overlap", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(0, 17), buf(16, 16)}}, false},
		{"same address", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(0, 16), buf(0, 16)}}, false},
		{"out of order", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(32, 16), buf(0, 16)}}, false},
		{"empty buffer", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(0, 0)}}, false},
		{"just below the top", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(top-16, 16)}}, true},
		{"wraps to zero", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(top-15, 16)}}, false},
		{"wraps past zero", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(top-3, 16)}}, false},
		{"huge length", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(1, top)}}, false},
		{"wrap hides overlap", segtable.SegmentDesc{Version: 1, Name: "a", Buffers: []segtable.BufferDesc{buf(16, 16), buf(64, top-8)}}, false},
	} {
		err := c.d.Validate()
		if (err == nil) != c.ok || (err != nil && !errors.Is(err, segtable.ErrBadDesc)) {
			t.Errorf("%s: Validate = %v, want ok %v", c.name, err, c.ok)
		}
	}
}

func TestUnmarshalDesc(t *testing.T) {
	d, err := segtable.UnmarshalDesc([]byte(`{"version":1,"name":"n","epoch":7,
		"endpoints":{"tcp":"h:1"},
		"buffers":[{"addr":4096,"length":16,"location":"cpu:0","keys":{"tcp":"k2"}},
		           {"addr":0,"length":16,"location":"","keys":null}],
		"devices":[{"name":"mlx5_0","kind":"rdma","node":1}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if d.Name != "n" || d.Epoch != 7 || d.Endpoints["tcp"] != "h:1" || len(d.Buffers) != 2 ||
		d.Buffers[0].Addr != 0 || d.Buffers[1].Addr != 4096 || d.Buffers[1].Keys["tcp"] != "k2" || d.Devices[0].Node != 1 {
		t.Fatalf("UnmarshalDesc = %+v (buffers must come out sorted)", d)
	}
	b, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	d2, err := segtable.UnmarshalDesc(b)
	if err != nil || !reflect.DeepEqual(d, d2) {
		t.Fatalf("Marshal round trip: %+v, %v", d2, err)
	}
	for _, bad := range []string{
		``, `{`, `[]`, `null`, `{"version":1}`, `{"version":2,"name":"n"}`,
		`{"version":1,"name":"n","buffers":[{"addr":0,"length":16},{"addr":8,"length":16}]}`,
		`{"version":1,"name":"n","buffers":[{"addr":0,"length":0}]}`,
		`{"version":1,"name":"n","buffers":[{"addr":-1,"length":1}]}`,
		`{"version":1,"name":"n","buffers":[{"addr":18446744073709551615,"length":2}]}`,
		`{"version":1,"name":"n","buffers":[{"addr":18446744073709551616,"length":1}]}`,
	} {
		if d, err := segtable.UnmarshalDesc([]byte(bad)); !errors.Is(err, segtable.ErrBadDesc) || d != nil {
			t.Errorf("UnmarshalDesc(%q) = %v, %v; want ErrBadDesc", bad, d, err)
		}
	}
}

func FuzzUnmarshalDesc(f *testing.F) {
	f.Add([]byte(`{"version":1,"name":"n","endpoints":{"tcp":"h:1"},"buffers":[{"addr":0,"length":16,"keys":{"tcp":"k"}}]}`))
	f.Add([]byte(`{"version":1,"name":"n","buffers":[{"addr":32,"length":16},{"addr":0,"length":16}]}`))
	f.Add([]byte(`{"version":1,"name":"n","buffers":[{"addr":18446744073709551600,"length":15}]}`))
	f.Add([]byte(`{"version":1,"name":"n","devices":[]}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := segtable.UnmarshalDesc(b)
		if err != nil {
			if !errors.Is(err, segtable.ErrBadDesc) || d != nil {
				t.Fatalf("UnmarshalDesc = %v, %v; a refusal must wrap ErrBadDesc", d, err)
			}
			return
		}
		if err := d.Validate(); err != nil {
			t.Fatalf("accepted descriptor does not validate: %v", err)
		}
		// Encoding is a fixed point after one round.
		enc, err := d.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		d2, err := segtable.UnmarshalDesc(enc)
		if err != nil {
			t.Fatalf("re-decoding %s: %v", enc, err)
		}
		enc2, _ := d2.Marshal()
		if !bytes.Equal(enc, enc2) {
			t.Fatalf("round trip changed %s into %s", enc, enc2)
		}
		// Every buffer finds itself, and the byte past it is not in it.
		for i, buf := range d.Buffers {
			if got := d.Find(buf.Addr, buf.Length); got != i {
				t.Fatalf("Find(buffer %d) = %d", i, got)
			}
			if got := d.Find(buf.Addr+buf.Length-1, 2); got != -1 {
				t.Fatalf("Find across the end of buffer %d = %d", i, got)
			}
		}
	})
}

func TestDescFind(t *testing.T) {
	d := desc("a",
		segtable.BufferDesc{Addr: 0x1000, Length: 0x100},
		segtable.BufferDesc{Addr: 0x1100, Length: 0x10}, // adjacent to the first
		segtable.BufferDesc{Addr: 0x2000, Length: 0x10},
		segtable.BufferDesc{Addr: top - 0x100, Length: 0x100}, // ends at top (exclusive)
	)
	if err := d.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		addr, n uint64
		want    int
	}{
		{0x1000, 0x100, 0}, // exactly the buffer
		{0x1000, 1, 0},
		{0x10ff, 1, 0},      // last byte
		{0x10ff, 2, -1},     // crosses into the adjacent buffer
		{0x1100, 1, 1},      // one past the first is the second
		{0x1000, 0x110, -1}, // spans two buffers
		{0x1000, 0x101, -1},
		{0xfff, 1, -1},
		{0xfff, 2, -1},
		{0x1110, 1, -1}, // one past the second
		{0x2000, 0x10, 2},
		{0x200f, 1, 2},
		{0x2010, 1, -1},
		{0x1fff, 0x11, -1},
		{0, 1, -1},
		{top - 0x100, 0x100, 3},
		{top - 1, 1, 3}, // the last byte (the end, top, is exclusive)
		{top - 2, 2, 3},
		{top - 1, 2, -1},
		{top, 1, -1},
		{top, top, -1},
		{0x1000, top, -1},          // addr+n wraps
		{0x1001, top - 0x1000, -1}, // addr+n wraps to exactly zero
		{top - 0x100, top, -1},     // huge length in the last buffer
		{0x2008, top - 0x2000, -1}, // addr+n wraps just past addr
		{top - 0x80, 0x81, -1},     // one byte too many at the top
	} {
		if got := d.Find(c.addr, c.n); got != c.want {
			t.Errorf("Find(%#x, %#x) = %d, want %d", c.addr, c.n, got, c.want)
		}
	}
	if got := desc("empty").Find(0, 1); got != -1 {
		t.Errorf("Find in a descriptor with no buffers = %d", got)
	}
}

// randDesc returns a valid descriptor of up to 8 buffers, some of them at
// the very top of the address space, and queries around their edges.
func randDesc(r *rand.Rand) (*segtable.SegmentDesc, [][2]uint64) {
	d := desc("r")
	addr := uint64(r.IntN(64))
	if r.IntN(3) == 0 {
		addr = top - uint64(r.IntN(1<<12)) - 1<<12
	}
	for range r.IntN(9) {
		addr += uint64(r.IntN(3)) * uint64(1+r.IntN(32)) // gap, often none
		n := uint64(1 + r.IntN(64))
		if addr+n < addr || addr+n == 0 {
			break
		}
		d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: addr, Length: n})
		addr += n
	}
	var qs [][2]uint64
	edges := []uint64{0, 1, top, top - 1}
	for _, b := range d.Buffers {
		edges = append(edges, b.Addr, b.Addr+b.Length, b.Addr+b.Length-1, b.Addr-1)
	}
	for range 64 {
		a := edges[r.IntN(len(edges))] + uint64(r.IntN(5)) - 2
		n := uint64(1 + r.IntN(80))
		switch r.IntN(6) {
		case 0:
			n = top - uint64(r.IntN(4))
		case 1:
			n = -a + uint64(r.IntN(3)) // addr+n near zero
		}
		qs = append(qs, [2]uint64{a, max(n, 1)})
	}
	return d, qs
}

// findModel is Find by linear search, with no arithmetic that can wrap.
func findModel(d *segtable.SegmentDesc, addr, n uint64) int {
	for i, b := range d.Buffers {
		if addr >= b.Addr && addr-b.Addr < b.Length && n <= b.Length-(addr-b.Addr) {
			return i
		}
	}
	return -1
}

func TestDescFindModel(t *testing.T) {
	props := properties(t, 500)
	props.Property("Find matches a linear search", prop.ForAll(func(seed uint64) string {
		d, qs := randDesc(rand.New(rand.NewPCG(seed, 0)))
		if err := d.Validate(); err != nil {
			return "generator made an invalid descriptor: " + err.Error()
		}
		for _, q := range qs {
			if got, want := d.Find(q[0], q[1]), findModel(d, q[0], q[1]); got != want {
				return "Find(" + hex(q[0]) + ", " + hex(q[1]) + ") = " + itoa(got) + ", want " + itoa(want)
			}
		}
		return ""
	}, gen.UInt64()))
	props.TestingRun(t)
}

func TestClone(t *testing.T) {
	d := &segtable.SegmentDesc{
		Version: 1, Name: "a", Epoch: 3,
		Endpoints: map[string]string{"tcp": "h:1"},
		Buffers:   []segtable.BufferDesc{{Addr: 0, Length: 8, Location: "cpu:0", Keys: map[string]string{"tcp": "k"}}},
		Devices:   []segtable.DeviceDesc{{Name: "nic", Kind: "rdma", Node: 0}},
	}
	c := d.Clone()
	if !reflect.DeepEqual(c, d) {
		t.Fatalf("Clone = %+v, want %+v", c, d)
	}
	c.Name = "b"
	c.Endpoints["tcp"] = "x"
	c.Buffers[0].Keys["tcp"] = "x"
	c.Buffers[0].Addr = 99
	c.Devices[0].Name = "x"
	if d.Name != "a" || d.Endpoints["tcp"] != "h:1" || d.Buffers[0].Keys["tcp"] != "k" || d.Buffers[0].Addr != 0 || d.Devices[0].Name != "nic" {
		t.Fatalf("changing the clone changed the original: %+v", d)
	}
	// Nil maps stay nil.
	e := (&segtable.SegmentDesc{Version: 1, Name: "e", Buffers: []segtable.BufferDesc{{Addr: 0, Length: 1}}}).Clone()
	if e.Endpoints != nil || e.Buffers[0].Keys != nil || e.Devices != nil {
		t.Fatalf("Clone invented maps: %+v", e)
	}
}

func hex(v uint64) string { return "0x" + strconv.FormatUint(v, 16) }

func itoa(v int) string { return strconv.Itoa(v) }
