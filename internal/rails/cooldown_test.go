package rails

import (
	"testing"
	"time"
)

const ms = int64(time.Millisecond)

// only fails t unless n picks all return rail.
func only(t *testing.T, p *Picker, n, rail int, what string) {
	t.Helper()
	for k := range n {
		if got := p.Pick(); got != rail {
			t.Fatalf("%s: pick %d went to rail %d, want %d only", what, k, got, rail)
		}
	}
}

// ok completes a slice on rail at the clock's time: a success.
func ok(p *Picker, c *clock, rail int) {
	p.Done(rail, 4096, c.now(), c.now())
}

// TestCooldownProbe: a failed rail gets no slice until MinCooldown has
// gone by; then exactly one Pick returns it, as a probe, and it gets no
// other until the probe is heard of; the probe's success heals it, and
// it gets its share again.
func TestCooldownProbe(t *testing.T) {
	var c clock
	c.set(int64(time.Hour))
	p := newPicker(t, 2, c.config())
	p.Failed(1)
	if !p.Cooling(1) || p.Cooling(0) {
		t.Fatal("Cooling does not say rail 1, and rail 1 only, is cooling")
	}
	only(t, p, 1000, 0, "cooling")
	c.add(100*ms - 1)
	only(t, p, 1000, 0, "a nanosecond before the cooldown's end")
	c.add(1)
	if got := p.Pick(); got != 1 {
		t.Fatalf("first pick after the cooldown: rail %d, want the probe to rail 1", got)
	}
	only(t, p, 1000, 0, "the probe out")
	ok(p, &c, 1)
	if p.Cooling(1) {
		t.Fatal("rail 1 still cooling after its probe succeeded")
	}
	near(t, "healed", shares(p, 10000), []float64{0.5, 0.5}, 0.002)
	if p.cooling.Load() != 0 {
		t.Fatalf("%d rails counted cooling, want 0", p.cooling.Load())
	}
}

// TestCooldownBackoff: each failed probe doubles the cooldown, from 100 ms
// up to 10 s; failures with no probe between them are one failure (the
// slices of one broken connection); a success starts again at 100 ms.
func TestCooldownBackoff(t *testing.T) {
	var c clock
	c.set(int64(time.Hour))
	p := newPicker(t, 2, c.config())
	p.Failed(1)
	want := 100 * ms
	for round := range 12 {
		c.add(want / 2)
		p.Failed(1) // the same failure: no probe went since
		c.add(want/2 - 1)
		only(t, p, 100, 0, "cooling")
		c.add(1)
		if got := p.Pick(); got != 1 {
			t.Fatalf("round %d: no probe %v after the cooldown started", round, time.Duration(want))
		}
		p.Failed(1) // the probe failed
		want = min(2*want, 10*int64(time.Second))
		if got := p.rails[1].backoff.Load(); got != want {
			t.Fatalf("round %d: cooldown %v, want %v", round, time.Duration(got), time.Duration(want))
		}
	}
	c.add(want)
	if got := p.Pick(); got != 1 {
		t.Fatalf("no probe after the longest cooldown: rail %d", got)
	}
	ok(p, &c, 1)
	p.Failed(1)
	if got := p.rails[1].backoff.Load(); got != 100*ms {
		t.Fatalf("cooldown %v after a success and a failure, want 100ms", time.Duration(got))
	}
}

// TestProbeLost: a probe never heard of (its slice went elsewhere, say) is
// followed by another once the cooldown's length has gone by again.
func TestProbeLost(t *testing.T) {
	var c clock
	c.set(int64(time.Hour))
	p := newPicker(t, 3, c.config())
	p.Failed(2)
	c.add(100 * ms)
	if got := p.Pick(); got != 2 {
		t.Fatalf("first probe: rail %d, want 2", got)
	}
	c.add(100*ms - 1)
	for range 1000 {
		if p.Pick() == 2 {
			t.Fatal("a second probe while the first may still come back")
		}
	}
	c.add(1)
	if got := p.Pick(); got != 2 {
		t.Fatalf("no second probe after the first was lost: rail %d", got)
	}
	ok(p, &c, 2)
	if p.Cooling(2) {
		t.Fatal("rail 2 cooling after the second probe succeeded")
	}
}

// TestStaleSuccess: a success of a slice that was out before the failure
// (no probe went since) leaves the rail cooling.
func TestStaleSuccess(t *testing.T) {
	var c clock
	c.set(int64(time.Hour))
	p := newPicker(t, 2, c.config())
	posted := c.now()
	p.Failed(1)
	p.Done(1, 4096, posted, c.now()+1)
	if !p.Cooling(1) {
		t.Fatal("a slice out before the failure healed the rail")
	}
	only(t, p, 100, 0, "cooling")
}

// TestAllCooling: with every rail cooling, Pick returns the rail whose
// cooldown ends first, then each probe as its cooldown ends.
func TestAllCooling(t *testing.T) {
	var c clock
	c.set(int64(time.Hour))
	p := newPicker(t, 3, c.config())
	p.Failed(0)
	c.add(10 * ms)
	p.Failed(2)
	c.add(10 * ms)
	p.Failed(1)
	only(t, p, 100, 0, "all cooling, rail 0's ends first")
	c.add(80 * ms) // rail 0's cooldown ends: its probe, then its wait
	if got := p.Pick(); got != 0 {
		t.Fatalf("rail 0's probe: rail %d", got)
	}
	only(t, p, 100, 2, "rail 0 probed until +200ms, rail 2 cools until +110ms")
	c.add(10 * ms)
	if got := p.Pick(); got != 2 {
		t.Fatalf("rail 2's probe: rail %d", got)
	}
	only(t, p, 100, 1, "rail 1 cools until +120ms, before 0 and 2's probes")
	ok(p, &c, 2)
	only(t, p, 100, 2, "rail 2 healed")
}
