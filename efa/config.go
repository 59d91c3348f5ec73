package efa

import (
	"fmt"
	"time"
)

// Name is the transport's name in segment descriptors, whatever libfabric
// provider carries it.
const Name = "efa"

// Defaults of Config.
const (
	// DefaultSliceSize is the slice size when the provider allows it.
	DefaultSliceSize = 1 << 20
	// DefaultTimeout is Config.Timeout's default.
	DefaultTimeout = 30 * time.Second
	// DefaultLinger is Config.Linger's default.
	DefaultLinger = 5 * time.Second
	// MaxDepth bounds Config.Depth.
	MaxDepth = 1 << 16
)

// Config configures a Transport. Zero fields take the defaults.
type Config struct {
	// Providers names the libfabric providers to try, in order (default
	// {"efa"}). Naming more than one is the user's permission to fall back:
	// {"efa", "tcp"} uses EFA where the machine has it and libfabric's TCP
	// provider (with ofi_rxm for reliable datagrams) elsewhere. Peers must
	// end up on the same provider: an endpoint published by another one is
	// unreachable.
	Providers []string
	// Domain, when set, picks the provider's domain by name (an EFA device
	// such as "rdmap16s27-rdm", a network interface such as "lo" for tcp).
	Domain string
	// Depth bounds the slices in flight on the transport, all endpoints
	// together (default: the provider's transmit queue size, at most
	// 4096). Post accepts fewer slices when it is reached.
	Depth int
	// SliceSize is the largest slice the engine should post (default 1 MiB;
	// always capped by the provider's max_msg_size).
	SliceSize uint64
	// Timeout is how long a posted slice may wait for its completion from
	// the provider before Poll fails it with an error wrapping ErrPeer
	// (default 30 s; negative: never). It is what turns a peer that died
	// without the provider noticing into failed requests.
	Timeout time.Duration
	// Linger is how long Endpoint.Close waits, polling, for the endpoint's
	// slices in flight before it fails them with ErrClosed (default 5 s).
	Linger time.Duration
	// Progress starts a goroutine that calls Poll until Close. Off by
	// default: the engine's pollers call Poll (every millisecond once
	// idle). A transport used without the engine, the target side of a
	// benchmark for instance, needs it, and an engine serving peers over a
	// software provider answers faster with it: libfabric's software
	// providers move a peer's RMA only while the target polls.
	Progress bool
	// ProgressSleep is how long the progress goroutine sleeps when a Poll
	// delivered nothing and no completion came for 50 µs (default 0: it
	// only yields, and so keeps a core busy; negative: same as 0).
	ProgressSleep time.Duration
}

// Effective returns c with the defaults filled in, and whether it is valid.
// The provider's limits (Depth, SliceSize) are applied by New.
func (c Config) Effective() (Config, error) {
	err := c.fill()
	return c, err
}

func (c *Config) fill() error {
	if len(c.Providers) == 0 {
		c.Providers = []string{"efa"}
	}
	for _, p := range c.Providers {
		if p == "" || len(p) > 64 {
			return fmt.Errorf("efa: bad config: provider name %q", p)
		}
	}
	if c.SliceSize == 0 {
		c.SliceSize = DefaultSliceSize
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Linger <= 0 {
		c.Linger = DefaultLinger
	}
	if c.Depth < 0 || c.Depth > MaxDepth {
		return fmt.Errorf("efa: bad config: Depth %d (0..%d)", c.Depth, MaxDepth)
	}
	if c.SliceSize < 4096 {
		return fmt.Errorf("efa: bad config: SliceSize %d below 4 KiB", c.SliceSize)
	}
	return nil
}
