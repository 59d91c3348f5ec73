//go:build linux

package shm

import (
	"net"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Defaults of Config's limits.
const (
	// DefaultMaxPending is Config.MaxPending's default.
	DefaultMaxPending = 256
	// DefaultMaxPendingPerUID is Config.MaxPendingPerUID's default.
	DefaultMaxPendingPerUID = 64
	// DefaultMaxConns is Config.MaxConns's default.
	DefaultMaxConns = 1024
)

// Stats counts a Transport's connections from peers and what its limits
// did to them (see Config.MaxPending, MaxPendingPerUID and MaxConns).
// The counters only grow, from New on.
type Stats struct {
	// Pending is the connections that have not proved the key yet, and
	// Peers those that have, now.
	Pending, Peers int
	// Evicted counts connections that had not proved the key, closed to
	// make room for a newer one past MaxPending.
	Evicted uint64
	// EvictedUID counts the same past MaxPendingPerUID.
	EvictedUID uint64
	// Refused counts connections closed because MaxConns peers were
	// connected: at once after the accept, or when they proved the key.
	Refused uint64
	// BadKey counts connections that failed the proof of the key.
	BadKey uint64
	// Failed counts other connections that ended before they proved the
	// key: silent past ReplyTimeout, a broken hello, another version or
	// boot id.
	Failed uint64
}

// Stats returns the connection counters. Safe for concurrent use.
func (t *Transport) Stats() Stats {
	t.mu.Lock()
	st := Stats{Pending: len(t.pending), Peers: t.peers}
	t.mu.Unlock()
	st.Evicted = t.refusals[refEvicted].Load()
	st.EvictedUID = t.refusals[refEvictedUID].Load()
	st.Refused = t.refusals[refFull].Load()
	st.BadKey = t.refusals[refBadKey].Load()
	st.Failed = t.refusals[refFailed].Load()
	return st
}

// Reasons a connection is dropped before it serves, indexes of
// Transport.refusals.
const (
	refEvicted = iota
	refEvictedUID
	refFull
	refBadKey
	refFailed
	refReasons
)

var refMessages = [refReasons]string{
	refEvicted:    "shm: connection without the key closed to make room (MaxPending)",
	refEvictedUID: "shm: connection without the key closed to make room (MaxPendingPerUID)",
	refFull:       "shm: connection refused: MaxConns peers connected",
	refBadKey:     "shm: connection failed the proof of the segment key",
	refFailed:     "shm: connection ended before it proved the key",
}

// refused counts a dropped connection and logs it, one line a second at
// most for each reason (with the count of those not logged since).
func (t *Transport) refused(reason int, uid int) {
	t.refusals[reason].Add(1)
	if ok, n := t.rlog[reason].Allow(); ok {
		t.cfg.Logger.Warn(refMessages[reason], "uid", uid, "not_logged_since_last", n)
	}
}

// refusalCounters is the counters behind Stats.
type refusalCounters [refReasons]atomic.Uint64

// peerUID returns the user id of the process at the other end of c
// (SO_PEERCRED), or -1.
func peerUID(c *net.UnixConn) int {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1
	}
	uid := -1
	rc.Control(func(fd uintptr) {
		if cr, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
			uid = int(cr.Uid)
		}
	})
	return uid
}

// admit takes a connection just accepted into the pending ones, making
// room past MaxPendingPerUID (that user's oldest pending connection) and
// MaxPending (the oldest of all), or refuses it when MaxConns peers are
// connected. t.mu is held; what it returns is closed by the caller after
// unlocking.
func (t *Transport) admit(s *server) (drop []*server, reasons []int, ok bool) {
	if t.peers >= t.cfg.MaxConns {
		return []*server{s}, []int{refFull}, false
	}
	if t.pendingUID[s.uid] >= t.cfg.MaxPendingPerUID {
		for _, p := range t.pending {
			if p.uid == s.uid {
				t.unpend(p)
				drop, reasons = append(drop, p), append(reasons, refEvictedUID)
				break
			}
		}
	} else if len(t.pending) >= t.cfg.MaxPending {
		p := t.pending[0]
		t.unpend(p)
		drop, reasons = append(drop, p), append(reasons, refEvicted)
	}
	s.pending = true
	t.pending = append(t.pending, s)
	t.pendingUID[s.uid]++
	return drop, reasons, true
}

// unpend takes s out of the pending connections. t.mu is held.
func (t *Transport) unpend(s *server) {
	if !s.pending {
		return
	}
	s.pending = false
	for i, p := range t.pending {
		if p == s {
			t.pending = append(t.pending[:i], t.pending[i+1:]...)
			break
		}
	}
	if t.pendingUID[s.uid]--; t.pendingUID[s.uid] == 0 {
		delete(t.pendingUID, s.uid)
	}
}

// login moves s, which proved the key, from the pending connections to
// the peers, or reports false: it was evicted meanwhile, or MaxConns
// peers are connected.
func (t *Transport) login(s *server) (ok, full bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !s.pending {
		return false, false // evicted: its connection is closed
	}
	t.unpend(s)
	if t.peers >= t.cfg.MaxConns {
		return false, true
	}
	t.peers++
	s.peer = true
	return true, false
}
