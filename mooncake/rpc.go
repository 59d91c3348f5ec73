// rpc.go holds the RPC daemon: the server on a Mooncake engine's RPC port
// (the P2PHANDSHAKE metadata exchange, notifications, probes and the
// transport handshake), its configuration and its connection bounds. What
// one connection gets is in rpc_exchange.go, the client in rpc_client.go.

package mooncake

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/internal/netaddr"
	"github.com/moonring/moonring/internal/ratelog"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Defaults of [RPCConfig].
const (
	// DefaultRPCTimeout bounds one exchange on the server: reading the
	// request, writing the answer and waiting for the client to close.
	DefaultRPCTimeout = 10 * time.Second
	// DefaultRPCMaxConns bounds the connections the daemon serves at once.
	DefaultRPCMaxConns = 128
	// DefaultRPCMaxConnsPerHost bounds those from one IP address.
	DefaultRPCMaxConnsPerHost = 16
)

// HandshakeFunc answers a Connection frame (Mooncake's transport
// handshake: RDMA queue pairs) with the document to send back; an error
// becomes a refusal (its text in reply_msg). It is called on the
// connection's goroutine, possibly concurrently, and must return within
// the exchange's deadline.
type HandshakeFunc func(req *HandshakeDesc) (*HandshakeDesc, error)

// RPCConfig configures [ListenRPC]. The zero value listens on an
// ephemeral loopback port, answers probes, answers metadata requests with
// null, and refuses notifications and handshakes.
type RPCConfig struct {
	// Listen is the TCP address to listen on; default "127.0.0.1:0".
	Listen string
	// Advertise is the host:port peers reach the daemon at, and so the
	// segment name of a P2PHANDSHAKE engine ([RPCServer.Name]). Default:
	// the listener's address; an unspecified host (0.0.0.0, [::]) becomes
	// the first non-loopback address of an interface that is up. An empty
	// host or a port of 0 takes the listener's.
	Advertise string
	// Descriptor returns this engine's descriptor as it is now, nil when
	// it has none; the daemon answers metadata requests with it,
	// converted by [FromSegtable], or with null. It is called on the
	// connections' goroutines, concurrently; the daemon neither modifies
	// nor keeps the descriptor beyond an encoding of it, which it reuses
	// while Descriptor returns the same pointer (so a source must replace
	// its descriptor, never change it in place). Nil: always null.
	Descriptor func() *segtable.SegmentDesc
	// Notify takes a notification a peer sent; an error refuses it (the
	// peer sees Mooncake's refusal). Nil: every notification is refused.
	// See also [RPCServer.SetNotify].
	Notify func(*transport.Notification) error
	// Handshake answers Connection frames; nil refuses them with a
	// reply_msg. See also [RPCServer.SetHandshake].
	Handshake HandshakeFunc
	// MaxFrame bounds a request frame's length (the type byte and JSON);
	// default [DefaultMaxFrame], never over [MaxFrameLimit]. Mooncake's
	// MC_HANDSHAKE_MAX_LENGTH is the same bound on its side.
	MaxFrame int
	// Timeout bounds one exchange (default [DefaultRPCTimeout]).
	Timeout time.Duration
	// MaxConns and MaxConnsPerHost bound the connections served at once,
	// in all and from one IP address (defaults [DefaultRPCMaxConns],
	// [DefaultRPCMaxConnsPerHost]); a connection past a bound is closed
	// at once, unanswered.
	MaxConns, MaxConnsPerHost int
	// Logf, when set, hears of refused connections, malformed frames and
	// timeouts, one line a second at most for each kind.
	Logf func(format string, args ...any)
}

// RPCStats counts what an [RPCServer] did; the counters only grow.
type RPCStats struct {
	// Conns is the connections being served now.
	Conns int
	// Served counts exchanges answered, by frame type (the index is the
	// type; the old protocol counts as Connection).
	Served [4]uint64
	// Refused counts connections closed at once by MaxConns or
	// MaxConnsPerHost.
	Refused uint64
	// Bad counts connections closed for a malformed, oversized or
	// unreadable request; Timeouts those that ran out of time.
	Bad, Timeouts uint64
}

// RPCServer is the daemon on a Mooncake engine's RPC port. Each TCP
// connection carries one exchange, as Mooncake's does: the client sends
// one frame, the server answers one frame of the same type (without a
// type byte to an old-protocol frame), shuts its write side down and
// waits for the client to close, all within RPCConfig.Timeout.
//
// Answers, as a Mooncake engine gives them:
//   - metadata: this engine's descriptor in Mooncake's schema
//     (RPCConfig.Descriptor), or null when it has none;
//   - probe: {"status":"success"};
//   - notify: {"name":"","notify_msg":"success"} when Notify took the
//     notification, {"name":"","notify_msg":""} (a refusal) when it failed
//     or none is set;
//   - connection and old-protocol frames: the handshake function's answer,
//     or a document whose reply_msg says why not.
//
// A request that is malformed (a bad length or type byte, JSON that does
// not parse, a document of the wrong shape) closes the connection
// unanswered, as Mooncake does. The port is unauthenticated: every frame is
// bounded by MaxFrame, every exchange by Timeout, the connections by
// MaxConns and MaxConnsPerHost, and what strangers provoke is logged at
// most once a second per kind.
//
// An RPCServer serves from [ListenRPC] until Close; it is safe for
// concurrent use and must not be copied.
type RPCServer struct {
	ln      net.Listener
	name    string
	timeout time.Duration
	max     int
	maxConn int
	perHost int
	logf    func(format string, args ...any)

	desc      func() *segtable.SegmentDesc
	notify    atomic.Pointer[func(*transport.Notification) error]
	handshake atomic.Pointer[HandshakeFunc]

	cache atomic.Pointer[descCache] // the last descriptor's encoding

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}
	byHost map[string]int
	wg     sync.WaitGroup // the accept loop and the connections

	served              [4]atomic.Uint64
	refused, bad, slow  atomic.Uint64
	logRefused, logBad  ratelog.Limit
	logSlow, logAnswers ratelog.Limit
}

// descCache is the encoded answer of one descriptor pointer.
type descCache struct {
	d    *segtable.SegmentDesc
	body []byte
}

// ListenRPC listens on cfg.Listen and serves the RPC port until Close. It
// fails when the listener cannot be opened or Advertise is not a
// host:port.
func ListenRPC(cfg RPCConfig) (*RPCServer, error) {
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultRPCTimeout
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = DefaultRPCMaxConns
	}
	if cfg.MaxConnsPerHost <= 0 {
		cfg.MaxConnsPerHost = DefaultRPCMaxConnsPerHost
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("mooncake rpc: %w", err)
	}
	name, err := advertise(cfg.Advertise, ln.Addr().(*net.TCPAddr))
	if err != nil {
		ln.Close()
		return nil, err
	}
	s := &RPCServer{
		ln: ln, name: name, timeout: cfg.Timeout, max: frameMax(cfg.MaxFrame),
		maxConn: cfg.MaxConns, perHost: cfg.MaxConnsPerHost, logf: cfg.Logf,
		desc: cfg.Descriptor, conns: map[net.Conn]struct{}{}, byHost: map[string]int{},
	}
	s.SetNotify(cfg.Notify)
	s.SetHandshake(cfg.Handshake)
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// advertise returns the name peers reach a listener at; see
// RPCConfig.Advertise.
func advertise(adv string, addr *net.TCPAddr) (string, error) {
	name, err := netaddr.Advertise(adv, addr)
	if err != nil {
		return "", fmt.Errorf("mooncake rpc: %w", err)
	}
	return name, nil
}

// Name returns "ip:rpc_port" (or "[ip6]:rpc_port"), the address peers
// reach the daemon at: a P2PHANDSHAKE engine's segment name.
func (s *RPCServer) Name() string { return s.name }

// Addr returns the listener's address.
func (s *RPCServer) Addr() net.Addr { return s.ln.Addr() }

// SetNotify replaces the function that takes notifications (nil refuses
// them). Safe for concurrent use; exchanges already past the call keep the
// function they read.
func (s *RPCServer) SetNotify(f func(*transport.Notification) error) {
	if f == nil {
		s.notify.Store(nil)
		return
	}
	s.notify.Store(&f)
}

// SetHandshake replaces the function that answers Connection frames (nil
// refuses them). Safe for concurrent use.
func (s *RPCServer) SetHandshake(f HandshakeFunc) {
	if f == nil {
		s.handshake.Store(nil)
		return
	}
	s.handshake.Store(&f)
}

// Stats returns the daemon's counters. Safe for concurrent use.
func (s *RPCServer) Stats() RPCStats {
	s.mu.Lock()
	n := len(s.conns)
	s.mu.Unlock()
	st := RPCStats{Conns: n, Refused: s.refused.Load(), Bad: s.bad.Load(), Timeouts: s.slow.Load()}
	for i := range st.Served {
		st.Served[i] = s.served[i].Load()
	}
	return st
}

// Close stops listening, closes every connection and waits for their
// goroutines. Later calls return nil.
func (s *RPCServer) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	err := s.ln.Close()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return err
}

// logLimited logs through l, at most once per second.
func (s *RPCServer) logLimited(l *ratelog.Limit, format string, args ...any) {
	if s.logf == nil {
		return
	}
	if ok, n := l.Allow(); ok {
		if n > 0 {
			format += " (and %d more like it)"
			args = append(args, n)
		}
		s.logf("mooncake rpc %s: "+format, append([]any{s.name}, args...)...)
	}
}

func (s *RPCServer) accept() {
	defer s.wg.Done()
	var delay time.Duration
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors, say: back off rather than spin.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			s.logLimited(&s.logRefused, "accept: %v", err)
			time.Sleep(delay)
			continue
		}
		delay = 0
		host := sourceHost(c.RemoteAddr())
		s.mu.Lock()
		switch {
		case s.closed:
			s.mu.Unlock()
			c.Close()
			return
		case len(s.conns) >= s.maxConn || s.byHost[host] >= s.perHost:
			s.mu.Unlock()
			c.Close()
			s.refused.Add(1)
			s.logLimited(&s.logRefused, "refused a connection from %s: too many connections", host)
			continue
		}
		s.conns[c] = struct{}{}
		s.byHost[host]++
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serve(c, host)
	}
}

// sourceHost is what a connection's peer counts under for
// MaxConnsPerHost: its IP, an IPv6 one by its /64 (netaddr.Source).
func sourceHost(a net.Addr) string {
	if ip := netaddr.Source(a); ip.IsValid() {
		return ip.String()
	}
	return a.String()
}

// serve runs one connection's exchange and forgets it.
func (s *RPCServer) serve(c net.Conn, host string) {
	defer s.wg.Done()
	defer func() {
		c.Close()
		s.mu.Lock()
		delete(s.conns, c)
		if s.byHost[host]--; s.byHost[host] <= 0 {
			delete(s.byHost, host)
		}
		s.mu.Unlock()
	}()
	c.SetDeadline(time.Now().Add(s.timeout))
	t, err := s.exchange(c, c)
	switch {
	case err == nil:
		if t == FrameOld {
			t = FrameConnection
		}
		s.served[t&3].Add(1)
	case isTimeout(err):
		s.slow.Add(1)
		s.logLimited(&s.logSlow, "%s: %v", c.RemoteAddr(), err)
		return
	default:
		s.bad.Add(1)
		s.logLimited(&s.logBad, "%s: %v", c.RemoteAddr(), err)
		return
	}
	// Mooncake's way: shut the write side, wait for the client's close.
	if tc, ok := c.(interface{ CloseWrite() error }); ok {
		tc.CloseWrite()
	}
	var b [1]byte
	c.Read(b[:])
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
