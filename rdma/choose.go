// choose.go holds an endpoint's choice of rail for a slice: the rail its
// rails.Picker chooses by measured speed, thinned to a FarNUMA share on
// devices far from the slice's local memory, never one on a device whose
// port is down, and (Mooncake mode) none on a device whose rails reach a
// peer NIC the peer's priority matrix does not pick for the remote
// buffer, while another is up.

package rdma

import (
	"fmt"
	"time"

	"github.com/moonring/moonring/internal/rails"
)

// maxTries bounds the picks of one choice: a pick is tried again when it
// lands on a down device, or on a far one whose turn it is not (at most
// every other far pick of a rail is passed over, so a choice takes two
// picks at most on average, and a few more only while devices are down).
const maxTries = 8

// chooser is an endpoint's choice of rail: one rails.Picker over all its
// rails, which measures each rail's speed (Done), cools a rail that
// failed (Failed) and picks in proportion to the speeds, plus the NUMA
// penalty, which depends on the slice's local memory, so it is not the
// Picker's (whose penalties are per rail, fixed): a rail on a device far
// from that memory is passed over on every other pick of it (FarNUMA),
// which gives it the share the Picker's Penalty would.
//
// One Picker per endpoint, not one per local NUMA node: a rail's speed and
// health are the queue pair's, whatever memory feeds it, and a Picker
// measures a rail only by the slices it picked, so pickers sharing the
// queue pairs would each see a part of their traffic and push their memory
// onto the near rails, which their own share made look faster.
//
// Concurrency: choose and up are called under the endpoint's postMu (the
// credits are plain); pick is safe for concurrent use on its own, and the
// pollers and the queue pairs' goroutines call its Done and Failed.
// Lifetime: the endpoint's; it holds nothing to release.
type chooser struct {
	pick   *rails.Picker
	dev    []int     // each rail's local device index, < 64
	devs   uint64    // the devices of the rails, one bit each
	credit []float64 // per rail: what its far picks have earned (see choose), under postMu
}

// railClockStart is the origin of railClock.
var railClockStart = time.Now()

// railClock is the rail pickers' clock: nanoseconds on the monotonic
// clock since the package was loaded.
func railClock() int64 { return int64(time.Since(railClockStart)) }

// newChooser returns the choice over rails whose local devices are dev, one
// entry per rail, with the picker configured by cfg (its Now defaulting to
// railClock, its Penalty left nil: choose applies the NUMA penalty).
func newChooser(dev []int, cfg rails.Config) (*chooser, error) {
	for _, d := range dev {
		if d < 0 || d >= 64 {
			return nil, fmt.Errorf("rdma: device index %d, want 0..63", d)
		}
	}
	if cfg.Now == nil {
		cfg.Now = railClock
	}
	cfg.Penalty = nil
	p, err := rails.New(len(dev), cfg)
	if err != nil {
		return nil, fmt.Errorf("rdma: %w", err)
	}
	var devs uint64
	for _, d := range dev {
		devs |= 1 << d
	}
	return &chooser{pick: p, dev: dev, devs: devs, credit: make([]float64, len(dev))}, nil
}

// choose returns the rail for a slice whose local memory is far from the
// devices in far, with the devices in down (one bit per device index)
// down, avoiding the devices in avoid (the remote buffer's nicPick).
//
// A rail on a down device is never returned while a device is up: a pick
// of it cools it (Failed, unless it is cooling already, so that its
// cooldown does not grow while the port is down and it comes back soon
// after) and picks again. A rail on an avoided device is never returned
// while a device neither down nor avoided is there: a pick of it picks
// again (it is not cooled: other buffers' slices want it). A far rail is
// passed over on every other pick (its credit grows by FarNUMA per pick,
// and a pick that makes it 1 takes it), but for a cooling one, whose pick
// is its probe or the best there is. After maxTries picks the first rail
// after the last that is up (and not avoided) is taken.
func (c *chooser) choose(far, down, avoid uint64) int {
	if c.devs&^(down|avoid) == 0 {
		avoid = 0 // every device the buffer wants is down: any that is up
	}
	ri := 0
	for range maxTries {
		ri = c.pick.Pick()
		bit := uint64(1) << c.dev[ri]
		if down&bit != 0 {
			if !c.pick.Cooling(ri) {
				c.pick.Failed(ri)
			}
			continue
		}
		if avoid&bit != 0 {
			continue
		}
		if far&bit == 0 || c.pick.Cooling(ri) {
			return ri
		}
		if c.credit[ri] += rails.FarNUMA; c.credit[ri] >= 1 {
			c.credit[ri]--
			return ri
		}
	}
	return c.up(ri, down|avoid)
}

// up returns ri, or when its device is down the first rail after it on a
// device that is up, or ri when every device is down.
func (c *chooser) up(ri int, down uint64) int {
	for k := range len(c.dev) {
		j := (ri + k) % len(c.dev)
		if down&(1<<c.dev[j]) == 0 {
			return j
		}
	}
	return ri
}
