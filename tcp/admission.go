package tcp

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moonring/moonring/internal/netaddr"
)

// Refusals counts, by reason, the connections the target refused or
// closed to protect itself (Config.MaxHandshakes and the fields after it).
// Each counter only grows, from New on.
type Refusals struct {
	// HandshakeCap: connections closed before they proved the key, to
	// stay within MaxHandshakes.
	HandshakeCap uint64
	// SourceCap: connections closed before they proved the key, to keep
	// their source within MaxHandshakesPerSource.
	SourceCap uint64
	// Descriptors: connections closed before they proved the key, to
	// free a descriptor when accept found none (EMFILE, ENFILE).
	Descriptors uint64
	// AcceptErrors: accepts that failed (out of descriptors, mostly); the
	// listener backs off and goes on.
	AcceptErrors uint64
	// HandshakeTimeout: connections that did not prove the key within
	// HandshakeTimeout.
	HandshakeTimeout uint64
	// BadHello: connections whose hello broke the protocol (bad magic,
	// another version, unknown flags), whose TLS handshake failed, or that
	// said a plain hello to a target that requires TLS.
	BadHello uint64
	// Auth: hellos with a proof of another key.
	Auth uint64
	// ConnCap: hellos that proved the key past MaxConns.
	ConnCap uint64
	// Idle: connections closed after IdleTimeout without a request.
	Idle uint64
	// BadFrame: connections closed for a framing error after the hello.
	BadFrame uint64
}

// reason indexes Transport.refused and Transport.logs.
type reason int

const (
	rHandshakeCap reason = iota
	rSourceCap
	rDescriptors
	rAcceptError
	rHandshakeTimeout
	rBadHello
	rAuth
	rConnCap
	rIdle
	rBadFrame
	nReasons
)

var reasonNames = [nReasons]string{"handshake cap", "per-source handshake cap", "out of descriptors", "accept failed",
	"handshake timeout", "bad hello", "wrong key", "connection cap", "idle", "bad frame"}

// Refusals returns the counts of refusals so far. Safe for concurrent use;
// the counters are read one by one, not as one snapshot.
func (t *Transport) Refusals() Refusals {
	r := func(x reason) uint64 { return t.refused[x].Load() }
	return Refusals{
		HandshakeCap:     r(rHandshakeCap),
		SourceCap:        r(rSourceCap),
		Descriptors:      r(rDescriptors),
		AcceptErrors:     r(rAcceptError),
		HandshakeTimeout: r(rHandshakeTimeout),
		BadHello:         r(rBadHello),
		Auth:             r(rAuth),
		ConnCap:          r(rConnCap),
		Idle:             r(rIdle),
		BadFrame:         r(rBadFrame),
	}
}

// refuse counts a refusal and logs it, at most once a second per reason
// with the count of those not logged since. peer and err may be nil.
func (t *Transport) refuse(why reason, peer net.Addr, err error) {
	t.refused[why].Add(1)
	ok, suppressed := t.logs[why].Allow()
	if !ok {
		return
	}
	attrs := []any{"reason", reasonNames[why]}
	if peer != nil {
		attrs = append(attrs, "peer", peer.String())
	}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	attrs = append(attrs, "suppressed", suppressed)
	level := slog.LevelInfo
	switch why {
	case rHandshakeCap, rSourceCap, rDescriptors, rAcceptError, rConnCap:
		level = slog.LevelWarn
	}
	t.cfg.Logger.Log(context.Background(), level, "tcp: connection refused", attrs...)
}

// peerConn is an accepted connection as admission sees it.
type peerConn struct {
	c          net.Conn
	src        netip.Addr // the source, an IPv6 one masked to its /64
	state      connState  // under Transport.mu
	prev, next *peerConn  // in admission.pending while state is pending
	// served counts what the connection served: written by its
	// goroutine, read by Served.
	served served
	// holdsOut says the connection holds a response buffer (server.go,
	// outs): while it has requests in hand, not while it waits.
	holdsOut atomic.Bool
	// holdsIn says the connection, one with raw reads (not TLS), holds a
	// frames' read buffer (server.go, ins): while it has requests in
	// hand, not while it waits.
	holdsIn atomic.Bool
	// holdsGroup says the connection holds the state of the group
	// frames and bulk WRITEs it reads (server.go, grps): from the first
	// such frame of a run of requests until it waits.
	holdsGroup atomic.Bool
	// idleWaits counts the waits for a request made holding no read
	// buffer (tests read it).
	idleWaits atomic.Uint64
}

type connState uint8

const (
	connPending  connState = iota // not yet proved the key
	connEvicted                   // closed by the accept loop for a cap
	connLoggedIn                  // proved the key, counted in loggedIn
	connDone                      // its goroutine has ended
)

// admission is the accounting of Config.MaxHandshakes,
// MaxHandshakesPerSource and MaxConns, under Transport.mu.
type admission struct {
	head, tail *peerConn // pending connections, oldest first
	npending   int
	sources    map[netip.Addr]int // pending connections per source
	loggedIn   int
}

func (a *admission) push(pc *peerConn) {
	pc.prev, pc.next = a.tail, nil
	if a.tail != nil {
		a.tail.next = pc
	} else {
		a.head = pc
	}
	a.tail = pc
	a.npending++
	a.sources[pc.src]++
}

// remove takes a pending connection off the list.
func (a *admission) remove(pc *peerConn) {
	if pc.prev != nil {
		pc.prev.next = pc.next
	} else {
		a.head = pc.next
	}
	if pc.next != nil {
		pc.next.prev = pc.prev
	} else {
		a.tail = pc.prev
	}
	pc.prev, pc.next = nil, nil
	a.npending--
	if a.sources[pc.src]--; a.sources[pc.src] <= 0 {
		delete(a.sources, pc.src)
	}
}

// oldest returns the oldest pending connection, of src when any is true.
func (a *admission) oldest(src netip.Addr, any bool) *peerConn {
	for pc := a.head; pc != nil; pc = pc.next {
		if any || pc.src == src {
			return pc
		}
	}
	return nil
}

// sourceOf is the address a connection counts under for
// MaxHandshakesPerSource (netaddr.Source).
func sourceOf(c net.Conn) netip.Addr { return netaddr.Source(c.RemoteAddr()) }

// accept serves the listener until Close. Past MaxHandshakes (overall or
// per source) a new connection closes the oldest not yet logged in; when
// accept runs out of descriptors, it closes the oldest such connection to
// free one, or else backs off (up to a second) and tries again.
func (t *Transport) accept() {
	defer t.wg.Done()
	var backoff time.Duration
	for {
		c, err := t.ln.Accept()
		if h := acceptHook.Load(); h != nil {
			c, err = (*h)(t, c, err)
		}
		if err != nil {
			if t.closed.Load() {
				return
			}
			t.refuse(rAcceptError, nil, err)
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) {
				t.mu.Lock()
				pc := t.adm.oldest(netip.Addr{}, true)
				if pc != nil {
					t.adm.remove(pc)
					pc.state = connEvicted
				}
				t.mu.Unlock()
				if pc != nil {
					// Counted before the close: a peer, or a test,
					// that sees the close finds it in Refusals.
					t.refuse(rDescriptors, pc.c.RemoteAddr(), nil)
					pc.c.Close()
					// The descriptor is released once its goroutine's read
					// has returned: let it run, then accept again.
					runtime.Gosched()
					continue
				}
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			select {
			case <-time.After(backoff):
			case <-t.shutdown:
				return
			}
			continue
		}
		backoff = 0
		pc := &peerConn{c: c, src: sourceOf(c)}
		var evict *peerConn
		var why reason
		t.mu.Lock()
		if t.closed.Load() {
			t.mu.Unlock()
			c.Close()
			return
		}
		if max := t.cfg.MaxHandshakesPerSource; max > 0 && t.adm.sources[pc.src] >= max {
			evict, why = t.adm.oldest(pc.src, false), rSourceCap
		} else if max := t.cfg.MaxHandshakes; max > 0 && t.adm.npending >= max {
			evict, why = t.adm.oldest(pc.src, true), rHandshakeCap
		}
		if evict != nil {
			t.adm.remove(evict)
			evict.state = connEvicted
		}
		t.adm.push(pc)
		t.conns[c] = pc
		t.wg.Add(1)
		t.mu.Unlock()
		if evict != nil {
			t.refuse(why, evict.c.RemoteAddr(), nil) // counted before the close
			evict.c.Close()
		}
		go t.serveConn(pc)
	}
}

// acceptHook, set only by tests (faults_test.go), sees what each Accept
// returned before the target does: it may fail the accept, or hand on a
// wrapper of the connection that fails its reads and writes at chosen
// bytes. Nil outside the tests, where it costs an atomic load per accept
// and nothing per frame.
var acceptHook atomic.Pointer[func(t *Transport, c net.Conn, err error) (net.Conn, error)]

// errIdle ends a connection idle for IdleTimeout; errConnCap one that
// proved the key past MaxConns.
var (
	errIdle    = errors.New("tcp: idle for IdleTimeout")
	errConnCap = errors.New("tcp: MaxConns connections served")
)

// admit logs pc in once it proved the key: nil, or why it may not be.
func (t *Transport) admit(pc *peerConn) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if pc.state != connPending {
		return net.ErrClosed // closed for a cap meanwhile
	}
	if t.cfg.MaxConns > 0 && t.adm.loggedIn >= t.cfg.MaxConns {
		return errConnCap
	}
	t.adm.remove(pc)
	pc.state = connLoggedIn
	t.adm.loggedIn++
	return nil
}

// serveConn serves one accepted connection and accounts for its end. A
// refusal is counted before the connection is closed, so that a peer (or
// a test) that sees the close finds it in Refusals.
func (t *Transport) serveConn(pc *peerConn) {
	defer t.wg.Done()
	err := t.serve(pc)
	t.mu.Lock()
	delete(t.conns, pc.c)
	t.retire(pc)
	state := pc.state
	switch state {
	case connPending:
		t.adm.remove(pc)
	case connLoggedIn:
		t.adm.loggedIn--
	}
	pc.state = connDone
	t.mu.Unlock()
	defer pc.c.Close()
	if err == nil || state == connEvicted || t.closed.Load() {
		return
	}
	peer := pc.c.RemoteAddr()
	switch {
	case errors.Is(err, errIdle):
		t.refuse(rIdle, peer, nil)
	case state == connLoggedIn && errors.Is(err, ErrProtocol):
		t.refuse(rBadFrame, peer, err)
	case state == connLoggedIn:
		if !errors.Is(err, io.EOF) {
			t.cfg.Logger.Info("tcp: connection closed", "peer", peer, "err", err)
		}
	case errors.Is(err, errConnCap):
		t.refuse(rConnCap, peer, nil)
	case errors.Is(err, os.ErrDeadlineExceeded):
		t.refuse(rHandshakeTimeout, peer, nil)
	case errors.Is(err, ErrAuth):
		t.refuse(rAuth, peer, nil)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNRESET):
		// The peer left during the hello: no refusal of ours.
	case errors.Is(err, ErrProtocol), errors.Is(err, ErrVersion), errors.Is(err, ErrTLSRequired), errors.Is(err, errTLSHandshake):
		t.refuse(rBadHello, peer, err)
	default:
		// The socket failed during the hello (a write to a peer that left,
		// the kernel's timeout of a vanished host): the hello broke no
		// rule, and no refusal of ours ended it.
	}
}
