// dial.go holds how an initiator reaches a target: the dial with its
// backoff, the TLS configuration a pinned descriptor asks for, and the
// hello that proves the segment key (PROTOCOL.md, Hello).

package tcp

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/moonring/moonring/internal/bell"
	"github.com/moonring/moonring/internal/mpsc"
	"github.com/moonring/moonring/transport"
	"golang.org/x/sys/unix"
)

// dial connects, runs the hello and starts the goroutines of a connection
// for rail (an index in e.rails, or -1 for the express lane).
func (e *Endpoint) dial(ctx context.Context, rail int) (*conn, error) {
	d := net.Dialer{Timeout: e.t.cfg.DialTimeout}
	to := e.dest.Load()
	raw, err := d.DialContext(ctx, "tcp", to.addr)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", transport.ErrPeer, err)
	}
	if tc, ok := raw.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		setLoopbackSendBuffer(tc, e.t.cfg.LoopbackSendBuffer)
		if err := setPeerTimeout(tc, e.t.cfg.PeerTimeout); err != nil {
			raw.Close()
			return nil, fmt.Errorf("tcp: set the peer timeout: %w", err)
		}
	}
	var nc net.Conn = raw
	// The hello within helloTimeout, or the caller's earlier deadline: a
	// target that accepts and never answers holds Open no longer.
	deadline := time.Now().Add(helloTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	raw.SetDeadline(deadline)
	if cfg := e.tlsConfig(to); cfg != nil {
		tc := tls.Client(raw, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			if cutShort(err) {
				return nil, fmt.Errorf("%w: tls: %w (%v)", transport.ErrPeer, errCut, err)
			}
			return nil, fmt.Errorf("tcp: tls: %w", err)
		}
		nc = tc
	}
	// The hello's reads heed only the deadline: closing the socket is what
	// makes ctx's end (Endpoint.Close stopping a redial) cut it short.
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	var src io.Reader = nc // what br and large payloads read from
	var br *bufio.Reader
	if nc == raw {
		src = newNBReader(raw) // raw reads (rawio.go)
		br = takeIn(src)       // given back while idle (receive.go)
	} else {
		br = bufio.NewReaderSize(src, inSize) // TLS keeps its own
	}
	maxLen, features, err := clientHello(nc, br, to.key)
	if !stop() && err == nil {
		err = fmt.Errorf("%w: hello: %v", transport.ErrPeer, context.Cause(ctx))
	}
	if err != nil {
		raw.Close()
		if nc == raw {
			giveIn(br)
		}
		return nil, err
	}
	raw.SetDeadline(time.Time{})
	depth := min(e.t.cfg.Depth, startDepth) // grow.go
	c := &conn{e: e, rail: rail, to: to, maxLen: maxLen, groupMax: groupMax(features, e.t.cfg.noGroups), nc: nc, src: src, br: br, bell: bell.New(), hdrs: make([][reqSize]byte, depth),
		parts: make([][3][]byte, depth), pre: make([][reqSize]byte, depth),
		resume: make(chan struct{}, 1), quit: make(chan struct{}), sendDone: make(chan struct{}), recvDone: make(chan struct{}), dead: make(chan struct{})}
	c.q, _ = mpsc.New[pending](depth)
	c.holdsIn.Store(true)
	c.rdr = reader{c: c, last: time.Now().UnixNano(), timeout: int64(e.t.cfg.ResponseTimeout)}
	c.iov = make([][]byte, 0, 192)
	c.sizes = make([]int, 0, 192)
	c.uiov = make([]unix.Iovec, 0, 192)
	if tc, ok := nc.(*net.TCPConn); ok {
		c.rc, _ = tc.SyscallConn()
		// Made once: a closure per kick would allocate.
		c.writeFn = func(fd uintptr) bool {
			c.wn, c.werr = c.writev(int(fd), c.wiov)
			return true // never wait: the sender goroutine does that
		}
		c.peekFn = c.peekOn
		c.rw = newRawWriter(c.rc)
		c.sp.max = int64(e.t.cfg.DriveSpin)
		if e.t.cfg.IOUring {
			c.useUring()
		}
	}
	go c.send()
	go c.receive()
	return c, nil
}

// tlsConfig is how to dial to: pinned to its certificate when its
// endpoint publishes one (AutoTLS), else ClientTLS; nil for plain TCP.
func (e *Endpoint) tlsConfig(to *dest) *tls.Config {
	if to.pin != nil {
		pin := to.pin
		cfg := &tls.Config{
			// The certificate is self-signed: it is checked against the
			// pin, which the signed descriptor carried, not against a CA.
			InsecureSkipVerify: true,
			MinVersion:         tls.VersionTLS13,
			VerifyConnection: func(cs tls.ConnectionState) error {
				if len(cs.PeerCertificates) == 0 {
					return ErrPinMismatch
				}
				if sum := sha256.Sum256(cs.PeerCertificates[0].Raw); subtle.ConstantTimeCompare(sum[:], pin) != 1 {
					return ErrPinMismatch
				}
				return nil
			},
		}
		if c := e.t.cert; c != nil {
			cfg.Certificates = []tls.Certificate{*c}
		} else if ct := e.t.cfg.ClientTLS; ct != nil {
			cfg.Certificates = ct.Certificates
		}
		return cfg
	}
	cfg := e.t.cfg.ClientTLS
	if cfg != nil && cfg.ServerName == "" {
		// As tls.Dial does: verify the peer as the host dialed. One
		// ClientTLS serves every peer, so it cannot name each of them.
		cfg = cfg.Clone()
		cfg.ServerName, _, _ = net.SplitHostPort(to.addr)
	}
	return cfg
}

// cutShort reports whether err is the peer closing or resetting the
// connection.
func cutShort(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// helloErr is the error of a hello that failed reading or writing.
func helloErr(err error) error {
	if cutShort(err) {
		return fmt.Errorf("%w: hello: %w (%v)", transport.ErrPeer, errCut, err)
	}
	return fmt.Errorf("%w: hello: %v", transport.ErrPeer, err)
}

// groupMax is the most WRITEs a group frame may take to a target whose
// hello offered features; 0: none (no group frames, or a test's
// noGroups).
func groupMax(features uint32, noGroups bool) int {
	switch {
	case noGroups || features&featGroups == 0:
		return 0
	case features&featWide != 0:
		return maxWide
	}
	return maxGroup
}

func clientHello(nc net.Conn, br *bufio.Reader, key []byte) (maxLen, features uint32, err error) {
	var h [24]byte
	copy(h[:], magic)
	binary.BigEndian.PutUint16(h[4:], version)
	cnonce := h[8:24]
	rand.Read(cnonce)
	if _, err := nc.Write(h[:]); err != nil {
		return 0, 0, helloErr(err)
	}
	var ch [32]byte
	if _, err := io.ReadFull(br, ch[:]); err != nil {
		return 0, 0, helloErr(err)
	}
	if string(ch[:4]) != magic {
		return 0, 0, fmt.Errorf("%w: bad magic in challenge", ErrProtocol)
	}
	switch binary.BigEndian.Uint16(ch[6:]) {
	case helloOK:
	case helloBadVersion:
		return 0, 0, fmt.Errorf("%w: we speak %d, it speaks %d", ErrVersion, version, binary.BigEndian.Uint16(ch[4:]))
	case helloTLS:
		return 0, 0, ErrTLSRequired
	default:
		return 0, 0, fmt.Errorf("%w: bad challenge status", ErrProtocol)
	}
	snonce := ch[8:24]
	maxLen = binary.BigEndian.Uint32(ch[24:])
	features = binary.BigEndian.Uint32(ch[28:]) // bits this version does not know are ignored
	if _, err := nc.Write(mac(key, "initiator", cnonce, snonce)); err != nil {
		return 0, 0, helloErr(err)
	}
	var acc [36]byte
	if _, err := io.ReadFull(br, acc[:]); err != nil {
		// A wrong key is answered (status 3): a target that closes instead
		// gave up on the connection (a cap, Close), which is no refusal of
		// the key.
		return 0, 0, helloErr(err)
	}
	switch binary.BigEndian.Uint16(acc[:]) {
	case helloBadKey:
		return 0, 0, ErrAuth
	case helloBusy:
		return 0, 0, fmt.Errorf("%w: %w", transport.ErrPeer, errBusy)
	}
	if !hmac.Equal(acc[4:], mac(key, "target", cnonce, snonce)) {
		return 0, 0, fmt.Errorf("%w: the target does not hold the key", ErrAuth)
	}
	return maxLen, features, nil
}

// errCut marks a hello (or TLS handshake) that the target cut short by
// closing the connection, and errBusy one it answered busy (MaxConns):
// Open dials again, as a rail's redial would.
var (
	errCut  = errors.New("the target closed the connection during the hello")
	errBusy = errors.New("the target serves as many connections as it takes (its MaxConns)")
)
