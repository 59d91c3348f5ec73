package ring

import (
	"bytes"
	"errors"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/sq"
)

// A request that waits for a slot while every slot is held by requests
// whose slices never come back still ends, TIMEOUT, within its deadline,
// and the poller wakes for it on its own (no other event arrives).
func TestBlockedHeadTimesOut(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Entries: 8, MaxInFlight: 2, Timeout: 50 * time.Millisecond}, ep, false)
	h.submit(h.write(1, 0, 0, 4096), h.write(2, 4096, 4096, 4096), h.write(3, 8192, 8192, 4096), h.write(4, 12288, 12288, 4096))
	seen := map[uint64]cq.Status{}
	deadline := time.Now().Add(hang) // a hang detector, not a timing assertion
	for len(seen) < 4 && time.Now().Before(deadline) {
		if c := h.r.Peek(); c != nil {
			seen[c.UserData] = c.Status
			h.r.Advance(1)
		} else {
			time.Sleep(time.Millisecond)
		}
	}
	if len(seen) < 4 {
		t.Fatalf("%d of 4 requests ended while every slot was held: %v", len(seen), seen)
	}
	for ud, st := range seen {
		if st != cq.Timeout {
			t.Errorf("request %d: %s; want TIMEOUT", ud, st)
		}
	}
	if n := ep.heldCount(); n != 2 {
		t.Errorf("%d slices posted; only the two requests with slots may post", n)
	}
}

// Failure paths are logged when a Logger is set: a slice retried on the
// next rail, and a request that ends FAILED.
func TestFailuresLogged(t *testing.T) {
	var log bytes.Buffer
	var mu sync.Mutex
	w := writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return log.Write(p) })
	ep := &fakeEP{rails: 2, fail: map[uint16]error{0: errors.New("rail 0 is down"), 1: errors.New("rail 1 is down")}}
	h := newHarness(t, Config{Entries: 8, RetryLimit: 1, Logger: slog.New(slog.NewTextHandler(w, nil))}, ep, false)
	h.submit(h.write(1, 0, 0, 4096))
	waitFor(t, "no completion", func() bool { return h.r.Peek() != nil })
	if c := h.r.Peek(); c.Status != cq.Failed {
		t.Fatalf("completion %+v; want FAILED", c)
	}
	h.r.Advance(1)
	mu.Lock()
	defer mu.Unlock()
	for _, want := range []string{"slice retried on another rail", "request ended"} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, log.String())
		}
	}
}

type writerFunc func(p []byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// A ring whose slots are all taken still reports work ready when the head
// of its SQ needs no slot (a Cancel), or when its blocked clock has not
// started; a blocked READ or WRITE at the head is no work until an event.
// (The poller parks when ready says no, for up to maxPark: a Cancel of a
// request in flight on a full ring waited that long.)
func TestReadyWhileBlocked(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Entries: 8, MaxInFlight: 1, Timeout: 10 * time.Millisecond}, ep, true)
	first := h.write(1, 0, 0, 4096)
	first.Timeout = uint64(time.Hour) // in flight throughout
	h.submit(first)
	h.step()
	if h.r.ready() {
		t.Fatal("ready with the one request in flight and an empty SQ")
	}
	h.submit(h.write(2, 4096, 4096, 4096))
	if !h.r.ready() {
		t.Fatal("not ready with a WRITE queued behind a full ring whose blocked clock has not started")
	}
	h.step() // starts the clock; the WRITE waits
	if h.r.ready() {
		t.Fatal("ready with only a blocked WRITE at the head of the SQ")
	}
	h.clock += int64(20 * time.Millisecond)
	h.step() // the WRITE times out without a slot; the ring stays full
	if c := h.r.Peek(); c == nil || c.UserData != 2 || c.Status != cq.Timeout {
		t.Fatalf("completion %+v; want request 2 TIMEOUT", c)
	}
	h.r.Advance(1)
	if err := h.r.Cancel(1); err != nil {
		t.Fatal(err)
	}
	if !h.r.ready() {
		t.Fatal("not ready with a Cancel at the head of a full ring's SQ")
	}
	h.step()
	if c := h.r.Peek(); c == nil || c.UserData != 1 || c.Status != cq.Canceled {
		t.Fatalf("completion %+v; want request 1 CANCELED", c)
	}
}

// With GOMAXPROCS 1 a spinning poller holds the process's only P, so the
// work it waits for can come only once it parks: it parks at once, however
// long its spin. (With the spin kept, it parks only after the hour.)
func TestPollerParksAtOnceWithOneP(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	p := NewPoller(PollerConfig{Spin: time.Hour})
	defer p.Stop()
	waitFor(t, "the poller did not park with one P", func() bool { return p.Stats().Parks > 0 })
}

// With GOMAXPROCS 1 but a transport that needs polling (a hook: RDMA, EFA),
// the poller still spins: that transport's completions are seen only by a
// Poll, and a parked poller would look once a millisecond.
func TestPollerSpinsForHooksWithOneP(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	p := NewPoller(PollerConfig{Spin: time.Hour})
	defer p.Stop()
	h := &countHook{}
	p.AddHook(h)
	parks := p.Stats().Parks // work: the next idle spell counts the hook
	// 1000 polls while parked would take a second or more, a park each.
	n := h.polls.Load() + 1000
	waitFor(t, "the hook was not polled", func() bool { return h.polls.Load() >= n })
	if got := p.Stats().Parks; got != parks {
		t.Fatalf("the poller parked %d times with a hook to poll", got-parks)
	}
}

type countHook struct{ polls atomic.Int64 }

func (h *countHook) Poll() int { h.polls.Add(1); return 0 }

// A second Close, coming while the first waits for the poller, returns only
// once the ring's requests have completed with ErrClosed, as the first
// does ("Close returns after the poller has done so"). It used to return at
// once.
func TestSecondCloseWaits(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Entries: 8}, ep, false)
	h.submit(h.write(1, 0, 0, 4096))
	waitFor(t, "the request was not posted", func() bool { return ep.heldCount() > 0 })
	// Hold the poller goroutine, so that the first Close waits for it.
	held, release := make(chan struct{}), make(chan struct{})
	go h.p.do(func() { close(held); <-release })
	<-held
	first := make(chan struct{})
	go func() { h.r.Close(); close(first) }()
	waitFor(t, "the first Close did not start", h.r.Closed)
	go func() { time.Sleep(20 * time.Millisecond); close(release) }()
	h.r.Close()
	c := h.r.Peek()
	if c == nil || c.UserData != 1 || c.Code != cq.CodeClosed {
		t.Fatalf("after the second Close the CQ holds %+v; want request 1 ended by the close", c)
	}
	<-first
}

// A hook with work in flight (transport.InFlight) keeps the poller
// polling past its spin; once the work is done it parks. Before, a parked
// poller looked at hooks once a millisecond, so a GPU copy that outlasted
// the spin waited up to a millisecond more.
func TestPollerStaysForInFlight(t *testing.T) {
	p := NewPoller(PollerConfig{Spin: time.Microsecond})
	defer p.Stop()
	h := &inFlightHook{}
	h.busy.Store(true)
	p.AddHook(h)
	parks := p.Stats().Parks
	n := h.polls.Load() + 3000 // three seconds or more if it parked between
	waitFor(t, "the hook was not polled", func() bool { return h.polls.Load() >= n })
	if got := p.Stats().Parks; got > parks+1 { // one park may have begun before AddHook
		t.Fatalf("the poller parked %d times with work in flight", got-parks)
	}
	h.busy.Store(false)
	waitFor(t, "the poller did not park once the work was done", func() bool { return p.Stats().Parks > parks+1 })
}

type inFlightHook struct {
	countHook
	busy atomic.Bool
}

func (h *inFlightHook) InFlight() bool { return h.busy.Load() }

// An entry with sq.FlagDeadline times out at its own deadline on the
// rings' clock, counting the time it waited for a slot: while every slot is
// held, a request whose deadline is near ends TIMEOUT then, and one whose
// deadline is far off keeps waiting (with a relative Timeout it would have
// timed out with the first, at the ring's 50 ms); one whose deadline passed
// before the poller took it ends TIMEOUT without posting.
func TestFlagDeadline(t *testing.T) {
	ep := &fakeEP{hold: true}
	h := newHarness(t, Config{Entries: 8, MaxInFlight: 1, Timeout: 50 * time.Millisecond}, ep, false)
	far := h.write(2, 4096, 4096, 4096)
	far.Flags, far.Timeout = sq.FlagDeadline, uint64(Now()+int64(time.Hour))
	near := h.write(3, 8192, 8192, 4096)
	near.Flags, near.Timeout = sq.FlagDeadline, uint64(Now()+int64(10*time.Millisecond))
	h.submit(h.write(1, 0, 0, 4096), near, far)
	seen := map[uint64]cq.Status{}
	deadline := time.Now().Add(hang) // a hang detector, not a timing assertion
	for len(seen) < 2 && time.Now().Before(deadline) {
		if c := h.r.Peek(); c != nil {
			seen[c.UserData] = c.Status
			h.r.Advance(1)
		} else {
			time.Sleep(time.Millisecond)
		}
	}
	if seen[3] != cq.Timeout || seen[1] != cq.Timeout {
		t.Fatalf("ended: %v; want requests 1 (in flight, relative timeout) and 3 (near deadline) TIMEOUT", seen)
	}
	time.Sleep(100 * time.Millisecond) // past 2x the ring's Timeout: a relative one would have ended 2
	if c := h.r.Peek(); c != nil && c.UserData == 2 {
		t.Fatalf("request 2 ended %s before its deadline, an hour away", c.Status)
	}
	if n := ep.heldCount(); n > 2 {
		t.Errorf("%d slices posted", n)
	}

	past := h.write(4, 0, 0, 4096)
	past.Flags, past.Timeout = sq.FlagDeadline, uint64(Now()-1)
	h2 := newHarness(t, Config{Entries: 8}, &fakeEP{hold: true}, false)
	h2.submit(past)
	waitFor(t, "no completion", func() bool { return h2.r.Peek() != nil })
	if c := h2.r.Peek(); c.Status != cq.Timeout || c.UserData != 4 {
		t.Fatalf("entry past its deadline: %+v, want TIMEOUT", c)
	}
}
