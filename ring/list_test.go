package ring

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/sq"
)

// listHarness is a harness whose tables hold lists.
func listHarness(t *testing.T, cfg Config, ep *fakeEP, manual bool) (*harness, *Lists) {
	h := newHarness(t, cfg, ep, manual)
	lists := new(Lists)
	h.tables.Lists = lists
	return h, lists
}

func addList(t testing.TB, lists *Lists, blocks []Block) ListID {
	t.Helper()
	id, err := lists.Prepare(blocks)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// storage returns the address of the blocks of the list id names.
func storage(lists *Lists, id ListID) *Block { return &lists.get(id).blocks[0] }

func listEntry(h *harness, op sq.Op, id ListID, first, count, ud uint64) sq.Entry {
	return sq.Entry{Op: op, Flags: sq.FlagList, Segment: h.seg.ID, Buffer: h.lbuf.ID, Local: uint64(id), Remote: first, Length: count, UserData: ud}
}

// A list's blocks, scattered over both of the segment's buffers and
// given in no order, each move as one slice with its own offsets and the
// position of its own remote buffer; the request completes once, with the
// run's bytes; a run in the middle of the list moves only its blocks; a
// READ brings them back.
func TestListMoves(t *testing.T) {
	ep := &fakeEP{async: true}
	h, lists := listHarness(t, Config{SliceSize: 4096}, ep, false)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range h.local {
		h.local[i] = byte(rng.Uint32())
	}
	// 48 blocks of 1 to 3,000 bytes: the first 32 in R1, the rest in R2,
	// at disjoint places, shuffled.
	var blocks []Block
	for i := range 48 {
		n := uint64(1 + rng.IntN(3000))
		loc := uint64(i) * 8192
		rem := h.r1 + uint64(i)*8192 + uint64(rng.IntN(100))
		if i >= 32 {
			rem = h.r2 + uint64(i-32)*4096
			n = min(n, 4096)
		}
		blocks = append(blocks, Block{Local: loc + uint64(rng.IntN(100)), Remote: rem, Length: n})
	}
	rng.Shuffle(len(blocks), func(i, j int) { blocks[i], blocks[j] = blocks[j], blocks[i] })
	id := addList(t, lists, blocks)
	h.submit(listEntry(h, sq.Write, id, 0, 48, 1))
	c := h.one(1)
	var sum uint64
	for _, b := range blocks {
		sum += b.Length
	}
	if c.Code != cq.CodeOK || c.Bytes != sum {
		t.Fatalf("completion %+v; want OK with %d bytes", c, sum)
	}
	want := bytes.Repeat([]byte{0xEE}, len(h.remote))
	for _, b := range blocks {
		copy(want[b.Remote-h.r1:], h.local[b.Local:b.Local+b.Length])
	}
	if !bytes.Equal(h.remote, want) {
		t.Fatal("the segment does not hold exactly the blocks written")
	}
	posts := ep.postsCopy()
	if len(posts) != 48 {
		t.Fatalf("%d slices posted for 48 blocks", len(posts))
	}
	for _, s := range posts {
		_, _, i := splitToken(s.Token)
		b := blocks[i]
		if s.Remote != b.Remote || s.Length != b.Length || s.LocalHandle != handle {
			t.Fatalf("slice %d: remote %#x length %d; want block %+v", i, s.Remote, s.Length, b)
		}
		if ri := h.seg.Resolve(b.Remote, b.Length); s.RemoteIndex != uint32(ri) {
			t.Fatalf("slice %d: remote index %d; the block's buffer is at %d", i, s.RemoteIndex, ri)
		}
	}

	// A run of the middle: blocks 10 to 19, READ into a cleared buffer.
	clear(h.local)
	h.submit(listEntry(h, sq.Read, id, 10, 10, 2))
	c = h.one(2)
	sum = 0
	wantLocal := make([]byte, len(h.local))
	for _, b := range blocks[10:20] {
		sum += b.Length
		copy(wantLocal[b.Local:], h.remote[b.Remote-h.r1:][:b.Length])
	}
	if c.Code != cq.CodeOK || c.Bytes != sum {
		t.Fatalf("run's completion %+v; want OK with %d bytes", c, sum)
	}
	if !bytes.Equal(h.local, wantLocal) {
		t.Fatal("the READ of blocks 10-19 did not bring back exactly them")
	}
}

// An entry with FlagList that names no list, a run outside its list, or a
// block outside its buffer or the segment completes with its code, and
// nothing of it moves: not even the blocks before the bad one.
func TestListRefused(t *testing.T) {
	ep := &fakeEP{}
	h, lists := listHarness(t, Config{SliceSize: 4096, MaxLength: 1 << 20}, ep, false)
	good := []Block{{0, h.r1, 100}, {100, h.r2, 100}}
	id := addList(t, lists, good)
	badLocal := addList(t, lists, append(slices.Clone(good), Block{hLocal - 10, h.r1, 11}))
	badRemote := addList(t, lists, append(slices.Clone(good), Block{0, h.r1 + hR1, 1})) // in the gap
	straddle := addList(t, lists, append(slices.Clone(good), Block{0, h.r2 - hGap - 4, 8}))
	freed := addList(t, lists, good)
	lists.Remove(freed)
	big := make([]Block, 5)
	for i := range big {
		big[i] = Block{0, h.r1, 256 << 10}
	}
	tooLong := addList(t, lists, big) // 1.25 MiB, above MaxLength
	// A block longer than the path's slices may be (MaxSlice(4096)).
	wide := addList(t, lists, []Block{{0, h.r1, 100}, {0, h.r1, MaxSlice(4096) + 1}})
	cases := []struct {
		name string
		code cq.Code
		e    sq.Entry
	}{
		{"list 0", cq.CodeInvalid, listEntry(h, sq.Write, 0, 0, 1, 0)},
		{"freed list", cq.CodeInvalid, listEntry(h, sq.Write, freed, 0, 1, 0)},
		{"ID of another generation", cq.CodeInvalid, listEntry(h, sq.Write, id, 0, 1, 0)},
		{"no blocks", cq.CodeInvalid, listEntry(h, sq.Write, id, 0, 0, 0)},
		{"run past the end", cq.CodeInvalid, listEntry(h, sq.Write, id, 1, 2, 0)},
		{"first past the end", cq.CodeInvalid, listEntry(h, sq.Write, id, 2, 1, 0)},
		{"count wrapping", cq.CodeInvalid, listEntry(h, sq.Write, id, 1, math.MaxUint64, 0)},
		{"block past the buffer", cq.CodeLocalRange, listEntry(h, sq.Write, badLocal, 0, 3, 0)},
		{"block in the gap", cq.CodeRemoteRange, listEntry(h, sq.Read, badRemote, 0, 3, 0)},
		{"block straddling R1's end", cq.CodeRemoteRange, listEntry(h, sq.Write, straddle, 0, 3, 0)},
		{"run above MaxLength", cq.CodeLength, listEntry(h, sq.Write, tooLong, 0, 5, 0)},
		{"block above the path's slices", cq.CodeLength, listEntry(h, sq.Write, wide, 0, 2, 0)},
		{"notify on a read", cq.CodeInvalid, func() sq.Entry {
			e := listEntry(h, sq.Read, id, 0, 1, 0)
			e.Flags |= sq.FlagNotify
			return e
		}()},
	}
	cases[2].e.Local += 1 << listIndexBits
	var es []sq.Entry
	for i, c := range cases {
		c.e.UserData = uint64(i)
		es = append(es, c.e)
	}
	h.submit(es...)
	for _, c := range h.collect(len(es)) {
		tc := cases[c.UserData]
		if c.Code != tc.code || c.Bytes != 0 {
			t.Errorf("%s: code %d (%v), %d bytes; want code %d (%v)", tc.name, c.Code, c.Err(), c.Bytes, tc.code, tc.code.Err())
		}
	}
	if n := len(ep.postsCopy()); n != 0 {
		t.Fatalf("%d slices posted by refused entries", n)
	}
	for i, b := range h.remote {
		if b != 0xEE {
			t.Fatalf("remote byte %d changed by a refused entry", i)
		}
	}
	// A ring whose tables hold no lists refuses every such entry.
	h.tables.Lists = nil
	h.submit(listEntry(h, sq.Write, id, 0, 2, 9))
	if c := h.one(9); c.Code != cq.CodeInvalid {
		t.Fatalf("with no lists: code %d; want CodeInvalid", c.Code)
	}
}

// A list freed while a request of it is in flight: the request finishes
// with the blocks it took; an entry naming it afterwards is refused.
func TestListFreedInFlight(t *testing.T) {
	ep := &fakeEP{}
	ep.setHold(true)
	h, lists := listHarness(t, Config{SliceSize: 4096}, ep, false)
	for i := range 4096 {
		h.local[i] = byte(i*5 + 3)
	}
	id := addList(t, lists, []Block{{0, h.r1 + 4096, 2048}, {2048, h.r2, 2048}})
	h.submit(listEntry(h, sq.Write, id, 0, 2, 1))
	for ep.heldCount() < 2 {
		h.poll()
	}
	held := storage(lists, id)
	if !lists.Remove(id) {
		t.Fatal("the list was not in the table")
	}
	// A list prepared while the request holds the freed one's blocks
	// gets storage of its own, and a run of it reads its own blocks.
	other := addList(t, lists, []Block{{0, h.r1, 1}, {1, h.r1 + 1, 1}})
	if storage(lists, other) == held {
		t.Fatal("a list made while a request held a freed list's blocks reused them")
	}
	ep.release(-1, nil)
	if c := h.one(1); c.Code != cq.CodeOK || c.Bytes != 4096 {
		t.Fatalf("request in flight across the free: %+v", c)
	}
	if !bytes.Equal(h.remote[4096:6144], h.local[:2048]) || !bytes.Equal(h.remote[h.r2-h.r1:][:2048], h.local[2048:4096]) {
		t.Fatal("blocks of the freed list not in place")
	}
	h.submit(listEntry(h, sq.Write, id, 0, 2, 2))
	if c := h.one(2); c.Code != cq.CodeInvalid {
		t.Fatalf("entry naming a freed list: code %d; want CodeInvalid", c.Code)
	}
	// Once the request ended, the next list of its size reuses them.
	if again := addList(t, lists, []Block{{0, h.r1, 7}, {7, h.r1 + 7, 1}}); storage(lists, again) != held {
		t.Fatal("the freed list's storage was not reused once no request held it")
	}
}

// Prepare reuses the storage of freed lists by class of size, keeps at
// most listCacheBytes of it, and an ID kept past its list's free never
// names the list that reused its storage.
func TestListsReuse(t *testing.T) {
	lists := new(Lists)
	a := addList(t, lists, make3(3))
	sa := storage(lists, a)
	lists.Remove(a)
	b := addList(t, lists, make3(4)) // class 4: a's storage (capacity 4)
	if storage(lists, b) != sa || lists.acquire(a) != nil || lists.Blocks(a) != 0 {
		t.Fatal("storage of a freed list of the class not reused, or its old ID still names it")
	}
	c := addList(t, lists, make3(5)) // class 8: new storage
	if storage(lists, c) == sa || lists.Blocks(b) != 4 || lists.Blocks(c) != 5 {
		t.Fatal("a list of another class took the storage of one live")
	}
	l := lists.acquire(b)
	if l == nil || l.blocks[3] != (Block{3, 3, 4}) {
		t.Fatalf("acquire(%d): %v", b, l)
	}
	lists.Remove(b)
	d := addList(t, lists, make3(4))
	if storage(lists, d) == sa {
		t.Fatal("storage reused while a reference held it")
	}
	l.release()
	lists.Remove(d)
	if n := len(lists.cache[2]); n != 2 {
		t.Fatalf("%d lists of 4 blocks cached; want b's, once released, and d's", n)
	}
	// The cache's bound: lists of MaxListBlocks (1.5 MiB each) freed
	// at once keep no more than listCacheBytes.
	var big []ListID
	for range 2 * listCacheBytes / (MaxListBlocks * int(blockBytes)) {
		big = append(big, addList(t, lists, make3(MaxListBlocks)))
	}
	for _, id := range big {
		lists.Remove(id)
	}
	if lists.cached > listCacheBytes || lists.cached < listCacheBytes/2 {
		t.Fatalf("%d bytes cached; want at most %d, and most of it", lists.cached, listCacheBytes)
	}
}

// An ID looked up just before its list was freed and its storage reused
// for another: the reference acquire takes then is to the other list,
// and it lets go of it.
func TestListsAcquireRace(t *testing.T) {
	lists := new(Lists)
	a := addList(t, lists, make3(2))
	stale := lists.get(a)
	lists.Remove(a)
	b := addList(t, lists, make3(2))
	if lists.get(b) != stale {
		t.Fatal("the freed list's storage was not reused")
	}
	if lists.hold(a, stale) != nil {
		t.Fatal("a freed ID held the list that reused its storage")
	}
	if n := stale.refs.Load(); n != 1 {
		t.Fatalf("%d references to the new list; want the table's one", n)
	}
	lists.Remove(b)
	if n := stale.refs.Load(); n != 0 || lists.hold(b, stale) != nil {
		t.Fatalf("a freed list: %d references, or held again", n)
	}
}

// make3 returns n blocks, block i {i, i, i+1}.
func make3(n int) []Block {
	bs := make([]Block, n)
	for i := range bs {
		bs[i] = Block{uint64(i), uint64(i), uint64(i + 1)}
	}
	return bs
}

// Lists prepared and freed on some goroutines while others acquire them
// by ID: an acquire gets the list the ID named, with its blocks as they
// were prepared, or nil (run with -race).
func TestListsConcurrentReuse(t *testing.T) {
	lists := new(Lists)
	type named struct {
		id    ListID
		stamp uint64
	}
	ids := make(chan named, 64)
	done := make(chan struct{})
	errs := make(chan string, 4)
	for w := range 2 {
		go func() {
			defer func() { errs <- "" }()
			for {
				select {
				case <-done:
					return
				case n := <-ids:
					l := lists.acquire(n.id)
					if l == nil {
						continue
					}
					for _, b := range l.blocks {
						if b.Remote != n.stamp {
							errs <- fmt.Sprintf("reader %d: list %d holds a block of stamp %d; want %d", w, n.id, b.Remote, n.stamp)
							l.release()
							return
						}
					}
					l.release()
				}
			}
		}()
	}
	var live []ListID
	blocks := make([]Block, 8)
	for stamp := range uint64(20000) {
		for i := range blocks {
			blocks[i] = Block{uint64(i), stamp, 1}
		}
		id, err := lists.Prepare(blocks[:1+stamp%8])
		if err != nil {
			t.Fatal(err)
		}
		live = append(live, id)
		select {
		case ids <- named{id, stamp}:
		default:
		}
		if len(live) > 4 {
			lists.Remove(live[0])
			live = live[1:]
		}
	}
	close(done)
	for range 2 {
		if e := <-errs; e != "" {
			t.Fatal(e)
		}
	}
}

// A failed block fails its request, once, with no bytes reported moved.
func TestListBlockFails(t *testing.T) {
	ep := &fakeEP{}
	h, lists := listHarness(t, Config{SliceSize: 4096, RetryLimit: -1}, ep, false)
	// The fake endpoint refuses a slice past its memory: a block whose
	// check passes (R2 is in the descriptor) but whose move fails.
	ep.mem = ep.mem[:hR1]
	id := addList(t, lists, []Block{{0, h.r1, 64}, {64, h.r2, 64}, {128, h.r1 + 64, 64}})
	h.submit(listEntry(h, sq.Write, id, 0, 3, 1))
	c := h.one(1)
	if c.Code != cq.CodeRemoteRange || c.Status != c.Code.Status() || c.Bytes != 0 {
		t.Fatalf("a request with a failed block: %+v; want it failed (remote range) with no bytes", c)
	}
	if n := len(ep.postsCopy()); n != 3 {
		t.Fatalf("%d slices posted; want the 3 blocks once each (no retries)", n)
	}
	if got := h.fence(); len(got) != 0 {
		t.Fatalf("more completions: %+v", got)
	}
}

func TestPrepareChecks(t *testing.T) {
	lists := new(Lists)
	for _, c := range []struct {
		name   string
		blocks []Block
	}{
		{"none", nil},
		{"too many", make([]Block, MaxListBlocks+1)},
		{"zero length", []Block{{0, 0, 1}, {0, 0, 0}}},
		{"above MaxBlock", []Block{{0, 0, MaxBlock + 1}}},
		{"local wraps", []Block{{math.MaxUint64 - 1, 0, 4}}},
		{"remote wraps", []Block{{0, math.MaxUint64 - 1, 4}}},
	} {
		if _, err := lists.Prepare(c.blocks); !errors.Is(err, ErrList) {
			t.Errorf("%s: %v; want ErrList", c.name, err)
		}
	}
	in := []Block{{1, 2, 3}, {4, 5, MaxBlock}}
	id, err := lists.Prepare(in)
	if err != nil || lists.Blocks(id) != 2 {
		t.Fatalf("Prepare: %d blocks, %v", lists.Blocks(id), err)
	}
	in[0].Length = 0 // the list holds a copy
	if lists.get(id).blocks[0].Length != 3 {
		t.Fatal("the list shares the caller's slice")
	}
}

// BenchmarkCheckList is the poller's check of a run of a list when it
// takes the entry, per block (ns/op is a block's): its local range and
// its remote buffer (Segment.Resolve), blocks at random in both of the
// segment's buffers.
func BenchmarkCheckList(b *testing.B) {
	h := newHarness(b, Config{SliceSize: 4096}, &fakeEP{}, true)
	rng := rand.New(rand.NewPCG(3, 4))
	blocks := make([]Block, MaxListBlocks)
	for i := range blocks {
		rem := h.r1 + uint64(rng.IntN(hR1/64))*64
		if i%2 == 1 {
			rem = h.r2 + uint64(rng.IntN(hR2/64))*64
		}
		blocks[i] = Block{Local: uint64(rng.IntN(hLocal/64)) * 64, Remote: rem, Length: 64}
	}
	lists := new(Lists)
	h.tables.Lists = lists
	id := addList(b, lists, blocks)
	e := listEntry(h, sq.Write, id, 0, uint64(len(blocks)), 0)
	b.ResetTimer()
	for i := 0; i < b.N; i += len(blocks) {
		if _, code := h.r.checkList(&e, h.lbuf, h.seg); code != cq.CodeOK {
			b.Fatal(code)
		}
	}
}

// Lists hands out IDs that name one list each: a freed slot's next ID has
// the next generation, so an old ID names nothing, however often the slot
// is reused; IDs are never 0; Remove of an unknown ID reports false.
func TestListsTable(t *testing.T) {
	var lists Lists
	l := &List{blocks: []Block{{0, 0, 1}}} // added under many IDs
	first, err := lists.add(l)
	if err != nil || first == 0 || lists.get(first) != l {
		t.Fatalf("Add: %d, %v", first, err)
	}
	old := first
	for range 10000 { // one slot, reused: far past a 12-bit generation
		if !lists.Remove(old) || lists.get(old) != nil || lists.Remove(old) {
			t.Fatalf("Remove of %#x", old)
		}
		id, err := lists.add(l)
		if err != nil || id == old || id&(1<<listIndexBits-1) != first&(1<<listIndexBits-1) {
			t.Fatalf("Add after Remove: %#x (%v); want the same slot, a new ID", id, err)
		}
		if lists.get(first) != nil && id != first {
			t.Fatal("the first ID names a later list")
		}
		old = id
	}
	for _, id := range []ListID{0, 1 << 19, 5 << listIndexBits} {
		if lists.get(id) != nil || lists.Remove(id) {
			t.Errorf("ID %#x names a list", id)
		}
	}
	second, _ := lists.add(l)
	if second == old || lists.get(second) != l || lists.get(old) != l {
		t.Fatal("a second list took the first's ID")
	}
}

// A property over random lists: a run moves exactly its blocks when every
// block lies inside the local buffer and one of the segment's buffers,
// and nothing at all (with the code of the first bad block's kind) when
// one does not; READs and WRITEs alike, runs anywhere in the list.
func TestListProperty(t *testing.T) {
	ep := &fakeEP{async: true}
	h, lists := listHarness(t, Config{SliceSize: 4096}, ep, false)
	rng := rand.New(rand.NewPCG(11, 12))
	const slot = 4096
	patL, patR := make([]byte, hLocal+256), make([]byte, hR1+hGap+hR2+256)
	for i := range patL {
		patL[i] = byte(i * 13)
	}
	for i := range patR {
		patR[i] = byte(i * 7)
	}
	for round := range 80 {
		// Distinct 4 KiB slots on both sides, so no two blocks overlap
		// where they land.
		n := 1 + rng.IntN(24)
		lslots, rslots := rng.Perm(hLocal / slot)[:n], rng.Perm((hR1 + hR2) / slot)[:n]
		blocks := make([]Block, n)
		for i := range blocks {
			rem := h.r1 + uint64(rslots[i]*slot)
			if rslots[i] >= hR1/slot {
				rem = h.r2 + uint64(rslots[i]-hR1/slot)*slot
			}
			ln := uint64(1 + rng.IntN(slot))
			blocks[i] = Block{Local: uint64(lslots[i] * slot), Remote: rem, Length: ln}
			switch rng.IntN(40) {
			case 0:
				blocks[i].Local = hLocal - ln/2 // past the local buffer's end
			case 1:
				blocks[i].Remote = h.r1 + hR1 + uint64(rng.IntN(hGap)) // in the gap
			case 2:
				blocks[i].Remote = h.r2 + hR2 - ln/2 // past the segment's end
			}
		}
		id := addList(t, lists, blocks)
		first := rng.IntN(n)
		count := 1 + rng.IntN(n-first)
		run := blocks[first : first+count]
		op := sq.Write
		if rng.IntN(2) == 0 {
			op = sq.Read
		}
		copy(h.local, patL[round:])
		copy(h.remote, patR[round:])
		wantL, wantR := bytes.Clone(h.local), bytes.Clone(h.remote)
		code, sum := cq.CodeOK, uint64(0)
		for _, b := range run {
			inR1 := b.Remote >= h.r1 && b.Remote+b.Length <= h.r1+hR1
			inR2 := b.Remote >= h.r2 && b.Remote+b.Length <= h.r2+hR2
			switch {
			case b.Local+b.Length > hLocal:
				code = cq.CodeLocalRange
			case !inR1 && !inR2:
				code = cq.CodeRemoteRange
			}
			if code != cq.CodeOK {
				break
			}
			sum += b.Length
			l, r := wantL[b.Local:][:b.Length], wantR[b.Remote-h.r1:][:b.Length]
			if op == sq.Write {
				copy(r, l)
			} else {
				copy(l, r)
			}
		}
		if code != cq.CodeOK {
			wantL, wantR, sum = h.local, h.remote, 0 // nothing moves
		}
		wantL, wantR = bytes.Clone(wantL), bytes.Clone(wantR)
		h.submit(listEntry(h, op, id, uint64(first), uint64(count), uint64(round)))
		c := h.one(uint64(round))
		if c.Code != code || c.Bytes != sum {
			t.Fatalf("round %d (%d of %d blocks from %d, %v): code %d, %d bytes; want code %d, %d bytes", round, count, n, first, op, c.Code, c.Bytes, code, sum)
		}
		if !bytes.Equal(h.local, wantL) || !bytes.Equal(h.remote, wantR) {
			t.Fatalf("round %d: memory is not what the run's blocks make it", round)
		}
		lists.Remove(id)
	}
}

// A table holds MaxLists lists at once, and one more after a Remove.
func TestListsFull(t *testing.T) {
	if testing.Short() {
		t.Skip("SKIP: fills a table of 2^20 lists (-short)")
	}
	var lists Lists
	l := &List{blocks: []Block{{0, 0, 1}}} // added under many IDs
	var last ListID
	for i := range MaxLists {
		id, err := lists.add(l)
		if err != nil || id == 0 {
			t.Fatalf("Add %d: %#x, %v", i, id, err)
		}
		last = id
	}
	if _, err := lists.add(l); !errors.Is(err, ErrListsFull) {
		t.Fatalf("Add past MaxLists: %v; want ErrListsFull", err)
	}
	if !lists.Remove(last) {
		t.Fatal("Remove")
	}
	if id, err := lists.add(l); err != nil || id == last || lists.get(id) != l {
		t.Fatalf("Add after a Remove: %#x, %v", id, err)
	}
}
