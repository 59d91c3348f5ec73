package segtable

import (
	"fmt"
	"strings"
	"testing"
)

// Insertions past the end of a full chunk in falling address order (the
// gap above a filled stretch, filled from the top down, as mmap's
// top-down placement gives) fill chunks and pages as insertions in
// address order do: they went to a chunk (and past a full page, a page)
// of their own each, and every later change copied an array of them all.
func TestFallingInsertsFillChunks(t *testing.T) {
	const below, above = ChunkSize * pageSize, 20000
	var l ChunkList
	s := new(Sorted[int])
	add := func(addr uint64) {
		if err := l.Insert(BufferDesc{Addr: addr, Length: 1}); err != nil {
			t.Fatal(err)
		}
		s.Insert(addr, 0)
	}
	for i := range below { // a full page of full chunks
		add(uint64(i) * 16)
	}
	for i := range above { // then the gap above it, from the top down
		add(uint64(below+above-i) * 16)
	}
	n := below + above
	cs := l.Chunks()
	if cs.Len() != n {
		t.Fatalf("%d buffers, want %d", cs.Len(), n)
	}
	// Chunks at least half full, pages of more than one chunk.
	if maxChunks := 2 * n / ChunkSize; cs.Count() > maxChunks {
		t.Errorf("%d chunks for %d buffers, want at most %d", cs.Count(), n, maxChunks)
	}
	if maxPages := 2 * cs.Count() / pageSize; len(cs.pages) > maxPages+1 {
		t.Errorf("%d pages for %d chunks, want at most %d", len(cs.pages), cs.Count(), maxPages+1)
	}
	if err := checkTree(s.tree()); err != nil {
		t.Fatal(err)
	}
	counts := levelCounts(s.tree())
	if maxLeaves := 2 * n / maxChunk; counts[0] > maxLeaves {
		t.Errorf("Sorted: %d leaves for %d keys, want at most %d", counts[0], n, maxLeaves)
	}
	for h := 1; h < len(counts); h++ {
		if maxNodes := 2*counts[h-1]/maxPage + 1; counts[h] > maxNodes {
			t.Errorf("Sorted: %d nodes of height %d over %d, want at most %d", counts[h], h, counts[h-1], maxNodes)
		}
	}
	// And the order holds.
	bufs := cs.Buffers()
	for i := 1; i < len(bufs); i++ {
		if bufs[i].Addr <= bufs[i-1].Addr {
			t.Fatalf("buffer %d at %#x after %#x", i, bufs[i].Addr, bufs[i-1].Addr)
		}
	}
}

// Insertions below everything in falling address order (each buffer
// placed under all the others, as mmap's top-down placement gives) leave
// full chunks, pages and leaves, as insertions in address order do: they
// went to the head of the first chunk, which split in halves when full.
func TestFallingBelowFillsChunks(t *testing.T) {
	const n = 3 * ChunkSize * pageSize
	var l ChunkList
	s := new(Sorted[int])
	for i := range n {
		addr := uint64(n-i) * 16
		if err := l.Insert(BufferDesc{Addr: addr, Length: 16}); err != nil {
			t.Fatal(err)
		}
		s.Insert(addr, i)
	}
	cs := l.Chunks()
	if cs.Len() != n || cs.Count() > n/ChunkSize+1 || len(cs.pages) > cs.Count()/pageSize+1 {
		t.Errorf("%d buffers in %d chunks and %d pages, want %d in at most %d and %d", cs.Len(), cs.Count(), len(cs.pages), n, n/ChunkSize+1, cs.Count()/pageSize+1)
	}
	if err := checkTree(s.tree()); err != nil {
		t.Fatal(err)
	}
	if counts := levelCounts(s.tree()); counts[0] > n/maxChunk+1 {
		t.Errorf("Sorted: %d leaves for %d keys, want at most %d", counts[0], n, n/maxChunk+1)
	}
	bufs := cs.Buffers()
	for i := 1; i < len(bufs); i++ {
		if bufs[i].Addr <= bufs[i-1].Addr {
			t.Fatalf("buffer %d at %#x after %#x", i, bufs[i].Addr, bufs[i-1].Addr)
		}
	}
}

// Printing a chunk list never shows a chunk's set element or the
// accumulated set hash.
func TestChunksPrintNoSecrets(t *testing.T) {
	var l ChunkList
	for i := range 3 {
		if err := l.Insert(BufferDesc{Addr: uint64(i) * 64, Length: 64}); err != nil {
			t.Fatal(err)
		}
	}
	cs := l.Chunks()
	cs.acc[0], cs.pages[0].chunks[0].elem[0] = 0xAB, 0xCD
	for _, got := range []string{fmt.Sprintf("%v", cs), fmt.Sprintf("%+v", &l), fmt.Sprint(*cs), fmt.Sprintf("%#v", cs)} {
		if strings.Contains(got, "171") || strings.Contains(got, "205") || strings.Contains(got, "elem") || strings.Contains(got, "acc") {
			t.Fatalf("printed %q", got)
		}
	}
}
