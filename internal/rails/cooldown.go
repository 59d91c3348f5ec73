// cooldown.go holds what a rail's failure does: the cooldown that keeps
// Pick off the rail, its doubling, the probe that ends it and the healing
// that a success of the probe brings.

package rails

// Failed reports that rail failed (its connection broke, a redial failed).
// A healthy rail cools for MinCooldown. A rail that failed since its last
// probe (or, never probed, since it cooled) is already cooling for this
// failure, so Failed leaves it be: the slices of one broken connection all
// fail, and that is one failure. A rail whose probe went out cools again
// for twice its last cooldown, up to MaxCooldown.
func (p *Picker) Failed(rail int) {
	r := &p.rails[rail]
	r.mu.Lock()
	defer r.mu.Unlock()
	u := r.until.Load()
	if u != 0 && u&1 == 0 {
		return // cooling, no probe since: the same failure
	}
	b := p.min
	if u != 0 {
		b = min(2*r.backoff.Load(), p.max)
	}
	r.backoff.Store(b)
	// The cooldown's end, even: no probe went yet. Never 0, which is
	// "healthy", whatever the clock says.
	r.until.Store(max((p.now()+b)&^1, 2))
	if u == 0 {
		p.cooling.Add(1)
	}
}

// probe lets one slice through to a cooling rail whose cooldown, or last
// probe's wait, ended: it claims the probe by moving until (seen as u) to
// now plus the cooldown's length, odd, so that no other Pick probes the
// rail until the probe had that long to come back. False when another Pick
// claimed it first, or a Failed or a heal came between.
func (p *Picker) probe(r *rail, u, now int64) bool {
	return r.until.CompareAndSwap(u, (now+r.backoff.Load())|1)
}

// heal makes a probed rail healthy again after a success, and its next
// failure cools it for MinCooldown.
func (p *Picker) heal(r *rail) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		u := r.until.Load()
		if u&1 == 0 {
			return // healed already, or failed again since the probe
		}
		if r.until.CompareAndSwap(u, 0) { // a Pick may move a probe's wait
			r.backoff.Store(0)
			p.cooling.Add(-1)
			return
		}
	}
}

// soonest returns the rail whose cooldown (or probe's wait) ends first: what
// Pick returns when every rail is cooling.
func (p *Picker) soonest() int {
	best, at := 0, int64(0)
	for i := range p.rails {
		u := p.rails[i].until.Load()
		if u == 0 {
			return i // healed meanwhile
		}
		u &^= 1
		if i == 0 || u < at {
			best, at = i, u
		}
	}
	return best
}

// Cooling reports whether rail is cooling down (skipped by Pick but for
// its probes) after a failure.
func (p *Picker) Cooling(rail int) bool { return p.rails[rail].until.Load() != 0 }
