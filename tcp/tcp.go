package tcp

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/netaddr"
	"github.com/moonring/moonring/internal/rails"
	"github.com/moonring/moonring/internal/ratelog"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Name is the transport's name in segment descriptors.
const Name = "tcp"

// Defaults of Config.
const (
	DefaultRails     = 2
	DefaultDepth     = 1024
	DefaultSliceSize = 1 << 20
	DefaultMaxLength = 16 << 20
	// DefaultPeerTimeout is Config.PeerTimeout's default.
	DefaultPeerTimeout = 10 * time.Second
	// DefaultMaxHandshakes is Config.MaxHandshakes's default.
	DefaultMaxHandshakes = 64
	// DefaultMaxHandshakesPerSource is Config.MaxHandshakesPerSource's
	// default.
	DefaultMaxHandshakesPerSource = 16
	// DefaultHandshakeTimeout is Config.HandshakeTimeout's default.
	DefaultHandshakeTimeout = 10 * time.Second
	// DefaultMaxConns is Config.MaxConns's default.
	DefaultMaxConns = 4096
	// DefaultIdleTimeout is Config.IdleTimeout's default.
	DefaultIdleTimeout = 5 * time.Minute
)

// Config configures a Transport. Zero fields take the defaults.
type Config struct {
	// Listen is the address to serve on (default "127.0.0.1:0").
	Listen string
	// Advertise is the host:port peers dial (default: the listener's, with
	// an interface's address for a listener on all interfaces).
	Advertise string
	// Key is the segment key shared by the deployment (any length; it is
	// hashed to 32 bytes). Empty: a random key, published in the
	// descriptor, so whoever reads the descriptor may connect.
	Key []byte
	// Rails is the number of connections per peer (default 2).
	Rails int
	// Depth bounds the slices in flight per connection (default 1024).
	// Each slot costs about 240 bytes of the connection's memory. A
	// connection is dialed with 64 slots (Depth when smaller) and takes
	// Depth's the first time a post finds all 64 in flight: posts are
	// refused (Post's backpressure) until every slice in flight is
	// answered, one round trip once in the connection's life. A peer
	// that never has more than 64 in flight keeps about 15 KiB of slots;
	// one that had, about 240 KiB at 1024. A request's KV cache as 32 KiB WRITEs
	// moved 9-41 % faster by round (median 13 %) at 1024 than at 128
	// (BENCHMARKS.md, the twenty-third session): with 128 a connection's
	// 4 MiB in flight did not cover the target's answers' delays on a
	// busy host.
	Depth int
	// SliceSize is the slice size the engine uses (default 1 MiB: on
	// loopback, with 2 rails, it reaches a raw stream's rate; see
	// BENCHMARKS.md).
	SliceSize uint64
	// MaxLength is the longest request frame accepted (default 16 MiB).
	MaxLength uint32
	// TLS, when set, makes the target accept TLS on its port.
	TLS *tls.Config
	// RequireTLS refuses plain connections (needs TLS).
	RequireTLS bool
	// ClientTLS, when set, makes the initiator dial with TLS. A peer whose
	// endpoint pins a certificate (AutoTLS) is dialed with TLS and checked
	// against its pin instead, whatever ClientTLS says.
	ClientTLS *tls.Config
	// AutoTLS gives the transport TLS without a PKI: New makes an ECDSA
	// P-256 self-signed certificate in memory, the target serves TLS 1.3
	// with it and refuses plain hellos (as RequireTLS does), and Endpoint
	// publishes the SHA-256 of the certificate ("?tls=<hex>", see
	// Fingerprint). A peer that reads the endpoint from a descriptor the
	// engine signed dials TLS and accepts only that certificate, so that a
	// relay on the path can neither read nor change the frames. An AutoTLS
	// initiator speaks only TLS: a peer whose endpoint pins no certificate
	// is refused (ErrNoPin), so that a replayed older descriptor cannot
	// strip the pin. Not with TLS.
	AutoTLS bool
	// DialTimeout bounds a dial and its hello (default 5 s). Open dials
	// again, with backoff, within DialTimeout when the target closed the
	// connection during the hello (its bounds on handshakes) or answered
	// busy (MaxConns).
	DialTimeout time.Duration
	// IOUring makes each connection's sender write through an io_uring of
	// its own (IORING_OP_WRITEV) instead of the netpoller, where the kernel
	// allows it; elsewhere it falls back by itself. Off by default: see
	// BENCHMARKS.md for the measurement.
	IOUring bool
	// ResponseTimeout bounds the wait for a response while requests are
	// out on a connection (default 30 s; negative: none). A target that
	// keeps the connection but stops answering then fails the rail, and
	// its slices come back to the engine with ErrPeer.
	ResponseTimeout time.Duration
	// DriveSpin is the longest a caller reading its own answers
	// (transport.Driver, Ring.SubmitAndWait) polls its connection before
	// its read parks in the netpoller (default DefaultDriveSpin; negative:
	// never). The spin adapts: it grows while answers come within
	// DriveSpin of the wait's start, and falls to none while they do not,
	// so slow answers cost no CPU. It saves the wake-up of a parked read.
	DriveSpin time.Duration
	// FrameTimeout bounds the target's moving of one frame's payload (a
	// WRITE's bytes in, a READ's out; default 30 s), so that a stalled
	// initiator cannot hold a buffer's Unregister.
	FrameTimeout time.Duration
	// PeerTimeout is how long the peer's host may stay silent before a
	// connection breaks (Linux only; default 10 s; negative: the kernel's
	// retransmission, about 15 minutes, and Go's keepalive, which breaks
	// a silent connection with nothing unacknowledged after about 2.5
	// minutes): bytes it sent
	// unacknowledged (TCP_USER_TIMEOUT), or, with nothing unacknowledged,
	// keepalive probes unanswered (the first after PeerTimeout/2 of
	// silence), so that a rail waiting for answers to requests the peer
	// acknowledged breaks as soon as one still sending. A peer whose host
	// vanished or whose link is down then fails the rail's slices, and
	// the rail is redialed, instead of the slices staying out: each holds
	// its request's slot in the in-flight table, after the request timed
	// out, until it returns. A live host answers the probes, however busy
	// its engine: a slow target is ResponseTimeout's.
	PeerTimeout time.Duration
	// MaxHandshakes bounds the connections the target holds that have not
	// yet proved the segment key (default 64; negative: no bound). Each
	// holds a descriptor: without a bound, idle sockets that never send a
	// byte exhaust the process's descriptors and lock every peer out. A
	// connection accepted past the bound closes the oldest of them, so
	// that sockets held idle cannot keep a peer that proves the key out:
	// a flood must outpace the hellos (MaxHandshakes arrivals within one
	// hello's time) to refuse one. Refusals counts them (HandshakeCap).
	MaxHandshakes int
	// MaxHandshakesPerSource bounds those connections per source address
	// (an IPv6 source counts by its /64; default 16; negative: no bound).
	// A connection past it closes the oldest of its source's, so one host
	// cannot take every handshake slot (Refusals.SourceCap).
	MaxHandshakesPerSource int
	// HandshakeTimeout bounds how long a connection may take to prove the
	// key, TLS handshake included (default 10 s; negative: no bound).
	HandshakeTimeout time.Duration
	// MaxConns bounds the connections that proved the key (default 4096;
	// negative: no bound). A hello past it is answered "busy" (accept
	// status 4, PROTOCOL.md) and closed; the initiator's dial fails with
	// ErrPeer and is retried (Refusals.ConnCap).
	MaxConns int
	// IdleTimeout closes a connection that proved the key once it has
	// sent no request for this long with nothing in flight: every
	// response sent and no payload moving (default 5 minutes; negative:
	// never). The close comes between one and two IdleTimeouts after the
	// last request (the timer is not moved per request). A connection
	// moving a payload is bounded by FrameTimeout instead, however long
	// the transfer. The initiator redials a rail closed so; a request it
	// sent as the target closed comes back with ErrPeer, for the engine
	// to retry (Refusals.Idle).
	IdleTimeout time.Duration
	// LoopbackSendBuffer is the send buffer (SO_SNDBUF) of a connection,
	// either end's, whose peer is on this host: at a loopback address or
	// at the connection's own (default DefaultLoopbackSendBuffer, which
	// the kernel doubles; negative: the kernel's autotuning, which grows
	// it to net.ipv4.tcp_wmem's maximum). A smaller buffer keeps the
	// bytes between a writev and the peer's read in cache (loopback.go).
	// A connection across a network keeps the autotuning whatever this
	// says.
	LoopbackSendBuffer int
	// Logger receives connection events (default: discard). Refusals are
	// logged at most once a second per reason, with the count of those
	// not logged since.
	Logger *slog.Logger

	// senderOnly, set only by tests, leaves every write to the sender
	// goroutine: the poller's non-blocking kick writes nothing, so a test
	// of the sender's path (io_uring) does not depend on how fast the
	// target drains the socket on the machine it runs on.
	senderOnly bool
	// noGroups, set only by tests: as an initiator, send every WRITE as a
	// frame of its own; as a target, do not offer group frames in the
	// hello (as a target from before them).
	noGroups bool
	// narrowGroups, set only by tests: as a target, offer group frames
	// but not wide ones, and close a connection that sends a group of
	// more than maxGroup WRITEs (as a target from before wide groups).
	narrowGroups bool
	// idleWatch, set only by tests, replaces defaultIdleWatch (drive.go).
	idleWatch time.Duration
	// railConfig, set only by tests, configures each endpoint's rail
	// picker (a half-life, a fake clock).
	railConfig rails.Config
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
	if c.Rails == 0 {
		c.Rails = DefaultRails
	}
	if c.Depth == 0 {
		c.Depth = DefaultDepth
	}
	if c.SliceSize == 0 {
		c.SliceSize = DefaultSliceSize
	}
	if c.MaxLength == 0 {
		c.MaxLength = DefaultMaxLength
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = 5 * time.Second
	}
	if c.ResponseTimeout == 0 {
		c.ResponseTimeout = 30 * time.Second
	}
	if c.DriveSpin == 0 {
		c.DriveSpin = DefaultDriveSpin
	}
	if c.FrameTimeout == 0 {
		c.FrameTimeout = 30 * time.Second
	}
	if c.PeerTimeout == 0 {
		c.PeerTimeout = DefaultPeerTimeout
	}
	if c.MaxHandshakes == 0 {
		c.MaxHandshakes = DefaultMaxHandshakes
	}
	if c.MaxHandshakesPerSource == 0 {
		c.MaxHandshakesPerSource = DefaultMaxHandshakesPerSource
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = DefaultIdleTimeout
	}
	if c.LoopbackSendBuffer == 0 {
		c.LoopbackSendBuffer = DefaultLoopbackSendBuffer
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Rails < 1 || c.Rails > 64 || c.Depth < 2 || c.Depth > 1<<16 || c.Depth&(c.Depth-1) != 0 {
		return fmt.Errorf("tcp: bad config: Rails %d (1..64), Depth %d (a power of two, 2..65536)", c.Rails, c.Depth)
	}
	if c.SliceSize > uint64(c.MaxLength) {
		return fmt.Errorf("tcp: bad config: SliceSize %d above MaxLength %d", c.SliceSize, c.MaxLength)
	}
	if c.RequireTLS && c.TLS == nil && !c.AutoTLS {
		return errors.New("tcp: bad config: RequireTLS without TLS")
	}
	if c.AutoTLS && c.TLS != nil {
		return errors.New("tcp: bad config: AutoTLS makes its own TLS config; TLS set too")
	}
	return nil
}

// Transport is the TCP transport of one engine. Use New.
type Transport struct {
	cfg  Config
	key  []byte
	open bool // the key is published in the descriptor
	ln   net.Listener
	addr string
	mu   sync.Mutex // guards regs changes, conns, endpoints, the admission state
	// regs holds the remote-accessible regions by buffer id, newest
	// first within one id (a buffer registered again while its old
	// registration drains): a lookup takes no lock and searches nothing,
	// and a registration copies nothing (see regionIndex).
	regs     regionIndex
	conns    map[net.Conn]*peerConn
	retired  map[netip.Addr]*served // what ended connections served, per source; under mu
	adm      admission              // under mu
	refused  [nReasons]atomic.Uint64
	logs     [nReasons]ratelog.Limit
	eps      map[*Endpoint]struct{}
	closed   atomic.Bool
	wg       sync.WaitGroup
	shutdown chan struct{}
	self     string           // the engine's segment name, sent as From
	cert     *tls.Certificate // AutoTLS's, or nil
	pin      string           // hex SHA-256 of cert's DER, or ""
	deliver  atomic.Pointer[func(*transport.Notification) error]
	groups   groupStats // what group frames the target served (tests read it)
}

type region struct {
	id     uint32
	addr   uint64
	base   unsafe.Pointer
	length uint64
	key    uint64
	ref    segtable.Ref
}

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Notifier  = (*Transport)(nil)
)

// SetNotify sets the engine's name, sent with its notifications, and the
// function that takes the notifications peers send.
func (t *Transport) SetNotify(self string, deliver func(*transport.Notification) error) {
	if len(self) > 255 {
		self = self[:255]
	}
	t.self = self
	t.deliver.Store(&deliver)
}

// New listens on cfg.Listen and starts serving.
func New(cfg Config) (*Transport, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	t := &Transport{cfg: cfg, conns: map[net.Conn]*peerConn{}, retired: map[netip.Addr]*served{}, eps: map[*Endpoint]struct{}{}, shutdown: make(chan struct{}), adm: admission{sources: map[netip.Addr]int{}}}
	if len(cfg.Key) > 0 {
		h := hashKey(cfg.Key)
		t.key = h[:]
	} else {
		t.key = make([]byte, keySize)
		rand.Read(t.key)
		t.open = true
	}
	if cfg.AutoTLS {
		cert, err := autoCert()
		if err != nil {
			return nil, fmt.Errorf("tcp: AutoTLS: %w", err)
		}
		sum := sha256.Sum256(cert.Certificate[0])
		t.cert, t.pin = cert, hex.EncodeToString(sum[:])
		t.cfg.TLS = &tls.Config{Certificates: []tls.Certificate{*cert}, MinVersion: tls.VersionTLS13}
		t.cfg.RequireTLS = true
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("tcp: listen: %w", err)
	}
	t.ln = ln
	t.addr = cfg.Advertise
	if t.addr == "" {
		t.addr = ln.Addr().String()
		// On all interfaces ("0.0.0.0", "[::]"): peers dial an interface's
		// address, not the unspecified one.
		if a, ok := ln.Addr().(*net.TCPAddr); ok && a.IP.IsUnspecified() {
			t.addr = net.JoinHostPort(netaddr.InterfaceIP(a.IP.To4() == nil).String(), strconv.Itoa(a.Port))
		}
	}
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

// Name returns "tcp".
func (t *Transport) Name() string { return Name }

// Addr returns the address peers dial.
func (t *Transport) Addr() string { return t.addr }

// Endpoint returns what a descriptor publishes for peers to dial:
// host:port, followed by "/<key hex>" in open mode and by "?tls=<SHA-256
// hex>" with AutoTLS (PROTOCOL.md, Endpoint). Safe for concurrent use.
func (t *Transport) Endpoint() string {
	ep := t.addr
	if t.open {
		ep += "/" + hex.EncodeToString(t.key)
	}
	if t.pin != "" {
		ep += "?tls=" + t.pin
	}
	return ep
}

// Fingerprint returns the SHA-256 of the AutoTLS certificate's DER in 64
// lowercase hex digits, as Endpoint publishes it, or "" without AutoTLS.
// The certificate lives as long as the Transport. Safe for concurrent use.
func (t *Transport) Fingerprint() string { return t.pin }

// SliceSize returns Config.SliceSize.
func (t *Transport) SliceSize() uint64 { return t.cfg.SliceSize }

// Register gives b a random 64-bit buffer key. Only remote-accessible
// buffers are served to peers; local-only ones get a registration with no
// key, for the initiator side.
func (t *Transport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	if t.closed.Load() {
		return segtable.Registration{}, fmt.Errorf("tcp: register: %w", transport.ErrClosed)
	}
	if !b.Remote {
		return segtable.Registration{}, nil
	}
	var k [8]byte
	rand.Read(k[:])
	mem := b.Bytes()
	r := &region{id: uint32(b.ID), addr: uint64(b.Addr), base: unsafe.Pointer(unsafe.SliceData(mem)), length: b.Length, key: binary.LittleEndian.Uint64(k[:])}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.regs.add(r)
	return segtable.Registration{Key: strconv.FormatUint(uint64(b.ID), 16) + "." + strconv.FormatUint(r.key, 16)}, nil
}

// Unregister stops serving b once no frame moves its bytes.
func (t *Transport) Unregister(b *segtable.Buffer, reg segtable.Registration) error {
	// A frame holds the region only while it moves its payload, which
	// FrameTimeout bounds: a minute is time enough.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return t.UnregisterContext(ctx, b, reg)
}

// Close stops the listener, closes every connection and endpoint and waits
// for their goroutines.
func (t *Transport) Close() error {
	if t.closed.Swap(true) {
		return nil
	}
	close(t.shutdown)
	err := t.ln.Close()
	t.mu.Lock()
	for c := range t.conns {
		c.Close()
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

func hashKey(k []byte) [32]byte {
	// A fixed-size key from a passphrase of any length.
	h := mac(k, "key", nil, nil)
	var out [32]byte
	copy(out[:], h)
	return out
}

// parseEndpoint splits a descriptor's tcp endpoint,
// <host:port>[/<key hex>][?tls=<SHA-256 hex>], into address, key and
// certificate pin (nil when there is none).
func (t *Transport) parseEndpoint(ep string) (addr string, key, pin []byte, err error) {
	rest, query, pinned := strings.Cut(ep, "?")
	if pinned {
		h, ok := strings.CutPrefix(query, "tls=")
		if !ok || len(h) != 2*sha256.Size || strings.ToLower(h) != h {
			return "", nil, nil, fmt.Errorf("tcp: bad endpoint %q: want ?tls=<64 lowercase hex digits>", ep)
		}
		if pin, err = hex.DecodeString(h); err != nil {
			return "", nil, nil, fmt.Errorf("tcp: bad endpoint %q: want ?tls=<64 lowercase hex digits>", ep)
		}
	}
	addr, k, open := strings.Cut(rest, "/")
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return "", nil, nil, fmt.Errorf("tcp: bad endpoint %q: %w", ep, err)
	}
	if pin == nil && t.cfg.AutoTLS {
		// Not even in plain to a peer that pins nothing: an older
		// descriptor of the same name, replayed, would strip the pin.
		return "", nil, nil, fmt.Errorf("tcp: endpoint %q: %w", ep, ErrNoPin)
	}
	if !open {
		if t.open {
			return "", nil, nil, fmt.Errorf("tcp: endpoint %q publishes no key and none is configured: %w", ep, ErrAuth)
		}
		return addr, t.key, pin, nil
	}
	key, err = hex.DecodeString(k)
	if err != nil || len(key) != keySize {
		return "", nil, nil, fmt.Errorf("tcp: bad key in endpoint %q", ep)
	}
	return addr, key, pin, nil
}

// autoCert makes AutoTLS's certificate: ECDSA P-256, self-signed, in
// memory. Peers check it by its hash, so its names and dates matter to no
// one; it is valid from an hour ago (clocks differ) for ten years.
func autoCert() (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "moonring tcp"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(10, 0, 0),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// peekConn replays bytes a bufio.Reader already took from the connection.
type peekConn struct {
	net.Conn
	r *bufio.Reader
}

func (c peekConn) Read(b []byte) (int, error) { return c.r.Read(b) }
