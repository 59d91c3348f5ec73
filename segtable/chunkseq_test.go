package segtable

import "testing"

// EachChunk visits the chunks in order with their numbers and buffers, a
// signed list's with their MACs, stops when told, and hands out slices an
// append cannot write through.
func TestEachChunk(t *testing.T) {
	var l ChunkList
	for i := range 200 {
		if err := l.Insert(BufferDesc{Addr: uint64(i+1) * 0x1000, Length: 0x800}); err != nil {
			t.Fatal(err)
		}
	}
	cs := l.Chunks()
	want := cs.infos()
	var got []ChunkInfo
	var all []BufferDesc
	cs.EachChunk(func(info ChunkInfo, bufs []BufferDesc) bool {
		if cap(bufs) != len(bufs) || len(bufs) != info.N {
			t.Fatalf("chunk %d: %d buffers, cap %d, N %d", info.Seq, len(bufs), cap(bufs), info.N)
		}
		got = append(got, info)
		all = append(all, bufs...)
		return true
	})
	if len(got) != len(want) || len(all) != cs.Len() {
		t.Fatalf("%d chunks, %d buffers; want %d, %d", len(got), len(all), len(want), cs.Len())
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("chunk %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	for i, b := range cs.Buffers() {
		if all[i].Addr != b.Addr {
			t.Fatalf("buffer %d at %#x, want %#x", i, all[i].Addr, b.Addr)
		}
	}
	calls := 0
	cs.EachChunk(func(ChunkInfo, []BufferDesc) bool { calls++; return false })
	if calls != 1 {
		t.Fatalf("%d calls after fn returned false", calls)
	}
	(*BufferChunks)(nil).EachChunk(func(ChunkInfo, []BufferDesc) bool { t.Fatal("a chunk of nil"); return true })

	s, err := NewSigner([]byte("k"))
	if err != nil {
		t.Fatal(err)
	}
	signed := s.SignChunks("n", 1, cs, nil, nil)
	signed.EachChunk(func(info ChunkInfo, bufs []BufferDesc) bool {
		if info.MAC == "" || bufs[0].MAC == "" {
			t.Fatalf("signed chunk %d without MACs", info.Seq)
		}
		return true
	})
}
