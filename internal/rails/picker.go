// Package rails chooses, slice by slice, which rail of a transport's
// endpoint (an RDMA device, an EFA endpoint, a TCP connection) carries the
// next slice: in proportion to what each rail has been measured to move,
// less a penalty for a rail on another NUMA node, skipping rails that
// failed until their cooldown ends.
//
// A Picker is embedded by an endpoint. Pick is its hot path: one atomic
// add on a shared counter and a few loads per rail, no lock, no
// allocation.
// The transport tells it of each slice done on a rail, with the time it
// was posted (Done), and of its rails' failures (Failed).
//
// # Weights
//
// A rail's weight is its rate, the moving average over wall time of the
// bytes per second it completes, raised by a quarter in the measure that
// its slices find room on it rather than wait their turn (rate.go), times
// its Penalty. What a rail has shown counts as far as it has been seen (a
// half-life of it, half), the mean of the rails' weights for the rest: a
// rail not yet measured weighs the mean (all weigh alike before any
// measurement). None weighs less than an eighth of the mean: every
// healthy rail gets slices and is measured.
//
// # Cooldown
//
// A rail that failed is skipped for its cooldown (cooldown.go), which
// doubles from MinCooldown up to MaxCooldown each time a probe fails. When
// it ends, one Pick lets one slice through as a probe; a success heals the
// rail (its cooldown length starts again from MinCooldown), a failure cools
// it again, and a probe never heard of is followed by another after the
// cooldown's length.
//
// # Concurrency
//
// Every method is safe for concurrent use: Pick by several pollers at once,
// Done and Failed from any goroutine (receivers, redialers).
//
// # Lifetimes
//
// A Picker holds no goroutine and no resource: it lives as long as what
// embeds it, and needs no closing.
package rails

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/cpu"
)

// MaxRails bounds the rails of one Picker.
const MaxRails = 64

// FarNUMA is the Penalty suggested for a rail on another NUMA node than the
// memory and CPU that feed it: it gets half the slices of a rail as fast
// on the near node.
const FarNUMA = 0.5

// Defaults of Config.
const (
	DefaultHalfLife    = 100 * time.Millisecond
	DefaultMinCooldown = 100 * time.Millisecond
	DefaultMaxCooldown = 10 * time.Second
)

// Config configures a Picker. Zero fields take the defaults.
type Config struct {
	// Penalty multiplies each rail's weight: 1 for a rail near the caller,
	// FarNUMA (or less) for one on another NUMA node. Nil: 1 for every
	// rail; otherwise one value in (0, 1] per rail.
	Penalty []float64
	// HalfLife is the wall time over which a rail's averages forget half
	// of what they knew (default 100 ms): each completion weighs the time
	// since the rail's completion before, so a rail's averages span about
	// the same stretch of time whatever its traffic and the size of its
	// slices.
	HalfLife time.Duration
	// MinCooldown and MaxCooldown bound how long a failed rail is skipped
	// before a probe (defaults 100 ms and 10 s): the first failure cools it
	// for MinCooldown, each failed probe doubles that, up to MaxCooldown.
	MinCooldown, MaxCooldown time.Duration
	// Now returns the time in nanoseconds on a monotonic clock, never
	// negative (default: the time since the process started). Tests set a
	// fake clock.
	Now func() int64
}

// Picker spreads slices over n rails by measured speed. Its zero value is
// not usable; use New. Safe for concurrent use; it must not be copied.
type Picker struct {
	rails   []rail
	tau     float64 // HalfLife / ln 2, in nanoseconds: the average's time constant
	idle    int64   // the longest stretch one sample spans: 4 HalfLives, ns
	min     int64   // MinCooldown, ns
	max     int64   // MaxCooldown, ns
	now     func() int64
	_       cpu.CacheLinePad
	seq     atomic.Uint64 // Picks so far: the index into the sequence of points
	_       cpu.CacheLinePad
	cooling atomic.Int32 // rails whose until is not 0: Pick reads the clock only then
	_       cpu.CacheLinePad
}

// rail is one rail's state, on a cache line of its own: each rail's
// completions come from its own goroutine.
type rail struct {
	// rate, room and seen are float64 bits, averages over wall time from
	// 0 (rate.go): of the bytes per second the rail completes, of 1 for a
	// slice that found room and 0 for one that waited its turn, and of 1s.
	rate atomic.Uint64
	room atomic.Uint64
	seen atomic.Uint64
	last atomic.Int64 // when the rail's last slice was done
	lat  atomic.Int64 // the time of a slice that finds the rail idle, ns
	// until is 0 while the rail is healthy. Otherwise it is when the
	// rail's cooldown ends (an even number), or, once a probe was let
	// through, when another may go (odd: the low bit says a probe went).
	until   atomic.Int64
	backoff atomic.Int64 // the current cooldown's length, ns; 0 after a success
	mu      sync.Mutex   // orders Failed and the healing of a probed rail
	penalty float64
	_       cpu.CacheLinePad
}

// start is the default clock's origin.
var start = time.Now()

func monotonic() int64 { return int64(time.Since(start)) }

// New returns a Picker over n rails, 1 <= n <= MaxRails, every rail healthy
// and unmeasured. It holds nothing to release: it lives as long as it is
// referenced.
func New(n int, cfg Config) (*Picker, error) {
	if n < 1 || n > MaxRails {
		return nil, fmt.Errorf("rails: %d rails, want 1..%d", n, MaxRails)
	}
	if cfg.Penalty != nil && len(cfg.Penalty) != n {
		return nil, fmt.Errorf("rails: %d penalties for %d rails", len(cfg.Penalty), n)
	}
	if cfg.HalfLife <= 0 {
		cfg.HalfLife = DefaultHalfLife
	}
	cfg.HalfLife = min(cfg.HalfLife, time.Duration(math.MaxInt64/4)) // idle below is 4 HalfLives
	if cfg.MinCooldown <= 0 {
		cfg.MinCooldown = DefaultMinCooldown
	}
	if cfg.MaxCooldown <= 0 {
		cfg.MaxCooldown = DefaultMaxCooldown
	}
	if cfg.MaxCooldown < cfg.MinCooldown {
		return nil, fmt.Errorf("rails: MaxCooldown %v below MinCooldown %v", cfg.MaxCooldown, cfg.MinCooldown)
	}
	if cfg.Now == nil {
		cfg.Now = monotonic
	}
	p := &Picker{rails: make([]rail, n), tau: float64(cfg.HalfLife) / math.Ln2, idle: 4 * int64(cfg.HalfLife), min: int64(cfg.MinCooldown), max: int64(cfg.MaxCooldown), now: cfg.Now}
	for i := range p.rails {
		p.rails[i].penalty = 1
		if cfg.Penalty != nil {
			w := cfg.Penalty[i]
			if !(w > 0 && w <= 1) { // NaN too
				return nil, fmt.Errorf("rails: penalty %v of rail %d, want (0, 1]", w, i)
			}
			p.rails[i].penalty = w
		}
	}
	return p, nil
}

// Len returns the number of rails.
func (p *Picker) Len() int { return len(p.rails) }

// minWeight is the least weight of a healthy rail, as a share of the mean
// weight: a rail that gets no slices is not measured again, so however
// slow it was it gets some, and shows when it is fast again.
const minWeight = 1.0 / 8

// golden is 2^64 divided by the golden ratio: the points seq*golden/2^64
// (mod 1) fill [0, 1) more evenly than random ones, at every length of the
// sequence (Weyl's sequence with the most irrational step), so that any
// run of picks has each rail's share within a few picks of its weight.
const golden = 0x9E3779B97F4A7C15

// Pick returns the rail for the next slice, in [0, Len()). Healthy rails
// are chosen in proportion to their weights, by the next point of a
// low-discrepancy sequence over their cumulative weights: deterministic
// for a given order of calls, with no lock. A cooling rail whose cooldown
// has ended is returned first, once, as its probe. When every rail is
// cooling, Pick returns the one whose cooldown ends first: the caller has
// nowhere better to go, and its slices fail over by their own rules.
//
// Pick takes no hint from the caller: an engine's rail hint (a request's
// rail plus the slice's index, already reduced modulo the rails) carries a
// few bits that would only disturb the sequence's spread.
func (p *Picker) Pick() int {
	x := p.seq.Add(1) * golden
	var now int64
	cooling := p.cooling.Load() != 0
	if cooling {
		now = p.now()
	}
	var w [MaxRails]float64 // a rail's own weight, then its weight; -1: cooling
	var measured, evidence float64
	for i := range p.rails {
		r := &p.rails[i]
		if cooling {
			if u := r.until.Load(); u != 0 {
				if now >= u&^1 && p.probe(r, u, now) {
					return i
				}
				w[i] = -1
				continue
			}
		}
		wi, seen := r.weight()
		w[i] = wi
		measured += wi * seen
		evidence += seen
	}
	// The mean weight, each rail's counted as far as it has been seen;
	// before any measurement all weigh alike.
	mean := 1.0
	if evidence > 0 {
		mean = measured / evidence
	}
	var sum float64
	for i := range p.rails {
		if w[i] < 0 {
			continue
		}
		seen := math.Float64frombits(p.rails[i].seen.Load()) // as weight read it, or a little more
		wi := seen*w[i] + (1-seen)*mean
		w[i] = max(wi, mean*minWeight) * p.rails[i].penalty
		sum += w[i]
	}
	if sum == 0 {
		return p.soonest()
	}
	u := float64(x>>11) * 0x1p-53 * sum
	last := -1
	for i := range p.rails {
		if w[i] < 0 {
			continue
		}
		if u -= w[i]; u < 0 {
			return i
		}
		last = i
	}
	return last // u rounded past the sum
}
