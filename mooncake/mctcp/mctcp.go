package mctcp

// mctcp.go: the transport's name, its Config and the Transport's life: New,
// Close and what the engine publishes for it.

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/internal/netaddr"
	"github.com/moonring/moonring/internal/ratelog"
	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/transport"
)

// Names in a segment descriptor (the same strings as mooncake.TransportTCP
// and mooncake.EndpointTCPVersion; this package does not import mooncake).
const (
	// Name is the transport's name: Endpoints[Name] is "host:port" of the
	// target's data port (Mooncake's tcp_data_port), and every buffer
	// reachable through it carries Keys[Name] = "" (the protocol has no
	// key).
	Name = "mooncake-tcp"
	// VersionEndpoint is the Endpoints entry that names the data protocol
	// version the target speaks: absent or "1" for version 1, "2" (or
	// more) for version 2.
	VersionEndpoint = "mooncake-tcp.version"
	// ServedVersion is the version this package's target speaks, published
	// under VersionEndpoint (see ExtraEndpoints).
	ServedVersion = 2
)

// Defaults of Config.
const (
	DefaultRails     = 4
	DefaultDepth     = 64
	DefaultSliceSize = 1 << 20
	DefaultMaxLength = 1 << 30
	// DefaultMaxConns is Config.MaxConns's default. Mooncake's TCP
	// client opens a connection per request unless its pool is on
	// (MC_TCP_ENABLE_CONNECTION_POOL), so one initiator host holds as
	// many connections as it has requests in flight: transfer_engine_bench
	// with its defaults, 12 threads of 128, holds 1,536. A connection
	// costs the target about 32 KiB and a descriptor.
	DefaultMaxConns = 8192
	// DefaultMaxConnsPerSource is Config.MaxConnsPerSource's default (see
	// DefaultMaxConns: one Mooncake host may need thousands).
	DefaultMaxConnsPerSource = 4096
	// evictAfter is how long a connection must have waited for a request
	// before admission may close it to make room: one accepted a moment
	// ago, or answered a moment ago, may have its next request in the
	// socket unread (Mooncake's client sends it at once on a new
	// connection), and closing it would fail that request.
	evictAfter           = time.Second
	DefaultIdleTimeout   = time.Hour
	DefaultFrameTimeout  = 30 * time.Second
	DefaultMinRate       = 100 << 20
	DefaultStatusTimeout = 30 * time.Second
	DefaultDialTimeout   = 5 * time.Second
)

// Errors of this package. Each is wrapped together with the transport
// sentinel that tells the engine what to do (ErrPeer: retry on another
// rail; ErrDenied: final).
var (
	// ErrRefused: a version 2 target answered a request with its refusal
	// status (the range is not inside one of its registered buffers).
	// Completed wrapped with transport.ErrDenied.
	ErrRefused = errors.New("mctcp: the target refused the address range")
	// ErrBadStatus: a status word without Mooncake's magic, or with a code
	// this package does not know: a peer that speaks version 1 behind a
	// descriptor that says 2, or a stream out of step. The connection is
	// dropped; completed wrapped with transport.ErrPeer.
	ErrBadStatus = errors.New("mctcp: malformed status word")
	// ErrTimeout: no status word or READ data within StatusTimeout. The
	// connection is dropped; completed wrapped with transport.ErrPeer.
	ErrTimeout = errors.New("mctcp: no answer within StatusTimeout")
)

// Config configures a Transport. Zero fields take the defaults; a negative
// duration or count means "no bound" where the field says so.
type Config struct {
	// Listen is the address the target serves on, Mooncake's
	// tcp_data_port (default "127.0.0.1:0").
	Listen string
	// Advertise is the host:port peers dial (default: the listener's, with
	// an interface's address for a listener on all interfaces).
	Advertise string

	// Rails is the number of connections per peer (default 4). A Mooncake
	// target serves one request at a time per connection, so the rails
	// are what moves requests in parallel.
	Rails int
	// Depth bounds the requests sent ahead on one connection before their
	// answers (default 64; 1..65536). The target still serves them one
	// after another.
	Depth int
	// SliceSize is the slice size the engine uses (default 1 MiB).
	SliceSize uint64
	// Version is the protocol the initiator speaks: 0 (default) as the
	// peer's descriptor says (VersionEndpoint; absent means 1, as for
	// Mooncake), 1 always version 1 (Mooncake's MC_TCP_PROTO=1), 2 always
	// version 2.
	Version int
	// StatusTimeout bounds the initiator's wait for each answer: a status
	// word, or a READ's data (default 30 s, Mooncake's
	// MC_TCP_STATUS_TIMEOUT_SEC). A peer that says nothing for this long
	// (plus up to 2 s when the request went out while the connection was
	// idle) fails the connection's slices with ErrPeer. It bounds each
	// write of requests too.
	StatusTimeout time.Duration
	// DialTimeout bounds each dial (default 5 s).
	DialTimeout time.Duration

	// MaxLength is the longest request the target serves (default 1 GiB;
	// a registered buffer bounds it too). Mooncake's initiator sends each
	// transfer request whole, unsliced.
	MaxLength uint64
	// MaxConns bounds the target's connections (default 8192; negative:
	// no bound). A connection accepted at the bound closes the one idle
	// longest (waiting for a request header for at least a second); when
	// none is, the new connection is closed instead.
	MaxConns int
	// MaxConnsPerSource bounds the target's connections from one source
	// address (an IPv6 source counts by its /64; default 4096; negative: no
	// bound), so that one host cannot take every connection: at the bound
	// its own connection idle longest is closed, or the new one.
	MaxConnsPerSource int
	// IdleTimeout closes a target connection that has not sent a whole
	// request header for this long (default an hour; negative: never).
	// Mooncake's initiator keeps its connections (lanes) and reuses one
	// without checking it, so a close fails its next request on it (in
	// version 1 a WRITE may even be reported done and lost): the default
	// is long, MaxConns bounds the idle connections a stranger can hold,
	// and TCP keepalive (on by default) ends those of vanished peers.
	IdleTimeout time.Duration
	// FrameTimeout bounds the moving of one request's payload on the
	// target, together with MinRate: it may take FrameTimeout plus its
	// length at MinRate (default 30 s), so that a stalled peer cannot
	// hold a buffer, and its Unregister, longer.
	FrameTimeout time.Duration
	// MinRate is the slowest payload rate the target waits for, in bytes
	// per second (default 100 MiB/s; see FrameTimeout).
	MinRate uint64

	// Logger receives connection events (default: discard). Refusals are
	// logged at most once a second per reason, with the count of those
	// not logged since.
	Logger *slog.Logger
}

// Effective returns c with the defaults filled in, and whether it is valid.
func (c Config) Effective() (Config, error) {
	err := c.fill()
	return c, err
}

func (c *Config) fill() error {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:0"
	}
	setDefault(&c.Rails, DefaultRails)
	setDefault(&c.Depth, DefaultDepth)
	setDefault(&c.SliceSize, DefaultSliceSize)
	setDefault(&c.MaxLength, DefaultMaxLength)
	setDefault(&c.MaxConns, DefaultMaxConns)
	setDefault(&c.MaxConnsPerSource, DefaultMaxConnsPerSource)
	setDefault(&c.IdleTimeout, DefaultIdleTimeout)
	setDefault(&c.FrameTimeout, DefaultFrameTimeout)
	setDefault(&c.MinRate, DefaultMinRate)
	setDefault(&c.StatusTimeout, DefaultStatusTimeout)
	setDefault(&c.DialTimeout, DefaultDialTimeout)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	switch {
	case c.Rails < 1 || c.Rails > 64:
		return fmt.Errorf("mctcp: bad config: Rails %d (1..64)", c.Rails)
	case c.Depth < 1 || c.Depth > 1<<16:
		return fmt.Errorf("mctcp: bad config: Depth %d (1..65536)", c.Depth)
	case c.Version < 0 || c.Version > 2:
		return fmt.Errorf("mctcp: bad config: Version %d (0, 1 or 2)", c.Version)
	case c.FrameTimeout < 0 || c.StatusTimeout < 0 || c.DialTimeout < 0:
		return errors.New("mctcp: bad config: FrameTimeout, StatusTimeout and DialTimeout must be positive (every wait is bounded)")
	}
	return nil
}

func setDefault[T comparable](p *T, v T) {
	var zero T
	if *p == zero {
		*p = v
	}
}

// Transport is Mooncake's TCP data protocol as a moonring transport: a
// target that serves Mooncake initiators (and moonring ones) the buffers
// registered with it, and an initiator that opens endpoints to Mooncake
// targets (and moonring ones). Use New; safe for concurrent use.
type Transport struct {
	cfg      Config
	ln       net.Listener
	addr     string
	regs     atomic.Pointer[[]*region] // sorted by address; replaced under mu
	mu       sync.Mutex                // guards regs changes, conns, eps
	conns    map[*srvConn]struct{}
	sources  map[netip.Addr]int // connections per source, under mu
	eps      map[*Endpoint]struct{}
	closed   atomic.Bool
	shutdown chan struct{}
	wg       sync.WaitGroup
	refused  [nReasons]atomic.Uint64
	logs     [nReasons]ratelog.Limit
	warnedV1 sync.Map               // peer address -> struct{}: the version 1 warning was logged
	self     atomic.Pointer[string] // the engine's segment name (SetNotify), sent with notifications
	rpc      mooncake.RPCClient     // sends notifications to peers' RPC ports
}

var (
	_ transport.Transport           = (*Transport)(nil)
	_ transport.ContextUnregisterer = (*Transport)(nil)
	_ ExtraEndpointer               = (*Transport)(nil)
)

// New listens on cfg.Listen and starts serving.
func New(cfg Config) (*Transport, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("mctcp: listen: %w", err)
	}
	t := &Transport{cfg: cfg, ln: ln, addr: cfg.Advertise, conns: map[*srvConn]struct{}{}, sources: map[netip.Addr]int{}, eps: map[*Endpoint]struct{}{}, shutdown: make(chan struct{})}
	if t.addr == "" {
		t.addr = ln.Addr().String()
		if a, ok := ln.Addr().(*net.TCPAddr); ok && a.IP.IsUnspecified() {
			t.addr = net.JoinHostPort(netaddr.InterfaceIP(a.IP.To4() == nil).String(), strconv.Itoa(a.Port))
		}
	}
	t.regs.Store(new([]*region))
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

// Name returns "mooncake-tcp".
func (t *Transport) Name() string { return Name }

// Endpoint returns the host:port peers dial: what a Mooncake descriptor
// publishes as the host of its rpc_meta entry and its tcp_data_port.
func (t *Transport) Endpoint() string { return t.addr }

// ExtraEndpointer is implemented by transports that need entries in the
// engine's published Endpoints beside their own (Endpoints[Name()] =
// Endpoint()). The engine adds every entry ExtraEndpoints returns when it
// builds its descriptor's header; the names must not be another
// transport's. Safe for concurrent use; the map is the caller's.
type ExtraEndpointer interface {
	ExtraEndpoints() map[string]string
}

// ExtraEndpoints returns {VersionEndpoint: "2"}: the target speaks version
// 2, so that peers (moonring's and, through mooncake.FromSegtable,
// Mooncake's tcp_proto_version) ask for its status words.
func (t *Transport) ExtraEndpoints() map[string]string {
	return map[string]string{VersionEndpoint: strconv.Itoa(ServedVersion)}
}

// SliceSize returns Config.SliceSize.
func (t *Transport) SliceSize() uint64 { return t.cfg.SliceSize }

// Close stops the listener, closes every connection and endpoint (their
// slices complete with transport.ErrClosed) and waits for their
// goroutines. It is idempotent.
func (t *Transport) Close() error {
	if t.closed.Swap(true) {
		return nil
	}
	close(t.shutdown)
	err := t.ln.Close()
	t.mu.Lock()
	for c := range t.conns {
		c.c.Close()
	}
	eps := make([]*Endpoint, 0, len(t.eps))
	for e := range t.eps {
		eps = append(eps, e)
	}
	t.mu.Unlock()
	for _, e := range eps {
		e.Close()
	}
	t.wg.Wait()
	return err
}
