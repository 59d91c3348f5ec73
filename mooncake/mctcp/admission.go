package mctcp

// admission.go: what the target does about connections it did not ask
// for. Mooncake's protocol authenticates nothing, so whoever reaches the
// port may connect: the target bounds the connections, per source and in
// all (MaxConnsPerSource, MaxConns, closing the one idle longest to make
// room), closes idle ones (IdleTimeout),
// counts every refusal by reason and logs it at most once a second.

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moonring/moonring/internal/netaddr"
)

// Refusals counts, by reason, the connections and requests the target
// refused or closed. Each counter only grows, from New on.
type Refusals struct {
	// ConnCap: connections closed to stay within MaxConns (the one idle
	// longest, or the new one when none was idle).
	ConnCap uint64
	// SourceCap: connections closed to keep their source within
	// MaxConnsPerSource (its connection idle longest, or the new one).
	SourceCap uint64
	// AcceptErrors: accepts that failed (out of descriptors, mostly); the
	// listener backs off and goes on.
	AcceptErrors uint64
	// Idle: connections closed after IdleTimeout without a whole header.
	Idle uint64
	// BadHeader: connections closed for an opcode other than READ and
	// WRITE.
	BadHeader uint64
	// Range: requests refused because their range is not wholly inside
	// one registered, remote-accessible buffer, or is longer than
	// MaxLength (answered with the refusal status in version 2; the
	// connection is closed either way).
	Range uint64
	// Stalled: connections closed because a payload did not move within
	// FrameTimeout plus its length at MinRate.
	Stalled uint64
}

type reason int

const (
	rConnCap reason = iota
	rSourceCap
	rAcceptError
	rIdle
	rBadHeader
	rRange
	rStalled
	nReasons
)

var reasonNames = [nReasons]string{"connection cap", "per-source connection cap", "accept failed", "idle", "bad header", "range refused", "payload stalled"}

// Refusals returns the counts of refusals so far. Safe for concurrent use;
// the counters are read one by one, not as one snapshot.
func (t *Transport) Refusals() Refusals {
	r := func(x reason) uint64 { return t.refused[x].Load() }
	return Refusals{ConnCap: r(rConnCap), SourceCap: r(rSourceCap), AcceptErrors: r(rAcceptError), Idle: r(rIdle), BadHeader: r(rBadHeader), Range: r(rRange), Stalled: r(rStalled)}
}

// refuse counts a refusal and logs it, at most once a second per reason
// with the count of those not logged since. peer and err may be nil.
func (t *Transport) refuse(why reason, peer net.Addr, err error, attrs ...any) {
	t.refused[why].Add(1)
	ok, suppressed := t.logs[why].Allow()
	if !ok {
		return
	}
	attrs = append(attrs, "reason", reasonNames[why], "suppressed", suppressed)
	if peer != nil {
		attrs = append(attrs, "peer", peer.String())
	}
	if err != nil {
		attrs = append(attrs, "err", err)
	}
	level := slog.LevelInfo
	if why == rConnCap || why == rSourceCap || why == rAcceptError {
		level = slog.LevelWarn
	}
	t.cfg.Logger.Log(context.Background(), level, "mctcp: refused", attrs...)
}

// srvConn is one connection the target serves. idle is the unix
// nanoseconds since which it has waited for a request header, 0 while it
// serves a request, and evicted once admission closed it: the connection
// and the evictor settle who wins with a CAS, so that a request the
// connection has begun is never cut by an eviction.
type srvConn struct {
	c    net.Conn
	src  netip.Addr // the source, an IPv6 one masked to its /64
	idle atomic.Int64
}

const evicted = -1

// accept serves the listener until Close.
func (t *Transport) accept() {
	defer t.wg.Done()
	var backoff time.Duration
	for {
		c, err := t.ln.Accept()
		if err != nil {
			if t.closed.Load() {
				return
			}
			t.refuse(rAcceptError, nil, err)
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			select {
			case <-time.After(backoff):
			case <-t.shutdown:
				return
			}
			continue
		}
		backoff = 0
		sc := &srvConn{c: c, src: sourceOf(c)}
		sc.idle.Store(time.Now().UnixNano())
		t.mu.Lock()
		if t.closed.Load() {
			t.mu.Unlock()
			c.Close()
			return
		}
		// Per source first, so that one host at its bound makes room
		// among its own connections, not among everyone's.
		var victim *srvConn
		why, bound := rSourceCap, t.cfg.MaxConnsPerSource
		if bound > 0 && t.sources[sc.src] >= bound {
			victim = t.evictLocked(sc.src, false)
		} else if why, bound = rConnCap, t.cfg.MaxConns; bound > 0 && len(t.conns) >= bound {
			victim = t.evictLocked(netip.Addr{}, true)
		} else {
			bound = 0
		}
		// A refusal is counted before the close (as serveConn's are), so
		// that a peer, or a test, that sees the close finds it in
		// Refusals.
		if bound > 0 && victim == nil {
			t.mu.Unlock()
			t.refuse(why, c.RemoteAddr(), nil, "bound", bound, "closed", "the new connection (none idle)")
			c.Close()
			continue
		}
		t.conns[sc] = struct{}{}
		t.sources[sc.src]++
		t.wg.Add(1)
		t.mu.Unlock()
		if victim != nil {
			t.refuse(why, victim.c.RemoteAddr(), nil, "bound", bound, "closed", "the one idle longest")
			victim.c.Close()
		}
		go t.serveConn(sc)
	}
}

// evictLocked picks the connection idle longest (of src, unless any),
// if it has waited for a request for evictAfter at least, and marks it
// evicted, so that it serves no further request; nil when every such
// connection is busy or idle only a moment (its request may be unread in
// the socket). It scans every connection, which happens only
// at a bound. mu must be held; the caller closes the victim after
// unlocking.
func (t *Transport) evictLocked(src netip.Addr, any bool) *srvConn {
	latest := time.Now().Add(-evictAfter).UnixNano() // idle since before this, or not a candidate
	for {
		var oldest *srvConn
		var since int64
		for sc := range t.conns {
			if !any && sc.src != src {
				continue
			}
			if s := sc.idle.Load(); s > 0 && s <= latest && (oldest == nil || s < since) {
				oldest, since = sc, s
			}
		}
		if oldest == nil {
			return nil
		}
		if oldest.idle.CompareAndSwap(since, evicted) {
			t.forgetLocked(oldest) // its goroutine finds it gone
			return oldest
		}
		// It began a request meanwhile: look again.
	}
}

// forgetLocked takes sc out of the connection table; mu must be held.
func (t *Transport) forgetLocked(sc *srvConn) {
	if _, ok := t.conns[sc]; !ok {
		return
	}
	delete(t.conns, sc)
	if t.sources[sc.src]--; t.sources[sc.src] <= 0 {
		delete(t.sources, sc.src)
	}
}

// sourceOf is the address a connection counts under for
// MaxConnsPerSource (netaddr.Source).
func sourceOf(c net.Conn) netip.Addr { return netaddr.Source(c.RemoteAddr()) }

// serveConn serves one connection until it ends, and accounts for its end.
func (t *Transport) serveConn(sc *srvConn) {
	defer t.wg.Done()
	err := t.serve(sc)
	t.mu.Lock()
	t.forgetLocked(sc)
	t.mu.Unlock()
	// A refusal is counted before the close, so that a peer (or a test)
	// that sees the close finds it in Refusals.
	defer sc.c.Close()
	if err == nil || t.closed.Load() || sc.idle.Load() == evicted {
		return
	}
	peer := sc.c.RemoteAddr()
	switch {
	case errors.Is(err, errIdle):
		t.refuse(rIdle, peer, nil)
	case errors.Is(err, errBadHeader):
		t.refuse(rBadHeader, peer, err)
	case errors.Is(err, errStalled):
		t.refuse(rStalled, peer, err)
	case errors.Is(err, errRefusedRange):
		// Counted and logged where it was refused.
	case errors.Is(err, net.ErrClosed), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
	default:
		if !isEOF(err) {
			t.cfg.Logger.Debug("mctcp: connection closed", "peer", peer, "err", err)
		}
	}
}
