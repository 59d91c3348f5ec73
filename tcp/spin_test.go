package tcp

// Tests of a driver's spin before its read parks (spin.go).

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// The spin's rule: a miss that a spin of at most max would have caught
// doubles it (from spinFirst, capped at max); a longer one halves it,
// and below spinFirst it stops.
func TestSpinAdapt(t *testing.T) {
	const us = int64(time.Microsecond)
	s := spinner{max: 50 * us}
	steps := []struct {
		wait, want int64
	}{
		{20 * us, 5 * us},  // none -> the first spin
		{20 * us, 10 * us}, // short: doubles
		{20 * us, 20 * us}, // ...
		{20 * us, 40 * us}, // ...
		{50 * us, 50 * us}, // capped at max
		{51 * us, 25 * us}, // long: halves
		{900 * us, 12500},  // ...
		{900 * us, 6250},
		{900 * us, 0},     // below spinFirst: none
		{900 * us, 0},     // stays none
		{10 * us, 5 * us}, // and comes back
	}
	for i, st := range steps {
		s.adapt(1000, 1000+st.wait)
		if s.cur != st.want {
			t.Fatalf("step %d (wait %d ns): spin %d ns, want %d", i, st.wait, s.cur, st.want)
		}
	}
	off := spinner{max: 0}
	off.adapt(0, 1)
	if off.cur != 0 {
		t.Fatalf("DriveSpin off: spin %d after a short wait", off.cur)
	}
}

// The verdict: waits go the way whose moving average is lower, except
// the probes (the last probeLen of every probeEvery), which go the other
// way; and a spin that is off (none yet) is not taken whatever the
// averages say.
func TestSpinPrefers(t *testing.T) {
	const us = int64(time.Microsecond)
	for _, tc := range []struct {
		name        string
		spin, park  int64
		wantSpinned bool
	}{
		{"spinning is faster", 10 * us, 30 * us, true},
		{"parking is faster", 30 * us, 10 * us, false},
	} {
		s := spinner{max: 50 * us, cur: 40 * us}
		// Teach the averages: waits of each kind, as the drive loop does.
		for range 64 {
			s.looked++
			s.spun = true
			s.done(0, tc.spin, true)
			s.spun = false
			s.done(0, tc.park, false)
		}
		spins, probes := 0, 0
		s.looked = 0
		for range probeEvery {
			s.looked++
			p := s.prefer()
			if s.looked%probeEvery >= probeEvery-probeLen {
				probes++
				if p == tc.wantSpinned {
					t.Fatalf("%s: a probe went the preferred way", tc.name)
				}
				continue
			}
			if p {
				spins++
			}
		}
		want := 0
		if tc.wantSpinned {
			want = probeEvery - probeLen
		}
		if spins != want || probes != probeLen {
			t.Fatalf("%s: %d of %d waits spun, %d probes; want %d, %d", tc.name, spins, probeEvery, probes, want, probeLen)
		}
	}
}

// spinPair is a one-rail endpoint with DriveSpin set, through a proxy
// that can hold the target's answers back.
func spinPair(t *testing.T, spin time.Duration) (transport.Endpoint, []byte, testBuf, *proxy) {
	t.Helper()
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 1<<16, 9), true)
	px := newProxy(t, targ.tr.Addr())
	init := newSide(t, Config{Rails: 1, DriveSpin: spin})
	local := init.alloc(t, 1<<16, 1)
	ep, err := init.tr.Open(context.Background(), targ.desc(px.addr(), remote))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep.Close() })
	return ep, local, remote, px
}

// driveReads posts n Driven 64-byte READs one at a time and reads each
// answer with Drive, checking the bytes.
func driveReads(t *testing.T, ep transport.Endpoint, local []byte, remote testBuf, n int) {
	t.Helper()
	u := &countUntil{ch: make(chanCompleter, 8)}
	for i := range n {
		clear(local[:64])
		u.want.Add(1)
		s := driven(localSlice(transport.Read, local[:64], remote.addr, uint64(i+1)))
		if k, err := ep.Post(u, []transport.Slice{s}); k != 1 || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		ep.(*Endpoint).Drive(u, 0)
		for !u.Done() { // the first answer may have gone to the receiver
			time.Sleep(time.Millisecond)
		}
		if err := <-u.ch; err.err != nil {
			t.Fatalf("read %d: %v", i, err.err)
		}
		if !bytes.Equal(local[:64], bytes.Repeat([]byte{9}, 64)) {
			t.Fatalf("read %d: wrong bytes", i)
		}
	}
}

// Answers held 20 ms, past the largest spin: the spin falls to none, so
// a slow peer costs no CPU. Each wait the spin misses halves it, and four
// take 50 µs below spinFirst; a wait whose answer was in before the
// driver looked (a loaded machine, the race detector) is caught at once
// and moves nothing, so the test counts the misses.
func TestSpinShrinksOnSlowAnswers(t *testing.T) {
	ep, local, remote, px := spinPair(t, 0)
	px.delay.Store(int64(20 * time.Millisecond))
	c := rail0(t, ep)
	c.sp.cur = c.sp.max // as if answers had been quick
	for i := 0; i < 4 && c.sp.looked-c.sp.caught < 4; i++ {
		driveReads(t, ep, local, remote, 4)
	}
	if misses := c.sp.looked - c.sp.caught; misses < 4 {
		t.Skipf("only %d of %d waits missed the spin: this machine is too loaded to tell", misses, c.sp.looked)
	}
	if c.sp.cur != 0 {
		t.Fatalf("after %d misses of answers 20 ms away: spin %v; want none", c.sp.looked-c.sp.caught, time.Duration(c.sp.cur))
	}
}

// Answers held 1 ms, within a DriveSpin of 1 s: the spin grows from none
// until it catches them.
func TestSpinGrowsAndCatches(t *testing.T) {
	ep, local, remote, px := spinPair(t, time.Second)
	px.delay.Store(int64(time.Millisecond))
	c := rail0(t, ep)
	driveReads(t, ep, local, remote, 24)
	if c.sp.caught == 0 || c.sp.cur == 0 {
		t.Fatalf("after 24 answers 1 ms away: spin %v, caught %d; want a spin that catches", time.Duration(c.sp.cur), c.sp.caught)
	}
	// The spin's look at the socket allocates nothing. (The drive as a
	// whole is TestDriveAllocs's. AllocsPerRun runs on one P, where this
	// test's in-process target and proxy wait out a spin of up to its
	// DriveSpin of 1 s: see spin.)
	if allocs := testing.AllocsPerRun(100, func() { c.peek() }); allocs != 0 {
		t.Fatalf("%v allocations per look", allocs)
	}
}

// DriveSpin negative: the driver never looks before it reads.
func TestSpinOff(t *testing.T) {
	ep, local, remote, _ := spinPair(t, -1)
	c := rail0(t, ep)
	driveReads(t, ep, local, remote, 8)
	if c.sp.cur != 0 || c.sp.caught != 0 || c.sp.looked != 0 {
		t.Fatalf("DriveSpin off: spin %d, caught %d, looked %d", c.sp.cur, c.sp.caught, c.sp.looked)
	}
}
