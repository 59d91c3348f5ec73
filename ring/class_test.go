package ring

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// classRing makes another ring of class c on the harness's tables and
// poller, closed at the end of the test.
func (h *harness) classRing(c transport.Class) *Ring {
	h.t.Helper()
	r, err := New(Config{Class: c}, &h.tables, h.p)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { r.Close() })
	return r
}

// drain reads r's completions and returns how many were COMPLETED; it
// fails on any other code.
func drain(t *testing.T, r *Ring) int {
	t.Helper()
	var cqes [64]cq.Completion
	total := 0
	for {
		n := r.PeekBatch(cqes[:])
		if n == 0 {
			return total
		}
		for _, c := range cqes[:n] {
			if c.Err() != nil {
				t.Fatalf("completion %+v: %v", c, c.Err())
			}
		}
		r.Advance(n)
		total += n
	}
}

// postedClasses returns the classes of the slices the endpoint took since
// the last call.
func postedClasses(f *fakeEP, from *int) []transport.Class {
	f.mu.Lock()
	defer f.mu.Unlock()
	var cs []transport.Class
	for _, s := range f.posts[*from:] {
		cs = append(cs, s.Class)
	}
	*from = len(f.posts)
	return cs
}

func TestClassOrder(t *testing.T) {
	h := newHarness(t, Config{}, &fakeEP{}, true) // h.r: normal
	lo := h.classRing(transport.ClassLow)
	hi := h.classRing(transport.ClassHigh)
	n2 := h.classRing(transport.ClassNormal)
	got := h.p.list()
	want := []*Ring{hi, h.r, n2, lo}
	if len(got) != len(want) {
		t.Fatalf("%d rings listed, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("ring %d is of class %v, want %v (high first, then each class in the order made)", i, got[i].Class(), want[i].Class())
		}
	}
	if _, err := New(Config{Class: transport.NumClasses}, &h.tables, h.p); err == nil {
		t.Fatal("New took a class out of range")
	}
}

// In a round in which the high-class ring takes entries, the normal and
// low ones post nothing; in the next, without high-class work, they do.
func TestHeldBehindHigherClass(t *testing.T) {
	ep := &fakeEP{}
	h := newHarness(t, Config{}, ep, true)
	lo := h.classRing(transport.ClassLow)
	hi := h.classRing(transport.ClassHigh)
	from := 0
	for _, r := range []*Ring{lo, h.r, hi} {
		if _, err := r.Submit([]sq.Entry{h.write(1, 0, 0, 4096), h.write(2, 4096, 4096, 4096)}); err != nil {
			t.Fatal(err)
		}
	}
	h.p.round(h.p.list(), h.clock)
	for _, c := range postedClasses(ep, &from) {
		if c != transport.ClassHigh {
			t.Fatalf("a %v slice was posted in the round the high-class ring took entries", c)
		}
	}
	// The high-class ring is done: past linger, the normal ring takes its
	// entries, and holds the low one back.
	h.p.round(h.p.list(), h.clock) // still held: within linger
	if got := postedClasses(ep, &from); len(got) != 0 {
		t.Fatalf("within linger of the high-class ring's work, %v was posted", got)
	}
	h.clock += int64(linger)
	h.p.round(h.p.list(), h.clock)
	if got := postedClasses(ep, &from); len(got) != 2 || got[0] != transport.ClassNormal || got[1] != transport.ClassNormal {
		t.Fatalf("second round posted %v; want the normal ring's two slices", got)
	}
	// The normal ring's completions are reaped in the next round: it was
	// busy then, and holds the low one back for linger more.
	h.clock += int64(linger)
	h.p.round(h.p.list(), h.clock)
	if got := postedClasses(ep, &from); len(got) != 0 {
		t.Fatalf("posted %v in the round the normal ring completed its requests", got)
	}
	h.clock += int64(linger)
	h.p.round(h.p.list(), h.clock)
	if got := postedClasses(ep, &from); len(got) != 2 || got[0] != transport.ClassLow || got[1] != transport.ClassLow {
		t.Fatalf("third round posted %v; want the low ring's two slices", got)
	}
	h.p.round(h.p.list(), h.clock) // reap
	for _, r := range []*Ring{lo, h.r, hi} {
		if n := drain(t, r); n != 2 {
			t.Fatalf("%v ring: %d completions, want 2", r.Class(), n)
		}
	}
	if st := lo.Stats(); st.Held != 4 || st.Promoted != 0 {
		t.Fatalf("low ring held %d rounds, promoted %d; want 4 and 0", st.Held, st.Promoted)
	}
}

// Under a high-class ring that takes entries every round, a low-class
// ring is promoted every Promote of the poller's clock and takes a few
// entries then: it makes progress and all its work completes.
func TestPromotionUnderConstantHighLoad(t *testing.T) {
	ep := &fakeEP{}
	h := newHarness(t, Config{}, ep, true)
	lo := h.classRing(transport.ClassLow)
	hi := h.classRing(transport.ClassHigh)
	const lowN = 64
	var es []sq.Entry
	for i := range lowN {
		es = append(es, h.write(uint64(i), 0, uint64(i)*64, 64))
	}
	if n, err := lo.Submit(es); n != lowN || err != nil {
		t.Fatalf("Submit: %d, %v", n, err)
	}
	const tick = 100 * time.Microsecond // the poller's clock per round here
	done, rounds := 0, 0
	from := 0
	for ; done < lowN; rounds++ {
		if rounds > 10000 {
			t.Fatalf("low-class ring starved: %d of %d done after %d rounds", done, lowN, rounds)
		}
		if _, err := hi.Submit([]sq.Entry{h.read(9, 0, 0, 64)}); err != nil {
			t.Fatal(err)
		}
		h.clock += int64(tick)
		h.p.round(h.p.list(), h.clock)
		low := 0
		for _, c := range postedClasses(ep, &from) {
			if c == transport.ClassLow {
				low++
			}
		}
		if low > promoteTake {
			t.Fatalf("round %d: the low-class ring posted %d slices while held (at most %d when promoted)", rounds, low, promoteTake)
		}
		drain(t, hi)
		done += drain(t, lo)
	}
	st := lo.Stats()
	if st.Promoted < lowN/promoteTake || st.Held == 0 {
		t.Fatalf("low ring: held %d rounds, promoted %d; want held, and promoted at least %d times", st.Held, st.Promoted, lowN/promoteTake)
	}
	// Promoted every Promote (1 ms = 10 ticks) of waiting, so about ten
	// rounds per promotion.
	if per := float64(rounds) / float64(st.Promoted); per < 8 || per > 12 {
		t.Fatalf("a promotion every %.1f rounds of %v; want about %v", per, tick, DefaultPromote/tick)
	}
}

// The same on a running poller: a goroutine keeps a high-class ring busy
// while a low-class ring's requests all complete.
func TestLowCompletesUnderHighLoad(t *testing.T) {
	ep := &fakeEP{}
	h := newHarness(t, Config{}, ep, false)
	lo := h.classRing(transport.ClassLow)
	hi := h.classRing(transport.ClassHigh)
	stop := make(chan struct{})
	highDone := make(chan int)
	var highSoFar atomic.Int64
	go func() {
		n := 0
		var cqes [64]cq.Completion
		for {
			select {
			case <-stop:
				highDone <- n
				return
			default:
			}
			if k, _ := hi.Submit([]sq.Entry{h.read(1, 0, 0, 64), h.read(2, 64, 64, 64)}); k == 0 {
				runtime.Gosched()
			}
			k := hi.PeekBatch(cqes[:])
			hi.Advance(k)
			n += k
			highSoFar.Store(int64(n))
		}
	}()
	const lowN = 500
	got := 0
	for i := range lowN {
		for {
			n, err := lo.Submit([]sq.Entry{h.write(uint64(i), 0, uint64(i%64)*64, 64)})
			if n == 1 {
				break
			}
			if err != ErrSQFull {
				t.Fatal(err)
			}
			got += drainWait(t, lo, 1)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for got < lowN {
		if time.Now().After(deadline) {
			t.Fatalf("hang: %d of %d low-class requests completed under high-class load (%+v)", got, lowN, lo.Stats())
		}
		got += drainWait(t, lo, 1)
	}
	// The low ring may finish before the high goroutine first runs (CI,
	// under -race beside other packages): the high ring has until the
	// deadline to show it is served too.
	for highSoFar.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	close(stop)
	if n := <-highDone; n == 0 {
		t.Fatal("the high-class ring completed nothing")
	}
}

// drainWait waits up to 10 ms for n completions of r and reads those
// there are; it fails on an error.
func drainWait(t *testing.T, r *Ring, n int) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	r.CQ().Wait(ctx, n)
	cancel()
	return drain(t, r)
}

// sizeEP is a fakeEP that copies synchronously and records each copy's
// length and the ring's class.
type sizeEP struct {
	*fakeEP
	copies []transport.Slice
}

func (c *sizeEP) Copy(s *transport.Slice) error {
	rec := *s
	rec.Local = nil
	c.copies = append(c.copies, rec)
	return c.move(s)
}

// While a high-class ring on the poller is busy or was within stall, a
// low-class ring's copies on the poller go in slices of yieldBytes, at most
// about yieldBytes a round; alone, or beside an idle high-class ring, it
// copies a request in one slice. The bytes are right either way.
func TestLowClassCopiesSliced(t *testing.T) {
	f := &fakeEP{}
	ep := &sizeEP{fakeEP: f}
	h := newHarness(t, Config{Class: transport.ClassLow, SliceSize: 1 << 20}, f, true)
	h.seg.Path().Endpoint = ep
	fillPattern(h.local, 9)
	h.submit(h.write(1, 0, 0, 256<<10))
	h.p.round(h.p.list(), h.clock)
	if len(ep.copies) != 1 || ep.copies[0].Length != 256<<10 {
		t.Fatalf("alone: %d copies (first %d bytes); want one of 256 KiB", len(ep.copies), ep.copies[0].Length)
	}
	drain(t, h.r)

	// An idle high-class ring costs nothing: still one slice.
	h.classRing(transport.ClassHigh)
	ep.copies = nil
	h.submit(h.write(3, 0, 0, 256<<10))
	h.p.round(h.p.list(), h.clock)
	if len(ep.copies) != 1 || ep.copies[0].Length != 256<<10 {
		t.Fatalf("beside an idle high-class ring: %d copies; want one of 256 KiB", len(ep.copies))
	}
	drain(t, h.r)

	// The high class was busy lately (past linger: not holding the low
	// ring back, but within stall).
	h.p.busyAt[0] = h.clock - 2*int64(linger)
	ep.copies = nil
	clear(h.remote[:hR1])
	h.submit(h.write(2, 0, 0, 256<<10))
	rounds := 0
	for done := 0; done == 0; rounds++ {
		if rounds > 100 {
			t.Fatal("the low-class request did not complete")
		}
		before := len(ep.copies)
		h.p.round(h.p.list(), h.clock)
		var bytes uint64
		for _, c := range ep.copies[before:] {
			if c.Length > yieldBytes {
				t.Fatalf("a copy of %d bytes beside a high-class ring (at most %d)", c.Length, yieldBytes)
			}
			bytes += c.Length
		}
		if bytes > yieldBytes {
			t.Fatalf("round %d copied %d bytes beside a high-class ring (at most %d)", rounds, bytes, yieldBytes)
		}
		done = drain(t, h.r)
	}
	if len(ep.copies) != 4 || rounds < 4 {
		t.Fatalf("%d copies in %d rounds; want 4 slices of 64 KiB, one a round", len(ep.copies), rounds)
	}
	if string(h.remote[:256<<10]) != string(h.local[:256<<10]) {
		t.Fatal("data differs")
	}

	// A list's block is not cut: one copy of its whole 256 KiB.
	lists := new(Lists)
	h.tables.Lists = lists
	id := addList(t, lists, []Block{{0, h.r1 + 8, 256 << 10}})
	ep.copies = nil
	clear(h.remote[:hR1])
	h.p.busyAt[0] = h.clock - 2*int64(linger)
	h.submit(listEntry(h, sq.Write, id, 0, 1, 4))
	h.p.round(h.p.list(), h.clock)
	if len(ep.copies) != 1 || ep.copies[0].Length != 256<<10 {
		t.Fatalf("a list's block beside a high-class ring: %d copies; want one of 256 KiB", len(ep.copies))
	}
	if drain(t, h.r) != 1 || string(h.remote[8:8+256<<10]) != string(h.local[:256<<10]) {
		t.Fatal("the list's block did not land")
	}
}

// A high-class ring whose request is stuck (no completion) holds lower
// classes back only for stall: then they run as if it were idle.
func TestStuckHighClassStopsHolding(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Class: transport.ClassLow}, ep, true)
	hi := h.classRing(transport.ClassHigh)
	if _, err := hi.Submit([]sq.Entry{h.read(1, 0, 0, 4096)}); err != nil {
		t.Fatal(err)
	}
	h.p.round(h.p.list(), h.clock)
	from := 0
	if got := postedClasses(ep, &from); len(got) != 1 || got[0] != transport.ClassHigh {
		t.Fatalf("posted %v, want the high-class READ", got)
	}
	if _, err := h.r.Submit([]sq.Entry{h.write(2, 0, 4096, 4096)}); err != nil {
		t.Fatal(err)
	}
	h.clock += int64(stall) / 2
	h.p.round(h.p.list(), h.clock)
	if got := postedClasses(ep, &from); len(got) != 0 {
		t.Fatalf("posted %v while the high-class READ is in flight and young", got)
	}
	h.clock += int64(stall)/2 + int64(linger)
	h.p.round(h.p.list(), h.clock)
	if got := postedClasses(ep, &from); len(got) != 1 || got[0] != transport.ClassLow {
		t.Fatalf("posted %v after the high-class READ stalled; want the low-class WRITE", got)
	}
	ep.release(-1, nil)
	h.p.round(h.p.list(), h.clock)
	drain(t, hi)
	drain(t, h.r)
}

// A ring held behind a higher class is no work for a parking poller (it
// would spin a CPU the higher class needs): ready says held instead, and
// the poller parks for at most linger.
func TestHeldIsNotReady(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Class: transport.ClassLow}, ep, true)
	hi := h.classRing(transport.ClassHigh)
	if _, err := hi.Submit([]sq.Entry{h.read(1, 0, 0, 4096)}); err != nil {
		t.Fatal(err)
	}
	h.p.round(h.p.list(), h.clock)
	if _, err := h.r.Submit([]sq.Entry{h.write(2, 0, 4096, 4096)}); err != nil {
		t.Fatal(err)
	}
	if ready, held := h.p.ready(h.clock); ready || !held {
		t.Fatalf("ready %v, held %v; want false, true while the high-class READ is in flight", ready, held)
	}
	ep.release(-1, nil) // the READ completes: its completion is work
	if ready, _ := h.p.ready(h.clock); !ready {
		t.Fatal("a slice completion is not seen as work")
	}
	h.p.round(h.p.list(), h.clock)
	h.clock += int64(linger)
	if ready, held := h.p.ready(h.clock); !ready || held {
		t.Fatalf("ready %v, held %v past linger; want true, false", ready, held)
	}
	h.p.round(h.p.list(), h.clock)
	ep.release(-1, nil)
	h.p.round(h.p.list(), h.clock)
	drain(t, hi)
	drain(t, h.r)
}

// A request a borrower (a submitter stepping a parked poller's rings)
// finds held must not wait for the parked poller's long timer: the
// borrower wakes it, so that it looks again when the hold ends. (It
// waited out a 100 ms park.)
func TestHeldWakesParkedPoller(t *testing.T) {
	ep := &fakeEP{}
	h := newHarness(t, Config{Class: transport.ClassLow}, ep, true)
	h.classRing(transport.ClassHigh)
	if _, err := h.r.Submit([]sq.Entry{h.write(2, 0, 4096, 4096)}); err != nil {
		t.Fatal(err)
	}
	// The high class was busy a moment ago, as far as any clock reading
	// in this test goes (so that a stall of the test cannot end the hold).
	h.p.busyAt[0] = now() + int64(time.Hour)
	h.p.parkUntil = now() + int64(maxPark) // parked, idle, as after the high class's work
	if !h.p.stepLent() {
		t.Fatal("a borrower left a held request to a poller parked for 100 ms")
	}
	h.p.parkUntil = now() + int64(linger)/2 // parked for less than the hold: its timer sees it
	if h.p.stepLent() {
		t.Fatal("a borrower woke a poller whose timer comes before the hold ends")
	}
}
