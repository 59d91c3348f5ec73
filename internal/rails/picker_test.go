package rails

import (
	"math"
	"sync/atomic"
	"testing"
	"time"
)

// setRates gives each rail a rate in bytes per second, seen whole, with
// no room.
func setRates(p *Picker, rates ...float64) {
	for i, r := range rates {
		setRate(p, i, r)
	}
}

func setRate(p *Picker, rail int, rate float64) {
	p.rails[rail].rate.Store(math.Float64bits(rate))
	p.rails[rail].room.Store(0)
	p.rails[rail].seen.Store(math.Float64bits(1))
}

// TestSharesFollowRates: rails measured at 1, 0.5 and 0.25 GB/s get 4/7,
// 2/7 and 1/7 of the picks, over a long run and within every short window
// of it (the sequence spreads the picks evenly, not just on average).
func TestSharesFollowRates(t *testing.T) {
	p := newPicker(t, 3, Config{})
	setRates(p, 1e9, 0.5e9, 0.25e9)
	for i, want := range []float64{1e9, 0.5e9, 0.25e9} {
		if got := p.Rate(i); got != want {
			t.Fatalf("rail %d: rate %v after its first sample, want %v", i, got, want)
		}
	}
	want := []float64{4.0 / 7, 2.0 / 7, 1.0 / 7}
	near(t, "70000 picks", shares(p, 70000), want, 0.002)
	// Every window of 70 picks: each rail within 3 picks of its due.
	for w := range 200 {
		got := shares(p, 70)
		for i := range want {
			if d := math.Abs(got[i]-want[i]) * 70; d > 3 {
				t.Fatalf("window %d: shares %.3f, want %.3f within 3 of 70 picks", w, got, want)
			}
		}
	}
}

// TestEqualBeforeMeasuring: rails weigh alike before any measurement, and
// a rail not yet measured weighs the mean of those that are, so that it
// gets slices and is measured in turn.
func TestEqualBeforeMeasuring(t *testing.T) {
	p := newPicker(t, 3, Config{})
	near(t, "unmeasured", shares(p, 30000), []float64{1.0 / 3, 1.0 / 3, 1.0 / 3}, 0.002)
	setRate(p, 0, 3e9)
	setRate(p, 1, 1e9)
	// Rail 2 weighs (3+1)/2 = 2 of 6.
	near(t, "rail 2 unmeasured", shares(p, 60000), []float64{3.0 / 6, 1.0 / 6, 2.0 / 6}, 0.002)
}

// TestNUMAPenalty: a far rail as fast as a near one gets half its slices;
// a far rail twice as fast as a near one gets as many.
func TestNUMAPenalty(t *testing.T) {
	p := newPicker(t, 2, Config{Penalty: []float64{1, FarNUMA}})
	near(t, "unmeasured, rail 1 far", shares(p, 30000), []float64{2.0 / 3, 1.0 / 3}, 0.002)
	setRates(p, 1e9, 1e9)
	near(t, "alike, rail 1 far", shares(p, 30000), []float64{2.0 / 3, 1.0 / 3}, 0.002)
	q := newPicker(t, 2, Config{Penalty: []float64{FarNUMA, 1}})
	setRates(q, 2e9, 1e9)
	near(t, "rail 0 twice as fast and far", shares(q, 30000), []float64{0.5, 0.5}, 0.002)
}

// TestAverage: a rail's rate follows what it completes over wall time,
// forgetting half in a half-life, and its first sample is its rate, seen
// only for the time it covers; a burst of completions adds about its bytes
// over the time constant, whatever its samples' rates; an idle stretch
// counts as four half-lives at most; the measure of room follows whether
// slices found room or waited their turn.
func TestAverage(t *testing.T) {
	const ms = int64(time.Millisecond)
	const half = 100 * ms
	tau := float64(half) / math.Ln2 // ns
	p := newPicker(t, 1, Config{HalfLife: time.Duration(half)})
	r := &p.rails[0]
	load := func(b *atomic.Uint64) float64 { return math.Float64frombits(b.Load()) }
	t0 := int64(time.Hour)
	p.Done(0, 1e6, t0, t0+ms) // alone: 1 MB in 1 ms
	a1 := float64(ms) / (float64(ms) + tau)
	if got := p.Rate(0); math.Abs(got-1e9) > 1 {
		t.Fatalf("rate %v after the first sample, want 1e9", got)
	}
	if w, seen := r.weight(); math.Abs(w-1e9*roomGain) > 1 || seen != a1 {
		t.Fatalf("weight %v seen %v after a first slice alone, want %v seen %v", w, seen, 1e9*roomGain, a1)
	}
	if got := r.lat.Load(); got != ms {
		t.Fatalf("latency %v after the first slice alone, want 1ms", time.Duration(got))
	}
	// A queue posted as the first is done, done every 100 µs at 0.25 GB/s
	// for one half-life: all but its first waited their turn.
	t1 := t0 + ms
	for k := int64(1); k <= 1000; k++ {
		p.Done(0, 25e3, t1, t1+k*ms/10)
	}
	const d = 0.5 // what a half-life leaves
	want := (0.25e9*(1-d) + 1e9*a1*d) / ((1 - d) + a1*d)
	if got := p.Rate(0); math.Abs(got-want) > 0.01*want {
		t.Fatalf("after a half-life at 0.25 GB/s: rate %v, want about %v", got, want)
	}
	if got := load(&r.seen); math.Abs(got-(1-d+a1*d)) > 0.01 {
		t.Fatalf("seen %v after a half-life, want about %v", got, 1-d+a1*d)
	}
	if room := load(&r.room) / load(&r.seen); room > 0.02 {
		t.Fatalf("room %v after a half-life backed up, want about 0", room)
	}
	// A burst: ten completions of 1 MB, a nanosecond apart.
	before, seen := p.Rate(0), load(&r.seen)
	now := t1 + 1000*ms/10
	for k := int64(1); k <= 10; k++ {
		p.Done(0, 1e6, t1, now+k)
	}
	if got, bound := p.Rate(0)-before, 10*1e6/(tau/1e9)/seen; got <= 0 || got > 1.01*bound {
		t.Fatalf("a burst of 10 MB raised the rate by %v, want (0, %v]", got, bound)
	}
	// An hour idle, then 1 MB: four half-lives at most, not an hour.
	raw, seen := load(&r.rate), load(&r.seen)
	t2 := now + int64(time.Hour)
	p.Done(0, 1e6, t2, t2+ms)
	s := 1e6 / (4 * float64(half) / 1e9)
	a := 4 * float64(half) / (4*float64(half) + tau)
	if got, want := p.Rate(0), (raw+a*(s-raw))/(seen+a*(1-seen)); math.Abs(got-want) > 1e-6*want {
		t.Fatalf("after an hour idle: rate %v, want %v", got, want)
	}
	// A sample of no time: 1 ns, not a division by zero.
	p.Done(0, 1, t2+ms, t2+ms)
	if got := p.Rate(0); math.IsInf(got, 0) || math.IsNaN(got) || got <= 0 {
		t.Fatalf("rate %v after a sample of 0 ns", got)
	}
}

// TestLatency: a rail's latency follows a slice alone that took less
// within about eight slices, one that took more (a stall of the host)
// within about sixty-four.
func TestLatency(t *testing.T) {
	const ms = int64(time.Millisecond)
	p := newPicker(t, 1, Config{})
	at := int64(time.Hour)
	alone := func(took int64) int64 {
		at += 10 * ms
		p.Done(0, 4096, at, at+took)
		at += took
		return p.rails[0].lat.Load()
	}
	if got := alone(ms); got != ms {
		t.Fatalf("latency %v after the first slice, want 1ms", time.Duration(got))
	}
	if got, want := alone(9*ms), ms+8*ms/64; got != want {
		t.Fatalf("latency %v after a 9 ms stall, want %v", time.Duration(got), time.Duration(want))
	}
	want := ms + 8*ms/64
	want += (ms/5 - want) / 8
	if got := alone(ms / 5); got != want {
		t.Fatalf("latency %v after a 0.2 ms slice, want %v", time.Duration(got), time.Duration(want))
	}
}

// TestSeenInPart: a rail measured on one small slice, whose time is mostly
// latency, counts what that showed only for the time it covered, the
// others' mean for the rest: it keeps about its even share.
func TestSeenInPart(t *testing.T) {
	p := newPicker(t, 2, Config{})
	setRate(p, 0, 1e9)
	now := int64(time.Hour)
	p.Done(1, 4096, now-100_000, now) // 4 KiB in 100 µs: 41 MB/s, for 100 µs
	got := shares(p, 10000)
	if got[1] < 0.45 {
		t.Fatalf("a rail seen for 100 µs at 41 MB/s beside one at 1 GB/s: shares %.3f, want about even", got)
	}
}

// TestFloor: a rail far slower than the others still weighs an eighth of
// the mean, so it gets slices and is measured again.
func TestFloor(t *testing.T) {
	p := newPicker(t, 2, Config{})
	setRates(p, 1e9, 1e3)
	mean := (1e9 + 1e3) / 2
	want := mean / 8 / (1e9 + mean/8)
	near(t, "a rail a million times slower", shares(p, 100000), []float64{1 - want, want}, 0.002)
}

// TestNewChecks: New refuses what it cannot serve.
func TestNewChecks(t *testing.T) {
	for _, c := range []struct {
		n   int
		cfg Config
	}{
		{0, Config{}},
		{MaxRails + 1, Config{}},
		{2, Config{Penalty: []float64{1}}},
		{2, Config{Penalty: []float64{1, 0}}},
		{2, Config{Penalty: []float64{1, 1.5}}},
		{2, Config{Penalty: []float64{1, math.NaN()}}},
		{2, Config{MinCooldown: time.Second, MaxCooldown: time.Millisecond}},
	} {
		if _, err := New(c.n, c.cfg); err == nil {
			t.Errorf("New(%d, %+v) succeeded", c.n, c.cfg)
		}
	}
	if p, err := New(MaxRails, Config{}); err != nil || p.Len() != MaxRails {
		t.Fatalf("New(%d): %v", MaxRails, err)
	}
}

// A half-life too long to multiply is cut to one that is not: the longest
// stretch a sample spans stays positive.
func TestLongHalfLife(t *testing.T) {
	p, err := New(2, Config{HalfLife: 1<<63 - 1})
	if err != nil {
		t.Fatal(err)
	}
	if p.idle <= 0 {
		t.Fatalf("idle %d: overflowed", p.idle)
	}
}
