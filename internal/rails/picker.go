// Package rails chooses, slice by slice, which rail of a transport's
// endpoint (an RDMA device, an EFA endpoint, a TCP connection) carries the
// next slice: in proportion to what each rail has been measured to move,
// less a penalty for a rail on another NUMA node, skipping rails that
// failed until their cooldown ends.
//
// A Picker is embedded by an endpoint. Pick is its hot path: one atomic
// add on a shared counter and one load per rail, no lock, no allocation.
// The transport tells it when a slice starts on a rail (Start) and when it
// is done (Done), and of its rails' failures (Failed).
//
// # Weights
//
// A rail's weight is its rate, the moving average of the bytes per second
// it delivers while it is backed up (rate.go), times its Penalty. A
// rail not yet measured weighs the mean of the measured ones (all weigh
// alike before any measurement), so it gets slices and is measured.
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
// Start, Done and Failed from any goroutine (pollers, receivers,
// redialers).
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
	// HalfLife is the time a rail has work over which its average forgets
	// half of what it knew (default 100 ms): each sample weighs its
	// slice's service time, so a rail's average spans about the same
	// stretch of its busy time whatever the size of its slices.
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
	rate      atomic.Uint64 // float64 bits: bytes per second; 0 unmeasured
	delivered atomic.Uint64 // bytes of the rail's slices done, for Flight.Mark
	last      atomic.Int64  // when the rail's last slice was done
	lat       atomic.Int64  // the time of a slice that finds the rail idle, ns (rate.go)
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
// and unmeasured.
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
	p := &Picker{rails: make([]rail, n), tau: float64(cfg.HalfLife) / math.Ln2, min: int64(cfg.MinCooldown), max: int64(cfg.MaxCooldown), now: cfg.Now}
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
	var w [MaxRails]float64
	var measured float64
	nm := 0
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
		rate := math.Float64frombits(r.rate.Load())
		w[i] = rate
		if rate > 0 {
			measured += rate
			nm++
		}
	}
	mean := 1.0
	if nm > 0 {
		mean = measured / float64(nm)
	}
	var sum float64
	for i := range p.rails {
		switch {
		case w[i] < 0:
			continue
		case w[i] == 0:
			w[i] = mean
		}
		w[i] *= p.rails[i].penalty
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
