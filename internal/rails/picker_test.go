package rails

import (
	"math"
	"testing"
	"time"
)

// setRates gives each rail a measured rate in bytes per second.
func setRates(p *Picker, rates ...float64) {
	for i, r := range rates {
		p.rails[i].rate.Store(math.Float64bits(r))
	}
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
	p.rails[0].rate.Store(math.Float64bits(3e9))
	p.rails[1].rate.Store(math.Float64bits(1e9))
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

// TestAverage: the first sample is taken whole; samples of a rail backed
// up move the average by the share of the half-life their service took
// (one half-life of a new rate halves the distance to it, within the
// first-order weight's error); a slice that found the rail idle, or waited
// less than the rail's latency, only raises the average, to roomGain
// times its rate.
func TestAverage(t *testing.T) {
	const ms = int64(time.Millisecond)
	p := newPicker(t, 1, Config{HalfLife: 100 * time.Millisecond})
	t0 := int64(time.Hour)
	p.Done(0, p.Start(0, t0), 1e6, t0+ms) // alone, 1 MB in 1 ms: 1 GB/s
	if got := p.Rate(0); got != 1e9*roomGain {
		t.Fatalf("rate %v after the first sample, want %v", got, 1e9*roomGain)
	}
	if got := p.rails[0].lat.Load(); got != ms {
		t.Fatalf("latency %v after the first slice alone, want 1ms", time.Duration(got))
	}
	p.rails[0].rate.Store(math.Float64bits(1e9))
	// A queue of 1001 slices of 0 bytes posted at once, done every 100 µs:
	// the first found the rail idle; the others waited their turn, past
	// the rail's latency, so they are backed up: 100 ms of service at 0
	// bytes per second.
	t1 := t0 + int64(time.Second)
	f := p.Start(0, t1)
	for k := int64(1); k <= 1001; k++ {
		p.Done(0, f, 0, t1+k*ms/10)
	}
	if got := p.Rate(0); math.Abs(got-0.5e9) > 0.01e9 {
		t.Fatalf("after a half-life of service at 0 B/s: rate %v, want about 0.5e9", got)
	}
	before := p.Rate(0)
	// Alone, 1 MB/s: below the average, so it leaves it.
	t2 := t1 + int64(time.Second)
	p.Done(0, p.Start(0, t2), 1e3, t2+ms)
	if got := p.Rate(0); got != before {
		t.Fatalf("a slice alone, below the average, moved it: %v -> %v", before, got)
	}
	// Two slices, the second posted 0.9 ms after the first, which is done
	// 0.1 ms later: it waited less than the latency, so it had room.
	// Below the average: left.
	t3 := t2 + int64(time.Second)
	a := p.Start(0, t3)
	b := p.Start(0, t3+9*ms/10)
	p.Done(0, a, 1e3, t3+ms)
	p.Done(0, b, 1e3, t3+2*ms)
	if got := p.Rate(0); got != before {
		t.Fatalf("a slice with room, below the average, moved it: %v -> %v", before, got)
	}
	// The same at 4 GB/s: raised.
	t4 := t3 + int64(time.Second)
	a = p.Start(0, t4)
	b = p.Start(0, t4+9*ms/10)
	p.Done(0, a, 4e6, t4+ms)
	p.Done(0, b, 4e6, t4+2*ms)
	after := p.Rate(0)
	if after <= before {
		t.Fatalf("a slice with room, above the average, did not raise it: %v -> %v", before, after)
	}
	// Two slices posted at once, the second done 1 s after the first: it
	// waited past the latency, backed up, and its slow sample lowers it.
	t5 := t4 + int64(time.Second)
	a = p.Start(0, t5)
	b = p.Start(0, t5)
	p.Done(0, a, 1e3, t5+int64(time.Second))
	p.Done(0, b, 1e3, t5+2*int64(time.Second))
	if got := p.Rate(0); got >= after {
		t.Fatalf("a slow slice of a backed-up rail did not lower the average: %v -> %v", after, got)
	}
	// A sample of no time: 1 ns, not a division by zero.
	p.Done(0, p.Start(0, 0), 1, 0)
	if got := p.Rate(0); math.IsInf(got, 0) || math.IsNaN(got) || got <= 0 {
		t.Fatalf("rate %v after a sample of 0 ns", got)
	}
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
