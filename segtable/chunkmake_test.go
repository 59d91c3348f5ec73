package segtable

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"testing"
)

// wireReader is what a reader of a networked store keeps of one segment:
// the chunks it made, by seq, and the list it joined last. Each chunk it
// makes is a copy of the publisher's (buffers and Keys maps of its own,
// as decoding makes them), made only for a chunk it does not hold: same
// seq, MAC and buffers (a store's reader tells them by seq and the sum of
// their encoding).
type wireReader struct {
	held map[uint64]Chunk
	last *BufferChunks
}

func (r *wireReader) read(t *testing.T, d *SegmentDesc) *SegmentDesc {
	t.Helper()
	var list []Chunk
	next := map[uint64]Chunk{}
	d.Chunked.EachChunk(func(info ChunkInfo, bufs []BufferDesc) bool {
		c, ok := r.held[info.Seq]
		if !ok || c.c.mac != info.MAC || !sameBufs(c.c.bufs, bufs) {
			cp := make([]BufferDesc, len(bufs))
			for i, b := range bufs {
				b.Keys = maps.Clone(b.Keys)
				cp[i] = b
			}
			var err error
			if c, err = MakeChunk(info.Seq, cp, info.MAC); err != nil {
				t.Fatal(err)
			}
		}
		next[info.Seq] = c
		list = append(list, c)
		return true
	})
	cs, err := JoinChunks(r.last, list, d.Chunked.Signed())
	if err != nil {
		t.Fatal(err)
	}
	r.held, r.last = next, cs
	w := d.CloneShared()
	w.Chunked = cs
	return w
}

func sameBufs(a, b []BufferDesc) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !SameBuffer(&a[i], &b[i]) || a[i].MAC != b[i].MAC {
			return false
		}
	}
	return true
}

// TestJoinChunksSharesUnchanged: through random registrations and
// unregistrations of a signing publisher, a reader that makes only the
// chunks it lacks and joins them onto its last list gets the publisher's
// buffers and chunks, which verify one republish at a time as they do
// whole, and a Mirror made from its last one makes tables only for the
// chunks it made; its pages stay between pageSize/4 and pageSize chunks.
func TestJoinChunksSharesUnchanged(t *testing.T) {
	s, err := NewSigner([]byte("k"))
	if err != nil {
		t.Fatal(err)
	}
	live := map[uint64]bool{}
	rnd := rand.New(rand.NewPCG(1, 2))
	change := func(l *ChunkList, i int) {
		n := 1 + i%3
		if i == 0 {
			n = 20000
		}
		for range n {
			seq := rnd.IntN(40000)
			addr := uint64(seq) * 64
			if live[addr] {
				l.Delete(addr)
				delete(live, addr)
			} else if err := l.Insert(BufferDesc{Addr: addr, Length: 64, Keys: map[string]string{"tcp": fmt.Sprint(seq)}}); err == nil {
				live[addr] = true
			}
		}
	}
	ds := signedSeq(t, s, "seg", 3, 150, change)
	var r wireReader
	var v *Verified
	var m *Mirror[uint64]
	var prev *BufferChunks
	for i, d := range ds {
		w := r.read(t, d)
		whole := i%16 == 15 // the checks of every buffer, now and then
		if got, want := w.Chunked.Buffers(), d.Chunked.Buffers(); whole && !sameBufs(got, want) {
			t.Fatalf("descriptor %d: the reader's buffers are not the publisher's", i)
		}
		if got, want := w.Chunked.infos(), d.Chunked.infos(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("descriptor %d: chunks %v, published %v", i, got, want)
		}
		nv, err := s.VerifySince(w, v)
		if err != nil {
			t.Fatalf("descriptor %d: %v", i, err)
		}
		if whole {
			if err := s.Verify(w); err != nil {
				t.Fatalf("descriptor %d whole: %v", i, err)
			}
			full, err := s.VerifySince(w, nil)
			if err != nil || full.acc != nv.acc || full.chunks != nv.chunks || full.n != nv.n {
				t.Fatalf("descriptor %d: state %d chunks %d buffers, from scratch %d, %d (%v)", i, nv.chunks, nv.n, full.chunks, full.n, err)
			}
		}
		v = nv
		made := 0 // buffers of the chunks not in the last list
		old := map[*chunk]bool{}
		prev.each(func(c *chunk) { old[c] = true })
		w.Chunked.each(func(c *chunk) {
			if !old[c] {
				made += len(c.bufs)
			}
		})
		convs := 0
		m = NewMirror(m, w.Chunked, func(b *BufferDesc) (uint64, bool) { convs++; return b.Addr, true })
		if i > 0 && (convs != made || made > 8*ChunkSize) {
			t.Fatalf("descriptor %d: the Mirror made %d entries, the reader %d buffers' chunks", i, convs, made)
		}
		if i > 0 {
			same := 0
			for _, pg := range w.Chunked.pages {
				for _, q := range prev.pages {
					if pg == q {
						same++
					}
				}
			}
			if len(w.Chunked.pages)-same > 3*(1+i%3) {
				t.Fatalf("descriptor %d: %d pages of %d made anew", i, len(w.Chunked.pages)-same, len(w.Chunked.pages))
			}
		}
		for _, pg := range w.Chunked.pages {
			if len(pg.chunks) > pageSize || len(pg.chunks) < pageSize/4 && w.Chunked.Count() >= pageSize/4 {
				t.Fatalf("descriptor %d: a page of %d chunks", i, len(pg.chunks))
			}
		}
		for _, b := range w.Chunked.Buffers() {
			if !whole {
				break
			}
			if p, _ := m.Floor(b.Addr); p == nil || *p != b.Addr {
				t.Fatalf("descriptor %d: the Mirror does not find %#x", i, b.Addr)
			}
		}
		prev = w.Chunked
	}
	if n := len(prev.pages); n < 16 {
		t.Fatalf("%d pages: too few to tell them apart", n)
	}
}

// TestJoinChunksRefuses: chunks and lists that a descriptor could not
// hold are refused with ErrBadDesc; a reader's chunks forged, spliced
// from an older republish or dropped fail VerifySince as they fail
// Verify.
func TestJoinChunksRefuses(t *testing.T) {
	b := func(addr, n uint64) BufferDesc { return BufferDesc{Addr: addr, Length: n} }
	many := make([]BufferDesc, ChunkSize+1)
	for i := range many {
		many[i] = b(uint64(i)*64, 64)
	}
	for _, tc := range []struct {
		name string
		bufs []BufferDesc
	}{
		{"none", nil},
		{"more than ChunkSize", many},
		{"empty", []BufferDesc{b(0, 0)}},
		{"overflowing", []BufferDesc{b(math.MaxUint64-1, 4)}},
		{"unsorted", []BufferDesc{b(128, 64), b(0, 64)}},
		{"overlapping", []BufferDesc{b(0, 64), b(32, 64)}},
	} {
		if _, err := MakeChunk(1, tc.bufs, ""); !errors.Is(err, ErrBadDesc) {
			t.Errorf("MakeChunk %s: %v", tc.name, err)
		}
	}
	mk := func(seq uint64, mac string, bufs ...BufferDesc) Chunk {
		c, err := MakeChunk(seq, bufs, mac)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	a, d := mk(1, "", b(0, 64), b(64, 64)), mk(3, "", b(128, 64))
	if cs, err := JoinChunks(nil, []Chunk{a, d}, false); err != nil || cs.Len() != 3 || cs.Count() != 2 {
		t.Fatalf("JoinChunks: %v, %v", cs, err)
	}
	for _, tc := range []struct {
		name   string
		list   []Chunk
		signed bool
	}{
		{"out of order", []Chunk{d, a}, false},
		{"overlapping across chunks", []Chunk{a, mk(4, "", b(127, 1))}, false},
		{"the same chunk twice", []Chunk{a, a}, false},
		{"the zero Chunk", []Chunk{a, {}}, false},
		{"a MAC in an unsigned list", []Chunk{mk(5, "x", b(0, 1))}, false},
	} {
		if _, err := JoinChunks(nil, tc.list, tc.signed); !errors.Is(err, ErrBadDesc) {
			t.Errorf("JoinChunks %s: %v", tc.name, err)
		}
	}

	s, err := NewSigner([]byte("k"))
	if err != nil {
		t.Fatal(err)
	}
	fill := func(l *ChunkList, i int) {
		if i == 0 {
			for j := range 3 * ChunkSize {
				if err := l.Insert(BufferDesc{Addr: uint64(j) * 64, Length: 64, Keys: map[string]string{"tcp": fmt.Sprint(j)}}); err != nil {
					t.Fatal(err)
				}
			}
			return
		}
		l.Delete(uint64(i) * 64 * 7)
	}
	ds := signedSeq(t, s, "seg", 5, 4, fill)
	var r wireReader
	ws := make([]*SegmentDesc, len(ds))
	states := make([]*Verified, len(ds))
	for i, d := range ds {
		ws[i] = r.read(t, d)
		var prev *Verified
		if i > 0 {
			prev = states[i-1]
		}
		if states[i], err = s.VerifySince(ws[i], prev); err != nil {
			t.Fatal(err)
		}
	}
	newer := ws[3]
	refused := func(what string, list []Chunk) {
		t.Helper()
		cs, err := JoinChunks(newer.Chunked, list, true)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		f := newer.CloneShared()
		f.Chunked = cs
		for i, prev := range append([]*Verified{nil}, states...) {
			if _, err := s.VerifySince(f, prev); !errors.Is(err, ErrForged) {
				t.Errorf("%s verified against state %d: %v", what, i, err)
			}
		}
		if err := s.Verify(f); !errors.Is(err, ErrForged) {
			t.Errorf("%s verified whole: %v", what, err)
		}
	}
	chunksOf := func(cs *BufferChunks) []Chunk {
		var out []Chunk
		cs.each(func(c *chunk) { out = append(out, Chunk{c}) })
		return out
	}
	cur := chunksOf(newer.Chunked)
	addr := uint64(3 * 7 * 64)
	_, ni := locateChunk(t, newer, addr)
	_, oi := locateChunk(t, ws[1], addr)
	splice := append([]Chunk(nil), cur...)
	splice[ni] = chunksOf(ws[1].Chunked)[oi]
	refused("an older chunk in place of the newer one", splice)
	drop := append(append([]Chunk(nil), cur[:ni]...), cur[ni+1:]...)
	refused("a chunk dropped", drop)
	forged := append([]Chunk(nil), cur...)
	x := cur[ni].c
	bufs := append([]BufferDesc(nil), x.bufs...)
	bufs[1].Keys = map[string]string{"tcp": "relay"}
	forged[ni] = mk(x.seq, x.mac, bufs...)
	refused("a buffer's key changed", forged)
	renum := append([]Chunk(nil), cur...)
	renum[ni] = mk(x.seq+1, x.mac, x.bufs...)
	refused("a chunk's number changed", renum)
	for i, prev := range states {
		if _, err := s.VerifySince(newer, prev); err != nil {
			t.Errorf("the newer descriptor against state %d: %v", i, err)
		}
	}
}
