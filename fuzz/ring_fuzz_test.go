package fuzz_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/ring"
	"github.com/moonring/moonring/sq"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

// gbuf is a registered buffer in guarded memory: a byte past either end is
// a PROT_NONE page (past the start, once the rounding slack is used up), so
// an access outside the buffer faults and fails the run.
type gbuf struct {
	name   string
	b      []byte
	id     moonring.BufferID
	remote bool
	owner  *moonring.Engine
	model  []byte // what the buffer must hold
}

func (g *gbuf) addr() uint64 { return uint64(moonring.AddressOf(g.b)) }

// world is two engines, A (the ring's) and B, with guarded buffers. Sizes
// are odd so that no buffer starts page aligned and every end touches its
// guard page.
type world struct {
	a, b     *moonring.Engine
	r        *moonring.Ring
	segB     moonring.SegmentID
	la1, la2 *gbuf // A's: local-only and remote-accessible
	rb1, rb2 *gbuf // B's, remote-accessible
	hb       *gbuf // B's, local-only
	all      []*gbuf
	stale    moonring.BufferID // an ID A no longer has
}

const sliceSize = 1024

func newWorld(tb testing.TB) *world {
	tb.Helper()
	w := &world{}
	var err error
	start := func(name string, cfg moonring.Config) *moonring.Engine {
		cfg.Name = fmt.Sprintf("%s-%s-%d", tb.Name(), name, time.Now().UnixNano())
		e, err := moonring.New(cfg)
		if err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { e.Close() })
		return e
	}
	alloc := func(name string, size int, remote bool) *gbuf {
		b, free, err := mem.AllocGuarded(size)
		if err != nil {
			tb.Skipf("guarded memory: %v", err)
		}
		tb.Cleanup(func() {
			if err := free(); err != nil {
				tb.Error(err)
			}
		})
		g := &gbuf{name: name, b: b, remote: remote, model: make([]byte, size)}
		w.all = append(w.all, g)
		return g
	}
	// The memory comes first, so that it is unmapped after the engines
	// close: cleanups run last in, first out.
	w.la1 = alloc("LA1", 3*4096+123, false)
	w.la2 = alloc("LA2", 5000, true)
	w.rb1 = alloc("RB1", 6001, true)
	w.rb2 = alloc("RB2", 4096, true)
	w.hb = alloc("HB", 700, false)
	w.a = start("a", moonring.Config{SliceSize: sliceSize})
	w.b = start("b", moonring.Config{})
	for _, g := range w.all {
		g.owner = w.a
		if g == w.rb1 || g == w.rb2 || g == w.hb {
			g.owner = w.b
		}
		if g.id, err = g.owner.RegisterLocalMemory(g.b, "cpu:0", g.remote); err != nil {
			tb.Fatal(err)
		}
	}
	tmp := make([]byte, 64)
	if w.stale, err = w.a.RegisterLocalMemory(tmp, "cpu:0", false); err != nil {
		tb.Fatal(err)
	}
	if err := w.a.UnregisterLocalMemory(context.Background(), tmp); err != nil {
		tb.Fatal(err)
	}
	if w.segB, err = w.a.OpenSegment(context.Background(), w.b.Name()); err != nil {
		tb.Fatal(err)
	}
	if w.r, err = w.a.NewRing(moonring.RingConfig{Entries: 16}); err != nil {
		tb.Fatal(err)
	}
	return w
}

// reset fills every buffer, and its model, with a pattern of seed.
func (w *world) reset(seed byte) {
	for k, g := range w.all {
		for i := range g.b {
			g.b[i] = byte(i*7+k*31) ^ seed
		}
		copy(g.model, g.b)
	}
}

// entry decodes a 16-byte record into a submission entry. The record picks
// among valid and invalid choices for each field, so that most entries come
// near the boundaries the ring checks.
func (w *world) entry(rec []byte, ud uint64) sq.Entry {
	e := sq.Entry{UserData: ud}
	ops := [8]sq.Op{sq.Write, sq.Read, sq.Write, sq.Read, sq.Nop, sq.Cancel, 4, 0xff}
	e.Op = ops[rec[0]&7]
	if rec[0]>>3 == 0x1f {
		e.Flags = 0x40 // a flag this version does not know
	}
	local := w.la1
	switch rec[2] % 8 {
	case 0, 1, 2:
		e.Buffer = w.la1.id
	case 3, 4:
		e.Buffer, local = w.la2.id, w.la2
	case 5:
		e.Buffer, local = w.stale, nil
	case 6:
		e.Buffer, local = 0, nil
	case 7:
		e.Buffer, local = moonring.BufferID(uint32(rec[2])<<20|uint32(rec[3])), nil
	}
	var target *gbuf
	switch rec[1] % 8 {
	case 0, 1, 2:
		e.Segment = moonring.LocalSegmentID
		target = []*gbuf{w.la1, w.la1, w.la1, w.la1, w.la2, w.la2, w.la2, nil}[rec[3]%8]
	case 3, 4, 5:
		e.Segment = w.segB
		target = []*gbuf{w.rb1, w.rb1, w.rb1, w.rb2, w.rb2, w.hb, w.la1, nil}[rec[3]%8]
	case 6:
		e.Segment = 999
		target = w.rb1
	case 7:
		e.Segment = moonring.SegmentID(uint32(rec[1]) << 12)
		target = w.rb1
	}
	loff := uint64(binary.LittleEndian.Uint16(rec[4:]))
	roff := uint64(binary.LittleEndian.Uint16(rec[6:]))
	e.Length = uint64(binary.LittleEndian.Uint16(rec[8:])) % 9000
	if local != nil {
		loff %= uint64(len(local.b)) + 64
	}
	e.Local = loff
	if target != nil {
		roff %= uint64(len(target.b)) + 64
		e.Remote = target.addr() + roff
		if rec[12]&1 != 0 {
			e.Remote = target.addr() - roff%64 - 1
		}
	} else {
		e.Remote = roff
	}
	switch {
	case rec[12]&2 != 0:
		e.Length = math.MaxUint64 - uint64(rec[13])
	case rec[12]&4 != 0:
		e.Length = ring.DefaultMaxLength + 1 + uint64(rec[13])
	case rec[12]&8 != 0:
		e.Local = math.MaxUint64 - uint64(rec[13]) // wraps with the length
	}
	e.Timeout = [4]uint64{0, math.MaxUint64, 1 << 63, 1 << 40}[rec[14]%4]
	if e.Op == sq.Cancel {
		e.Remote = ud - 1 // the entry before, long complete: nothing to cancel
	}
	if rec[10] == 0xA5 {
		at := [6]int{2, 3, 12, 13, 14, 15}[rec[11]%6]
		// Entry is a plain 64-byte struct: writing one of its reserved
		// bytes through a byte view is what a caller's bug would do.
		(*[sq.EntrySize]byte)(unsafe.Pointer(&e))[at] = rec[11] | 1
	}
	return e
}

// reserved reports whether e has a non-zero byte where sq.Entry reserves
// one (bytes 2-3 and 12-15, as its encoding documents).
func reserved(e *sq.Entry) bool {
	b := (*[sq.EntrySize]byte)(unsafe.Pointer(e))
	for _, i := range []int{2, 3, 12, 13, 14, 15} {
		if b[i] != 0 {
			return true
		}
	}
	return false
}

// expect is the reference model of the ring's checks, in the ring's order:
// the code e must complete with, the buffers it reads and writes, and
// whether it completes at all (a Cancel does not).
func (w *world) expect(e *sq.Entry) (code moonring.Code, src, dst *gbuf, srcOff, dstOff uint64, completes bool) {
	return w.expectAs(e, false, false)
}

// expectAs is expect for e, or (asList) for the entry that moves e's
// range as a prepared list's one block, which PrepareList took or
// refused (prepared): the same checks but for the order, the buffer and
// the segment before the list and its block's ranges.
func (w *world) expectAs(e *sq.Entry, asList, prepared bool) (code moonring.Code, src, dst *gbuf, srcOff, dstOff uint64, completes bool) {
	if e.Flags&^sq.FlagsMask != 0 || reserved(e) || !e.Op.Valid() || (e.Flags&sq.FlagNotify != 0 && e.Op != sq.Write) {
		return cq.CodeInvalid, nil, nil, 0, 0, true
	}
	switch e.Op {
	case sq.Nop:
		return cq.CodeOK, nil, nil, 0, 0, true
	case sq.Cancel:
		return cq.CodeOK, nil, nil, 0, 0, false
	}
	if !asList && (e.Length == 0 || e.Length > ring.DefaultMaxLength) {
		return cq.CodeLength, nil, nil, 0, 0, true
	}
	var local *gbuf
	for _, g := range []*gbuf{w.la1, w.la2} {
		if g.id == e.Buffer {
			local = g
		}
	}
	if local == nil {
		return cq.CodeBadBuffer, nil, nil, 0, 0, true
	}
	badLocal := e.Length > uint64(len(local.b)) || e.Local > uint64(len(local.b))-e.Length
	if !asList && badLocal {
		return cq.CodeLocalRange, nil, nil, 0, 0, true
	}
	var granted []*gbuf
	switch e.Segment {
	case moonring.LocalSegmentID:
		granted = []*gbuf{w.la1, w.la2} // the engine's own segment: every buffer
	case w.segB:
		granted = []*gbuf{w.rb1, w.rb2} // the peer's: remote-accessible ones
	default:
		return cq.CodeBadSegment, nil, nil, 0, 0, true
	}
	if asList && !prepared {
		return cq.CodeInvalid, nil, nil, 0, 0, true // the entry names list 0
	}
	if asList && badLocal {
		return cq.CodeLocalRange, nil, nil, 0, 0, true
	}
	var target *gbuf
	var roff uint64
	for _, g := range granted {
		if e.Remote >= g.addr() && e.Length <= uint64(len(g.b)) && e.Remote-g.addr() <= uint64(len(g.b))-e.Length {
			target, roff = g, e.Remote-g.addr()
		}
	}
	if target == nil {
		return cq.CodeRemoteRange, nil, nil, 0, 0, true
	}
	// A list's block moves as one slice: no longer than its path allows
	// (the local transport's 1 MiB, to B and to the engine's own segment
	// alike, whatever the engine's SliceSize).
	if asList && e.Length > ring.MaxSlice(1<<20) {
		return cq.CodeLength, nil, nil, 0, 0, true
	}
	if e.Op == sq.Write {
		return 0, local, target, e.Local, roff, true
	}
	return 0, target, local, roff, e.Local, true
}

// wait returns the next completion.
func (w *world) wait(tb testing.TB) moonring.Completion {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := w.r.CQ().Wait(ctx, 1); err != nil {
		tb.Fatalf("hang: no completion: %v", err)
	}
	c := *w.r.Peek()
	w.r.Advance(1)
	return c
}

// run submits the entries one by one and checks each completion and every
// byte of every buffer after each.
func (w *world) run(tb testing.TB, data []byte) {
	tb.Helper()
	const recSize = 16
	seed := byte(0)
	if len(data) > 0 {
		seed = data[0]
	}
	w.reset(seed)
	for i := 0; (i+1)*recSize <= len(data) && i < 64; i++ {
		ud := uint64(i + 1)
		r := data[i*recSize : (i+1)*recSize]
		e := w.entry(r, ud)
		// Bit 7 of byte 15: a READ or WRITE goes as a prepared list of
		// one block, its range, instead (PrepareList refuses a length of
		// 0 or above MaxBlock, and a range that wraps: the entry then
		// names no list).
		asList := r[15]&0x80 != 0 && (e.Op == sq.Read || e.Op == sq.Write)
		var list moonring.ListID
		sent := e
		if asList {
			var err error
			list, err = w.a.PrepareList([]moonring.Block{{Local: e.Local, Remote: e.Remote, Length: e.Length}})
			if err != nil && !errors.Is(err, moonring.ErrList) {
				tb.Fatalf("entry %d: PrepareList: %v", i, err)
			}
			sent.Flags |= sq.FlagList
			sent.Local, sent.Remote, sent.Length = uint64(list), 0, 1
		}
		code, src, dst, soff, doff, completes := w.expectAs(&e, asList, list != 0)
		w.submit(tb, i, &sent)
		if !completes {
			continue
		}
		c := w.wait(tb)
		if list != 0 {
			if err := w.a.FreeList(list); err != nil {
				tb.Fatalf("entry %d: FreeList: %v", i, err)
			}
		}
		if c.UserData != ud {
			tb.Fatalf("entry %d (%+v): completion for %d; want %d (a completion lost, doubled or from a Cancel)", i, e, c.UserData, ud)
		}
		if c.Code != code || c.Status != code.Status() {
			tb.Fatalf("entry %d (%+v): code %d (%v); the model says %d (%v)", i, e, c.Code, c.Err(), code, code.Err())
		}
		wantBytes := uint64(0)
		if code == 0 && src != nil {
			wantBytes = e.Length
			n := int(e.Length)
			overlap := src == dst && soff < doff+e.Length && doff < soff+e.Length
			copy(dst.model[doff:int(doff)+n], src.model[soff:int(soff)+n])
			if overlap {
				// Slices of a self-overlapping copy run in order, not as one
				// memmove: the destination's bytes are unspecified; every
				// other byte is still checked.
				copy(dst.model[doff:int(doff)+n], dst.b[doff:int(doff)+n])
			}
		}
		if c.Bytes != wantBytes {
			tb.Fatalf("entry %d (%+v): %d bytes reported, want %d", i, e, c.Bytes, wantBytes)
		}
		for _, g := range w.all {
			if string(g.b) != string(g.model) {
				for j := range g.b {
					if g.b[j] != g.model[j] {
						tb.Fatalf("entry %d (%+v, code %d): %s byte %d is %#x, the model says %#x", i, e, c.Code, g.name, j, g.b[j], g.model[j])
					}
				}
			}
		}
	}
	// A fence: nothing more completes (no completion is doubled or late).
	fence := sq.Entry{Op: sq.Nop, UserData: math.MaxUint64}
	w.submit(tb, -1, &fence)
	if c := w.wait(tb); c.UserData != math.MaxUint64 {
		tb.Fatalf("an extra completion %+v", c)
	}
}

// submit submits e, retrying a full SQ as a caller would, until a hang
// detector: Cancels complete nothing, so a run of them can fill the SQ
// before the poller takes them.
func (w *world) submit(tb testing.TB, i int, e *sq.Entry) {
	tb.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := w.r.SubmitOne(e)
		if err == nil {
			return
		}
		if !errors.Is(err, moonring.ErrSQFull) || time.Now().After(deadline) {
			tb.Fatalf("entry %d: Submit: %v", i, err)
		}
		runtime.Gosched()
	}
}

// rec builds one 16-byte record.
func rec(op, seg, buf, tgt byte, loff, roff, n uint16, flags byte) []byte {
	r := make([]byte, 16)
	r[0], r[1], r[2], r[3] = op, seg, buf, tgt
	binary.LittleEndian.PutUint16(r[4:], loff)
	binary.LittleEndian.PutUint16(r[6:], roff)
	binary.LittleEndian.PutUint16(r[8:], n)
	r[12] = flags
	return r
}

func join(rs ...[]byte) []byte {
	var out []byte
	for _, r := range rs {
		out = append(out, r...)
	}
	return out
}

// FuzzRingEntries submits arbitrary entries to a ring whose engine and
// peer own guarded buffers: the run must never fault, every entry must
// complete exactly once (a Cancel never), each with the code the model
// gives it, and no byte outside what a valid entry addresses may change.
func FuzzRingEntries(f *testing.F) {
	// op: 0 WRITE, 1 READ, 4 NOP, 5 CANCEL, 6 and 7 unknown; seg: 0 local,
	// 3 B, 6 unknown; buf: 0 LA1, 3 LA2, 5 stale, 6 zero; tgt: see entry.
	f.Add(join(rec(0, 0, 0, 4, 10, 20, 3000, 0)))                               // WRITE LA1 -> LA2, local segment
	f.Add(join(rec(1, 3, 3, 0, 1, 2, 5000, 0), rec(0, 3, 0, 3, 7, 0, 4096, 0))) // READ RB1 -> LA2, WRITE LA1 -> RB2 whole
	f.Add(join(rec(0, 0, 0, 0, 0, 1000, 2500, 0)))                              // self-overlapping copy in LA1
	f.Add(join(rec(0, 3, 0, 5, 0, 0, 10, 0), rec(1, 3, 0, 6, 0, 0, 10, 0)))     // B's local-only buffer; A's buffer through B
	f.Add(join(rec(0, 3, 0, 0, 0, 6000, 2, 0), rec(0, 3, 0, 0, 0, 0, 6002, 0))) // past RB1's end
	f.Add(join(rec(0, 3, 0, 0, 0, 5, 10, 1)))                                   // below RB1
	f.Add(join(rec(0, 0, 0, 0, 12410, 0, 10, 0), rec(0, 0, 0, 0, 0, 0, 0, 0)))  // local past the end; zero length
	f.Add(join(rec(0, 0, 0, 0, 0, 0, 10, 2), rec(0, 0, 0, 0, 0, 0, 10, 4), rec(0, 0, 0, 0, 0, 0, 10, 8)))
	f.Add(join(rec(0, 0, 5, 0, 0, 0, 10, 0), rec(0, 0, 6, 0, 0, 0, 10, 0), rec(0, 0, 7, 0, 0, 0, 10, 0))) // bad buffers
	f.Add(join(rec(0, 6, 0, 0, 0, 0, 10, 0), rec(0, 7, 0, 0, 0, 0, 10, 0)))                               // bad segments
	f.Add(join(rec(4, 0, 0, 0, 0, 0, 0, 0), rec(5, 0, 0, 0, 0, 0, 0, 0), rec(6, 0, 0, 0, 0, 0, 10, 0), rec(7, 0, 0, 0, 0, 0, 10, 0)))
	f.Add(join(rec(0xf8, 0, 0, 0, 0, 0, 10, 0))) // a flag
	asList := func(r []byte) []byte { r[15] |= 0x80; return r }
	f.Add(join(asList(rec(0, 3, 3, 0, 1, 2, 5000, 0)), asList(rec(1, 3, 0, 3, 7, 0, 4096, 0)), asList(rec(0, 3, 0, 0, 0, 6000, 2, 0)),
		asList(rec(0, 0, 0, 0, 12410, 0, 10, 0)), asList(rec(0, 0, 0, 0, 0, 0, 0, 0)), asList(rec(0, 6, 0, 0, 0, 0, 10, 0)))) // as lists
	bad := rec(0, 0, 0, 4, 0, 0, 10, 0)
	bad[10], bad[11] = 0xA5, 3 // a reserved byte
	f.Add(bad)
	var mixed []byte
	for i := 0; i < 24; i++ {
		mixed = append(mixed, rec(byte(i), byte(i*3), byte(i*5), byte(i*7), uint16(i*977), uint16(i*1231), uint16(i*397), byte(i%3))...)
	}
	f.Add(mixed)
	w := newWorld(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		w.run(t, data)
	})
}

// TestModelKnowsEveryCode makes sure the seeds above reach every code the
// model predicts, so a model that always agreed by accident would show.
func TestModelKnowsEveryCode(t *testing.T) {
	w := newWorld(t)
	seen := map[moonring.Code]bool{}
	recs := [][]byte{
		rec(0, 0, 0, 4, 10, 20, 3000, 0), rec(0, 3, 0, 5, 0, 0, 10, 0), rec(0, 0, 0, 0, 12410, 0, 10, 0),
		rec(0, 0, 0, 0, 0, 0, 0, 0), rec(0, 0, 5, 0, 0, 0, 10, 0), rec(0, 6, 0, 0, 0, 0, 10, 0), rec(6, 0, 0, 0, 0, 0, 10, 0),
	}
	for i, r := range recs {
		e := w.entry(r, uint64(i+1))
		code, _, _, _, _, _ := w.expect(&e)
		seen[code] = true
	}
	for _, c := range []moonring.Code{cq.CodeOK, cq.CodeRemoteRange, cq.CodeLocalRange, cq.CodeLength, cq.CodeBadBuffer, cq.CodeBadSegment, cq.CodeInvalid} {
		if !seen[c] {
			t.Errorf("no seed reaches code %d (%v)", c, c.Err())
		}
	}
	w.run(t, join(recs...))
}
