// rate.go holds a rail's measured speed, which Done feeds and Pick weighs:
// the moving average of what the rail completes per second, the measure
// in which its slices find room on it (which tells what it can move from
// what it was offered), and how much of either has been seen.

package rails

import (
	"math"
	"sync/atomic"
)

// roomGain is how far above what it completes a rail with room is
// weighed (see Done): enough to find a faster rail's speed within some
// half-lives, little enough to leave a rail that has room what it has.
const roomGain = 1.25

// Now returns the time on the Picker's clock (Config.Now), the clock of
// Done's times.
func (p *Picker) Now() int64 { return p.now() }

// Done records that a slice of bytes bytes, posted on rail at posted,
// completed at now, both nanoseconds on the Picker's clock (Now; a
// transport posting a batch may read it once for the whole batch). It
// heals the rail if it was probed (cooldown.go). Only slices that
// succeeded count: a failure is Failed's.
//
// The rail's rate is the moving average, over wall time, of the bytes it
// completes per second: each completion is a sample of its bytes over the
// time since the rail's completion before, weighed by that time (see
// average). Completions that come in a burst weigh little each, and a
// rail's average follows the clock, not its traffic: a rail that gets few
// slices is measured as promptly as one that gets many. What one sample
// says is believed only as far as the time it covers: a rail weighs its
// own rate in the measure of the time it has been seen (a half-life seen
// is half), and the mean of the rails' for the rest (see Pick), so that
// the first small slice on a rail, whose time is mostly latency, does not
// make it look slow.
//
// While a rail is backed up (its slices wait their turn at least as long
// as its latency, the time a slice that finds it idle takes), what it
// completes is what it can move. A rail with room completes only what it
// is offered: weighed by that, a rail that got fewer slices than it could
// take would stay where it is, however fast it is. So a rail weighs its
// rate times roomGain in the measure that its recent slices had room: it
// is offered more until it backs up and its rate says what it moves. When
// every rail has room (a light load), each weighs what it completes times
// roomGain, and the split stays where it is: no rail is a bottleneck
// then, so the split costs nothing.
func (p *Picker) Done(rail int, bytes uint64, posted, now int64) {
	r := &p.rails[rail]
	last := r.last.Swap(now)
	front := max(last, posted) // when the slice reached the front of the rail's queue
	room := 1.0
	if front == posted {
		r.latency(now - posted) // it found the rail idle
	} else if front-posted >= r.lat.Load() {
		room = 0 // it waited its turn: the rail is backed up
	}
	gap := now - last // since the completion before, idle time included
	if last == 0 {
		gap = now - posted // the first: its own time
	}
	// An idle stretch past a few half-lives counts as that: after a pause
	// of the whole endpoint, each rail's first sample says it was idle,
	// not how long each happened to be.
	gap = min(max(gap, 1), p.idle)
	a := float64(gap) / (float64(gap) + p.tau)
	average(&r.rate, float64(bytes)*1e9/float64(gap), a)
	average(&r.room, room, a)
	average(&r.seen, 1, a)
	if r.until.Load()&1 != 0 {
		p.heal(r)
	}
}

// average folds sample s into the average in bits (a float64's, from 0)
// with weight a, the first-order form of 1-exp(-t/tau) for a sample of t:
// the average forgets half of what it knew in about HalfLife, however the
// time is cut into samples. The averages start at 0; divided by the
// average of 1s (seen), they are the averages of what was seen. No lock:
// a CAS on the bits.
func average(bits *atomic.Uint64, s, a float64) {
	for {
		old := bits.Load()
		v := math.Float64frombits(old)
		nv := v + a*(s-v)
		if nv == v || bits.CompareAndSwap(old, math.Float64bits(nv)) {
			return
		}
	}
}

// latency folds the time of a slice that found the rail idle into the
// rail's latency: an average that follows a shorter time within eight or
// so slices, a longer one within sixty-four, so that it stays near the
// rail's own latency, not the stalls a loaded host adds to some slices.
func (r *rail) latency(took int64) {
	for {
		old := r.lat.Load()
		nl := took
		if old > 0 && took < old {
			nl = old + (took-old)/8
		} else if old > 0 {
			nl = old + (took-old)/64
		}
		if nl == old || r.lat.CompareAndSwap(old, nl) {
			return
		}
	}
}

// Rate returns rail's measured rate in bytes per second, 0 while it is
// unmeasured.
func (p *Picker) Rate(rail int) float64 {
	r := &p.rails[rail]
	seen := math.Float64frombits(r.seen.Load())
	if seen == 0 {
		return 0
	}
	return math.Float64frombits(r.rate.Load()) / seen
}

// weight returns what rail's own measure makes its weight (its rate,
// raised by roomGain in the measure that it has room) and how far that is
// to be believed (seen, in [0, 1)); 0, 0 while unmeasured.
func (r *rail) weight() (w, seen float64) {
	seen = math.Float64frombits(r.seen.Load())
	if seen == 0 {
		return 0, 0
	}
	rate := math.Float64frombits(r.rate.Load())
	room := math.Float64frombits(r.room.Load())
	return rate / seen * (1 + (roomGain-1)*room/seen), seen
}
