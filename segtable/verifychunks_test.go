package segtable

import (
	"errors"
	"fmt"
	"testing"
)

// signedSeq publishes a ChunkList through steps changes, signing each as
// a signing store does (SignChunks from the last), and returns the
// descriptors as the in-process store hands them out (Chunked, shared).
func signedSeq(t *testing.T, s *Signer, name string, epoch uint64, steps int, change func(l *ChunkList, i int)) []*SegmentDesc {
	t.Helper()
	var l ChunkList
	var prevSrc, prevOut *BufferChunks
	var out []*SegmentDesc
	for i := range steps {
		change(&l, i)
		d := &SegmentDesc{Version: 1, Name: name, Epoch: epoch, Rev: uint64(i + 1), Endpoints: map[string]string{"tcp": "a:1"}}
		d.Chunked = s.SignChunks(name, epoch, l.Chunks(), prevSrc, prevOut)
		d.MAC = s.HeaderMAC(d)
		prevSrc, prevOut = l.Chunks(), d.Chunked
		out = append(out, d.CloneShared())
	}
	return out
}

// withChunk returns d with its chunk at (page p, index i) replaced by c
// (nil: dropped), every other page and chunk shared by pointer: what a
// forger in the reader's process could hand it.
func withChunk(d *SegmentDesc, p, i int, c *chunk) *SegmentDesc {
	old := d.Chunked
	pages := append([]*chunkPage(nil), old.pages...)
	chunks := append([]*chunk(nil), pages[p].chunks...)
	if c == nil {
		chunks = append(chunks[:i], chunks[i+1:]...)
	} else {
		chunks[i] = c
	}
	pages[p] = newChunkPage(chunks)
	cs := &BufferChunks{pages: pages, signed: true, acc: old.acc}
	for _, pg := range pages {
		cs.n += pg.n
		cs.count += len(pg.chunks)
	}
	f := d.CloneShared()
	f.Chunked = cs
	return f
}

// locateChunk returns the page and index of the chunk of d that holds
// addr.
func locateChunk(t *testing.T, d *SegmentDesc, addr uint64) (int, int) {
	t.Helper()
	p, i := d.Chunked.locate(addr)
	if p < 0 {
		t.Fatalf("no chunk holds %#x", addr)
	}
	return p, i
}

// TestVerifySinceMatchesVerify: through random registrations and
// unregistrations, each descriptor checked against the last one accepted
// verifies, as it does whole, and its state equals a check from scratch.
func TestVerifySinceMatchesVerify(t *testing.T) {
	s, err := NewSigner([]byte("k"))
	if err != nil {
		t.Fatal(err)
	}
	live := map[uint64]bool{}
	seq := 0
	change := func(l *ChunkList, i int) {
		for range 1 + i%3 {
			seq = (seq*7919 + 13) % 3000
			addr := uint64(seq) * 64
			if live[addr] {
				l.Delete(addr)
				delete(live, addr)
			} else if err := l.Insert(BufferDesc{Addr: addr, Length: 64, Keys: map[string]string{"tcp": fmt.Sprint(seq)}}); err == nil {
				live[addr] = true
			}
		}
	}
	ds := signedSeq(t, s, "seg", 3, 600, change)
	var v *Verified
	for i, d := range ds {
		nv, err := s.VerifySince(d, v)
		if err != nil {
			t.Fatalf("descriptor %d: %v", i, err)
		}
		if err := s.Verify(d); err != nil {
			t.Fatalf("descriptor %d whole: %v", i, err)
		}
		full, err := s.VerifySince(d, nil)
		if err != nil || full.acc != nv.acc || full.chunks != nv.chunks || full.n != nv.n || nv.n != d.Chunked.Len() {
			t.Fatalf("descriptor %d: state %d chunks %d buffers, from scratch %d, %d (%v)", i, nv.chunks, nv.n, full.chunks, full.n, err)
		}
		v = nv
	}
	// Out of order (an older one after a newer: metadata.Signed refuses
	// it by its Rev, the signatures hold) and across epochs.
	if _, err := s.VerifySince(ds[10], v); err != nil {
		t.Errorf("an older descriptor against a newer state: %v", err)
	}
	other := signedSeq(t, s, "seg", 4, 3, change)
	if _, err := s.VerifySince(other[2], v); err != nil {
		t.Errorf("another epoch against this one's state: %v", err)
	}
}

// TestVerifySinceRefusesSplice: a forged or spliced chunk among chunks
// the reader verified before (shared by pointer with the state it
// checks against) is refused, as Verify refuses it whole
// (TestVerifyRefusesSplice).
func TestVerifySinceRefusesSplice(t *testing.T) {
	s, err := NewSigner([]byte("k"))
	if err != nil {
		t.Fatal(err)
	}
	const n = 3 * ChunkSize
	fill := func(l *ChunkList, i int) {
		if i == 0 {
			for j := range n {
				if err := l.Insert(BufferDesc{Addr: uint64(j) * 64, Length: 64, Keys: map[string]string{"tcp": fmt.Sprint(j)}}); err != nil {
					t.Fatal(err)
				}
			}
			return
		}
		l.Delete(uint64(i) * 64 * 7) // one withdrawn per publish
	}
	ds := signedSeq(t, s, "seg", 5, 4, fill)
	older, newer := ds[1], ds[3]
	var refusedSince func(what string, f *SegmentDesc)
	states := make([]*Verified, len(ds))
	for i, d := range ds {
		var prev *Verified
		if i > 0 {
			prev = states[i-1]
		}
		if states[i], err = s.VerifySince(d, prev); err != nil {
			t.Fatal(err)
		}
	}
	refused := func(what string, f *SegmentDesc) {
		t.Helper()
		refusedSince(what, f)
		if err := s.Verify(f); !errors.Is(err, ErrForged) {
			t.Errorf("%s verified whole: %v", what, err)
		}
	}
	refusedSince = func(what string, f *SegmentDesc) {
		t.Helper()
		for _, prev := range []*Verified{nil, states[1], states[2], states[3]} {
			if _, err := s.VerifySince(f, prev); !errors.Is(err, ErrForged) {
				t.Errorf("%s verified against state %v: %v", what, prev != nil, err)
			}
		}
	}
	addr := uint64(3 * 7 * 64) // the buffer withdrawn last
	op, oi := locateChunk(t, older, addr)
	np, ni := locateChunk(t, newer, addr)
	// The older chunk (verified once, in states[1]) in place of the newer.
	refused("an older chunk in place of the newer one", withChunk(newer, np, ni, older.Chunked.pages[op].chunks[oi]))
	// Another segment's or epoch's chunk, with its own MACs.
	for _, o := range [][]*SegmentDesc{signedSeq(t, s, "seg2", 5, 4, fill), signedSeq(t, s, "seg", 6, 4, fill)} {
		refused("a chunk of another segment or epoch", withChunk(newer, np, ni, o[3].Chunked.pages[np].chunks[ni]))
	}
	// A chunk dropped.
	refused("a chunk dropped", withChunk(newer, np, ni, nil))
	// A chunk forged: a buffer's key changed, its MAC kept; a buffer
	// dropped; the set element or the MAC changed.
	c := newer.Chunked.pages[np].chunks[ni]
	forge := func(change func(f *chunk)) *chunk {
		f := *c
		f.bufs = append([]BufferDesc(nil), c.bufs...)
		change(&f)
		return &f
	}
	refused("a buffer's key changed", withChunk(newer, np, ni, forge(func(f *chunk) {
		f.bufs[1].Keys = map[string]string{"tcp": "relay"}
	})))
	refused("a buffer dropped", withChunk(newer, np, ni, forge(func(f *chunk) { f.bufs = f.bufs[1:]; f.first = f.bufs[0].Addr })))
	// (The set element is not published: a flat copy has none, so only
	// a reader of shared chunks, which takes it from the chunk, checks it.)
	refusedSince("a set element changed", withChunk(newer, np, ni, forge(func(f *chunk) { f.elem[0] ^= 1 })))
	refused("a chunk's number changed", withChunk(newer, np, ni, forge(func(f *chunk) { f.seq++ })))
	// The header: Rev, endpoints.
	f := newer.CloneShared()
	f.Rev++
	refused("Rev changed", f)
	f = newer.CloneShared()
	f.Endpoints["tcp"] = "relay:1"
	refused("an endpoint changed", f)
	// And the descriptor itself still verifies against every state.
	for i, prev := range states {
		if _, err := s.VerifySince(newer, prev); err != nil {
			t.Errorf("the newer descriptor against state %d: %v", i, err)
		}
	}
}

// TestUndoRelists: deleting the buffer inserted last, with no change
// between, makes the list before the insertion current again, the very
// one; Seq moves on; and the descriptors published through such
// changes (chunks replaced, then listed again) sign incrementally as
// from scratch and verify against the last one accepted as whole.
func TestUndoRelists(t *testing.T) {
	var l ChunkList
	for i := range 4 * ChunkSize {
		if i != 2*ChunkSize+5 {
			if err := l.Insert(BufferDesc{Addr: uint64(i) * 64, Length: 64}); err != nil {
				t.Fatal(err)
			}
		}
	}
	hole := uint64(2*ChunkSize+5) * 64
	before, seq := l.Chunks(), l.Seq()
	if err := l.Insert(BufferDesc{Addr: hole, Length: 64}); err != nil {
		t.Fatal(err)
	}
	if !l.Delete(hole) || l.Chunks() != before || l.Seq() <= seq {
		t.Fatalf("after an insertion and its deletion: list %p (was %p), Seq %d (was %d)", l.Chunks(), before, l.Seq(), seq)
	}
	// Another change between: no undo.
	if err := l.Insert(BufferDesc{Addr: hole, Length: 64}); err != nil {
		t.Fatal(err)
	}
	if err := l.Insert(BufferDesc{Addr: 4 * ChunkSize * 64, Length: 64}); err != nil {
		t.Fatal(err)
	}
	mid := l.Chunks()
	if !l.Delete(hole) || l.Chunks() == before || l.Chunks() == mid || l.Chunks().Len() != before.Len()+1 {
		t.Fatalf("a deletion after another change: list of %d buffers", l.Chunks().Len())
	}

	s, err := NewSigner([]byte("k"))
	if err != nil {
		t.Fatal(err)
	}
	live := map[uint64]bool{}
	x := 0
	var last uint64
	change := func(l *ChunkList, i int) {
		if i%3 == 2 && live[last] { // the one inserted last, alone
			l.Delete(last)
			delete(live, last)
			return
		}
		x = (x*7919 + 13) % 2000
		addr := uint64(x) * 64
		if live[addr] {
			l.Delete(addr)
			delete(live, addr)
		} else if err := l.Insert(BufferDesc{Addr: addr, Length: 64, Keys: map[string]string{"tcp": fmt.Sprint(x)}}); err == nil {
			live[addr], last = true, addr
		}
	}
	ds := signedSeq(t, s, "seg", 3, 900, change)
	var v *Verified
	for i, d := range ds {
		nv, err := s.VerifySince(d, v)
		if err != nil {
			t.Fatalf("descriptor %d: %v", i, err)
		}
		full, err := s.VerifySince(d, nil)
		if err != nil || full.acc != nv.acc || full.chunks != nv.chunks || full.n != nv.n || nv.n != len(live) && i == len(ds)-1 {
			t.Fatalf("descriptor %d: state %d chunks %d buffers, from scratch %d, %d (%v)", i, nv.chunks, nv.n, full.chunks, full.n, err)
		}
		v = nv
	}
}

// TestDeleteGrowsSeq: every change of a ChunkList moves Seq, a
// publisher's Rev, a deletion that empties a chunk too.
func TestDeleteGrowsSeq(t *testing.T) {
	var l ChunkList
	for i := range ChunkSize + 1 {
		if err := l.Insert(BufferDesc{Addr: uint64(i) * 64, Length: 64}); err != nil {
			t.Fatal(err)
		}
	}
	seq := l.Seq()
	if !l.Delete(ChunkSize * 64) { // alone in its chunk, past a full one
		t.Fatal("not found")
	}
	if l.Seq() <= seq {
		t.Errorf("Seq %d after a deletion, %d before", l.Seq(), seq)
	}
}
