package rdma

import (
	"errors"
	"time"

	"github.com/moonring/moonring/internal/rails"
)

// Name is the transport's name in segment descriptors.
const Name = "rdma"

// Defaults of Config.
const (
	DefaultQPsPerDevice   = 2
	DefaultDepth          = 128
	DefaultSliceSize      = 1 << 20
	DefaultMaxQPs         = 256
	DefaultMaxPeerQPs     = 1024
	DefaultConnectTimeout = 5 * time.Second
	// MaxMessage is the longest slice one work request carries.
	MaxMessage = 1 << 30
)

// Errors of the package, besides the transport sentinels it wraps.
var (
	// ErrNoDevice: no RDMA device is usable (none present, none ACTIVE,
	// none with a routable GID). It wraps transport.ErrNotSupported.
	ErrNoDevice = errors.New("rdma: no usable RDMA device")
	// ErrNoGID: a port has no GID the transport may use.
	ErrNoGID = errors.New("rdma: no usable GID")
	// ErrHandshake: the control connection's handshake failed (bad
	// message, refused QP).
	ErrHandshake = errors.New("rdma: handshake failed")
	// ErrTooManyQPs: the QP bound (Config.MaxQPs) is reached and no idle
	// endpoint could give one back.
	ErrTooManyQPs = errors.New("rdma: QP bound reached")
)

// Config configures a Transport. Zero fields take the defaults. A Config
// is read by New and not kept.
type Config struct {
	// Listen is the address of the control listener that peers dial to
	// connect queue pairs (default "127.0.0.1:0").
	Listen string
	// Advertise is the host:port peers dial (default: the listener's).
	Advertise string
	// Key is the segment key shared by the deployment (any length). Every
	// queue pair's handshake proves with an HMAC over fresh nonces that
	// both sides hold it, before the target creates anything. Empty: a
	// random key, published in Endpoint, so whoever reads the descriptor
	// may connect (as the TCP transport's open mode).
	Key []byte
	// Devices names the RDMA devices to use (default: every device with
	// an ACTIVE port and a usable GID).
	Devices []string
	// Port is the port number used on every device (default: the first
	// ACTIVE port).
	Port int
	// GIDIndex, when not nil, forces that GID table index on every device
	// instead of the automatic choice of a routable RoCE v2 GID (see
	// ChooseGID).
	GIDIndex *int
	// QPsPerDevice is the number of RC queue pairs per endpoint and local
	// device: the endpoint's rails (default 2). Devices times QPsPerDevice
	// is at most rails.MaxRails (64), or New fails.
	QPsPerDevice int
	// Depth bounds the work requests in flight per queue pair (default
	// 128); a full queue pair makes Post accept fewer slices.
	Depth int
	// SliceSize is the slice size the engine uses (default 1 MiB).
	SliceSize uint64
	// MaxQPs bounds the initiator's queue pairs over all endpoints
	// (default 256). Past it, Open and reconnects evict the idle queue
	// pairs of the least recently used endpoints, which reconnect when
	// next used.
	MaxQPs int
	// MaxPeerQPs bounds the queue pairs peers may connect to this
	// transport (default 1024). Only peers that proved the segment key
	// count, so those without it cannot use up the bound; control
	// connections still in the handshake are bounded apart (64 at once,
	// each for up to ConnectTimeout) and one beyond is closed unread.
	MaxPeerQPs int
	// ConnectTimeout bounds the connect of one queue pair (in Mooncake
	// mode, of one device's set): the dial, the handshake and the moves
	// to RTR and RTS (default 5 s), or the caller's context's deadline
	// when that is earlier. The kernel's steps cannot be interrupted (the
	// move to RTR resolves the peer's address: up to about 1 s): a
	// connect fails at most one such step after the timeout.
	ConnectTimeout time.Duration
	// Mooncake, when set, makes the transport speak Mooncake's RDMA
	// transport instead of moonring's (mooncake_mode.go): it is named
	// "mooncake-rdma", has no control listener (Listen, Advertise and Key
	// are not used), connects queue pairs through Mooncake's RPC
	// handshake and publishes its rkeys in Mooncake's form. Off (nil) by
	// default: Mooncake's wire has no authentication.
	Mooncake *MooncakeMode
	// railConfig, set only by tests, configures each endpoint's rail
	// picker (a half-life, a fake clock); its Penalty is ignored (see
	// chooser). Its Now, railClock by default, times each slice's post
	// and completion for every endpoint's picker.
	railConfig rails.Config
}

func (c Config) withDefaults() Config {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:0"
	}
	if c.QPsPerDevice <= 0 {
		c.QPsPerDevice = DefaultQPsPerDevice
	}
	if c.Depth <= 0 {
		c.Depth = DefaultDepth
	}
	if c.SliceSize == 0 {
		c.SliceSize = DefaultSliceSize
	}
	c.SliceSize = min(c.SliceSize, MaxMessage)
	if c.MaxQPs <= 0 {
		c.MaxQPs = DefaultMaxQPs
	}
	if c.MaxPeerQPs <= 0 {
		c.MaxPeerQPs = DefaultMaxPeerQPs
	}
	if c.ConnectTimeout <= 0 {
		c.ConnectTimeout = DefaultConnectTimeout
	}
	if c.railConfig.Now == nil {
		c.railConfig.Now = railClock
	}
	return c
}

// DeviceInfo describes one RDMA device, as Devices reports it.
type DeviceInfo struct {
	Name string
	// NUMANode is the device's NUMA node, -1 when unknown (soft devices).
	NUMANode int
	Ports    []PortInfo
}

// PortInfo describes one port of a device.
type PortInfo struct {
	Port int
	// State is the port state ("ACTIVE", "DOWN", ...).
	State string
	// LinkLayer is "InfiniBand" or "Ethernet".
	LinkLayer string
	// MTU is the active path MTU in bytes.
	MTU int
	LID uint16
	// GIDs is the port's GID table (valid entries only).
	GIDs []GID
	// Chosen is the index in GIDs of the GID the transport would use by
	// default, -1 when none is usable.
	Chosen int
}
