// class.go holds the priority classes of rings: the order a poller steps
// its rings in, the rounds in which a lower class waits for a higher one,
// and the promotion that keeps waiting lower-class work from starving.

package ring

import (
	"slices"
	"time"

	"github.com/moonring/moonring/transport"
)

// DefaultPromote is PollerConfig.Promote's default.
const DefaultPromote = time.Millisecond

// promoteTake bounds the entries a promoted ring takes in the round it is
// promoted: one, so that a high-class request finds at most one promoted
// request of a lower class ahead of it (over TCP a 1 MiB one costs a
// quarter of a millisecond here).
const promoteTake = 1

// Class returns the ring's priority class. Safe for concurrent use.
func (r *Ring) Class() transport.Class { return r.cfg.Class }

// hold decides, at the start of a ring's step, whether the ring waits this
// round because a ring of a higher class is busy (held: see heldAt).
// A waiting ring reaps its completions and expires its deadlines but
// starts nothing new: no entry taken, no slice posted. Once it has waited
// Promote with work pending, it is promoted for one round and takes up to
// promoteTake entries (and posts its pending slices); its wait starts over.
// It returns the most entries the ring may take now: 0 to wait.
func (r *Ring) hold(t int64, held bool) int {
	if !held {
		r.heldSince = 0
		return maxTake
	}
	if r.sq.Empty() && len(r.redo) == 0 && r.queued == 0 && r.qredo == 0 {
		// Nothing waits now, but entries a caller pushes while this
		// step publishes completions must wait like any other.
		r.heldSince = 0
		return 0
	}
	if r.heldSince == 0 {
		r.heldSince = t
	}
	if t-r.heldSince < int64(r.poller.cfg.Promote) {
		r.stats.Held++
		return 0
	}
	r.heldSince = t
	r.stats.Promoted++
	return promoteTake
}

// linger is how long after a ring of a higher class was last busy (see
// noteBusy) a lower-class ring is still held: a
// latency-critical caller's next request comes a few microseconds after
// its last completion, and bulk posted in that gap would be in flight
// ahead of it.
const linger = 100 * time.Microsecond

// heldAt reports whether a ring of the given rank is held at t: a ring of
// a higher class was busy this round or within linger. Token holder only.
func (p *Poller) heldAt(rank int, t int64) bool { return p.busyWithin(rank, t, linger) }

// busyWithin reports whether a ring of a higher class than rank was busy
// within d of t. Token holder only.
func (p *Poller) busyWithin(rank int, t int64, d time.Duration) bool {
	for k := range rank {
		if at := p.busyAt[k]; at != 0 && t-at < int64(d) {
			return true
		}
	}
	return false
}

// noteBusy records that r, of the given rank, is busy at t: it took
// entries or completed a request this step (its caller's next request may
// be a moment away: see linger), or it has requests in flight and
// completed or took one within stall. A ring whose requests are stuck (a
// peer that does not answer, a long transfer) stops holding lower classes
// back after stall. Token holder only.
func (p *Poller) noteBusy(r *Ring, rank int, t int64) {
	if r.took || r.lastEnd == t || (r.active > 0 && t-max(r.lastEnd, r.takenAt) < int64(stall)) {
		p.busyAt[rank] = t
	}
}

// stall is how long a ring with requests in flight that completes none
// still counts as busy.
const stall = 10 * time.Millisecond

// maxTake bounds the entries a ring takes in one round.
const maxTake = 64

// yieldBytes bounds the inline copies (local, shm: done on the poller) a
// ring makes in one round while a ring of a higher class on its poller is
// busy or was within stall: a request of that class waits for at most
// this much copying (and one request's, or one block of a prepared
// list's, which is not cut: see MaxBlock) before the poller looks at it.
// noYield is the bound otherwise (an idle higher class costs a lower one's
// copies nothing: 64 KiB slices cost a third of 1 MiB ones' throughput).
const (
	yieldBytes = 64 << 10
	noYield    = ^uint64(0)
)

// insertByClass returns rs with r inserted after every ring of its class
// or a higher one: a poller steps its rings high class first, each class
// in the order its rings were made.
func insertByClass(rs []*Ring, r *Ring) []*Ring {
	i := len(rs)
	for i > 0 && rs[i-1].cfg.Class.Rank() > r.cfg.Class.Rank() {
		i--
	}
	return slices.Insert(slices.Clone(rs), i, r)
}
