package chunkwire

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"runtime"
	"testing"

	"github.com/moonring/moonring/segtable"
)

// publish returns the header of d and the encodings of its chunks, by
// seq, as a store sends them.
func publish(t testing.TB, d *segtable.SegmentDesc) (*Header, map[uint64][]byte) {
	t.Helper()
	h := NewHeader(d)
	values := map[uint64][]byte{}
	d.Chunked.EachChunk(func(info segtable.ChunkInfo, bufs []segtable.BufferDesc) bool {
		v, err := Encode(bufs)
		if err != nil {
			t.Fatal(err)
		}
		values[info.Seq] = v
		h.Chunks = append(h.Chunks, Chunk{Seq: info.Seq, N: info.N, Sum: Sum(v), MAC: info.MAC})
		return true
	})
	b, err := json.Marshal(&h)
	if err != nil {
		t.Fatal(err)
	}
	p, err := ParseHeader(d.Name, b)
	if err != nil {
		t.Fatal(err)
	}
	return p, values
}

// read returns what a reader that holds s reads of h: the chunks s does
// not hold, decoded.
func read(t testing.TB, h *Header, values map[uint64][]byte, s *Set) map[uint64]Held {
	t.Helper()
	got := map[uint64]Held{}
	for _, c := range h.Chunks {
		if s.Has(h.Desc.Epoch, c) {
			continue
		}
		hc, err := DecodeListed(c, values[c.Seq])
		if err != nil {
			t.Fatal(err)
		}
		got[c.Seq] = hc
	}
	return got
}

// firsts returns the address of each chunk's first buffer by seq: its
// identity.
func firsts(d *segtable.SegmentDesc) map[uint64]*segtable.BufferDesc {
	out := map[uint64]*segtable.BufferDesc{}
	d.Chunked.EachChunk(func(info segtable.ChunkInfo, bufs []segtable.BufferDesc) bool {
		out[info.Seq] = &bufs[0]
		return true
	})
	return out
}

// TestAssembleChunkedShares: a reader that reads only the chunks it does
// not hold assembles, after a registration, a descriptor that encodes as
// the publisher's, byte for byte, and shares every chunk the
// registration did not change with the one before; of another epoch,
// none.
func TestAssembleChunkedShares(t *testing.T) {
	var l segtable.ChunkList
	for i := range 300 {
		if err := l.Insert(segtable.BufferDesc{Addr: uint64(1+i) << 16, Length: 4096, Keys: map[string]string{"tcp": "k"}}); err != nil {
			t.Fatal(err)
		}
	}
	desc := func(epoch uint64) *segtable.SegmentDesc {
		return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "seg", Epoch: epoch, Endpoints: map[string]string{"tcp": "a:1"}, Chunked: l.Chunks()}
	}
	var s *Set
	var last *segtable.SegmentDesc
	for i := range 4 {
		before := l.Chunks()
		if i > 0 {
			if err := l.Insert(segtable.BufferDesc{Addr: uint64(1000+i) << 16, Length: 4096}); err != nil {
				t.Fatal(err)
			}
		}
		d := desc(3)
		h, values := publish(t, d)
		got := read(t, h, values, s)
		if lo, hi := l.Chunks().Changed(before); i > 0 && len(got) != hi-lo {
			t.Fatalf("publish %d: read %d chunks, %d made", i, len(got), hi-lo)
		}
		a, next, err := AssembleChunked(h, s, got)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := json.Marshal(d)
		if b, _ := json.Marshal(a); string(b) != string(want) {
			t.Fatalf("publish %d: assembled\n%s\nwant\n%s", i, b, want)
		}
		if i > 0 {
			old, now := firsts(last), firsts(a)
			for seq, p := range now {
				if _, read := got[seq]; !read && old[seq] != p {
					t.Fatalf("publish %d: chunk %d held, not shared", i, seq)
				}
			}
		}
		a.Endpoints["tcp"] = "changed"
		s, last = next, a
	}
	h, values := publish(t, desc(4))
	got := read(t, h, values, s)
	if len(got) != len(h.Chunks) {
		t.Fatalf("another epoch: read %d chunks of %d", len(got), len(h.Chunks))
	}
	a, _, err := AssembleChunked(h, s, got)
	if err != nil {
		t.Fatal(err)
	}
	old := firsts(last)
	for seq, p := range firsts(a) {
		if old[seq] == p {
			t.Fatalf("another epoch: chunk %d shared", seq)
		}
	}
}

// TestAssembleChunkedRefuses: a chunk listed that is neither read nor
// held, read but not the one listed, listed twice, or with a MAC in an
// unsigned header, is refused; a chunk of more buffers than a
// publisher's makes a flat descriptor of the caller's own.
func TestAssembleChunkedRefuses(t *testing.T) {
	d := chunked(t, 100)
	h, values := publish(t, d)
	got := read(t, h, values, nil)
	_, s, err := AssembleChunked(h, nil, got)
	if err != nil {
		t.Fatal(err)
	}
	for name, f := range map[string]func(h *Header, got map[uint64]Held){
		"a chunk neither read nor held": func(h *Header, got map[uint64]Held) {
			h.Chunks[1].Seq = 1 << 40
		},
		"a chunk read that is not the one listed": func(h *Header, got map[uint64]Held) {
			h.Chunks[1].Sum++
			got[h.Chunks[1].Seq] = Held{Sum: h.Chunks[1].Sum - 1, Bufs: got[h.Chunks[1].Seq].Bufs}
		},
		"a chunk listed twice": func(h *Header, got map[uint64]Held) { h.Chunks[2] = h.Chunks[1] },
		"a MAC unsigned": func(h *Header, got map[uint64]Held) {
			h.Chunks[1].MAC = "x"
			hc := got[h.Chunks[1].Seq]
			hc.MAC = "x"
			got[h.Chunks[1].Seq] = hc
		},
	} {
		for _, base := range []*Set{nil, s} {
			c := *h
			c.Chunks = append([]Chunk(nil), h.Chunks...)
			g := read(t, h, values, nil)
			f(&c, g)
			if _, _, err := AssembleChunked(&c, base, g); !errors.Is(err, segtable.ErrBadDesc) {
				t.Errorf("%s (held %v): %v; want ErrBadDesc", name, base != nil, err)
			}
		}
	}
	// A chunk of more buffers than ChunkSize: flat, Keys of its own.
	bufs := d.AllBuffers()[:segtable.ChunkSize+1]
	v, _ := Encode(bufs)
	big := &Header{Layout: Layout, Desc: h.Desc, Chunks: []Chunk{{Seq: 1, N: len(bufs), Sum: Sum(v)}}}
	hc, err := DecodeListed(big.Chunks[0], v)
	if err != nil {
		t.Fatal(err)
	}
	f, _, err := AssembleChunked(big, nil, map[uint64]Held{1: hc})
	if err != nil || f.Chunked != nil || len(f.Buffers) != len(bufs) {
		t.Fatalf("a chunk of %d buffers: %v, want it flat", len(bufs), err)
	}
	f.Buffers[0].Keys["tcp"] = "changed"
	if hc.Bufs[0].Keys["tcp"] == "changed" {
		t.Fatal("the flat descriptor shares the held chunk's Keys")
	}
}

// TestCache: a Set per name, the chunks of at most MaxBuffers buffers
// kept alive in all; past that a Set is still found while something else
// keeps it alive (a watch), and not once nothing does.
func TestCache(t *testing.T) {
	var c Cache
	if c.Load("a") != nil {
		t.Fatal("an empty cache holds a")
	}
	a, b := &Set{n: MaxBuffers / 2}, &Set{n: MaxBuffers/2 + 1}
	c.Store("a", a)
	c.Store("a", a)
	if c.Load("a") != a || c.n != MaxBuffers/2 {
		t.Fatalf("a: %v, %d buffers", c.Load("a"), c.n)
	}
	c.Store("b", b) // past MaxBuffers: a is no longer kept alive
	if c.sets["a"] != nil || c.Load("b") != b || c.n != b.n {
		t.Fatalf("past MaxBuffers: a kept %v, b %v, %d buffers", c.sets["a"], c.Load("b"), c.n)
	}
	if c.Load("a") != a {
		t.Fatal("a, alive elsewhere, not found past MaxBuffers")
	}
	runtime.KeepAlive(a)
	a = nil
	runtime.GC()
	runtime.GC()
	if c.Load("a") != nil {
		t.Fatal("the cache keeps a alive past MaxBuffers")
	}
	c.Store("b", nil)
	if c.Load("b") != nil || c.n != 0 {
		t.Fatalf("b dropped: %v, %d buffers", c.Load("b"), c.n)
	}
	for i := range 200 { // names whose Sets are gone are dropped as the map grows
		c.Store(fmt.Sprint("n", i), &Set{n: MaxBuffers}) // each evicts the last from what is kept alive
		runtime.GC()
	}
	if len(c.weak) > 150 {
		t.Fatalf("%d weak entries for 200 names stored and dropped", len(c.weak))
	}
}

// FuzzAssembleChunked: a header and chunks made of the input either fail
// AssembleChunked, with ErrBadDesc, or assemble to a descriptor that
// encodes as Assemble's flat one, byte for byte; held from one header to
// the next (the input's second half), the same.
func FuzzAssembleChunked(f *testing.F) {
	f.Add([]byte{3, 1, 0, 10, 2, 1, 20, 4, 2, 30, 1, 0, 3, 2, 0, 10, 2, 1, 25, 4})
	f.Add([]byte{2, 5, 1, 8, 8, 5, 2, 4, 4})
	f.Add([]byte{1, 1, 33, 0, 1})
	f.Fuzz(func(t *testing.T, in []byte) {
		at := 0
		next := func() int {
			if at >= len(in) {
				return 0
			}
			at++
			return int(in[at-1])
		}
		var s *Set
		for round := range 2 {
			h := &Header{Layout: Layout, Desc: segtable.SegmentDesc{Version: segtable.DescVersion, Name: "seg", Epoch: uint64(1 + next()%2)}}
			h.Signed = next()%2 == 1
			got := map[uint64]Held{}
			values := map[uint64][]byte{}
			for range next() % 5 {
				seq := uint64(next() % 8)
				n := 1 + next()%3
				if n == 3 && next()%4 == 0 {
					n = segtable.ChunkSize + 1
				}
				var bufs []segtable.BufferDesc
				addr := uint64(next()) << 8
				for range n {
					bufs = append(bufs, segtable.BufferDesc{Addr: addr, Length: uint64(1 + next()), Keys: map[string]string{"k": "v"}})
					addr += uint64(next()) << 4
				}
				mac := ""
				if next()%3 == 0 {
					mac = "m"
				}
				v, err := Encode(bufs)
				if err != nil {
					t.Fatal(err)
				}
				c := Chunk{Seq: seq, N: n, Sum: Sum(v), MAC: mac}
				h.Chunks = append(h.Chunks, c)
				values[seq] = v
				if s.Has(h.Desc.Epoch, c) && next()%2 == 0 {
					continue // held: not read
				}
				if hc, err := DecodeListed(c, v); err == nil {
					got[seq] = hc
				}
			}
			d, ns, err := AssembleChunked(h, s, got)
			if err != nil {
				if !errors.Is(err, segtable.ErrBadDesc) {
					t.Fatalf("round %d: %v, not ErrBadDesc", round, err)
				}
				continue
			}
			held := func(seq uint64) Held {
				for _, c := range h.Chunks {
					if c.Seq == seq {
						hc, _ := DecodeListed(c, values[seq])
						return hc
					}
				}
				return Held{}
			}
			flat, err := Assemble(h, held, true)
			if err != nil {
				t.Fatalf("round %d: AssembleChunked took what Assemble refuses: %v", round, err)
			}
			a, _ := json.Marshal(d)
			b, _ := json.Marshal(flat)
			if string(a) != string(b) {
				t.Fatalf("round %d: assembled\n%s\nflat\n%s", round, a, b)
			}
			s = ns
		}
	})
}

// BenchmarkReadRepublish is a reader's work on a republish beside n
// buffers after one registration, the chunk made read already:
// parse=header the header's decoding and checks (O(chunks), the same
// either way); assemble=flat the flat descriptor (Assemble, as readers
// did), assemble=chunked the descriptor sharing the chunks held
// (AssembleChunked).
func BenchmarkReadRepublish(b *testing.B) {
	for _, n := range []int{10_000, 100_000} {
		var l segtable.ChunkList
		for i := range n {
			if err := l.Insert(segtable.BufferDesc{Addr: uint64(1+i) << 16, Length: 4096, Keys: map[string]string{"tcp": "k"}}); err != nil {
				b.Fatal(err)
			}
		}
		t := b
		d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "seg", Epoch: 1, Endpoints: map[string]string{"tcp": "a:1"}, Chunked: l.Chunks()}
		h0, v0 := publish(t, d)
		_, s, err := AssembleChunked(h0, nil, read(t, h0, v0, nil))
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Insert(segtable.BufferDesc{Addr: uint64(n/2)<<16 + 8192, Length: 4096}); err != nil {
			b.Fatal(err)
		}
		d = &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "seg", Epoch: 1, Endpoints: map[string]string{"tcp": "a:1"}, Chunked: l.Chunks()}
		h, values := publish(t, d)
		got := read(t, h, values, s)
		body, _ := json.Marshal(h)
		b.Run(fmt.Sprintf("n=%d/parse=header", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ParseHeader("seg", body); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("n=%d/assemble=flat", n), func(b *testing.B) {
			all := read(t, h, values, nil)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Assemble(h, func(seq uint64) Held { return all[seq] }, true); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("n=%d/assemble=chunked", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				// The chunks read are made each time, as a reader makes them once.
				g := make(map[uint64]Held, len(got))
				maps.Copy(g, got)
				if _, _, err := AssembleChunked(h, s, g); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
