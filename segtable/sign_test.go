package segtable_test

import (
	"bytes"
	"errors"
	"reflect"
	"testing"

	"github.com/moonring/moonring/segtable"
)

func signedDesc(t testing.TB, s *segtable.Signer) *segtable.SegmentDesc {
	t.Helper()
	d := &segtable.SegmentDesc{
		Version: 1, Name: "node-a", Epoch: 42,
		Endpoints: map[string]string{"tcp": "10.0.0.1:7001?tls=00ff", "shm": "/run/a.sock"},
		Buffers: []segtable.BufferDesc{
			{Addr: 0x1000, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "1.abc", "shm": "9"}},
			{Addr: 0x4000, Length: 8192, Location: "cuda:0", Keys: map[string]string{"tcp": "2.def"}},
			{Addr: 0x9000, Length: 16, Location: "cpu:1"},
		},
		Devices: []segtable.DeviceDesc{{Name: "mlx5_0", Kind: "rdma", Node: 1}},
	}
	s.Sign(d)
	return d
}

func signer(t testing.TB, key string) *segtable.Signer {
	t.Helper()
	s, err := segtable.NewSigner([]byte(key))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestSignVerify(t *testing.T) {
	s := signer(t, "deployment key")
	d := signedDesc(t, s)
	if err := s.Verify(d); err != nil {
		t.Fatalf("Verify of a signed descriptor: %v", err)
	}
	// Through JSON, as stores carry it.
	b, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	back, err := segtable.UnmarshalDesc(b)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Verify(back); err != nil {
		t.Fatalf("Verify after a JSON round trip: %v", err)
	}
	if err := s.Verify(d.Clone()); err != nil {
		t.Fatalf("Verify of a clone: %v", err)
	}
	if _, err := segtable.NewSigner(nil); err == nil {
		t.Fatal("NewSigner accepted an empty key")
	}
}

// TestVerifyRefuses changes one thing that peers act on at a time; each
// must fail the check.
func TestVerifyRefuses(t *testing.T) {
	s := signer(t, "deployment key")
	for _, c := range []struct {
		name   string
		change func(d *segtable.SegmentDesc)
	}{
		{"unsigned", func(d *segtable.SegmentDesc) { d.MAC = "" }},
		{"mac not base64", func(d *segtable.SegmentDesc) { d.MAC = "!!" + d.MAC[2:] }},
		{"mac too long", func(d *segtable.SegmentDesc) { d.MAC += "AA" }},
		{"name", func(d *segtable.SegmentDesc) { d.Name = "node-b" }},
		{"epoch", func(d *segtable.SegmentDesc) { d.Epoch++ }},
		{"version", func(d *segtable.SegmentDesc) { d.Version = 2 }},
		{"endpoint moved", func(d *segtable.SegmentDesc) { d.Endpoints["tcp"] = "10.6.6.6:7001" }},
		{"tls pin dropped", func(d *segtable.SegmentDesc) { d.Endpoints["tcp"] = "10.0.0.1:7001" }},
		{"endpoint added", func(d *segtable.SegmentDesc) { d.Endpoints["rdma"] = "x" }},
		{"endpoint removed", func(d *segtable.SegmentDesc) { delete(d.Endpoints, "shm") }},
		{"endpoint key and value swapped", func(d *segtable.SegmentDesc) {
			d.Endpoints = map[string]string{"10.0.0.1:7001?tls=00ff": "tcp", "/run/a.sock": "shm"}
		}},
		{"device", func(d *segtable.SegmentDesc) { d.Devices[0].Node = 0 }},
		{"buffer address", func(d *segtable.SegmentDesc) { d.Buffers[0].Addr = 0x2000 }},
		{"buffer length", func(d *segtable.SegmentDesc) { d.Buffers[1].Length = 1 << 30 }},
		{"buffer location", func(d *segtable.SegmentDesc) { d.Buffers[1].Location = "cpu:0" }},
		{"buffer key", func(d *segtable.SegmentDesc) { d.Buffers[0].Keys["tcp"] = "1.abd" }},
		{"buffer key added", func(d *segtable.SegmentDesc) { d.Buffers[2].Keys = map[string]string{"tcp": "3.0"} }},
		{"buffer mac cleared", func(d *segtable.SegmentDesc) { d.Buffers[2].MAC = "" }},
		{"buffer dropped", func(d *segtable.SegmentDesc) { d.Buffers = d.Buffers[1:] }},
		{"buffers swapped", func(d *segtable.SegmentDesc) { d.Buffers[0], d.Buffers[1] = d.Buffers[1], d.Buffers[0] }},
		{"buffer duplicated", func(d *segtable.SegmentDesc) { d.Buffers = append(d.Buffers, d.Buffers[2]) }},
		{"buffer macs swapped", func(d *segtable.SegmentDesc) { d.Buffers[0].MAC, d.Buffers[1].MAC = d.Buffers[1].MAC, d.Buffers[0].MAC }},
	} {
		d := signedDesc(t, s)
		c.change(d)
		if err := s.Verify(d); !errors.Is(err, segtable.ErrForged) {
			t.Errorf("%s: Verify = %v, want ErrForged", c.name, err)
		}
	}
	// Another key: nothing verifies.
	if err := signer(t, "another key").Verify(signedDesc(t, s)); !errors.Is(err, segtable.ErrForged) {
		t.Errorf("another key: Verify = %v, want ErrForged", err)
	}
}

// TestBufferMACBound: a buffer or chunk signed for one segment or epoch
// does not verify in another, even under a header signed for the new one
// (MACs carried over by a publisher that kept them too long).
func TestBufferMACBound(t *testing.T) {
	s := signer(t, "k")
	d := signedDesc(t, s)
	for _, change := range []func(*segtable.SegmentDesc){
		func(o *segtable.SegmentDesc) { o.Epoch++ },
		func(o *segtable.SegmentDesc) { o.Name = "node-b" },
	} {
		other := d.Clone()
		change(other)
		s.Sign(other)
		if err := s.Verify(other); err != nil {
			t.Fatalf("re-signed: %v", err)
		}
		bufs := other.Clone()
		for i := range bufs.Buffers {
			bufs.Buffers[i].MAC = d.Buffers[i].MAC
		}
		chunks := other.Clone()
		copy(chunks.Chunks, d.Chunks)
		for _, o := range []*segtable.SegmentDesc{bufs, chunks} {
			if err := s.Verify(o); !errors.Is(err, segtable.ErrForged) {
				t.Fatalf("MACs of another segment or epoch: Verify = %v, want ErrForged", err)
			}
		}
	}
}

// TestSignFull: signing from scratch is deterministic, whatever MACs the
// descriptor carried.
func TestSignFull(t *testing.T) {
	s := signer(t, "k")
	d := signedDesc(t, s)
	d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: 0x10000, Length: 64, Location: "cpu:0", Keys: map[string]string{"tcp": "4.1"}})
	d.Chunks = nil
	s.Sign(d)
	full := d.Clone()
	for i := range full.Buffers {
		full.Buffers[i].MAC = ""
	}
	full.MAC, full.Chunks = "", nil
	s.Sign(full)
	a, _ := d.Marshal()
	b, _ := full.Marshal()
	if !bytes.Equal(a, b) {
		t.Fatalf("two signings differ:\n%s\n%s", a, b)
	}
	if err := s.Verify(d); err != nil {
		t.Fatal(err)
	}
	if !segtable.SameBuffer(&d.Buffers[0], &full.Buffers[0]) || segtable.SameBuffer(&d.Buffers[0], &d.Buffers[1]) {
		t.Fatal("SameBuffer")
	}
}

// FuzzVerify: whatever a store hands back, Verify does not panic, and a
// descriptor that passes says exactly what the signer signed.
func FuzzVerify(f *testing.F) {
	s := signer(f, "fuzz key")
	orig := signedDesc(f, s)
	want, err := orig.Marshal()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(want)
	f.Add([]byte(`{"version":1,"name":"node-a","epoch":42,"mac":"AAAAAAAAAAAAAAAAAAAAAA"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := segtable.UnmarshalDesc(b)
		if err != nil {
			return
		}
		if s.Verify(d) != nil {
			return
		}
		if !reflect.DeepEqual(normalize(d), normalize(orig)) {
			got, _ := d.Marshal()
			t.Fatalf("a descriptor other than the signed one verified:\n%s\nsigned:\n%s", got, want)
		}
	})
}

// normalize returns a copy of d in which empty maps and slices are nil: the
// encodings differ ("keys":null against {}), the meaning does not.
func normalize(d *segtable.SegmentDesc) *segtable.SegmentDesc {
	c := d.Clone()
	if len(c.Endpoints) == 0 {
		c.Endpoints = nil
	}
	if len(c.Devices) == 0 {
		c.Devices = nil
	}
	if len(c.Buffers) == 0 {
		c.Buffers = nil
	}
	for i := range c.Buffers {
		if len(c.Buffers[i].Keys) == 0 {
			c.Buffers[i].Keys = nil
		}
	}
	return c
}

// TestVerifyFirstFormat: a descriptor signed by the first version of the
// format (a MAC per buffer and a header MAC over them, no Rev, no chunks;
// written by the code of d580acb) still verifies, for engines not yet
// upgraded, and not once changed, nor with chunks or a Rev added.
func TestVerifyFirstFormat(t *testing.T) {
	const v1 = `{"version":1,"name":"old-engine","epoch":9,"endpoints":{"tcp":"10.0.0.1:7001"},"buffers":[{"addr":4096,"length":4096,"location":"cpu:0","keys":{"tcp":"1.a"},"mac":"2NqTa7QgxjO6ITsa67CYMQ"},{"addr":12288,"length":64,"location":"cpu:0","keys":{"tcp":"2.b"},"mac":"iMOOt7eN8EoTvcIHtumtMg"}],"mac":"KY8ReWzTkY7WuowmtzCYgA"}`
	s := signer(t, "v1 key")
	d, err := segtable.UnmarshalDesc([]byte(v1))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Verify(d); err != nil {
		t.Fatalf("a first-format descriptor: %v", err)
	}
	for _, change := range []func(*segtable.SegmentDesc){
		func(d *segtable.SegmentDesc) { d.Buffers = d.Buffers[:1] },
		func(d *segtable.SegmentDesc) { d.Buffers[1].Keys["tcp"] = "3.c" },
		func(d *segtable.SegmentDesc) { d.Rev = 1 },
		func(d *segtable.SegmentDesc) { d.Chunks = []segtable.ChunkInfo{{Seq: 1, N: 2}} },
	} {
		x := d.Clone()
		change(x)
		if err := s.Verify(x); !errors.Is(err, segtable.ErrForged) {
			t.Errorf("a changed first-format descriptor: %v, want ErrForged", err)
		}
	}
}
