// rate.go holds a rail's measured speed: the moving average of its
// delivery rate that Start and Done feed and Pick weighs, and the rail's
// latency, which tells a sample of what the rail can move from one of
// what it was offered.

package rails

import (
	"math"
)

// roomGain is how far above what it was offered a rail with room is
// pushed (see Done): enough to find a faster rail's speed within some
// half-lives, little enough to leave a rail that has room what it has.
const roomGain = 1.25

// Flight is what a transport keeps of a slice from its post on a rail to
// its completion: Start returns it, Done takes it back. A plain value; it
// holds nothing that needs releasing.
type Flight struct {
	// Posted is when the rail took the slice, on the Picker's clock.
	Posted int64
	// Mark is the bytes the rail had delivered by then.
	Mark uint64
}

// Now returns the time on the Picker's clock (Config.Now), the clock of
// Start's and Done's times.
func (p *Picker) Now() int64 { return p.now() }

// Start returns the Flight of a slice that rail takes at now (from Now; a
// transport posting a batch may read it once for the whole batch).
func (p *Picker) Start(rail int, now int64) Flight {
	return Flight{Posted: now, Mark: p.rails[rail].delivered.Load()}
}

// Done records that the slice of Flight f, of bytes bytes, completed on
// rail at now, and heals the rail if it was probed (cooldown.go). Only
// slices that succeeded count: a failure is Failed's.
//
// The sample is the rail's delivery rate over the slice's flight: the
// bytes the rail delivered from f.Posted to now, this slice's included,
// over that time. While the rail is backed up (the slice waited its turn
// at least as long as the rail's latency, the time a slice that finds the
// rail idle takes), the rail moved bytes the whole time, so the sample is
// what the rail can move, and it moves the average down as well as up.
// Otherwise the sample shows what the rail was offered, not what it can
// move: were it to lower the average, a rail that got fewer slices than it
// could take would look slower and get fewer still, down to a fixed point
// at any rate below its speed. Such a sample, times roomGain, only raises
// the average: a rail with room is offered more until it backs up and its
// samples say what it moves.
func (p *Picker) Done(rail int, f Flight, bytes uint64, now int64) {
	r := &p.rails[rail]
	delivered := r.delivered.Add(bytes)
	front := max(r.last.Swap(now), f.Posted) // when it reached the front of the rail's queue
	took := now - f.Posted
	backed := false
	if front == f.Posted {
		r.latency(took) // it found the rail idle
	} else {
		backed = front-f.Posted >= r.lat.Load()
	}
	if took <= 0 {
		took = 1
	}
	s := float64(delivered-f.Mark) * 1e9 / float64(took)
	if !backed {
		s *= roomGain
	}
	// The weight is the slice's service time (from the front of the
	// queue to done: over a stretch of work these add up to the stretch)
	// in the first-order form of 1-exp(-t/tau): the average forgets half
	// of what it knew in about HalfLife of the rail's work, however that
	// is cut into slices. The first sample is taken whole.
	service := float64(max(now-front, 1))
	a := service / (service + p.tau)
	for {
		old := r.rate.Load()
		v := math.Float64frombits(old)
		if !backed && v >= s {
			break
		}
		nv := s
		if v > 0 {
			nv = v + a*(s-v)
		}
		if nv == v || r.rate.CompareAndSwap(old, math.Float64bits(nv)) {
			break
		}
	}
	if r.until.Load()&1 != 0 {
		p.heal(r)
	}
}

// latency folds the time of a slice that found the rail idle into the
// rail's latency, an average over the last eight or so such slices.
func (r *rail) latency(took int64) {
	for {
		old := r.lat.Load()
		nl := took
		if old > 0 {
			nl = old + (took-old)/8
		}
		if nl == old || r.lat.CompareAndSwap(old, nl) {
			return
		}
	}
}

// Rate returns rail's measured rate in bytes per second, 0 while it is
// unmeasured.
func (p *Picker) Rate(rail int) float64 {
	return math.Float64frombits(p.rails[rail].rate.Load())
}
