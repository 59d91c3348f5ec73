package ring

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/internal/testwait"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// hang bounds every wait: a hang detector, never a performance assertion.
const hang = 30 * time.Second

// waitFor polls cond until it holds; hang is the hang detector.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	testwait.For(t, hang, what, cond)
}

// ---------------------------------------------------------------------------
// Slicing and tokens.

// refSlices is the slow reference model of slicing: cut n into size-byte
// pieces, and merge a last piece shorter than size/4 into the one before.
func refSlices(n, size uint64) [][2]uint64 {
	var out [][2]uint64
	for off := uint64(0); off < n; off += size {
		out = append(out, [2]uint64{off, min(size, n-off)})
	}
	if k := len(out); k > 1 && out[k-1][1] < size/4 {
		out[k-2][1] += out[k-1][1]
		out = out[:k-1]
	}
	return out
}

func TestSlicingModel(t *testing.T) {
	props := gopter.NewProperties(propParams(t, 3000))
	// n = q*size + r covers exact multiples, tiny tails and long requests.
	props.Property("slices cover [0, n) exactly as the model cuts it", prop.ForAll(
		func(size uint64, q uint64, r uint64) string {
			r %= size
			n := q*size + r
			if n == 0 {
				return ""
			}
			want := refSlices(n, size)
			c := sliceCount(n, size)
			if int(c) != len(want) {
				return fmt.Sprintf("n=%d size=%d: %d slices, model %d", n, size, c, len(want))
			}
			var end uint64
			for i := uint32(0); i < c; i++ {
				off, l := sliceRange(n, size, c, i)
				switch {
				case off != end:
					return fmt.Sprintf("n=%d size=%d: slice %d starts at %d, previous ended at %d (gap or overlap)", n, size, i, off, end)
				case l == 0:
					return fmt.Sprintf("n=%d size=%d: slice %d is empty", n, size, i)
				case c > 1 && l < size/4:
					return fmt.Sprintf("n=%d size=%d: slice %d of %d has %d bytes, under a quarter slice", n, size, i, c, l)
				case l > MaxSlice(size):
					return fmt.Sprintf("n=%d size=%d: slice %d has %d bytes: more than MaxSlice's %d", n, size, i, l, MaxSlice(size))
				case [2]uint64{off, l} != want[i]:
					return fmt.Sprintf("n=%d size=%d: slice %d is [%d,+%d), model [%d,+%d)", n, size, i, off, l, want[i][0], want[i][1])
				}
				end = off + l
			}
			if end != n {
				return fmt.Sprintf("n=%d size=%d: slices end at %d", n, size, end)
			}
			return ""
		},
		gen.OneGenOf(gen.UInt64Range(1, 16), gen.UInt64Range(1, 1<<20), gen.OneConstOf(uint64(4096), uint64(64<<10), uint64(1<<20))),
		gen.OneGenOf(gen.UInt64Range(0, 3), gen.UInt64Range(0, 2000)),
		gen.UInt64(),
	))
	props.TestingRun(t)
}

// TestMaxSlice: MaxSlice is reached (a request of that length is one
// slice) and one byte more is cut in two.
func TestMaxSlice(t *testing.T) {
	for _, size := range []uint64{1, 2, 3, 4, 5, 7, 8, 4096, 64 << 10, 1 << 20, 4<<20 + 3} {
		m := MaxSlice(size)
		if c := sliceCount(m, size); c != 1 {
			t.Errorf("size %d: a request of MaxSlice %d bytes is %d slices, want 1", size, m, c)
		}
		if c := sliceCount(m+1, size); c != 2 {
			t.Errorf("size %d: a request of MaxSlice+1 = %d bytes is %d slices, want 2", size, m+1, c)
		}
	}
}

// TestSlicingLarge checks the structure of slicings too long to enumerate,
// through the first and last slices and the count.
func TestSlicingLarge(t *testing.T) {
	props := gopter.NewProperties(propParams(t, 3000))
	props.Property("first and last slices of a long request", prop.ForAll(
		func(n, size uint64) string {
			c := sliceCount(n, size)
			if c == 0 {
				return fmt.Sprintf("n=%d size=%d: no slices", n, size)
			}
			off0, l0 := sliceRange(n, size, c, 0)
			offL, lL := sliceRange(n, size, c, c-1)
			if off0 != 0 || (c > 1 && l0 != size) || offL+lL != n || offL != uint64(c-1)*size {
				return fmt.Sprintf("n=%d size=%d count=%d: first [%d,+%d) last [%d,+%d)", n, size, c, off0, l0, offL, lL)
			}
			if c > 1 && lL < size/4 {
				return fmt.Sprintf("n=%d size=%d: last slice %d bytes, under a quarter slice", n, size, lL)
			}
			return ""
		},
		gen.UInt64Range(1, DefaultMaxLength),
		gen.UInt64Range(4096, 1<<26),
	))
	props.TestingRun(t)
}

func TestTokenRoundTrip(t *testing.T) {
	props := gopter.NewProperties(propParams(t, 3000))
	props.Property("splitToken and attempt of token(idx, gen, slice) + k attempts round-trip", prop.ForAll(
		func(idx int32, g uint16, slice uint32, k uint64) bool {
			tok := token(idx, g, slice) + k*attemptOne
			i2, g2, s2 := splitToken(tok)
			return i2 == idx && g2 == g && s2 == slice && attempt(tok) == k%16
		},
		gen.Int32Range(0, 1<<idxBits-1),
		gen.UInt16Range(0, 1<<genBits-1),
		gen.OneGenOf(gen.UInt32Range(0, 1000), gen.UInt32Range(0, 1<<sliceBits-1)),
		gen.UInt64Range(0, 40),
	))
	props.TestingRun(t)
	// Every field reaches its own bits: no two distinct values collide at
	// the boundaries.
	seen := map[uint64][4]uint64{}
	for _, idx := range []int32{0, 1, 1<<idxBits - 1} {
		for _, g := range []uint16{0, 1, 1<<genBits - 1} {
			for _, s := range []uint32{0, 1, 1<<sliceBits - 1} {
				for _, a := range []uint64{0, 1, 15} {
					tok := token(idx, g, s) + a*attemptOne
					if prev, ok := seen[tok]; ok {
						t.Fatalf("token(%d,%d,%d)+%d attempts = token%v", idx, g, s, a, prev)
					}
					seen[tok] = [4]uint64{uint64(idx), uint64(g), uint64(s), a}
				}
			}
		}
	}
	// The slice count never exceeds what a token can name.
	// (One index is kept free for the notification slice.)
	if c := sliceCount(DefaultMaxLength, 1); c != 1<<sliceBits-2 {
		t.Fatalf("sliceCount(1 TiB, 1) = %d, want the cap %d", c, 1<<sliceBits-2)
	}
}

// ---------------------------------------------------------------------------
// A test endpoint and a ring around it.

// fakeEP is an endpoint that copies between in-process memory and, on
// demand, holds slices until released, fails the slices of chosen rails,
// completes from another goroutine, and accepts only so many slices at a
// time. It records every slice it accepted.
type fakeEP struct {
	rails int
	mem   []byte // the segment's memory
	base  uint64

	mu       sync.Mutex
	hold     bool
	held     []fakeSlice
	fail     map[uint16]error // per rail
	postErr  error            // Post refuses everything with it
	capacity int              // most slices accepted and not completed; 0: no limit
	inflight int
	async    bool
	stall    time.Duration   // how long each Post takes (a transport that writes in Post)
	out      map[uint64]bool // tokens accepted and not completed
	dups     int             // tokens accepted while already out
	posts    []transport.Slice
	sizes    []int // each Post's slices offered
	width    int   // > 0: the harness opens the segment through a wideEP
	offered  int   // slices offered to Post, taken or not
	done     int
	closed   bool
	wg       sync.WaitGroup
}

type fakeSlice struct {
	c transport.Completer
	s transport.Slice
}

var _ transport.Endpoint = (*fakeEP)(nil)

// wideEP is a fakeEP that asks for Posts of its width (transport.WidePoster).
type wideEP struct{ *fakeEP }

func (w wideEP) PostWidth() int { return w.width }

func (f *fakeEP) Rails() int                        { return f.rails }
func (f *fakeEP) Update(desc *segtable.SegmentDesc) {}

func (f *fakeEP) Post(c transport.Completer, s []transport.Slice) (int, error) {
	f.mu.Lock()
	if f.closed || f.postErr != nil {
		err := f.postErr
		if err == nil {
			err = transport.ErrClosed
		}
		f.mu.Unlock()
		return 0, err
	}
	n := len(s)
	f.offered += n
	f.sizes = append(f.sizes, n)
	if f.capacity > 0 {
		n = max(0, min(n, f.capacity-f.inflight))
	}
	var now []fakeSlice
	for _, x := range s[:n] {
		if f.out[x.Token] {
			f.dups++
		}
		f.out[x.Token] = true
		f.inflight++
		rec := x
		rec.Local = nil
		f.posts = append(f.posts, rec)
		if f.hold {
			f.held = append(f.held, fakeSlice{c, x})
		} else {
			now = append(now, fakeSlice{c, x})
		}
	}
	async, stall := f.async, f.stall
	f.mu.Unlock()
	time.Sleep(stall)
	if async && len(now) > 0 {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			runtime.Gosched()
			f.complete(now, nil)
		}()
	} else {
		f.complete(now, nil)
	}
	return n, nil
}

// complete finishes slices: with err when it is not nil, else by moving
// their bytes.
func (f *fakeEP) complete(list []fakeSlice, err error) {
	for _, x := range list {
		e := err
		if e == nil {
			e = f.move(&x.s)
		}
		f.mu.Lock()
		delete(f.out, x.s.Token)
		f.inflight--
		f.done++
		f.mu.Unlock()
		x.c.Complete(x.s.Token, e)
	}
}

func (f *fakeEP) move(s *transport.Slice) error {
	f.mu.Lock()
	err := f.fail[s.Rail]
	f.mu.Unlock()
	if err != nil {
		return err
	}
	if s.Remote < f.base || s.Remote-f.base > uint64(len(f.mem)) || s.Length > uint64(len(f.mem))-(s.Remote-f.base) {
		return transport.ErrRange
	}
	remote := f.mem[s.Remote-f.base:][:s.Length]
	local := unsafe.Slice((*byte)(s.Local), s.Length)
	if s.Op == transport.Write {
		copy(remote, local)
	} else {
		copy(local, remote)
	}
	return nil
}

// release completes the first n held slices (all when n < 0) on the
// caller's goroutine, with err or by moving their bytes.
func (f *fakeEP) release(n int, err error) int {
	f.mu.Lock()
	if n < 0 || n > len(f.held) {
		n = len(f.held)
	}
	list := slices.Clone(f.held[:n])
	f.held = f.held[n:]
	f.mu.Unlock()
	f.complete(list, err)
	return n
}

func (f *fakeEP) setHold(on bool) { f.mu.Lock(); f.hold = on; f.mu.Unlock() }

func (f *fakeEP) heldCount() int { f.mu.Lock(); defer f.mu.Unlock(); return len(f.held) }

func (f *fakeEP) postsCopy() []transport.Slice {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.posts)
}

func (f *fakeEP) Close() error {
	f.mu.Lock()
	f.closed = true
	f.mu.Unlock()
	f.release(-1, transport.ErrClosed)
	return nil
}

// Layout of the harness's memory: a local buffer, and a segment of two
// buffers with a gap between them.
const (
	hLocal = 1 << 20
	hR1    = 512 << 10
	hGap   = 4096
	hR2    = 64 << 10
	handle = 77
)

type harness struct {
	t      testing.TB
	r      *Ring
	p      *Poller
	manual bool
	// clock is the time a manual harness's steps pass. It starts at the
	// ring's real clock: a round that moved 256 KiB or more reads that
	// clock again (step), and a fixed start (it was 1 s) put a request's
	// deadline behind it once the test binary had run for a few seconds,
	// so such a request timed out at its first round.
	clock  int64
	bufs   segtable.Buffers
	segs   segtable.Segments[transport.Endpoint]
	tables Tables
	ep     *fakeEP
	seg    *segtable.Segment[transport.Endpoint]
	local  []byte
	lbuf   *segtable.Buffer
	remote []byte
	r1, r2 uint64
}

// manualPoller is a poller with no goroutine: the test calls Ring.step. Its
// done channel is closed, so Close shuts the ring down on the caller's
// goroutine, as for a stopped poller.
func manualPoller() *Poller {
	p := &Poller{bell: sq.NewDoorbell(), requests: make(chan func(), 1), stop: make(chan struct{}), done: make(chan struct{})}
	p.cfg.Promote = DefaultPromote
	close(p.done)
	return p
}

func newHarness(t testing.TB, cfg Config, ep *fakeEP, manual bool) *harness {
	t.Helper()
	return newHarnessPoller(t, cfg, ep, manual, PollerConfig{})
}

// newHarnessPoller is newHarness with a poller of its own configuration
// (manual false).
func newHarnessPoller(t testing.TB, cfg Config, ep *fakeEP, manual bool, pcfg PollerConfig) *harness {
	t.Helper()
	h := &harness{t: t, ep: ep, manual: manual, clock: now()}
	if ep.rails == 0 {
		ep.rails = 1
	}
	ep.out = map[uint64]bool{}
	h.local = make([]byte, hLocal)
	h.remote = make([]byte, hR1+hGap+hR2)
	for i := range h.remote {
		h.remote[i] = 0xEE
	}
	var err error
	h.lbuf, err = h.bufs.Register(h.local, "", false)
	if err != nil {
		t.Fatal(err)
	}
	h.lbuf.Regs[0].Store(&segtable.Registration{Handle: handle})
	ep.mem = h.remote
	ep.base = uint64(uintptr(unsafe.Pointer(unsafe.SliceData(h.remote))))
	h.r1, h.r2 = ep.base, ep.base+hR1+hGap
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "remote", Epoch: 1,
		Endpoints: map[string]string{"fake": ""},
		Buffers: []segtable.BufferDesc{
			{Addr: h.r1, Length: hR1, Keys: map[string]string{"fake": "k1"}},
			{Addr: h.r2, Length: hR2, Keys: map[string]string{"fake": "k2"}},
		}}
	if err := desc.Validate(); err != nil {
		t.Fatal(err)
	}
	var tep transport.Endpoint = ep
	if ep.width > 0 {
		tep = wideEP{ep}
	}
	h.seg, err = h.segs.Open("remote", desc, 0, 0, tep, nil)
	if err != nil {
		t.Fatal(err)
	}
	h.tables = Tables{Buffers: &h.bufs, Segments: &h.segs}
	if manual {
		h.p = manualPoller()
	} else {
		h.p = NewPoller(pcfg)
	}
	h.r, err = New(cfg, &h.tables, h.p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		h.r.Close()
		ep.Close()
		ep.wg.Wait()
		if !manual {
			h.p.Stop()
		}
		for _, b := range h.bufs.All() {
			if _, err := h.bufs.Unregister(context.Background(), b.ID); err != nil {
				t.Errorf("unregister: %v", err)
			}
		}
	})
	return h
}

// write returns a WRITE of n bytes from local offset loff to R1+roff.
func (h *harness) write(ud, loff, roff, n uint64) sq.Entry {
	return sq.Entry{Op: sq.Write, Segment: h.seg.ID, Buffer: h.lbuf.ID, Local: loff, Remote: h.r1 + roff, Length: n, UserData: ud}
}

func (h *harness) read(ud, loff, roff, n uint64) sq.Entry {
	e := h.write(ud, loff, roff, n)
	e.Op = sq.Read
	return e
}

func (h *harness) submit(es ...sq.Entry) {
	h.t.Helper()
	deadline := time.Now().Add(hang)
	for len(es) > 0 {
		n, err := h.r.Submit(es)
		es = es[n:]
		if err != nil && err != ErrSQFull {
			h.t.Fatalf("Submit: %v", err)
		}
		if len(es) > 0 {
			if time.Now().After(deadline) {
				h.t.Fatalf("hang: SQ stays full")
			}
			if h.manual {
				h.step()
			}
			runtime.Gosched()
		}
	}
}

func (h *harness) step() { h.r.step(h.clock, false) }

// poll returns the completions ready now (after one step when manual).
func (h *harness) poll() []cq.Completion {
	if h.manual {
		h.step()
	}
	var out []cq.Completion
	var buf [64]cq.Completion
	for {
		n := h.r.PeekBatch(buf[:])
		if n == 0 {
			return out
		}
		out = append(out, buf[:n]...)
		h.r.Advance(n)
	}
}

// collect waits until it has read at least n completions and returns all
// it read.
func (h *harness) collect(n int) []cq.Completion {
	h.t.Helper()
	deadline := time.Now().Add(hang)
	var out []cq.Completion
	for len(out) < n {
		got := h.poll()
		out = append(out, got...)
		if len(got) > 0 {
			continue
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("hang: %d of %d completions after %v", len(out), n, hang)
		}
		if h.manual {
			runtime.Gosched()
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
		h.r.CQ().Wait(ctx, 1)
		cancel()
	}
	return out
}

// one waits for the completion of ud and fails on any other.
func (h *harness) one(ud uint64) cq.Completion {
	h.t.Helper()
	got := h.collect(1)
	if len(got) != 1 || got[0].UserData != ud {
		h.t.Fatalf("completions %+v; want exactly one, for %d", got, ud)
	}
	return got[0]
}

const fenceUD = 1 << 63

// fence proves that everything the poller had to apply before now has been
// applied: two Nops in a row, since the round that takes the second one
// reaped every slice completion queued before the first one completed. It
// returns the other completions it read.
func (h *harness) fence() []cq.Completion {
	h.t.Helper()
	var other []cq.Completion
	for i := uint64(0); i < 2; i++ {
		h.submit(sq.Entry{Op: sq.Nop, UserData: fenceUD + i})
		for seen := false; !seen; {
			for _, c := range h.collect(1) {
				if c.UserData == fenceUD+i {
					seen = true
				} else {
					other = append(other, c)
				}
			}
		}
	}
	return other
}

func expectCode(t testing.TB, c cq.Completion, code cq.Code) {
	t.Helper()
	if c.Code != code || c.Status != code.Status() {
		t.Fatalf("completion %d: status %v code %d (%v); want %v code %d (%v)", c.UserData, c.Status, c.Code, c.Err(), code.Status(), code, code.Err())
	}
	if code != cq.CodeOK && c.Bytes != 0 {
		t.Fatalf("completion %d failed with %v but reports %d bytes", c.UserData, c.Err(), c.Bytes)
	}
}

func fillPattern(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i*31) ^ seed
	}
}

// ---------------------------------------------------------------------------
// Data path.

func TestReadWriteData(t *testing.T) {
	ep := &fakeEP{rails: 3, async: true}
	h := newHarness(t, Config{SliceSize: 4096}, ep, false)
	fillPattern(h.local, 1)
	lengths := []uint64{1, 7, 4095, 4096, 4097, 4096 + 1023, 4096 + 1024, 3*4096 + 1, 100 << 10, 256<<10 + 3}
	var es []sq.Entry
	var roff uint64
	for i, n := range lengths {
		es = append(es, h.write(uint64(i), uint64(i*13), roff, n))
		roff += n + 5
	}
	h.submit(es...)
	got := h.collect(len(es))
	if len(got) != len(es) {
		t.Fatalf("%d completions for %d writes", len(got), len(es))
	}
	for _, c := range got {
		expectCode(t, c, cq.CodeOK)
		if e := es[c.UserData]; c.Bytes != e.Length {
			t.Fatalf("write %d: %d bytes reported, want %d", c.UserData, c.Bytes, e.Length)
		}
	}
	for _, e := range es {
		r := e.Remote - h.r1
		if string(h.remote[r:r+e.Length]) != string(h.local[e.Local:e.Local+e.Length]) {
			t.Fatalf("write %d: data differs", e.UserData)
		}
	}
	if h.remote[roff] != 0xEE {
		t.Fatalf("byte after the last write changed")
	}
	// Read them all back into the upper half of the local buffer.
	var rs []sq.Entry
	for i, e := range es {
		rs = append(rs, h.read(uint64(100+i), 512<<10+e.Local, e.Remote-h.r1, e.Length))
	}
	h.submit(rs...)
	for _, c := range h.collect(len(rs)) {
		expectCode(t, c, cq.CodeOK)
	}
	for i, e := range rs {
		if string(h.local[e.Local:e.Local+e.Length]) != string(h.local[es[i].Local:es[i].Local+e.Length]) {
			t.Fatalf("read %d: data differs", e.UserData)
		}
	}
	// Every slice names the buffer's handle, a rail in range, and at most
	// the slice size plus a merged tail.
	for _, s := range ep.postsCopy() {
		if s.LocalHandle != handle || int(s.Rail) >= ep.rails || s.Length > 4096+4096/4 {
			t.Fatalf("slice %+v: bad handle, rail or length", s)
		}
	}
	st := h.r.Stats()
	if st.Requests != uint64(len(es)+len(rs)) || st.Failed != 0 || st.Stale != 0 {
		t.Fatalf("stats: %d requests, %d failed, %d stale", st.Requests, st.Failed, st.Stale)
	}
}

// ---------------------------------------------------------------------------
// Deadlines, cancel and late completions.

func TestTimeoutManual(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Timeout: time.Millisecond, MaxInFlight: 4}, ep, true)
	// One with its own deadline, one with the ring's default.
	e1 := h.write(1, 0, 0, 10000)
	e1.Timeout = uint64(time.Microsecond)
	e2 := h.write(2, 0, 20000, 10)
	h.submit(e1, e2)
	if got := h.poll(); len(got) != 0 {
		t.Fatalf("completions before any deadline: %+v", got)
	}
	if ep.heldCount() == 0 {
		t.Fatalf("nothing was posted")
	}
	h.clock += int64(10 * time.Microsecond)
	got := h.poll()
	if len(got) != 1 || got[0].UserData != 1 {
		t.Fatalf("after 10µs: %+v; want request 1 timed out", got)
	}
	expectCode(t, got[0], cq.CodeTimeout)
	h.clock += int64(time.Millisecond)
	got = h.poll()
	if len(got) != 1 || got[0].UserData != 2 {
		t.Fatalf("after 1ms: %+v; want request 2 timed out", got)
	}
	expectCode(t, got[0], cq.CodeTimeout)
	// The transport still holds their slices: the slots stay taken and the
	// buffer in use, so it cannot be unregistered under the transport.
	if !h.r.uses(h.lbuf, nil) || !h.r.uses(nil, h.seg) {
		t.Fatalf("timed-out requests with slices out no longer hold their buffer and segment")
	}
	ep.release(-1, nil)
	if got := h.poll(); len(got) != 0 {
		t.Fatalf("late slice completions produced completions: %+v", got)
	}
	if h.r.uses(h.lbuf, nil) || len(h.r.free) != 4 || h.r.active != 0 || h.r.outstanding != 0 {
		t.Fatalf("after the late completions: uses %v, %d free, %d active, %d outstanding", h.r.uses(h.lbuf, nil), len(h.r.free), h.r.active, h.r.outstanding)
	}
	if st := h.r.Stats(); st.Timeouts != 2 || st.Stale != 0 || st.Requests != 0 {
		t.Fatalf("stats: %d timeouts, %d stale, %d completed", st.Timeouts, st.Stale, st.Requests)
	}
}

// TestTimeoutPoller checks that a parked poller wakes for a deadline.
func TestTimeoutPoller(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{}, ep, false)
	e := h.write(9, 0, 0, 100)
	e.Timeout = uint64(20 * time.Millisecond)
	h.submit(e)
	expectCode(t, h.one(9), cq.CodeTimeout)
	ep.release(-1, nil)
	if other := h.fence(); len(other) != 0 {
		t.Fatalf("completions after the late slice: %+v", other)
	}
}

func TestCancel(t *testing.T) {
	for _, manual := range []bool{true, false} {
		t.Run(fmt.Sprintf("manual=%v", manual), func(t *testing.T) {
			ep := &fakeEP{hold: true}
			h := newHarness(t, Config{SliceSize: 4096}, ep, manual)
			h.submit(h.write(1, 0, 0, 3*4096))
			deadline := time.Now().Add(hang)
			for ep.heldCount() < 3 {
				if h.manual {
					h.step()
				}
				if time.Now().After(deadline) {
					t.Fatal("hang: slices never posted")
				}
				runtime.Gosched()
			}
			if err := h.r.Cancel(12345); err != nil { // names nothing: ignored
				t.Fatal(err)
			}
			if err := h.r.Cancel(1); err != nil {
				t.Fatal(err)
			}
			expectCode(t, h.one(1), cq.CodeCanceled)
			ep.release(1, nil) // one slice comes back, the others fail
			ep.release(-1, transport.ErrPeer)
			if err := h.r.Cancel(1); err != nil { // already done: ignored
				t.Fatal(err)
			}
			if h.manual {
				h.step()
				if got := h.poll(); len(got) != 0 {
					t.Fatalf("completions after cancel: %+v", got)
				}
			} else if other := h.fence(); len(other) != 0 {
				t.Fatalf("completions after cancel: %+v", other)
			}
			if st := h.r.Stats(); st.Canceled != 1 || st.Retries != 0 || st.Stale != 0 {
				t.Fatalf("stats: %d canceled, %d retries, %d stale", st.Canceled, st.Retries, st.Stale)
			}
		})
	}
}

// TestCancelInSameRound cancels a request in the same round that takes
// it: its slices are then cut but not yet posted. They must not reach the
// transport after the request's slot (the only thing keeping its buffer
// registered) is released.
func TestCancelInSameRound(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{SliceSize: 4096}, ep, true)
	h.submit(h.write(1, 0, 0, 2*4096), sq.Entry{Op: sq.Cancel, Remote: 1})
	got := h.poll()
	if len(got) != 1 {
		t.Fatalf("completions %+v; want the cancel of 1", got)
	}
	expectCode(t, got[0], cq.CodeCanceled)
	if n := ep.heldCount(); n > 0 && !h.r.uses(h.lbuf, nil) {
		t.Fatalf("the transport holds %d slices of a request whose slot was released: its buffer could be unregistered under them", n)
	}
	ep.release(-1, nil)
	h.step()
	if got := h.poll(); len(got) != 0 {
		t.Fatalf("completions after the cancel: %+v", got)
	}
	if st := h.r.Stats(); st.Stale != 0 || h.r.outstanding != 0 || h.r.active != 0 {
		t.Fatalf("after the slices came back: %d stale, %d outstanding, %d active", st.Stale, h.r.outstanding, h.r.active)
	}
	// The ring still works.
	ep.setHold(false)
	h.submit(h.write(2, 0, 0, 100))
	expectCode(t, h.one(2), cq.CodeOK)
}

// TestLateCompletionGeneration reuses one slot: a slice completion of its
// earlier use must not complete the request that holds it now.
func TestLateCompletionGeneration(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{MaxInFlight: 1}, ep, true)
	a := h.write(1, 0, 0, 100)
	a.Timeout = 1
	h.submit(a)
	h.step()
	h.clock += int64(time.Millisecond)
	expectCode(t, h.one(1), cq.CodeTimeout)
	// B waits: A's slot is reserved while A's slice is out.
	h.submit(h.write(2, 100, 100, 100))
	h.step()
	if n := len(ep.postsCopy()); n != 1 {
		t.Fatalf("%d slices posted; B must wait for A's slot", n)
	}
	ep.release(-1, nil) // A's slice, late
	if got := h.poll(); len(got) != 0 {
		t.Fatalf("A's late slice produced completions %+v", got)
	}
	posts := ep.postsCopy()
	if len(posts) != 2 {
		t.Fatalf("%d slices posted; want B's after A's slot was freed", len(posts))
	}
	ia, ga, _ := splitToken(posts[0].Token)
	ib, gb, _ := splitToken(posts[1].Token)
	if ia != ib || ga == gb {
		t.Fatalf("A (slot %d gen %d) and B (slot %d gen %d): want one slot, two generations", ia, ga, ib, gb)
	}
	// A's completion again, as a confused transport might deliver it, in
	// every flavour: none may touch B.
	for _, err := range []error{nil, transport.ErrPeer, transport.ErrDenied} {
		h.r.Complete(posts[0].Token, err)
		if got := h.poll(); len(got) != 0 {
			t.Fatalf("a stale completion (%v) completed %+v", err, got)
		}
	}
	if st := h.r.Stats(); st.Stale != 3 || st.Retries != 0 {
		t.Fatalf("stats: %d stale (want 3), %d retries", st.Stale, st.Retries)
	}
	ep.release(-1, nil)
	c := h.one(2)
	expectCode(t, c, cq.CodeOK)
	if c.Bytes != 100 {
		t.Fatalf("B moved %d bytes, want 100", c.Bytes)
	}
}

// ---------------------------------------------------------------------------
// Retries over rails.

func TestRetryOtherRail(t *testing.T) {
	t.Run("one slice", func(t *testing.T) {
		ep := &fakeEP{rails: 2, fail: map[uint16]error{0: transport.ErrPeer}}
		h := newHarness(t, Config{SliceSize: 4096}, ep, true)
		fillPattern(h.local[:100], 3)
		h.submit(h.write(1, 0, 0, 100)) // the ring's first request starts on rail 0
		c := h.collect(1)[0]
		expectCode(t, c, cq.CodeOK)
		posts := ep.postsCopy()
		if len(posts) != 2 || posts[0].Rail != 0 || posts[1].Rail != 1 {
			t.Fatalf("posts on rails %v; want 0 then 1", rails(posts))
		}
		if h.r.Stats().Retries != 1 || string(h.remote[:100]) != string(h.local[:100]) {
			t.Fatalf("%d retries; data equal %v", h.r.Stats().Retries, string(h.remote[:100]) == string(h.local[:100]))
		}
	})
	// Half the slices of a request land on the dead rail; each must move
	// to the live one on its retry, within the retry limit.
	for _, async := range []bool{false, true} {
		t.Run(fmt.Sprintf("several slices async=%v", async), func(t *testing.T) {
			ep := &fakeEP{rails: 2, async: async, fail: map[uint16]error{0: transport.ErrPeer}}
			h := newHarness(t, Config{SliceSize: 4096, RetryLimit: 3}, ep, async == false)
			fillPattern(h.local[:4*4096], 4)
			h.submit(h.write(1, 0, 0, 4*4096))
			c := h.collect(1)[0]
			if c.Code != cq.CodeOK {
				t.Fatalf("a 4-slice request over 2 rails, rail 0 dead, retry limit 3: %v (rails posted %v); want it to complete on rail 1", c.Err(), rails(ep.postsCopy()))
			}
			if n := h.r.Stats().Retries; n != 2 {
				t.Fatalf("%d retries; want 2 (the two slices on rail 0, once each)", n)
			}
			if string(h.remote[:4*4096]) != string(h.local[:4*4096]) {
				t.Fatal("data differs")
			}
		})
	}
	t.Run("three rails two dead", func(t *testing.T) {
		ep := &fakeEP{rails: 3, fail: map[uint16]error{0: transport.ErrPeer, 1: transport.ErrPeer}}
		h := newHarness(t, Config{SliceSize: 4096, RetryLimit: 2}, ep, true)
		h.submit(h.write(1, 0, 0, 100))
		expectCode(t, h.collect(1)[0], cq.CodeOK)
		if got := rails(ep.postsCopy()); !slices.Equal(got, []uint16{0, 1, 2}) {
			t.Fatalf("rails %v; want 0, 1, 2", got)
		}
	})
	t.Run("all rails dead", func(t *testing.T) {
		ep := &fakeEP{rails: 2, fail: map[uint16]error{0: transport.ErrPeer, 1: errors.New("some link error")}}
		h := newHarness(t, Config{SliceSize: 4096, RetryLimit: 5}, ep, true)
		h.submit(h.write(1, 0, 0, 100))
		c := h.collect(1)[0]
		expectCode(t, c, cq.CodeTransport)
		if !errors.Is(c.Err(), cq.ErrTransport) {
			t.Fatalf("error %v; want ErrTransport", c.Err())
		}
		st := h.r.Stats()
		if st.Retries != 5 || len(ep.postsCopy()) != 6 || st.Failed != 1 {
			t.Fatalf("%d retries, %d posts, %d failed; want 5, 6, 1", st.Retries, len(ep.postsCopy()), st.Failed)
		}
		if string(h.remote[:100]) != string(slices.Repeat([]byte{0xEE}, 100)) {
			t.Fatal("a failed slice moved bytes")
		}
	})
	for _, tc := range []struct {
		err  error
		code cq.Code
	}{
		{transport.ErrDenied, cq.CodeDenied},
		{fmt.Errorf("wrapped: %w", transport.ErrRange), cq.CodeRemoteRange},
		{transport.ErrClosed, cq.CodeClosed},
	} {
		t.Run(fmt.Sprintf("final %v", tc.err), func(t *testing.T) {
			ep := &fakeEP{rails: 2, fail: map[uint16]error{0: tc.err, 1: tc.err}}
			h := newHarness(t, Config{SliceSize: 4096}, ep, true)
			h.submit(h.write(1, 0, 0, 3*4096))
			expectCode(t, h.collect(1)[0], tc.code)
			if n := h.r.Stats().Retries; n != 0 {
				t.Fatalf("%d retries of a final error", n)
			}
		})
	}
	t.Run("Post refuses", func(t *testing.T) {
		ep := &fakeEP{rails: 2, postErr: fmt.Errorf("gone: %w", transport.ErrClosed)}
		h := newHarness(t, Config{SliceSize: 4096}, ep, true)
		h.submit(h.write(1, 0, 0, 3*4096))
		expectCode(t, h.collect(1)[0], cq.CodeClosed)
		if h.r.active != 0 || h.r.outstanding != 0 {
			t.Fatalf("%d active, %d outstanding after Post refused", h.r.active, h.r.outstanding)
		}
	})
}

func rails(s []transport.Slice) []uint16 {
	var out []uint16
	for _, x := range s {
		out = append(out, x.Rail)
	}
	return out
}

// ---------------------------------------------------------------------------
// Backpressure.

// TestBackpressure has the endpoint take fewer slices than offered: every
// slice must still be posted exactly once.
func TestBackpressure(t *testing.T) {
	t.Run("manual", func(t *testing.T) {
		ep := &fakeEP{hold: true, capacity: 70}
		h := newHarness(t, Config{SliceSize: 1024}, ep, true)
		const n = 200 * 1024
		fillPattern(h.local[:n], 5)
		h.submit(h.write(1, 0, 0, n))
		var got []cq.Completion
		for i := 0; i < 100 && len(got) == 0; i++ {
			h.step()
			ep.release(-1, nil)
			got = h.poll()
		}
		if len(got) != 1 {
			t.Fatalf("completions %+v; want the one request", got)
		}
		expectCode(t, got[0], cq.CodeOK)
		checkPostedOnce(t, ep, 200)
		if got[0].Bytes != n || string(h.remote[:n]) != string(h.local[:n]) {
			t.Fatalf("%d bytes reported; data equal %v", got[0].Bytes, string(h.remote[:n]) == string(h.local[:n]))
		}
	})
	t.Run("poller", func(t *testing.T) {
		ep := &fakeEP{async: true, capacity: 5, rails: 2}
		h := newHarness(t, Config{SliceSize: 1024}, ep, false)
		fillPattern(h.local, 6)
		var es []sq.Entry
		for i := uint64(0); i < 8; i++ {
			es = append(es, h.write(i, i*64<<10, i*64<<10, 64<<10-uint64(i)))
		}
		h.submit(es...)
		for _, c := range h.collect(len(es)) {
			expectCode(t, c, cq.CodeOK)
			if c.Bytes != es[c.UserData].Length {
				t.Fatalf("request %d: %d bytes, want %d", c.UserData, c.Bytes, es[c.UserData].Length)
			}
		}
		for _, e := range es {
			if r := e.Remote - h.r1; string(h.remote[r:r+e.Length]) != string(h.local[e.Local:e.Local+e.Length]) || (e.UserData > 0 && h.remote[r+e.Length] != 0xEE) {
				t.Fatalf("request %d: data differs or the byte after it changed", e.UserData)
			}
		}
		ep.mu.Lock()
		defer ep.mu.Unlock()
		if ep.dups != 0 {
			t.Fatalf("%d slices posted again while out", ep.dups)
		}
	})
}

// An endpoint that refused slices for want of room is offered them again
// after a few of the ring's slices complete, not at every completion:
// each offer of a whole batch that it refuses again costs an add and a
// look per slice (with one completion a step, about 64 offers a slice
// before waitingRoom, 4 after).
func TestFullEndpointWaitsForRoom(t *testing.T) {
	ep := &fakeEP{hold: true, capacity: 32}
	h := newHarness(t, Config{SliceSize: 64}, ep, true)
	const slices = 2000
	const n = slices * 64
	fillPattern(h.local[:n], 7)
	h.submit(h.write(1, 0, 0, n))
	var got []cq.Completion
	for i := 0; i < 10*slices && len(got) == 0; i++ {
		h.step()
		ep.release(1, nil)
		got = h.poll()
	}
	if len(got) != 1 {
		t.Fatalf("completions %+v; want the one request", got)
	}
	expectCode(t, got[0], cq.CodeOK)
	checkPostedOnce(t, ep, slices)
	if string(h.remote[:n]) != string(h.local[:n]) {
		t.Fatal("data differs")
	}
	ep.mu.Lock()
	offered := ep.offered
	ep.mu.Unlock()
	if offered > 8*slices {
		t.Fatalf("%d slices offered for %d posted: the full endpoint was offered a batch at every completion", offered, slices)
	}
	t.Logf("%d slices offered for %d posted", offered, slices)
}

// A request whose slices all complete within a round that outlived its
// deadline (a Post that took long, as tcp's writing its frames does) ends
// with a timeout: the round checks the deadlines at the time it ends, not
// at the time it began, before the next round reaps the slices as done.
func TestSlowPostTimesOut(t *testing.T) {
	ep := &fakeEP{stall: 20 * time.Millisecond}
	h := newHarness(t, Config{SliceSize: 64 << 10, Timeout: 2 * time.Millisecond}, ep, false)
	h.submit(h.write(1, 0, 0, hR1)) // 8 slices, 512 KiB in one round
	got := h.collect(1)
	expectCode(t, got[0], cq.CodeTimeout)
}

// checkPostedOnce checks that the endpoint accepted each of the n slices of
// the harness's only request exactly once.
func checkPostedOnce(t *testing.T, ep *fakeEP, n int) {
	t.Helper()
	count := map[uint32]int{}
	for _, s := range ep.postsCopy() {
		_, _, i := splitToken(s.Token)
		count[i]++
	}
	for i := 0; i < n; i++ {
		if count[uint32(i)] != 1 {
			t.Fatalf("slice %d posted %d times", i, count[uint32(i)])
		}
	}
	if len(count) != n {
		t.Fatalf("%d distinct slices posted, want %d", len(count), n)
	}
}

// ---------------------------------------------------------------------------
// Bad entries.

func TestBadEntries(t *testing.T) {
	ep := &fakeEP{}
	h := newHarness(t, Config{MaxLength: 2 << 20}, ep, true)
	// A stale buffer ID: registered, then unregistered.
	stale, err := h.bufs.Register(make([]byte, 64), "", false)
	if err != nil {
		t.Fatal(err)
	}
	stale.Regs[0].Store(&segtable.Registration{})
	if _, err := h.bufs.Unregister(context.Background(), stale.ID); err != nil {
		t.Fatal(err)
	}
	// A buffer without a registration for the segment's transport.
	unreg, err := h.bufs.Register(make([]byte, 64), "", false)
	if err != nil {
		t.Fatal(err)
	}
	// A buffer staged for the segment's transport, on a segment that has
	// no staged endpoint.
	staged, err := h.bufs.Register(make([]byte, 64), "", false)
	if err != nil {
		t.Fatal(err)
	}
	staged.Regs[0].Store(&segtable.Registration{Handle: 7, Staged: true})
	// A stale segment ID.
	gone, err := h.segs.Open("gone", h.seg.Desc(), 0, 0, ep, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.segs.Close(context.Background(), gone.ID); err != nil {
		t.Fatal(err)
	}
	ok := h.write(0, 0, 0, 8)
	type bad struct {
		name string
		code cq.Code
		mod  func(e *sq.Entry)
	}
	reservedAt := func(off int) func(e *sq.Entry) {
		return func(e *sq.Entry) { (*[sq.EntrySize]byte)(unsafe.Pointer(e))[off] = 1 }
	}
	cases := []bad{
		{"valid", cq.CodeOK, func(e *sq.Entry) {}},
		{"nop", cq.CodeOK, func(e *sq.Entry) { e.Op = sq.Nop }},
		{"unknown op 4", cq.CodeInvalid, func(e *sq.Entry) { e.Op = 4 }},
		{"unknown op 255", cq.CodeInvalid, func(e *sq.Entry) { e.Op = 255 }},
		{"unknown flag", cq.CodeInvalid, func(e *sq.Entry) { e.Flags = 0x40 }},
		{"notify on a read", cq.CodeInvalid, func(e *sq.Entry) { e.Op = sq.Read; e.Flags = sq.FlagNotify }},
		{"high flag", cq.CodeInvalid, func(e *sq.Entry) { e.Flags = 0x80 }},
		{"reserved byte 2", cq.CodeInvalid, reservedAt(2)},
		{"reserved byte 3", cq.CodeInvalid, reservedAt(3)},
		{"reserved byte 12", cq.CodeInvalid, reservedAt(12)},
		{"reserved byte 15", cq.CodeInvalid, reservedAt(15)},
		{"reserved byte 13", cq.CodeInvalid, reservedAt(13)},
		{"reserved byte on a nop", cq.CodeInvalid, func(e *sq.Entry) { e.Op = sq.Nop; reservedAt(14)(e) }},
		{"zero length", cq.CodeLength, func(e *sq.Entry) { e.Length = 0 }},
		{"length over MaxLength", cq.CodeLength, func(e *sq.Entry) { e.Length = 2<<20 + 1 }},
		{"huge length", cq.CodeLength, func(e *sq.Entry) { e.Length = math.MaxUint64 }},
		{"buffer 0", cq.CodeBadBuffer, func(e *sq.Entry) { e.Buffer = 0 }},
		{"unknown buffer", cq.CodeBadBuffer, func(e *sq.Entry) { e.Buffer = 12345 }},
		{"stale buffer", cq.CodeBadBuffer, func(e *sq.Entry) { e.Buffer = stale.ID }},
		{"local past the end", cq.CodeLocalRange, func(e *sq.Entry) { e.Local = hLocal - 4 }},
		{"local at the end", cq.CodeLocalRange, func(e *sq.Entry) { e.Local = hLocal; e.Length = 1 }},
		{"local offset wrapping", cq.CodeLocalRange, func(e *sq.Entry) { e.Local = math.MaxUint64 - 2 }},
		{"local longer than the buffer", cq.CodeLocalRange, func(e *sq.Entry) { e.Local = 0; e.Length = hLocal + 1 }},
		{"segment 0, no local segment set", cq.CodeBadSegment, func(e *sq.Entry) { e.Segment = segtable.LocalSegmentID }},
		{"unknown segment", cq.CodeBadSegment, func(e *sq.Entry) { e.Segment = 999 }},
		{"stale segment", cq.CodeBadSegment, func(e *sq.Entry) { e.Segment = gone.ID }},
		{"remote past R2", cq.CodeRemoteRange, func(e *sq.Entry) { e.Remote = h.r2 + hR2 - 4 }},
		{"remote in the gap", cq.CodeRemoteRange, func(e *sq.Entry) { e.Remote = h.r1 + hR1 + 1 }},
		{"remote straddling R1 and the gap", cq.CodeRemoteRange, func(e *sq.Entry) { e.Remote = h.r1 + hR1 - 4 }},
		{"remote below R1", cq.CodeRemoteRange, func(e *sq.Entry) { e.Remote = h.r1 - 1 }},
		{"remote wrapping", cq.CodeRemoteRange, func(e *sq.Entry) { e.Remote = math.MaxUint64 - 2 }},
		{"no registration for the transport", cq.CodeNoTransport, func(e *sq.Entry) { e.Buffer = unreg.ID }},
		{"staged registration, no staged endpoint", cq.CodeNoTransport, func(e *sq.Entry) { e.Buffer = staged.ID }},
		{"read: unknown op flag", cq.CodeInvalid, func(e *sq.Entry) { e.Op = sq.Read; e.Flags = 0x40 }},
		{"read: remote in the gap", cq.CodeRemoteRange, func(e *sq.Entry) { e.Op = sq.Read; e.Remote = h.r1 + hR1 }},
	}
	var es []sq.Entry
	for i, c := range cases {
		e := ok
		e.UserData = uint64(i)
		c.mod(&e)
		es = append(es, e)
	}
	h.submit(es...)
	got := h.collect(len(es))
	if len(got) != len(es) {
		t.Fatalf("%d completions for %d entries", len(got), len(es))
	}
	for _, c := range got {
		tc := cases[c.UserData]
		if c.Code != tc.code || c.Status != tc.code.Status() {
			t.Errorf("%s: status %v code %d (%v); want code %d (%v)", tc.name, c.Status, c.Code, c.Err(), tc.code, tc.code.Err())
		}
	}
	// Only the valid write moved bytes: 8 of them.
	for i, b := range h.remote {
		if b != 0xEE && i >= 8 {
			t.Fatalf("remote byte %d changed by a refused entry", i)
		}
	}
	if len(ep.postsCopy()) != 1 {
		t.Fatalf("%d slices posted; only the valid write may post", len(ep.postsCopy()))
	}
}

// TestStagedRoute: the requests of a buffer whose registration is Staged
// go to the segment's Staged endpoint, with the staged handle, and never
// to its Endpoint (nor inline, though the endpoint could copy at once);
// the other buffers' requests go to Endpoint.
func TestStagedRoute(t *testing.T) {
	ep := &fakeEP{}
	h := newHarness(t, Config{SliceSize: 4096}, ep, true)
	sep := &fakeEP{rails: 1, out: map[uint64]bool{}, mem: ep.mem, base: ep.base}
	t.Cleanup(func() { sep.Close(); sep.wg.Wait() })
	seg, err := h.segs.Open("staged", h.seg.Desc(), 0, 0, ep, sep)
	if err != nil {
		t.Fatal(err)
	}
	dev := make([]byte, 3*4096)
	for i := range dev {
		dev[i] = byte(i*7 + 1)
	}
	db, err := h.bufs.Register(dev, "cuda:0", false)
	if err != nil {
		t.Fatal(err)
	}
	db.Regs[0].Store(&segtable.Registration{Handle: 77, Staged: true})
	want := bytes.Clone(dev)
	w := h.write(1, 0, 0, 3*4096)
	w.Segment, w.Buffer = seg.ID, db.ID
	plain := h.write(2, 0, 3*4096, 8)
	plain.Segment = seg.ID
	rd := w
	rd.Op, rd.UserData, rd.Remote = sq.Read, 3, w.Remote+4096
	h.submit(w, plain, rd)
	for _, c := range h.collect(3) {
		if c.Code != cq.CodeOK {
			t.Errorf("request %d: %v", c.UserData, c.Err())
		}
	}
	// The fake moves slices in the order posted: the WRITE, then the READ
	// of its last two thirds.
	if !bytes.Equal(h.remote[:3*4096], want) {
		t.Error("the staged WRITE's bytes did not land")
	}
	if !bytes.Equal(dev[:2*4096], want[4096:]) {
		t.Error("the staged READ's bytes did not land")
	}
	sp := sep.postsCopy()
	if len(sp) != 6 {
		t.Fatalf("%d slices posted to the staged endpoint, want 6 (two requests of 3 slices)", len(sp))
	}
	for _, s := range sp {
		if s.LocalHandle != 77 {
			t.Errorf("staged slice with local handle %d, want 77", s.LocalHandle)
		}
	}
	if n := len(ep.postsCopy()); n != 1 {
		t.Errorf("%d slices posted to the segment's endpoint, want 1 (the plain WRITE)", n)
	}
}

// TestClosingBuffer: a buffer that began unregistering is refused, and
// accepted again when the unregistration gives up.
func TestClosingBuffer(t *testing.T) {
	ep := &fakeEP{}
	h := newHarness(t, Config{}, ep, true)
	var busy atomic.Bool
	busy.Store(true)
	h.bufs.Busy = func(*segtable.Buffer) bool { return busy.Load() }
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := h.bufs.Unregister(ctx, h.lbuf.ID)
		errc <- err
	}()
	waitFor(t, "unregistration never began", h.lbuf.Closing)
	h.submit(h.write(1, 0, 0, 8))
	expectCode(t, h.one(1), cq.CodeBadBuffer)
	cancel()
	if err := <-errc; !errors.Is(err, segtable.ErrBusy) {
		t.Fatalf("Unregister: %v; want ErrBusy", err)
	}
	h.bufs.Busy = nil
	h.submit(h.write(2, 0, 0, 8))
	expectCode(t, h.one(2), cq.CodeOK)
}

// ---------------------------------------------------------------------------
// Close, overflow, concurrency.

func TestCloseInFlight(t *testing.T) {
	ep := &fakeEP{hold: true, rails: 2}
	h := newHarness(t, Config{Entries: 16, MaxInFlight: 4, SliceSize: 4096}, ep, false)
	var es []sq.Entry
	for i := uint64(0); i < 14; i++ {
		es = append(es, h.write(i, i*8192, i*8192, 8192))
	}
	h.submit(es...)
	deadline := time.Now().Add(hang)
	for ep.heldCount() < 8 { // 4 requests of 2 slices in flight
		if time.Now().After(deadline) {
			t.Fatalf("hang: %d slices posted", ep.heldCount())
		}
		runtime.Gosched()
	}
	if err := h.r.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := h.r.Submit(es[:1]); !errors.Is(err, ErrClosed) {
		t.Fatalf("Submit after Close: %v; want ErrClosed", err)
	}
	got := h.poll() // Close returns after every completion is posted
	seen := map[uint64]int{}
	for _, c := range got {
		seen[c.UserData]++
		expectCode(t, c, cq.CodeClosed)
	}
	for _, e := range es {
		if seen[e.UserData] != 1 {
			t.Fatalf("request %d completed %d times", e.UserData, seen[e.UserData])
		}
	}
	if len(got) != len(es) {
		t.Fatalf("%d completions for %d requests", len(got), len(es))
	}
	// The held slices come back to a closed ring: no completion, and the
	// poller lets the ring go once they are all in.
	ep.release(-1, nil)
	for h.p.Uses(h.lbuf, nil) {
		if time.Now().After(deadline) {
			t.Fatal("hang: the closed ring never drained")
		}
		time.Sleep(time.Millisecond)
	}
	if got := h.poll(); len(got) != 0 {
		t.Fatalf("completions after Close: %+v", got)
	}
	if err := h.r.CQ().Wait(context.Background(), 1); !errors.Is(err, cq.ErrClosed) {
		t.Fatalf("Wait on a closed, drained ring: %v", err)
	}
}

// TestSubmitCloseRace closes a ring while goroutines submit to it: every
// entry Submit accepted completes exactly once.
func TestSubmitCloseRace(t *testing.T) {
	rounds := 30
	if testing.Short() {
		rounds = 5
	}
	for round := 0; round < rounds; round++ {
		t.Run(fmt.Sprint(round), func(t *testing.T) { submitCloseRound(t) })
	}
}

func submitCloseRound(t *testing.T) {
	{
		ep := &fakeEP{async: true}
		h := newHarness(t, Config{Entries: 64, SliceSize: 4096}, ep, false)
		var accepted atomic.Int64
		var wg sync.WaitGroup
		var started sync.WaitGroup
		for g := 0; g < 3; g++ {
			wg.Add(1)
			started.Add(1)
			go func() {
				defer wg.Done()
				first := true
				for i := uint64(0); ; i++ {
					e := sq.Entry{Op: sq.Nop, UserData: uint64(g)<<32 | i}
					if i%3 == 0 {
						// A region of its own: at most Entries requests
						// are out at once, far fewer than 1600.
						off := uint64(g)*160<<10 + (i/3%1600)*100
						e = h.write(e.UserData, off, off, 100)
					}
					n, err := h.r.Submit([]sq.Entry{e})
					accepted.Add(int64(n))
					if first {
						first = false
						started.Done()
					}
					if errors.Is(err, ErrClosed) {
						return
					}
					if n == 0 {
						runtime.Gosched()
					}
				}
			}()
		}
		started.Wait()
		var got []cq.Completion
		got = append(got, h.poll()...)
		if err := h.r.Close(); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		got = append(got, h.poll()...)
		seen := map[uint64]int{}
		for _, c := range got {
			seen[c.UserData]++
			if seen[c.UserData] > 1 {
				t.Fatalf("entry %#x completed twice", c.UserData)
			}
		}
		if int64(len(got)) != accepted.Load() {
			t.Fatalf("Submit accepted %d entries, %d completed", accepted.Load(), len(got))
		}
	}
}

func TestCQOverflow(t *testing.T) {
	ep := &fakeEP{async: true, rails: 2}
	h := newHarness(t, Config{Entries: 16, CQEntries: 2, SliceSize: 4096}, ep, false)
	const n = 300
	for i := uint64(0); i < n; i++ {
		e := h.write(i, i*1024, i*1024, 1000)
		if i%4 == 3 {
			e = sq.Entry{Op: sq.Nop, UserData: i}
		}
		h.submit(e) // the SQ drains without reaping: completions overflow
	}
	// Let everything complete before reading anything.
	deadline := time.Now().Add(hang)
	for h.r.Stats().Requests < n {
		if time.Now().After(deadline) {
			t.Fatalf("hang: %d of %d requests completed", h.r.Stats().Requests, n)
		}
		time.Sleep(time.Millisecond)
	}
	got := h.collect(n)
	if len(got) != n {
		t.Fatalf("%d completions for %d requests", len(got), n)
	}
	seen := map[uint64]bool{}
	for _, c := range got {
		if seen[c.UserData] || c.UserData >= n {
			t.Fatalf("completion for %d twice or unknown", c.UserData)
		}
		seen[c.UserData] = true
		expectCode(t, c, cq.CodeOK)
	}
	if h.r.CQ().Overflowed() == 0 {
		t.Fatalf("no overflow with a 2-entry CQ: the test proved nothing")
	}
}

// TestConcurrentSubmitters runs several submitters and checks every
// request's data and its single completion.
func TestConcurrentSubmitters(t *testing.T) {
	ep := &fakeEP{async: true, rails: 2}
	h := newHarness(t, Config{Entries: 32, SliceSize: 2048}, ep, false)
	const (
		workers = 4
		each    = 40
		region  = hR1 / workers
	)
	fillPattern(h.local, 8)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				n := uint64(1 + (i*977)%(region/each-1))
				off := uint64(w*region + i*(region/each))
				e := h.write(uint64(w<<16|i), off, off, n)
				for {
					if _, err := h.r.Submit([]sq.Entry{e}); err == nil {
						break
					}
					runtime.Gosched()
				}
			}
		}()
	}
	got := h.collect(workers * each)
	wg.Wait()
	seen := map[uint64]bool{}
	for _, c := range got {
		if seen[c.UserData] {
			t.Fatalf("request %#x completed twice", c.UserData)
		}
		seen[c.UserData] = true
		expectCode(t, c, cq.CodeOK)
	}
	if len(seen) != workers*each {
		t.Fatalf("%d requests completed, want %d", len(seen), workers*each)
	}
	for w := 0; w < workers; w++ {
		for i := 0; i < each; i++ {
			n := 1 + (i*977)%(region/each-1)
			off := w*region + i*(region/each)
			if string(h.remote[off:off+n]) != string(h.local[off:off+n]) {
				t.Fatalf("request %d/%d: data differs", w, i)
			}
			if h.remote[off+n] != 0xEE { // it belongs to no request
				t.Fatalf("request %d/%d: byte after the range changed", w, i)
			}
		}
	}
}

// writeAll submits WRITEs into the segment's first buffer, expects every
// one to complete, and checks their bytes landed.
func (h *harness) writeAll(es []sq.Entry) {
	h.t.Helper()
	h.submit(es...)
	for _, c := range h.collect(len(es)) {
		expectCode(h.t, c, cq.CodeOK)
	}
	for _, e := range es {
		r := e.Remote - h.r1
		if string(h.remote[r:r+e.Length]) != string(h.local[e.Local:e.Local+e.Length]) {
			h.t.Fatalf("write %d: data differs", e.UserData)
		}
	}
}

// batchEP is a fakeEP that moves slices synchronously, a batch per call.
type batchEP struct {
	*fakeEP
	calls, most int
}

func (b *batchEP) Copy(s *transport.Slice) error { return b.move(s) }

func (b *batchEP) CopyBatch(s []transport.Slice, errs []error) {
	b.calls++
	b.most = max(b.most, len(s))
	for i := range s {
		errs[i] = b.move(&s[i])
	}
}

// TestBatchCopier: a BatchCopier gets the slices of a round in one call;
// data lands, and a slice failed on one rail is retried on another.
func TestBatchCopier(t *testing.T) {
	f := &fakeEP{rails: 2, fail: map[uint16]error{1: transport.ErrPeer}}
	ep := &batchEP{fakeEP: f}
	h := newHarness(t, Config{SliceSize: 4096, RetryLimit: 8}, f, true)
	h.seg.Path().Endpoint = ep
	fillPattern(h.local, 3)
	var es []sq.Entry
	for i := range 16 {
		es = append(es, h.write(uint64(i), uint64(i)*8192, uint64(i)*8192, 8000))
	}
	h.writeAll(es)
	if ep.most < 2 {
		t.Fatalf("CopyBatch got at most %d slices a call in %d calls", ep.most, ep.calls)
	}
	if st := h.r.Stats(); st.Retries == 0 {
		t.Fatalf("no retries, though rail 1 fails every slice")
	}
}

// copyEP is a fakeEP that moves slices synchronously, one per call, and
// counts the calls per rail.
type copyEP struct {
	*fakeEP
	rails map[uint16]int
	r     *Ring
	// inline and slotted count the copies made with no request in the
	// in-flight table (copyInline) and with one (copyEach).
	inline, slotted int
}

func (c *copyEP) Copy(s *transport.Slice) error {
	c.rails[s.Rail]++
	if c.r.active == 0 {
		c.inline++
	} else {
		c.slotted++
	}
	return c.move(s)
}

// TestCopyInline: a one-slice request on a synchronous endpoint is copied
// as the poller takes it (no slot, no Post); a failed inline copy is
// retried on the next rail and counted as a retry; a longer request and a
// failure past the retry limit take their usual ways.
func TestCopyInline(t *testing.T) {
	f := &fakeEP{rails: 2}
	ep := &copyEP{fakeEP: f, rails: map[uint16]int{}}
	h := newHarness(t, Config{SliceSize: 4096, RetryLimit: 1}, f, true)
	h.seg.Path().Endpoint = ep
	ep.r = h.r
	fillPattern(h.local, 5)

	h.submit(h.write(1, 0, 0, 4096))
	c := h.collect(1)[0]
	expectCode(t, c, cq.CodeOK)
	if c.Bytes != 4096 || string(h.remote[:4096]) != string(h.local[:4096]) {
		t.Fatalf("inline write: %d bytes, data equal %v", c.Bytes, string(h.remote[:4096]) == string(h.local[:4096]))
	}
	if h.r.active != 0 || len(h.r.free) != len(h.r.reqs) {
		t.Fatalf("inline request took a slot: %d active, %d of %d free", h.r.active, len(h.r.free), len(h.r.reqs))
	}
	if len(f.postsCopy()) != 0 || ep.inline != 1 || ep.slotted != 0 {
		t.Fatalf("inline request: %d posts, %d copies inline, %d from a slot; want 0, 1, 0", len(f.postsCopy()), ep.inline, ep.slotted)
	}

	// Rail of the next request fails once: the retry goes to the other rail.
	next := uint16(h.r.rail % 2)
	before := maps.Clone(ep.rails)
	f.fail = map[uint16]error{next: transport.ErrPeer}
	h.submit(h.read(2, 8192, 0, 4096))
	c = h.collect(1)[0]
	expectCode(t, c, cq.CodeOK)
	if string(h.local[8192:8192+4096]) != string(h.remote[:4096]) {
		t.Fatalf("retried read: data differs")
	}
	if st := h.r.Stats(); st.Retries != 1 || ep.rails[next] != before[next]+1 || ep.rails[1-next] != before[1-next]+1 {
		t.Fatalf("retries %d, copies per rail %v; want 1 retry and the retry on rail %d", st.Retries, ep.rails, 1-next)
	}

	// Both rails fail: the retry limit ends it FAILED, with no bytes.
	f.fail = map[uint16]error{0: transport.ErrPeer, 1: transport.ErrPeer}
	h.submit(h.write(3, 0, 0, 100))
	expectCode(t, h.collect(1)[0], cq.CodeTransport)

	// A bounds error is not retried and fails at once.
	f.fail = nil
	h.submit(h.write(4, 0, hR1-10, 100))
	expectCode(t, h.collect(1)[0], cq.CodeRemoteRange)

	// Several slices: the normal way, through the slot table.
	slotted := ep.slotted
	h.submit(h.write(5, 0, 0, 3*4096))
	expectCode(t, h.collect(1)[0], cq.CodeOK)
	if h.r.Stats().Retries != 2 || ep.slotted != slotted+3 {
		t.Fatalf("retries %d, %d copies from a slot; want 2 and %d", h.r.Stats().Retries, ep.slotted, slotted+3)
	}
}

// holdEP is a fakeEP whose memory is one region with a reference count,
// as local's and shm's: CopyHold leaves the reference in the Holds it is
// given, Copy takes and drops its own.
type holdEP struct {
	*fakeEP
	ref      segtable.Ref
	acquires int
	// heldAtCopy counts copies that found the reference held by
	// someone other than their Holds: the ring must give its round's
	// back before a flush calls into the endpoint.
	heldAtCopy int
}

func (c *holdEP) Copy(s *transport.Slice) error { return c.CopyHold(s, nil) }

func (c *holdEP) CopyHold(s *transport.Slice, h *transport.Holds) error {
	held := h != nil && h.Has(&c.ref)
	if !held && c.ref.InUse() != 0 {
		c.heldAtCopy++
	}
	ok, release := h.Take(&c.ref)
	if !ok {
		return transport.ErrDenied
	}
	if !held {
		c.acquires++
	}
	err := c.move(s)
	if release {
		c.ref.Release()
	}
	return err
}

// TestHoldingCopier: the one-slice requests of a round take the region's
// reference once and the ring gives it back at the end of the round, and
// before a flush calls into the endpoint; the flush's copies take it once
// for the batch; a region being drained is refused.
func TestHoldingCopier(t *testing.T) {
	f := &fakeEP{rails: 1}
	ep := &holdEP{fakeEP: f}
	h := newHarness(t, Config{SliceSize: 4096}, f, true)
	h.seg.Path().Endpoint = ep
	fillPattern(h.local, 9)
	var es []sq.Entry
	for i := range 8 {
		es = append(es, h.write(uint64(i), uint64(i)*4096, uint64(i)*4096, 4096))
	}
	h.writeAll(es)
	if ep.acquires != 1 || ep.ref.InUse() != 0 {
		t.Fatalf("8 one-slice writes in one round: %d acquires (want 1), %d references held after it (want 0)", ep.acquires, ep.ref.InUse())
	}
	// An inline copy, then a request of three slices in the same round:
	// the flush that copies those gives the inline copy's reference back
	// first (else its copies would find it held, and take none), then
	// takes it once for the three.
	ep.acquires = 0
	h.writeAll([]sq.Entry{h.write(10, 0, 64<<10, 4096), h.write(11, 8192, 96<<10, 3*4096)})
	if ep.heldAtCopy != 0 || ep.ref.InUse() != 0 || ep.acquires != 2 {
		t.Fatalf("copies found the reference held elsewhere %d times; %d held after the round; %d acquires (want 0, 0, 2)", ep.heldAtCopy, ep.ref.InUse(), ep.acquires)
	}
	// A drained region (nothing held: Drain returns at once, and refuses
	// references from then on) takes no new one.
	if err := ep.ref.Drain(context.Background()); err != nil {
		t.Fatal(err)
	}
	h.submit(h.write(20, 0, 0, 4096))
	expectCode(t, h.collect(1)[0], cq.CodeDenied)
}

// inlineEP is a batchEP that moves slices of the first half of the
// segment's first buffer at once (CopyNow) and leaves the others to
// batches.
type inlineEP struct {
	*batchEP
	now int
}

func (c *inlineEP) CopyNow(s *transport.Slice, _ *transport.Holds) (bool, error) {
	if s.Remote-c.base >= hR1/2 {
		return false, nil
	}
	c.now++
	return true, c.move(s)
}

// TestInlineCopier: an InlineCopier's slices that it takes at once
// complete without a slot, the others go through CopyBatch, and data lands
// either way.
func TestInlineCopier(t *testing.T) {
	f := &fakeEP{rails: 1}
	ep := &inlineEP{batchEP: &batchEP{fakeEP: f}}
	h := newHarness(t, Config{SliceSize: 4096}, f, true)
	h.seg.Path().Endpoint = ep
	fillPattern(h.local, 7)
	write := func(i int) sq.Entry {
		roff := uint64(i) * 4096
		if i%2 == 1 {
			roff += hR1 / 2 // the half CopyNow leaves to batches
		}
		return h.write(uint64(i), uint64(i)*4096, roff, 4000)
	}
	// Interleaved: once a slice waits in the batch for the endpoint, the
	// requests after it join the batch too (their order is kept).
	var es []sq.Entry
	for i := range 16 {
		es = append(es, write(i))
	}
	h.writeAll(es)
	if ep.now != 1 || ep.calls == 0 {
		t.Fatalf("interleaved: %d slices copied at once, %d CopyBatch calls; want 1 and some", ep.now, ep.calls)
	}
	// The ones CopyNow takes first: each is copied at once.
	es = es[:0]
	for i := 0; i < 16; i += 2 {
		es = append(es, write(i))
	}
	for i := 1; i < 16; i += 2 {
		es = append(es, write(i))
	}
	h.writeAll(es)
	if ep.now != 1+8 {
		t.Fatalf("%d slices copied at once; want 9", ep.now)
	}
}

// sqCheckEP is a copyEP that checks, at every copy, that the caller can
// see no completion for an entry the SQ still holds: a caller that keeps at
// most Entries requests in flight must never find the SQ full.
type sqCheckEP struct {
	*copyEP
	submitted int
	bad       string
}

func (c *sqCheckEP) Copy(s *transport.Slice) error {
	seen, consumed := c.r.cq.Ready(), c.submitted-c.r.sq.Len()
	if seen > consumed && c.bad == "" {
		c.bad = fmt.Sprintf("%d completions readable, but only %d of %d entries left the SQ", seen, consumed, c.submitted)
	}
	return c.copyEP.Copy(s)
}

// TestCompletionFreesSQ: a completion becomes readable only once its
// entry has left the SQ, even when a round's completions outgrow the
// poller's completion buffer (slice completions reaped first, then a full
// take of inline copies).
func TestCompletionFreesSQ(t *testing.T) {
	f := &fakeEP{} // not a Copier: requests take slots, complete through reap
	h := newHarness(t, Config{Entries: 256, SliceSize: 4096}, f, true)
	for i := range uint64(10) {
		h.submit(h.write(i, i*100, i*100, 100))
	}
	h.step() // posted; their slice completions wait for the next round's reap
	if n := h.r.cq.Ready(); n != 0 {
		t.Fatalf("%d completions after the first round; the test needs them reaped in the second", n)
	}
	ep := &sqCheckEP{copyEP: &copyEP{fakeEP: f, rails: map[uint16]int{}, r: h.r}, submitted: 10}
	h.seg.Path().Endpoint = ep
	for i := range uint64(64) {
		h.submit(h.write(100+i, i*100, i*100, 100))
	}
	ep.submitted += 64
	h.step()
	if ep.bad != "" {
		t.Fatal(ep.bad)
	}
	if got := h.collect(74); len(got) != 74 || ep.inline != 64 {
		t.Fatalf("%d completions, %d inline copies; want 74 and 64", len(got), ep.inline)
	}
}

// TestReadyDetached: a slice completion for a detached ring (closed with
// slices out) is work a parking poller must see: reaping it frees the
// buffers and segments the slices held. It used to park for up to 100 ms.
func TestReadyDetached(t *testing.T) {
	h := newHarness(t, Config{}, &fakeEP{}, true)
	if ready, _ := h.p.ready(h.clock); ready {
		t.Fatal("an idle poller reports work")
	}
	h.r.detached = true
	h.r.Complete(token(0, 1, 0), nil) // a late slice completion
	if ready, _ := h.p.ready(h.clock); !ready {
		t.Fatal("a slice completion of a detached ring is not seen at park time")
	}
	h.r.reap()
	h.r.detached = false
}

// TestPostWidth: a round hands an endpoint up to 64 slices a Post, and a
// transport.WidePoster up to its width (at most wideCap); every slice is
// posted once and every request completes.
func TestPostWidth(t *testing.T) {
	for _, c := range []struct {
		width, want int
	}{{0, batchCap}, {200, 200}, {1000, wideCap}} {
		t.Run(fmt.Sprint(c.width), func(t *testing.T) {
			ep := &fakeEP{width: c.width}
			h := newHarness(t, Config{Entries: 1024, MaxInFlight: 1024}, ep, true)
			const n = 600
			es := make([]sq.Entry, n)
			for i := range es {
				es[i] = h.write(uint64(i+1), uint64(i)*64, uint64(i)*64, 64)
			}
			h.submit(es...)
			got := h.collect(n)
			for _, c := range got {
				expectCode(t, c, cq.CodeOK)
			}
			ep.mu.Lock()
			sizes := slices.Clone(ep.sizes)
			ep.mu.Unlock()
			if slices.Max(sizes) != c.want || ep.offered != n {
				t.Errorf("Post sizes %v (%d slices); want at most %d a Post and %d slices", sizes, ep.offered, c.want, n)
			}
		})
	}
}

// copierWide is a Copier that asks for wide Posts: it gets batchCap, the
// size of the jobs its batches are shared out in.
type copierWide struct{ wideEP }

func (copierWide) Copy(*transport.Slice) error { return nil }

// TestPostWidthStops: a round goes past maxTake only while its entries
// join the wide batch: the first that does not (a Nop here) ends it, and
// a Copier's batches stay at batchCap whatever width it asks.
func TestPostWidthStops(t *testing.T) {
	if got := postWidth(copierWide{wideEP{&fakeEP{width: 256}}}); got != batchCap {
		t.Errorf("postWidth of a wide Copier = %d, want %d", got, batchCap)
	}
	ep := &fakeEP{width: 256}
	h := newHarness(t, Config{Entries: 1024, MaxInFlight: 1024}, ep, true)
	var es []sq.Entry
	for i := range maxTake {
		es = append(es, h.write(uint64(i+1), uint64(i)*64, uint64(i)*64, 64))
	}
	for i := range 100 {
		es = append(es, sq.Entry{Op: sq.Nop, UserData: uint64(1000 + i)})
	}
	for i := range 100 {
		es = append(es, h.write(uint64(2000+i), uint64(maxTake+i)*64, uint64(maxTake+i)*64, 64))
	}
	h.submit(es...)
	h.step()
	ep.mu.Lock()
	sizes := slices.Clone(ep.sizes)
	ep.mu.Unlock()
	if len(sizes) == 0 || sizes[0] != maxTake {
		t.Errorf("the first round's Posts %v; want one of %d (the Nop after them ends the round)", sizes, maxTake)
	}
	got := h.collect(len(es))
	for _, c := range got {
		expectCode(t, c, cq.CodeOK)
	}
}
