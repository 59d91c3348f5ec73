// p2p_limit.go holds the limits of a [P2P] store's endpoint: its listener
// (connLimiter), which bounds the connections open at once, in all and per
// remote IP, by evicting idle ones or refusing new ones, and the counters
// of what it did (P2PStats).

package metadata

import (
	"container/list"
	"net"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/moonring/moonring/internal/netaddr"
	"github.com/moonring/moonring/internal/ratelog"
)

// Defaults of the endpoint's limits in [P2PConfig].
const (
	// DefaultP2PMaxConns is P2PConfig.MaxConns's default.
	DefaultP2PMaxConns = 256
	// DefaultP2PMaxConnsPerHost is P2PConfig.MaxConnsPerHost's default.
	DefaultP2PMaxConnsPerHost = 64
)

// P2PStats counts the connections of a [P2P] store's endpoint and what
// its limits did to them ([P2PConfig.MaxConns]). The counters only grow,
// from NewP2P on.
type P2PStats struct {
	// Conns is the connections open now.
	Conns int
	// Evicted counts connections closed between requests (idle, or not
	// done sending a request's headers) to make room for a new one.
	Evicted uint64
	// Refused counts new connections closed at once because every
	// connection in their way was in the middle of a request.
	Refused uint64
}

// Stats returns the endpoint's connection counters. Safe for concurrent
// use.
func (p *P2P) Stats() P2PStats {
	p.lim.mu.Lock()
	n := p.lim.list.Len()
	p.lim.mu.Unlock()
	return P2PStats{Conns: n, Evicted: p.lim.evicted.Load(), Refused: p.lim.refused.Load()}
}

// connLimiter is the endpoint's listener: it tracks every connection it
// accepted, in accept order, with its HTTP state (from the server's
// ConnState hook), and keeps their number within max, and within perHost
// for each remote IP. A connection past a bound takes the place of the
// oldest connection in the same bound that is between requests, which is
// closed (evicted); if all are in a request, the new one is closed
// (refused). Idle connections held open, or slow headers, cannot lock
// peers out that way, and nothing grows without bound.
type connLimiter struct {
	net.Listener
	max, perHost int
	logf         func(format string, args ...any)
	what         string // names the listener in log lines ("metadata p2p")

	mu     sync.Mutex
	list   list.List      // of *limitConn, oldest first
	byHost map[string]int // open connections per remote IP

	evicted, refused atomic.Uint64
	logs             [2]ratelog.Limit // evicted, refused
}

// limitConn is one connection of a connLimiter.
type limitConn struct {
	net.Conn
	l     *connLimiter
	host  string
	el    *list.Element // under l.mu; nil once forgotten
	state atomic.Int32  // http.ConnState
	once  sync.Once
}

// Close closes the connection and forgets it.
func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.forget(c) })
	return err
}

func (l *connLimiter) forget(c *limitConn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if c.el == nil {
		return
	}
	l.list.Remove(c.el)
	c.el = nil
	if l.byHost[c.host]--; l.byHost[c.host] <= 0 {
		delete(l.byHost, c.host)
	}
}

// Accept returns the next connection within the bounds, evicting or
// refusing as connLimiter says.
func (l *connLimiter) Accept() (net.Conn, error) {
	for {
		nc, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		host := sourceOf(nc.RemoteAddr())
		c := &limitConn{Conn: nc, l: l, host: host}
		c.state.Store(int32(http.StateNew))
		l.mu.Lock()
		var victim *limitConn
		full := false
		switch {
		case l.byHost[host] >= l.perHost:
			victim, full = l.oldestIdle(host), true
		case l.list.Len() >= l.max:
			victim, full = l.oldestIdle(""), true
		}
		if full && victim == nil {
			l.mu.Unlock()
			nc.Close()
			l.refused.Add(1)
			l.log(1, "%s: connection from %s refused: every connection in its way is in a request (MaxConns %d, MaxConnsPerHost %d)", l.name(), host, l.max, l.perHost)
			continue
		}
		c.el = l.list.PushBack(c)
		l.byHost[host]++
		l.mu.Unlock()
		if victim != nil {
			victim.Close()
			l.evicted.Add(1)
			l.log(0, "%s: idle connection from %s closed to make room for one from %s (MaxConns %d, MaxConnsPerHost %d)", l.name(), victim.host, host, l.max, l.perHost)
		}
		return c, nil
	}
}

func (l *connLimiter) name() string {
	if l.what == "" {
		return "metadata p2p"
	}
	return l.what
}

// open returns how many connections are open.
func (l *connLimiter) open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.list.Len()
}

// sourceOf names a connection's source for the per-host bound: its IP, an
// IPv6 one masked to its /64 (a host has a /64 to pick addresses from).
func sourceOf(a net.Addr) string {
	if ip := netaddr.Source(a); ip.IsValid() {
		return ip.String()
	}
	return ""
}

// oldestIdle returns the oldest connection (of host, when not empty)
// that is between requests, or nil. l.mu is held.
func (l *connLimiter) oldestIdle(host string) *limitConn {
	for e := l.list.Front(); e != nil; e = e.Next() {
		c := e.Value.(*limitConn)
		if host != "" && c.host != host {
			continue
		}
		if st := http.ConnState(c.state.Load()); st == http.StateNew || st == http.StateIdle {
			return c
		}
	}
	return nil
}

// connState is the server's ConnState hook: it records each connection's
// state.
func (l *connLimiter) connState(nc net.Conn, st http.ConnState) {
	if u, ok := nc.(interface{ NetConn() net.Conn }); ok { // a TLS connection
		nc = u.NetConn()
	}
	if c, ok := nc.(*limitConn); ok {
		c.state.Store(int32(st))
	}
}

// log logs one line a second at most per kind (0 evicted, 1 refused),
// saying how many were not logged since.
func (l *connLimiter) log(kind int, format string, args ...any) {
	if l.logf == nil {
		return
	}
	if ok, n := l.logs[kind].Allow(); ok {
		l.logf(format+" (%d more not logged)", append(args, n)...)
	}
}
