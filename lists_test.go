package moonring_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// listPair is an initiator with a local pool and a target's pool open as
// a segment, in this process (the local transport) or over TCP.
type listPair struct {
	ini          *moonring.Engine
	local, pool  []byte
	lid          moonring.BufferID
	seg          moonring.SegmentID
	remoteBase   uint64
	localBlocks  int
	remoteBlocks int
}

func newListPair(t *testing.T, transport string, size int) *listPair {
	t.Helper()
	p := &listPair{local: make([]byte, size), pool: make([]byte, size)}
	var tgt *moonring.Engine
	if transport == "tcp" {
		store, key := metadata.NewMemory(), []byte("list test key")
		tgt = keyedEngine(t, store, t.Name()+"-target", key)
		p.ini = keyedEngine(t, store, t.Name()+"-initiator", key)
	} else {
		tgt, p.ini = newEngine(t, t.Name()+"-target"), newEngine(t, t.Name()+"-initiator")
	}
	if _, err := tgt.RegisterLocalMemory(p.pool, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	var err error
	if p.lid, err = p.ini.RegisterLocalMemory(p.local, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if p.seg, err = p.ini.OpenSegment(ctx, tgt.Name()); err != nil {
		t.Fatal(err)
	}
	p.remoteBase = uint64(moonring.AddressOf(p.pool))
	if got, err := p.ini.SegmentTransport(p.seg); err != nil || got != transport {
		t.Fatalf("the segment is open through %q (%v); want %s", got, err, transport)
	}
	return p
}

// run submits es on r and returns their completions by UserData.
func runEntries(t *testing.T, r *moonring.Ring, es ...moonring.Entry) map[uint64]moonring.Completion {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if _, err := r.SubmitAndWait(ctx, es, len(es)); err != nil {
		t.Fatal(err)
	}
	got := map[uint64]moonring.Completion{}
	var buf [16]moonring.Completion
	for len(got) < len(es) {
		n := r.PeekBatch(buf[:])
		if n == 0 {
			if err := r.CQ().Wait(ctx, 1); err != nil {
				t.Fatalf("%d of %d completions: %v", len(got), len(es), err)
			}
			continue
		}
		for _, c := range buf[:n] {
			got[c.UserData] = c
		}
		r.Advance(n)
	}
	return got
}

// TestPreparedLists: a prepared list of 2,048 blocks of 4 KiB at random
// places of both pools moves with one entry each way, in process and over
// TCP: a WRITE puts every block where the list says and nowhere else, a
// READ of a run of the list brings exactly those blocks back; the
// completion counts the bytes; a list freed is refused (ErrInvalid), a
// block outside the buffer or the segment fails the request before a byte
// moves, and PrepareList checks its blocks.
func TestPreparedLists(t *testing.T) {
	const block, n, size = 4 << 10, 2048, 16 << 20
	for _, tr := range []string{"local", "tcp"} {
		t.Run(tr, func(t *testing.T) {
			p := newListPair(t, tr, size)
			r, err := p.ini.NewRing(moonring.RingConfig{Entries: 64})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			rng := rand.New(rand.NewPCG(7, 8))
			fill(p.local, 5)
			ls, rs := rng.Perm(size / block)[:n], rng.Perm(size / block)[:n]
			blocks := make([]moonring.Block, n)
			for i := range blocks {
				blocks[i] = moonring.Block{Local: uint64(ls[i] * block), Remote: p.remoteBase + uint64(rs[i]*block), Length: block}
			}
			id, err := p.ini.PrepareList(blocks)
			if err != nil {
				t.Fatal(err)
			}
			c := runEntries(t, r, moonring.ListEntry(moonring.Write, p.lid, p.seg, id, 0, n, 1))[1]
			if c.Err() != nil || c.Bytes != n*block {
				t.Fatalf("WRITE of the list: %+v (%v); want %d bytes", c, c.Err(), n*block)
			}
			want := make([]byte, size)
			for _, b := range blocks {
				copy(want[b.Remote-p.remoteBase:], p.local[b.Local:][:b.Length])
			}
			if !bytes.Equal(p.pool, want) {
				t.Fatal("the target's pool does not hold exactly the list's blocks")
			}

			// A run of the middle comes back into a cleared buffer.
			clear(p.local)
			c = runEntries(t, r, moonring.ListEntry(moonring.Read, p.lid, p.seg, id, 100, 1000, 2))[2]
			if c.Err() != nil || c.Bytes != 1000*block {
				t.Fatalf("READ of a run: %+v (%v)", c, c.Err())
			}
			wantLocal := make([]byte, size)
			for _, b := range blocks[100:1100] {
				copy(wantLocal[b.Local:], p.pool[b.Remote-p.remoteBase:][:b.Length])
			}
			if !bytes.Equal(p.local, wantLocal) {
				t.Fatal("the READ did not bring back exactly the run's blocks")
			}

			// Bad blocks: the good ones before them do not move.
			before := bytes.Clone(p.pool)
			fill(p.local, 9)
			badLocal, err := p.ini.PrepareList(append(blocks[:10:10], moonring.Block{Local: size - 1, Remote: p.remoteBase, Length: 2}))
			if err != nil {
				t.Fatal(err)
			}
			badRemote, err := p.ini.PrepareList(append(blocks[:10:10], moonring.Block{Local: 0, Remote: p.remoteBase + size - 1, Length: 2}))
			if err != nil {
				t.Fatal(err)
			}
			if err := p.ini.FreeList(id); err != nil {
				t.Fatal(err)
			}
			if err := p.ini.FreeList(id); !errors.Is(err, segtable.ErrNotFound) {
				t.Fatalf("FreeList twice: %v; want ErrNotFound", err)
			}
			got := runEntries(t, r,
				moonring.ListEntry(moonring.Write, p.lid, p.seg, badLocal, 0, 11, 3),
				moonring.ListEntry(moonring.Write, p.lid, p.seg, badRemote, 0, 11, 4),
				moonring.ListEntry(moonring.Write, p.lid, p.seg, id, 0, 1, 5),
				moonring.ListEntry(moonring.Write, p.lid, p.seg, badLocal, 5, 7, 6))
			for ud, want := range map[uint64]error{3: moonring.ErrLocalRange, 4: moonring.ErrRemoteRange, 5: moonring.ErrInvalid, 6: moonring.ErrInvalid} {
				if c := got[ud]; !errors.Is(c.Err(), want) || c.Bytes != 0 {
					t.Errorf("entry %d: %v, %d bytes; want %v", ud, c.Err(), c.Bytes, want)
				}
			}
			if !bytes.Equal(p.pool, before) {
				t.Fatal("a refused list moved bytes")
			}
			for _, bad := range [][]moonring.Block{nil, {{Length: 0}}, {{Length: moonring.MaxBlock + 1}}, make([]moonring.Block, moonring.MaxListBlocks+1)} {
				if _, err := p.ini.PrepareList(bad); !errors.Is(err, moonring.ErrList) {
					t.Errorf("PrepareList of %d blocks: %v; want ErrList", len(bad), err)
				}
			}
		})
	}
}

// A list entry moved and reaped through a ring costs no allocation once
// the ring is warm, however many blocks it has; nor does a list
// prepared and freed per request.
func TestPreparedListAllocs(t *testing.T) {
	p := newListPair(t, "local", 4<<20)
	r, err := p.ini.NewRing(moonring.RingConfig{Entries: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	blocks := make([]moonring.Block, 256)
	for i := range blocks {
		blocks[i] = moonring.Block{Local: uint64(i) * 8192, Remote: p.remoteBase + uint64(255-i)*8192, Length: 4096}
	}
	id, err := p.ini.PrepareList(blocks)
	if err != nil {
		t.Fatal(err)
	}
	es := []moonring.Entry{moonring.ListEntry(moonring.Write, p.lid, p.seg, id, 0, len(blocks), 1)}
	var cs [4]moonring.Completion
	ctx := context.Background()
	move := func() {
		if _, err := r.SubmitAndWait(ctx, es, 1); err != nil {
			t.Fatal(err)
		}
		for n := 0; n < 1; {
			k := r.PeekBatch(cs[:])
			for _, c := range cs[:k] {
				if c.Err() != nil {
					t.Fatal(c.Err())
				}
			}
			r.Advance(k)
			n += k
		}
	}
	move()
	if a := testing.AllocsPerRun(50, move); a != 0 {
		t.Fatalf("%.1f allocations a list entry of 256 blocks; want 0", a)
	}
	// A list made and freed per request, as a KV request's scattered
	// blocks are: the engine reuses the freed list's storage.
	if err := p.ini.FreeList(id); err != nil {
		t.Fatal(err)
	}
	perRequest := func() {
		l, err := p.ini.PrepareList(blocks)
		if err != nil {
			t.Fatal(err)
		}
		es[0].Local = uint64(l)
		move()
		if err := p.ini.FreeList(l); err != nil {
			t.Fatal(err)
		}
	}
	perRequest()
	if a := testing.AllocsPerRun(50, perRequest); a != 0 {
		t.Fatalf("%.1f allocations a list of 256 blocks prepared, moved and freed; want 0", a)
	}
}

// Through the batch API a task may be a run of a prepared list: its
// status and bytes are the run's, its blocks land where the list says,
// and SubmitTransfer refuses a list task with a range or length of its
// own, an unknown list or a run outside it.
func TestPreparedListsBatch(t *testing.T) {
	const block, n, size = 8 << 10, 64, 4 << 20
	p := newListPair(t, "local", size)
	fill(p.local, 21)
	blocks := make([]moonring.Block, n)
	for i := range blocks {
		blocks[i] = moonring.Block{Local: uint64(i * 3 * block), Remote: p.remoteBase + uint64((n-i)*2*block), Length: block}
	}
	id, err := p.ini.PrepareList(blocks)
	if err != nil {
		t.Fatal(err)
	}
	defer p.ini.FreeList(id)
	task := func(first, count int) moonring.TransferRequest {
		return moonring.TransferRequest{Opcode: moonring.Write, Buffer: p.lid, TargetID: p.seg, List: id, First: first, Count: count}
	}
	bid, err := p.ini.AllocateBatchID(2)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.ini.SubmitTransfer(bid, []moonring.TransferRequest{task(0, 40), task(40, 24)}); err != nil {
		t.Fatal(err)
	}
	if err := p.ini.WaitBatch(t.Context(), bid); err != nil {
		t.Fatal(err)
	}
	for i, want := range []uint64{40 * block, 24 * block} {
		if st, err := p.ini.GetTransferStatus(bid, i); err != nil || st.Status != moonring.COMPLETED || st.Bytes != want {
			t.Fatalf("task %d: %+v, %v; want COMPLETED with %d bytes", i, st, err, want)
		}
	}
	if err := p.ini.FreeBatchID(bid); err != nil {
		t.Fatal(err)
	}
	for i, b := range blocks {
		if !bytes.Equal(p.pool[b.Remote-p.remoteBase:][:block], p.local[b.Local:][:block]) {
			t.Fatalf("block %d not in its place", i)
		}
	}
	bad := []moonring.TransferRequest{task(0, 0), task(60, 5), task(-1, 2), task(0, 1), task(0, 1), task(0, 1), task(0, 1), task(0, 1)}
	bad[3].Length = block
	bad[4].Local = 8
	bad[5].Buffer, bad[5].Source = 0, moonring.AddressOf(p.local)
	bad[6].List = id + 1
	bad[7].List, bad[7].Source, bad[7].Buffer, bad[7].Length = 0, moonring.AddressOf(p.local), 0, block // First and Count, no List
	for i, req := range bad {
		bid, err := p.ini.AllocateBatchID(1)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.ini.SubmitTransfer(bid, []moonring.TransferRequest{req}); !errors.Is(err, moonring.ErrInvalid) {
			t.Errorf("bad list task %d: %v; want ErrInvalid", i, err)
		}
		p.ini.FreeBatchID(bid)
	}
}

// TestListOwnSegment: a list's blocks to the engine's own segment take
// the local transport's slices, as to another engine (up to MaxSlice of 1
// MiB); a longer block fails the run with ErrLength, moving nothing.
func TestListOwnSegment(t *testing.T) {
	e := newEngine(t, t.Name())
	const mib = 1 << 20
	src, dst := make([]byte, 4*mib), make([]byte, 4*mib)
	fill(src, 3)
	sid, err := e.RegisterLocalMemory(src, "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	base := uint64(moonring.AddressOf(dst))
	longest := uint64(mib + mib/4 - 1)
	ok, err := e.PrepareList([]moonring.Block{{Local: 0, Remote: base + 2*mib, Length: longest}, {Local: 2 * mib, Remote: base, Length: mib}})
	if err != nil {
		t.Fatal(err)
	}
	tooLong, err := e.PrepareList([]moonring.Block{{Local: 0, Remote: base, Length: longest + 1}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := e.NewRing(moonring.RingConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	got := runEntries(t, r,
		moonring.ListEntry(moonring.Write, sid, moonring.LocalSegmentID, ok, 0, 2, 1),
		moonring.ListEntry(moonring.Write, sid, moonring.LocalSegmentID, tooLong, 0, 1, 2))
	if c := got[1]; c.Err() != nil || c.Bytes != longest+mib {
		t.Fatalf("1.25 MiB and 1 MiB blocks to the own segment: %v, %d bytes; want %d", c.Err(), c.Bytes, longest+mib)
	}
	if c := got[2]; !errors.Is(c.Err(), moonring.ErrLength) || c.Bytes != 0 {
		t.Fatalf("a block past MaxSlice: %v, %d bytes; want ErrLength", c.Err(), c.Bytes)
	}
	want := make([]byte, 4*mib)
	copy(want[2*mib:], src[:longest])
	copy(want, src[2*mib:3*mib])
	if !bytes.Equal(dst, want) {
		t.Fatal("the own segment's pool differs from its blocks")
	}
}
