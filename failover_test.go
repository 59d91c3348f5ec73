package moonring_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// fakeClock is a clock that moves only when the test advances it.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers []fakeTimer
}

type fakeTimer struct {
	at time.Time
	ch chan time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{now: time.Unix(1_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) After(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan time.Time, 1)
	if d <= 0 {
		ch <- c.now
		return ch
	}
	c.timers = append(c.timers, fakeTimer{c.now.Add(d), ch})
	return ch
}

// Advance moves the clock by d and fires the timers due.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	c.timers = slices.DeleteFunc(c.timers, func(t fakeTimer) bool {
		if t.at.After(c.now) {
			return false
		}
		t.ch <- c.now
		return true
	})
}

// waitTimer waits until a timer due at at is set.
func (c *fakeClock) waitTimer(t testing.TB, at time.Time) {
	t.Helper()
	deadline := time.Now().Add(hangLimit)
	for {
		c.mu.Lock()
		found := slices.ContainsFunc(c.timers, func(x fakeTimer) bool { return x.at.Equal(at) })
		var ats []time.Duration
		for _, x := range c.timers {
			ats = append(ats, x.at.Sub(c.now))
		}
		c.mu.Unlock()
		if found {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("hang: no timer at %v from now (timers in %v)", at.Sub(c.Now()), ats)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func (f *faultTransport) openCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.opens
}

func (f *faultTransport) postCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.posted
}

// setDown makes the transport's path fail as a dead connection does:
// slices with ErrPeer, Opens (the probes) too.
func (f *faultTransport) setDown(down bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail, f.openErr = nil, nil
	if down {
		f.fail, f.openErr = transport.ErrPeer, transport.ErrPeer
	}
}

// waitFor waits until cond holds.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hangLimit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("hang: %s", what)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// pathStats returns e's failover counters of segment seg and transport tn.
func pathStats(e *moonring.Engine, seg, tn string) moonring.PathStats {
	for _, ps := range e.PathStats() {
		if ps.Segment == seg && ps.Transport == tn {
			return ps
		}
	}
	return moonring.PathStats{Segment: seg, Transport: tn}
}

// failoverPair is an initiator and a target joined by two fault
// transports, "fault" preferred to "fault2".
type failoverPair struct {
	*faultPair
	f2a, f2b *faultTransport
}

func newFailoverPair(t *testing.T, clk *fakeClock, size int) *failoverPair {
	t.Helper()
	return newFailoverPairCfg(t, clk, size, moonring.Config{})
}

// newFailoverPairCfg is newFailoverPair with cfg for the initiator.
func newFailoverPairCfg(t *testing.T, clk *fakeClock, size int, cfg moonring.Config) *failoverPair {
	t.Helper()
	return newFailoverPairWith(t, clk, size, cfg, nil)
}

// newFailoverPairWith is newFailoverPairCfg with set applied to the
// initiator's preferred fault transport before it is installed.
func newFailoverPairWith(t *testing.T, clk *fakeClock, size int, cfg moonring.Config, set func(*faultTransport)) *failoverPair {
	t.Helper()
	p := &failoverPair{faultPair: &faultPair{fa: newFaultTransport(), fb: newFaultTransport()},
		f2a: &faultTransport{inner: newFaultTransport().inner, name: "fault2"}, f2b: &faultTransport{inner: newFaultTransport().inner, name: "fault2"}}
	if set != nil {
		set(p.fa)
	}
	cfg.Transports = []string{faultName, "fault2"}
	p.a = startEngine(t, cfg)
	p.b = startEngine(t, moonring.Config{})
	if clk != nil {
		moonring.SetHealthClock(p.a, clk)
	}
	for _, x := range []struct {
		e *moonring.Engine
		t transport.Transport
	}{{p.a, p.fa}, {p.a, p.f2a}, {p.b, p.fb}, {p.b, p.f2b}} {
		if err := x.e.InstallTransport(x.t); err != nil {
			t.Fatal(err)
		}
	}
	p.src, p.dst = make([]byte, size), make([]byte, size)
	var err error
	if p.srcID, err = p.a.RegisterLocalMemory(p.src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := p.b.RegisterLocalMemory(p.dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	if p.seg, err = p.a.OpenSegment(ctx, p.b.Name()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the standby path opens", func() bool {
		info, err := p.a.Segment(p.seg)
		return err == nil && len(info.Paths) == 2
	})
	return p
}

// transfer WRITEs n bytes of a fresh pattern to dst at off and checks
// they landed.
func (p *failoverPair) transfer(t *testing.T, req moonring.TransferRequest, seed uint64) error {
	t.Helper()
	fill(p.src, seed)
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	if err := p.a.Transfer(ctx, req); err != nil {
		return err
	}
	if !bytes.Equal(p.src[:req.Length], p.dst[:req.Length]) {
		t.Fatalf("transfer with seed %d: bytes differ", seed)
	}
	return nil
}

func segTransport(t testing.TB, e *moonring.Engine, id moonring.SegmentID) string {
	t.Helper()
	name, err := e.SegmentTransport(id)
	if err != nil {
		t.Fatal(err)
	}
	return name
}

// TestFailoverCooldownProbe: the preferred path dies; a transfer
// completes over the other one with its bytes; the dead path is probed
// after 100 ms, then 200 ms more, then 400 ms more (a fake clock: not a
// probe before its time); once a probe finds it working, new requests
// move back to it. A request that must take the dead transport fails at
// once with ErrTransportDown; one that prefers it takes the other.
func TestFailoverCooldownProbe(t *testing.T) {
	clk := newFakeClock()
	p := newFailoverPair(t, clk, 256<<10)
	segName := p.b.Name()
	if got := segTransport(t, p.a, p.seg); got != faultName {
		t.Fatalf("segment opened over %q, want %q", got, faultName)
	}
	if err := p.transfer(t, p.write(0, 256<<10), 1); err != nil {
		t.Fatal(err)
	}

	p.fa.setDown(true)
	posted2 := p.f2a.postCount()
	if err := p.transfer(t, p.write(0, 256<<10), 2); err != nil {
		t.Fatalf("transfer as the path dies: %v", err)
	}
	if got := segTransport(t, p.a, p.seg); got != "fault2" {
		t.Fatalf("after the failure the segment goes over %q, want fault2", got)
	}
	if p.f2a.postCount() == posted2 {
		t.Fatal("nothing went over fault2")
	}
	waitFor(t, "the failover is counted", func() bool { return pathStats(p.a, segName, faultName).Failovers == 1 })

	// Hints while the preferred path is down.
	only := p.write(0, 4096)
	only.Transport, only.TransportOnly = faultName, true
	if err := p.transfer(t, only, 3); !errors.Is(err, moonring.ErrTransportDown) {
		t.Fatalf("a request that must take the dead transport: %v, want ErrTransportDown", err)
	}
	prefer := p.write(0, 4096)
	prefer.Transport = faultName
	if err := p.transfer(t, prefer, 4); err != nil {
		t.Fatalf("a request that prefers the dead transport: %v", err)
	}

	// Cooldown and probes, on the fake clock.
	down := clk.Now()
	opens := p.fa.openCount()
	for i, wait := range []time.Duration{100 * time.Millisecond, 200 * time.Millisecond} {
		clk.waitTimer(t, down.Add(wait))
		clk.Advance(wait - time.Millisecond)
		time.Sleep(20 * time.Millisecond) // a probe started early would show by now
		if n := p.fa.openCount(); n != opens+i {
			t.Fatalf("probe %d: %d probes %v after the last event, want %d", i+1, n-opens, wait-time.Millisecond, i)
		}
		clk.Advance(time.Millisecond)
		waitFor(t, "probe "+strconv.Itoa(i+1), func() bool { return p.fa.openCount() == opens+i+1 })
		down = clk.Now()
	}
	if got := segTransport(t, p.a, p.seg); got != "fault2" {
		t.Fatalf("a failed probe moved the segment to %q", got)
	}
	p.fa.setDown(false)
	clk.waitTimer(t, down.Add(400*time.Millisecond))
	clk.Advance(400 * time.Millisecond)
	waitFor(t, "failback", func() bool { return segTransport(t, p.a, p.seg) == faultName })
	if ps := pathStats(p.a, segName, faultName); ps.Failovers != 1 || ps.Failbacks != 1 {
		t.Fatalf("counters %+v, want 1 failover and 1 failback", ps)
	}
	posted := p.fa.postCount()
	if err := p.transfer(t, p.write(0, 256<<10), 5); err != nil {
		t.Fatal(err)
	}
	if p.fa.postCount() == posted {
		t.Fatal("after the failback nothing went over fault")
	}
	// A request that prefers the standby takes it.
	posted2 = p.f2a.postCount()
	prefer.Transport = "fault2"
	if err := p.transfer(t, prefer, 6); err != nil || p.f2a.postCount() == posted2 {
		t.Fatalf("a request that prefers fault2: %v, %d posts there", err, p.f2a.postCount()-posted2)
	}
}

// TestTransportHint: hints through the ring API and the batch API's
// refusals.
func TestTransportHint(t *testing.T) {
	p := newFailoverPair(t, nil, 64<<10)
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	bad := p.write(0, 4096)
	bad.Transport = "nosuch"
	if err := p.a.Transfer(ctx, bad); !errors.Is(err, moonring.ErrNoSuchTransport) {
		t.Fatalf("a hint naming no transport: %v, want ErrNoSuchTransport", err)
	}
	bad.Transport = ""
	bad.TransportOnly = true
	if err := p.a.Transfer(ctx, bad); !errors.Is(err, moonring.ErrInvalid) {
		t.Fatalf("TransportOnly without a transport: %v, want ErrInvalid", err)
	}
	// "local" is installed, but the segment has no path through it.
	r, err := p.a.NewRing(moonring.RingConfig{Entries: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	slot, err := p.a.TransportSlot("local")
	if err != nil {
		t.Fatal(err)
	}
	f2, err := p.a.TransportSlot("fault2")
	if err != nil {
		t.Fatal(err)
	}
	base := moonring.Entry{Op: moonring.OpWrite, Segment: p.seg, Buffer: p.srcID, Remote: uint64(moonring.AddressOf(p.dst)), Length: 4096}
	cases := []struct {
		flags     sq.Flags
		transport uint8
		want      error
	}{
		{moonring.FlagTransportOnly, slot, moonring.ErrTransportDown}, // not open for the segment
		{moonring.FlagTransportPrefer, slot, nil},                     // takes the current path
		{moonring.FlagTransportOnly, f2, nil},
		{moonring.FlagTransportOnly | moonring.FlagTransportPrefer, f2, moonring.ErrInvalid},
		{0, f2, moonring.ErrInvalid},                           // a transport without a hint
		{moonring.FlagTransportOnly, 200, moonring.ErrInvalid}, // no such slot
	}
	for i, c := range cases {
		e := base
		e.Flags, e.Transport, e.UserData = c.flags, c.transport, uint64(i+1)
		posted := p.f2a.postCount()
		if err := r.SubmitOne(&e); err != nil {
			t.Fatal(err)
		}
		if err := r.CQ().Wait(ctx, 1); err != nil {
			t.Fatal(err)
		}
		cqe := r.Peek()
		if cqe.UserData != uint64(i+1) || !errors.Is(cqe.Err(), c.want) {
			t.Errorf("case %d (flags %#x, transport %d): %+v (%v), want %v", i, c.flags, c.transport, *cqe, cqe.Err(), c.want)
		}
		r.Advance(1)
		if i == 2 && p.f2a.postCount() == posted {
			t.Errorf("FlagTransportOnly fault2 did not go over fault2")
		}
	}
}

// TestFailoverSHMToTCP: batches of WRITEs stream over shm to a target in
// this process; the target's shm transport goes away mid-stream (its
// socket closes); every task completes with its bytes, over TCP from the
// failure on; once the target has shm again, new requests move back. The
// time from the path's end to the first request completed on TCP is
// logged; MOONRING_FAILOVER_ROUNDS repeats the cycle and prints the
// median (BENCHMARKS.md).
func TestFailoverSHMToTCP(t *testing.T) {
	rounds := 1
	if n, err := strconv.Atoi(os.Getenv("MOONRING_FAILOVER_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	const size = 8 << 20
	key := []byte("failover-test-key")
	a := startEngine(t, moonring.Config{Key: key, Transports: []string{shm.Name, tcp.Name}, TCP: &tcp.Config{}, SHM: &shm.Config{}})
	b := startEngine(t, moonring.Config{Key: key, TCP: &tcp.Config{}, SHM: &shm.Config{}})
	src, err := a.Alloc(size, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	dst, err := b.Alloc(size, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // after the engines' Close (cleanups run last first)
		a.Free(src)
		b.Free(dst)
	})
	if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*hangLimit)
	defer cancel()
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	if got := segTransport(t, a, seg); got != shm.Name {
		t.Fatalf("segment opened over %q, want shm", got)
	}
	waitFor(t, "the TCP standby opens", func() bool {
		info, err := a.Segment(seg)
		return err == nil && len(info.Paths) == 2
	})

	// stream WRITEs batches of 16 x 64 KiB, each task a fresh pattern at
	// its own place, until stop; every task must complete. It reports
	// when the first batch found the segment on TCP.
	const tasks, n = 16, 64 << 10
	stream := func(stop <-chan struct{}, seed uint64, onTCP chan<- time.Time) error {
		id, err := a.AllocateBatchID(tasks)
		if err != nil {
			return err
		}
		defer func() { a.FreeBatchID(id) }()
		reported := false
		for round := uint64(0); ; round++ {
			select {
			case <-stop:
				return nil
			default:
			}
			reqs := make([]moonring.TransferRequest, tasks)
			for i := range reqs {
				off := (int(round)*tasks + i) % (size / n) * n
				fill(src[off:off+n], seed+round*tasks+uint64(i))
				reqs[i] = moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src[off:]), TargetID: seg,
					TargetOffset: uint64(moonring.AddressOf(dst[off:])), Length: n}
			}
			if err := a.SubmitTransfer(id, reqs); err != nil {
				return err
			}
			if err := a.WaitBatch(ctx, id); err != nil {
				return err
			}
			for i := range reqs {
				st, err := a.GetTransferStatus(id, i)
				if err != nil || st.Status != moonring.COMPLETED {
					return errors.Join(err, st.Err(), errors.New("task "+strconv.Itoa(i)+" of round "+strconv.FormatUint(round, 10)+" did not complete"))
				}
				off := (int(round)*tasks + i) % (size / n) * n
				if !bytes.Equal(src[off:off+n], dst[off:off+n]) {
					return errors.New("bytes of task " + strconv.Itoa(i) + " differ")
				}
			}
			if !reported {
				if name, _ := a.SegmentTransport(seg); name == tcp.Name {
					onTCP <- time.Now()
					reported = true
				}
			}
			if err := a.FreeBatchID(id); err != nil {
				return err
			}
			if id, err = a.AllocateBatchID(tasks); err != nil {
				return err
			}
		}
	}

	var times, teardown []time.Duration
	for round := range rounds {
		stop := make(chan struct{})
		onTCP := make(chan time.Time, 1)
		errc := make(chan error, 1)
		go func() { errc <- stream(stop, uint64(round)<<32, onTCP) }()
		time.Sleep(20 * time.Millisecond) // a stream in flight
		killed := time.Now()
		if err := b.UninstallTransport(shm.Name); err != nil {
			t.Fatal(err)
		}
		teardown = append(teardown, time.Since(killed))
		var switched time.Time
		select {
		case switched = <-onTCP:
		case err := <-errc:
			t.Fatalf("round %d: stream ended before the failover: %v", round, err)
		case <-time.After(hangLimit):
			t.Fatalf("round %d: hang: no batch completed over TCP", round)
		}
		times = append(times, switched.Sub(killed))
		time.Sleep(10 * time.Millisecond) // more batches over TCP
		// shm comes back; the probe finds it and new requests move back.
		st, err := shm.New(shm.Config{Key: key})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.InstallTransport(st); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "failback to shm", func() bool { return segTransport(t, a, seg) == shm.Name })
		time.Sleep(10 * time.Millisecond) // more batches over shm
		close(stop)
		if err := <-errc; err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		ps := pathStats(a, b.Name(), shm.Name)
		if ps.Failovers != uint64(round+1) || ps.Failbacks != uint64(round+1) {
			t.Fatalf("round %d: counters %+v", round, ps)
		}
	}
	t.Logf("failover shm -> tcp, from the target's shm going away (UninstallTransport called) to a batch (16 x 64 KiB WRITEs) completed over TCP: median %v of %d (all: %v); the target's UninstallTransport itself took median %v (all: %v)",
		median(times), len(times), times, median(teardown), teardown)
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// TestFailoverTime: the engine's own failover cost. A path that fails
// every slice at once (a fault transport: no detection time) dies, and
// a 4 KiB WRITE is submitted: the time from the path's death to that
// request's completion over the standby path, on a fresh pair each round
// (MOONRING_FAILOVER_ROUNDS, default 3), and the same WRITE on a healthy
// path for comparison.
func TestFailoverTime(t *testing.T) {
	rounds := 3
	if n, err := strconv.Atoi(os.Getenv("MOONRING_FAILOVER_ROUNDS")); err == nil && n > 0 {
		rounds = n
	}
	var fo, healthy []time.Duration
	for range rounds {
		p := newFailoverPair(t, nil, 4096)
		ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
		req := p.write(0, 4096)
		for range 100 { // warm
			if err := p.a.Transfer(ctx, req); err != nil {
				t.Fatal(err)
			}
		}
		start := time.Now()
		if err := p.a.Transfer(ctx, req); err != nil {
			t.Fatal(err)
		}
		healthy = append(healthy, time.Since(start))
		start = time.Now()
		p.fa.setDown(true)
		err := p.a.Transfer(ctx, req)
		fo = append(fo, time.Since(start))
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if got := segTransport(t, p.a, p.seg); got != "fault2" {
			t.Fatalf("segment on %q after the failover", got)
		}
	}
	t.Logf("failover of a 4 KiB WRITE (path dies -> request completed on the standby): median %v of %d (all: %v); the same WRITE on a healthy path: median %v",
		median(fo), len(fo), fo, median(healthy))
}

// TestFailoverNoAlloc: a request to a segment with two paths, plain and
// with a transport hint, costs no allocation from Submit to reap.
func TestFailoverNoAlloc(t *testing.T) {
	p := newFailoverPair(t, nil, 4096)
	fill(p.src, 3)
	r, err := p.a.NewRing(moonring.RingConfig{Entries: 8})
	if err != nil {
		t.Fatal(err)
	}
	f2, err := p.a.TransportSlot("fault2")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		flags sq.Flags
	}{{"current path", 0}, {"prefer the standby", moonring.FlagTransportPrefer}, {"only the standby", moonring.FlagTransportOnly}} {
		es := []moonring.Entry{{Op: moonring.OpWrite, Flags: c.flags, Segment: p.seg, Buffer: p.srcID, Remote: uint64(moonring.AddressOf(p.dst)), Length: 4096, UserData: 1}}
		if c.flags != 0 {
			es[0].Transport = f2
		}
		for i := 0; i < 100; i++ { // warm up
			if cqe, ok := ringRoundTrip(r, es); !ok {
				t.Fatalf("%s: warm-up write: %v", c.name, cqe.Err())
			}
		}
		var failed error
		allocs := testing.AllocsPerRun(500, func() {
			if cqe, ok := ringRoundTrip(r, es); !ok && failed == nil {
				failed = cqe.Err()
			}
		})
		if failed != nil || allocs != 0 {
			t.Fatalf("%s: %v allocations per request (%v), want 0", c.name, allocs, failed)
		}
	}
	if !bytes.Equal(p.src, p.dst) {
		t.Fatal("data differs")
	}
}

// TestFailoverSHMToTCPTwoProcesses: a target child serves its memory
// over shm and TCP; batches of WRITEs, each read back and compared,
// stream to it over shm; the child's shm transport goes away mid-stream
// (its sockets close), and every task completes, over TCP from then on;
// once the child has shm again (a new socket, a republished descriptor),
// new requests move back to shm.
func TestFailoverSHMToTCPTwoProcesses(t *testing.T) {
	e2eLeaks(t)
	const size = 4 << 20
	c := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size), "MOONRING_SHM=1")
	d := c.targetDesc(t)
	store := metadata.NewMemory()
	ctx, cancel := context.WithTimeout(context.Background(), 4*hangLimit)
	defer cancel()
	if err := store.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	e, err := moonring.New(moonring.Config{Metadata: store, TCP: &tcp.Config{Key: childKey}, SHM: &shm.Config{}})
	if err != nil {
		t.Fatal(err)
	}
	var local []byte
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("Engine.Close: %v", err)
		}
		if local != nil {
			if err := e.Free(local); err != nil {
				t.Errorf("Free: %v", err)
			}
		}
	})
	seg, err := e.OpenSegment(ctx, d.Name)
	if err != nil {
		t.Fatal(err)
	}
	if got := segTransport(t, e, seg); got != shm.Name {
		t.Fatalf("segment opened over %q, want shm", got)
	}
	waitFor(t, "the TCP standby opens", func() bool {
		info, err := e.Segment(seg)
		return err == nil && len(info.Paths) == 2
	})
	if local, err = e.Alloc(2*size, "cpu:0"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.RegisterLocalMemory(local, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	remote := d.Buffers[0].Addr
	out, back := local[:size], local[size:]

	// run moves one batch of tasks 64 KiB requests of op between out (or
	// back) and the target at round's place.
	const tasks, n = 16, 64 << 10
	run := func(op moonring.Op, round uint64) error {
		id, err := e.AllocateBatchID(tasks)
		if err != nil {
			return err
		}
		defer e.FreeBatchID(id)
		reqs := make([]moonring.TransferRequest, tasks)
		for i := range reqs {
			off := (int(round)*tasks + i) % (size / n) * n
			src := out
			if op == moonring.Read {
				src = back
			}
			reqs[i] = moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(src[off:]), TargetID: seg, TargetOffset: remote + uint64(off), Length: n}
		}
		if err := e.SubmitTransfer(id, reqs); err != nil {
			return err
		}
		if err := e.WaitBatch(ctx, id); err != nil {
			return err
		}
		for i := range reqs {
			st, err := e.GetTransferStatus(id, i)
			if err != nil || st.Status != moonring.COMPLETED {
				return fmt.Errorf("round %d, %v task %d: %v %v %v", round, op, i, st.Status, st.Err(), err)
			}
		}
		return nil
	}
	stop := make(chan struct{})
	var rounds, tcpRounds atomic.Uint64
	var firstTCP atomic.Int64 // when the first round found the segment on TCP
	errc := make(chan error, 1)
	go func() {
		errc <- func() error {
			for round := uint64(0); ; round++ {
				select {
				case <-stop:
					return nil
				default:
				}
				for i := range tasks {
					off := (int(round)*tasks + i) % (size / n) * n
					fill(out[off:off+n], round<<8|uint64(i))
				}
				if err := run(moonring.Write, round); err != nil {
					return err
				}
				if err := run(moonring.Read, round); err != nil {
					return err
				}
				lo := int(round) * tasks % (size / n) * n
				if !bytes.Equal(out[lo:lo+tasks*n], back[lo:lo+tasks*n]) {
					return fmt.Errorf("round %d: the bytes read back differ from those written", round)
				}
				rounds.Add(1)
				if name, _ := e.SegmentTransport(seg); name == tcp.Name {
					if tcpRounds.Add(1) == 1 {
						firstTCP.Store(time.Now().UnixNano())
					}
				}
			}
		}()
	}()
	waitRounds := func(what string, counter *atomic.Uint64, k uint64) {
		t.Helper()
		start := counter.Load()
		deadline := time.Now().Add(hangLimit)
		for counter.Load() < start+k {
			select {
			case err := <-errc:
				t.Fatalf("%s: the stream ended: %v", what, err)
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("hang: %s", what)
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitRounds("rounds over shm", &rounds, 5)
	killed := time.Now()
	if a := c.Ask(t, "shm-off"); a != "ok" {
		t.Fatalf("shm-off: %s", a)
	}
	answered := time.Since(killed)
	waitRounds("rounds over TCP", &tcpRounds, 5)
	desc := c.Ask(t, "shm-on")
	d2, err := segtable.UnmarshalDesc([]byte(desc))
	if err != nil {
		t.Fatalf("shm-on: %s (%v)", desc, err)
	}
	if err := store.Put(ctx, d2); err != nil { // the child's republish, as a shared store would carry it
		t.Fatal(err)
	}
	waitFor(t, "failback to shm", func() bool { return segTransport(t, e, seg) == shm.Name })
	waitRounds("rounds over shm again", &rounds, 5)
	close(stop)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	ps := pathStats(e, d.Name, shm.Name)
	if ps.Failovers != 1 || ps.Failbacks != 1 {
		t.Fatalf("counters %+v, want 1 failover and 1 failback", ps)
	}
	t.Logf("%d rounds of 16 WRITEs and 16 READs of 64 KiB, %d on TCP; from shm-off sent to the first round (WRITEs and READs) completed on TCP: %v (the child's uninstall answered after %v)",
		rounds.Load(), tcpRounds.Load(), time.Unix(0, firstTCP.Load()).Sub(killed), answered)
}

// TestFailoverInFlight: the path dies with every slice of a request out
// on it (held by the fault transport, then failed together); the request
// moves to the standby at the cost of one retry (RetryLimit 1 suffices:
// the other slices failed with the same path) and completes with its
// bytes. A request pinned to the path (TransportOnly) fails
// ErrTransportDown in the same situation; with no retries at all
// (RetryLimit -1) a request does not move.
func TestFailoverInFlight(t *testing.T) {
	for _, c := range []struct {
		name  string
		limit int
		only  bool
		want  error
	}{{"moves", 1, false, nil}, {"pinned", 3, true, moonring.ErrTransportDown}, {"no retries", -1, false, moonring.ErrTransport}} {
		t.Run(c.name, func(t *testing.T) {
			p := newFailoverPairCfg(t, nil, 256<<10, moonring.Config{RetryLimit: c.limit})
			fill(p.src, 9)
			req := p.write(0, 256<<10) // 4 slices of 64 KiB
			if c.only {
				req.Transport, req.TransportOnly = faultName, true
			}
			id, err := p.a.AllocateBatchID(1)
			if err != nil {
				t.Fatal(err)
			}
			p.fa.setHold(true)
			if err := p.a.SubmitTransfer(id, []moonring.TransferRequest{req}); err != nil {
				t.Fatal(err)
			}
			p.fa.waitHeld(t, 4)
			p.fa.setHold(false)
			p.fa.setDown(true)
			p.fa.releaseWith(-1, transport.ErrPeer, nil)
			waitBatch(t, p.a, id)
			st := statusOf(t, p.a, id, 0)
			if !errors.Is(st.Err(), c.want) {
				t.Fatalf("status %v (%v), want %v", st.Status, st.Err(), c.want)
			}
			if c.want == nil && !bytes.Equal(p.src, p.dst) {
				t.Fatal("bytes differ")
			}
			if c.want != nil && c.limit < 0 {
				if got := segTransport(t, p.a, p.seg); got != "fault2" {
					// The path is down all the same: new requests take the other.
					t.Fatalf("segment on %q", got)
				}
			}
		})
	}
}

// TestFailoverMetrics: the collector reports the failover, the failback
// and the path in use.
func TestFailoverMetrics(t *testing.T) {
	clk := newFakeClock()
	p := newFailoverPair(t, clk, 64<<10)
	p.fa.setDown(true)
	if err := p.transfer(t, p.write(0, 64<<10), 1); err != nil {
		t.Fatal(err)
	}
	p.fa.setDown(false)
	waitFor(t, "the failover is counted", func() bool { return pathStats(p.a, p.b.Name(), faultName).Failovers == 1 })
	clk.waitTimer(t, clk.Now().Add(100*time.Millisecond))
	clk.Advance(100 * time.Millisecond)
	waitFor(t, "failback", func() bool { return segTransport(t, p.a, p.seg) == faultName })
	rec := httptest.NewRecorder()
	p.a.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body := rec.Body.String()
	seg := p.b.Name()
	for _, want := range []string{
		`moonring_path_failovers_total{segment="` + seg + `",transport="fault"} 1`,
		`moonring_path_failbacks_total{segment="` + seg + `",transport="fault"} 1`,
		`moonring_segment_path{segment="` + seg + `",transport="fault"} 1`,
		`moonring_segment_path{segment="` + seg + `",transport="fault2"} 0`,
		`moonring_request_failovers_total{ring="batch/0"} 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if t.Failed() {
		t.Log(body)
	}
}

// TestFailoverNotForRequestErrors: a failure of the request itself (the
// peer denies it, the range is not its) is not a failure of the path:
// the request fails, on the path it took, and the path stays current.
func TestFailoverNotForRequestErrors(t *testing.T) {
	p := newFailoverPair(t, nil, 64<<10)
	for _, c := range []struct {
		err  error
		want error
	}{{transport.ErrDenied, moonring.ErrDenied}, {transport.ErrRange, moonring.ErrRemoteRange}} {
		p.fa.setFail(c.err)
		posted := p.f2a.postCount()
		if err := p.transfer(t, p.write(0, 4096), 1); !errors.Is(err, c.want) {
			t.Fatalf("%v: %v, want %v", c.err, err, c.want)
		}
		if p.f2a.postCount() != posted || segTransport(t, p.a, p.seg) != faultName {
			t.Fatalf("%v moved the request or the segment to the other path", c.err)
		}
		if ps := pathStats(p.a, p.b.Name(), faultName); ps.Failovers != 0 {
			t.Fatalf("%v counted as a failover: %+v", c.err, ps)
		}
	}
}

// TestFailoverPeerAddsTransport: a transport the peer installs after the
// segment was opened (its descriptor republished) becomes a path of the
// segment, and a failover takes it.
func TestFailoverPeerAddsTransport(t *testing.T) {
	p := &failoverPair{faultPair: &faultPair{fa: newFaultTransport(), fb: newFaultTransport()},
		f2a: &faultTransport{inner: newFaultTransport().inner, name: "fault2"}, f2b: &faultTransport{inner: newFaultTransport().inner, name: "fault2"}}
	p.a = startEngine(t, moonring.Config{Transports: []string{faultName, "fault2"}})
	p.b = startEngine(t, moonring.Config{})
	for _, x := range []struct {
		e *moonring.Engine
		t transport.Transport
	}{{p.a, p.fa}, {p.a, p.f2a}, {p.b, p.fb}} {
		if err := x.e.InstallTransport(x.t); err != nil {
			t.Fatal(err)
		}
	}
	p.src, p.dst = make([]byte, 64<<10), make([]byte, 64<<10)
	var err error
	if p.srcID, err = p.a.RegisterLocalMemory(p.src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := p.b.RegisterLocalMemory(p.dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	if p.seg, err = p.a.OpenSegment(ctx, p.b.Name()); err != nil {
		t.Fatal(err)
	}
	if info, err := p.a.Segment(p.seg); err != nil || len(info.Paths) != 1 {
		t.Fatalf("paths %+v (%v), want fault alone", info.Paths, err)
	}
	if err := p.b.InstallTransport(p.f2b); err != nil { // republishes b's segment
		t.Fatal(err)
	}
	waitFor(t, "the new transport's path opens", func() bool {
		info, err := p.a.Segment(p.seg)
		return err == nil && len(info.Paths) == 2 && info.Paths[1].Transport == "fault2"
	})
	p.fa.setDown(true)
	if err := p.transfer(t, p.write(0, 64<<10), 2); err != nil {
		t.Fatal(err)
	}
	if got := segTransport(t, p.a, p.seg); got != "fault2" {
		t.Fatalf("segment on %q after the failover", got)
	}
}

// TestFailoverInlineCopy: the same over a synchronous path (a Copier, as
// shm is), whose one-slice requests the ring copies as it takes them:
// the copy fails for a reason of the path (ErrPeer, or ErrClosed: the
// endpoint closed under it), and the request moves to the standby; one
// pinned to the path fails ErrTransportDown.
func TestFailoverInlineCopy(t *testing.T) {
	for _, perr := range []error{transport.ErrPeer, transport.ErrClosed} {
		t.Run(perr.Error(), func(t *testing.T) {
			// BusyPoll: a poller that never parks never lends its rings,
			// and takes each entry itself, copying it inline.
			p := newFailoverPairWith(t, nil, 64<<10, moonring.Config{BusyPoll: true}, func(fa *faultTransport) { fa.copier = true })
			p.fa.setFail(perr)
			posted2 := p.f2a.postCount()
			if err := p.transfer(t, p.write(0, 4096), 1); err != nil {
				t.Fatalf("one-slice request as the path dies: %v", err)
			}
			if p.f2a.postCount() == posted2 || segTransport(t, p.a, p.seg) != "fault2" {
				t.Fatal("the request did not move to fault2")
			}
			only := p.write(0, 4096)
			only.Transport, only.TransportOnly = faultName, true
			if err := p.transfer(t, only, 2); !errors.Is(err, moonring.ErrTransportDown) {
				t.Fatalf("pinned to the dead path: %v, want ErrTransportDown", err)
			}
		})
	}
}

// TestFailoverPeerWithdrawsTransport: a peer that uninstalls a transport
// republishes its descriptor without it; the path through it goes down at
// once (no request has to fail on it first, and none is denied for the
// keys the new descriptor lacks), new requests take the next path, and
// when the peer installs the transport again the segment fails back.
func TestFailoverPeerWithdrawsTransport(t *testing.T) {
	p := &failoverPair{faultPair: &faultPair{fa: newFaultTransport(), fb: newFaultTransport()},
		f2a: &faultTransport{inner: newFaultTransport().inner, name: "fault2"}, f2b: &faultTransport{inner: newFaultTransport().inner, name: "fault2"}}
	p.a = startEngine(t, moonring.Config{Transports: []string{faultName, "fault2"}})
	p.b = startEngine(t, moonring.Config{})
	for _, x := range []struct {
		e *moonring.Engine
		t transport.Transport
	}{{p.a, p.fa}, {p.a, p.f2a}, {p.b, p.fb}, {p.b, p.f2b}} {
		if err := x.e.InstallTransport(x.t); err != nil {
			t.Fatal(err)
		}
	}
	p.src, p.dst = make([]byte, 64<<10), make([]byte, 64<<10)
	var err error
	if p.srcID, err = p.a.RegisterLocalMemory(p.src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := p.b.RegisterLocalMemory(p.dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	if p.seg, err = p.a.OpenSegment(ctx, p.b.Name()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both paths open", func() bool {
		info, err := p.a.Segment(p.seg)
		return err == nil && len(info.Paths) == 2
	})
	if got := segTransport(t, p.a, p.seg); got != faultName {
		t.Fatalf("segment on %q, want %q", got, faultName)
	}
	if err := p.b.UninstallTransport(faultName); err != nil { // republishes b's segment without it
		t.Fatal(err)
	}
	waitFor(t, "the segment leaves the withdrawn transport", func() bool { return segTransport(t, p.a, p.seg) == "fault2" })
	if err := p.transfer(t, p.write(0, 64<<10), 3); err != nil {
		t.Fatal(err)
	}
	posted := p.fa.postCount()
	if err := p.transfer(t, p.write(0, 64<<10), 4); err != nil {
		t.Fatal(err)
	}
	if n := p.fa.postCount(); n != posted {
		t.Fatalf("%d slices posted to the withdrawn transport's path", n-posted)
	}
	waitFor(t, "one failover counted", func() bool {
		for _, ps := range p.a.PathStats() {
			if ps.Segment == p.b.Name() && ps.Transport == faultName {
				return ps.Failovers == 1
			}
		}
		return false
	})
	fb := newFaultTransport()
	if err := p.b.InstallTransport(fb); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the segment fails back", func() bool { return segTransport(t, p.a, p.seg) == faultName })
	if err := p.transfer(t, p.write(0, 64<<10), 5); err != nil {
		t.Fatal(err)
	}
}

// TestFailoverList: a prepared list's request whose path dies with its
// blocks out moves to the other path, every block in its own place.
func TestFailoverList(t *testing.T) {
	const block, n = 16 << 10, 8
	p := newFailoverPairCfg(t, nil, n*block, moonring.Config{RetryLimit: 1})
	fill(p.src, 13)
	base := uint64(moonring.AddressOf(p.dst))
	blocks := make([]moonring.Block, n)
	for i := range blocks { // block i to place n-1-i
		blocks[i] = moonring.Block{Local: uint64(i * block), Remote: base + uint64((n-1-i)*block), Length: block}
	}
	list, err := p.a.PrepareList(blocks)
	if err != nil {
		t.Fatal(err)
	}
	r, err := p.a.NewRing(moonring.RingConfig{Entries: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	p.fa.setHold(true)
	if err := r.SubmitOne(ptr(moonring.ListEntry(moonring.OpWrite, p.srcID, p.seg, list, 0, n, 1))); err != nil {
		t.Fatal(err)
	}
	p.fa.waitHeld(t, n)
	p.fa.setHold(false)
	p.fa.setDown(true)
	p.fa.releaseWith(-1, transport.ErrPeer, nil)
	ctx, cancel := context.WithTimeout(t.Context(), hangLimit)
	defer cancel()
	if err := r.CQ().Wait(ctx, 1); err != nil {
		t.Fatal(err)
	}
	c := r.Peek()
	if c == nil || c.Err() != nil || c.Bytes != n*block {
		t.Fatalf("completion %+v; want OK with %d bytes", c, n*block)
	}
	r.Advance(1)
	for i, b := range blocks {
		if !bytes.Equal(p.dst[b.Remote-base:][:block], p.src[b.Local:][:block]) {
			t.Fatalf("block %d not in its place after the failover", i)
		}
	}
	if got := segTransport(t, p.a, p.seg); got != "fault2" {
		t.Fatalf("segment on %q; want fault2", got)
	}
}

func ptr[T any](v T) *T { return &v }
