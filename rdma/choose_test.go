package rdma

// Tests of the choice of rail (choose.go) without a device. The picker's
// clock is the test's; the rails' rates are those of a steady history fed
// to the picker (seedRates), and stay so while the clock stands still.

import (
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/rails"
)

// fakeClock is the pickers' clock in these tests: it moves when the test
// moves it.
type fakeClock struct{ ns atomic.Int64 }

func (c *fakeClock) now() int64          { return c.ns.Load() }
func (c *fakeClock) add(d time.Duration) { c.ns.Add(int64(d)) }

// seedHalfLife is the pickers' half-life in these tests.
const seedHalfLife = time.Second

// steadyRails configures a picker on c, started at an hour.
func steadyRails(c *fakeClock) rails.Config {
	c.ns.CompareAndSwap(0, int64(time.Hour))
	return rails.Config{HalfLife: seedHalfLife, Now: c.now}
}

// seedRates feeds pick thirty half-lives of steady completions, rail i
// completing rates[i] bytes per second in slices that each find it idle
// (every rail alike in that): its measure is then rates[i], whatever the
// average's form. The clock stands still afterwards: completions done at
// one instant weigh nothing against that history.
func seedRates(pick *rails.Picker, c *fakeClock, rates ...float64) {
	const step = seedHalfLife / 10
	for range 300 {
		posted := c.now()
		c.add(step)
		now := c.now()
		for i, r := range rates {
			pick.Done(i, uint64(r*step.Seconds()), posted, now)
		}
	}
}

// newTestChooser returns the choice over rails on devices dev, each rail
// measured at rates[i] bytes per second (none: unmeasured).
func newTestChooser(t *testing.T, dev []int, c *fakeClock, rates ...float64) *chooser {
	t.Helper()
	ch, err := newChooser(dev, steadyRails(c))
	if err != nil {
		t.Fatal(err)
	}
	seedRates(ch.pick, c, rates...)
	return ch
}

// choiceShares makes n choices and returns each rail's share of them.
func choiceShares(ch *chooser, n int, far, down uint64) []float64 {
	counts := make([]int, len(ch.dev))
	for range n {
		counts[ch.choose(far, down, 0)]++
	}
	out := make([]float64, len(counts))
	for i, k := range counts {
		out[i] = float64(k) / float64(n)
	}
	return out
}

// sharesNear fails t unless got is want within tol, rail by rail.
func sharesNear(t *testing.T, what string, got, want []float64, tol float64) {
	t.Helper()
	for i := range want {
		if math.Abs(got[i]-want[i]) > tol {
			t.Fatalf("%s: shares %.4f, want %.4f (within %v)", what, got, want, tol)
		}
	}
}

// TestChooseFarNUMA: two devices of two rails each, alike in speed; for
// memory near device 0, device 1's rails get half the share of device 0's
// (a third of the slices in all, not a half, and not none as they did
// when near memory kept to its near devices); for memory of no node,
// every rail the same. A far device twice as fast as the near one gets
// as many slices.
func TestChooseFarNUMA(t *testing.T) {
	var c fakeClock
	ch := newTestChooser(t, []int{0, 0, 1, 1}, &c, 1e9, 1e9, 1e9, 1e9)
	const far1 = 1 << 1 // device 1 is far
	sharesNear(t, "device 1 far", choiceShares(ch, 60000, far1, 0), []float64{1.0 / 3, 1.0 / 3, 1.0 / 6, 1.0 / 6}, 0.003)
	sharesNear(t, "no far device", choiceShares(ch, 60000, 0, 0), []float64{0.25, 0.25, 0.25, 0.25}, 0.003)
	fast := newTestChooser(t, []int{0, 0, 1, 1}, &c, 1e9, 1e9, 2e9, 2e9)
	sharesNear(t, "device 1 far and twice as fast", choiceShares(fast, 60000, far1, 0), []float64{0.25, 0.25, 0.25, 0.25}, 0.003)
	// Every window of 60 choices is close to its due too: the thinning
	// keeps the picker's even spread.
	for w := range 100 {
		got := choiceShares(ch, 60, far1, 0)
		for i, want := range []float64{20, 20, 10, 10} {
			if d := math.Abs(got[i]*60 - want); d > 3 {
				t.Fatalf("window %d: %.0f choices of rail %d, want %.0f within 3", w, got[i]*60, i, want)
			}
		}
	}
}

// TestChooseSlowRail: a rail measured at a quarter of the others' speed
// gets a quarter of their share; on a far device, an eighth.
func TestChooseSlowRail(t *testing.T) {
	var c fakeClock
	ch := newTestChooser(t, []int{0, 0, 1, 1}, &c, 4e9, 4e9, 4e9, 1e9)
	sharesNear(t, "rail 3 slow", choiceShares(ch, 65000, 0, 0), []float64{4.0 / 13, 4.0 / 13, 4.0 / 13, 1.0 / 13}, 0.003)
	sharesNear(t, "rail 3 slow, device 1 far", choiceShares(ch, 65000, 1<<1, 0), []float64{4.0 / 10.5, 4.0 / 10.5, 2.0 / 10.5, 0.5 / 10.5}, 0.003)
}

// TestChooseCooldown: a failed rail gets no slice during its cooldown
// (100 ms on the picker's clock), whatever the memory; when it ends, the
// next choice is its probe, even on a far device whose turn it is not
// (the thinning must not eat the probe, or the rail would wait another
// cooldown); after the probe's success the rail has its share again.
func TestChooseCooldown(t *testing.T) {
	var c fakeClock
	ch := newTestChooser(t, []int{0, 1}, &c, 1e9, 1e9)
	const far1 = 1 << 1
	ch.pick.Failed(1)
	for _, far := range []uint64{0, far1} {
		if got := choiceShares(ch, 10000, far, 0); got[1] != 0 {
			t.Fatalf("far %b: the cooling rail took %.4f of the choices, want none", far, got[1])
		}
	}
	c.add(rails.DefaultMinCooldown)
	// Device 1's turn in the thinning is not now: its credit is 0 and one
	// far pick leaves it at a half.
	if got := ch.choose(far1, 0, 0); got != 1 {
		t.Fatalf("first choice after the cooldown: rail %d, want rail 1's probe", got)
	}
	if got := choiceShares(ch, 10000, far1, 0); got[1] != 0 {
		t.Fatalf("the probe out: rail 1 took %.4f more of the choices, want none", got[1])
	}
	now := c.now()
	// The probe succeeded, the rail moving what it moved before (1 GB/s
	// over the cooldown since its last completion).
	ch.pick.Done(1, uint64(1e9*rails.DefaultMinCooldown.Seconds()), now, now)
	if ch.pick.Cooling(1) {
		t.Fatal("rail 1 still cooling after its probe succeeded")
	}
	sharesNear(t, "healed", choiceShares(ch, 30000, far1, 0), []float64{2.0 / 3, 1.0 / 3}, 0.003)
}

// TestChooseDown: no rail of a device that is down is chosen while another
// is up, and its rails cool (picks go elsewhere at once). Their cooldown
// does not grow while the port stays down: once it is up, each rail is
// probed within one MinCooldown, as it was the first time. With every
// device down a choice still returns a rail (the queue pairs' own
// failures tell the engine).
func TestChooseDown(t *testing.T) {
	var c fakeClock
	ch := newTestChooser(t, []int{0, 0, 1, 1}, &c, 1e9, 1e9, 1e9, 1e9)
	const down1 = 1 << 1
	for period := range 10 {
		got := choiceShares(ch, 1000, 0, down1)
		if got[2] != 0 || got[3] != 0 {
			t.Fatalf("period %d: device 1 down, shares %.4f; want none on rails 2 and 3", period, got)
		}
		if !ch.pick.Cooling(2) || !ch.pick.Cooling(3) {
			t.Fatalf("period %d: the down device's rails are not cooling", period)
		}
		c.add(rails.DefaultMinCooldown) // their probes come, and are passed over
	}
	// The port is up again: within one MinCooldown each rail's probe.
	c.add(rails.DefaultMinCooldown)
	probed := map[int]bool{}
	for range 10 {
		if ri := ch.choose(0, 0, 0); ri >= 2 {
			probed[ri] = true
		}
	}
	if !probed[2] || !probed[3] {
		t.Fatalf("probes of rails 2 and 3 after the port came back: %v; want both within one cooldown", probed)
	}
	// Notifications keep their rail, moved off a down device.
	for ri, want := range []int{0, 1, 0, 0} {
		if got := ch.up(ri, down1); got != want {
			t.Errorf("up(%d) with device 1 down: %d, want %d", ri, got, want)
		}
	}
	if got := ch.up(3, 0); got != 3 {
		t.Errorf("up(3) with every device up: %d, want 3", got)
	}
	// Everything down: some rail, no hang.
	if got := ch.choose(0, 0b11, 0); got < 0 || got >= 4 {
		t.Fatalf("every device down: rail %d", got)
	}
}

// TestChooseAvoid: the devices a remote buffer's NICs avoid get no slice
// and do not cool (other buffers' slices want them); the rest share by
// speed as before, a far one thinned. When every device the buffer wants
// is down, any device that is up serves.
func TestChooseAvoid(t *testing.T) {
	var c fakeClock
	ch := newTestChooser(t, []int{0, 0, 1, 1, 2, 2}, &c, 1e9, 1e9, 1e9, 3e9, 1e9, 1e9)
	const dev0, dev1, dev2 = 1 << 0, 1 << 1, 1 << 2
	sharesNear(t, "only device 1", choiceSharesAvoid(ch, 40000, 0, 0, dev0|dev2), []float64{0, 0, 0.25, 0.75, 0, 0}, 0.005)
	for ri := range 6 {
		if ch.pick.Cooling(ri) {
			t.Fatalf("rail %d cools after being avoided", ri)
		}
	}
	// Device 1 far: still only device 1 (thinning shares among the
	// devices wanted, and there is one).
	sharesNear(t, "only device 1, far", choiceSharesAvoid(ch, 40000, dev1, 0, dev0|dev2), []float64{0, 0, 0.25, 0.75, 0, 0}, 0.005)
	// Devices 0 and 2 wanted, 0 down: device 2 alone.
	sharesNear(t, "device 0 down", choiceSharesAvoid(ch, 40000, 0, dev0, dev1), []float64{0, 0, 0, 0, 0.5, 0.5}, 0.005)
	// The one device wanted is down: the others, as without the mask (a
	// fresh chooser: device 0's rails cool from being down just now).
	ch = newTestChooser(t, []int{0, 0, 1, 1, 2, 2}, &c, 1e9, 1e9, 1e9, 3e9, 1e9, 1e9)
	got := choiceSharesAvoid(ch, 40000, 0, dev1, dev0|dev2)
	if got[2] != 0 || got[3] != 0 || got[0] == 0 || got[4] == 0 {
		t.Fatalf("device 1 wanted and down: shares %.4f; want devices 0 and 2", got)
	}
}

// choiceSharesAvoid is choiceShares with the devices in avoid avoided.
func choiceSharesAvoid(ch *chooser, n int, far, down, avoid uint64) []float64 {
	counts := make([]int, len(ch.dev))
	for range n {
		counts[ch.choose(far, down, avoid)]++
	}
	out := make([]float64, len(counts))
	for i, k := range counts {
		out[i] = float64(k) / float64(n)
	}
	return out
}

// TestChooseAllocs: a choice allocates nothing, thinning, down and
// avoided devices included.
func TestChooseAllocs(t *testing.T) {
	var c fakeClock
	ch := newTestChooser(t, []int{0, 0, 1, 1, 2, 2}, &c, 1e9, 2e9, 1e9, 2e9, 1e9, 2e9)
	if a := testing.AllocsPerRun(1000, func() { ch.choose(1<<1, 1<<2, 1<<0) }); a != 0 {
		t.Fatalf("%.1f allocations per choice; want 0", a)
	}
}

// TestChooserBounds: a device index past the masks' 64 bits is refused, as
// is a number of rails the picker does not take.
func TestChooserBounds(t *testing.T) {
	if _, err := newChooser([]int{0, 64}, rails.Config{}); err == nil {
		t.Error("device 64 taken")
	}
	if _, err := newChooser(make([]int, rails.MaxRails+1), rails.Config{}); err == nil {
		t.Errorf("%d rails taken", rails.MaxRails+1)
	}
	if _, err := newChooser(nil, rails.Config{}); err == nil {
		t.Error("no rails taken")
	}
}
