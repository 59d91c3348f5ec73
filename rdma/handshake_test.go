//go:build rdma && cgo

package rdma

import (
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/transport"
)

// peerCounts returns the target's control connections, those of them
// still in the handshake, and the queue pairs counted against MaxPeerQPs.
func peerCounts(tr *Transport) (conns, hs, qps int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return len(tr.tqp), tr.hs, tr.npqp
}

// dialIdle opens n control connections to tr that never send a byte, as
// anyone who reaches the listener can, key or not.
func dialIdle(t *testing.T, tr *Transport, n int) []net.Conn {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range n {
		c, err := net.Dial("tcp", tr.ln.Addr().String())
		if err != nil {
			t.Fatalf("dial the control listener: %v", err)
		}
		conns = append(conns, c)
	}
	return conns
}

// readErr reads from c for up to d: the target sends nothing to a peer
// that sent nothing, so the error says whether it closed c (EOF, reset) or
// still holds it (a timeout).
func readErr(c net.Conn, d time.Duration) error {
	c.SetReadDeadline(time.Now().Add(d))
	var b [1]byte
	_, err := c.Read(b[:])
	return err
}

func isClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// Control connections still in the handshake do not count against
// MaxPeerQPs: more of them than MaxPeerQPs, idle, leave room for a peer
// that proves the key, which connects and moves data. MaxPeerQPs still
// holds for such peers. The connections in the handshake are bounded
// apart: beyond maxPendingHandshakes the target closes a connection at
// once, unread. Every count goes back to zero.
func TestPendingHandshakes(t *testing.T) {
	key := []byte("deployment secret")
	init := needDevice(t, Config{Key: key, QPsPerDevice: 1})
	rails := len(init.devs)
	// A minute: only the test ends the idle connections here.
	targ := needDevice(t, Config{Key: key, MaxPeerQPs: rails, ConnectTimeout: time.Minute})
	w := newWorldWith(t, init, targ, 1<<12, true)
	counts := func(wantConns, wantHS, wantQPs int) {
		t.Helper()
		waitFor(t, "the target's counts", func() bool {
			conns, hs, qps := peerCounts(targ)
			return conns == wantConns && hs == wantHS && qps == wantQPs
		})
	}

	idle := dialIdle(t, targ, rails+2)
	counts(len(idle), len(idle), 0)
	ep := w.open(t)
	c := newWaiter()
	w.lmem[7] = 0x5a
	postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 64, 1)})
	if err := c.wait(t, 1); err != nil {
		t.Fatalf("WRITE: %v", err)
	}
	if w.rmem[7] != 0x5a {
		t.Fatal("WRITE did not land")
	}
	counts(len(idle)+rails, len(idle), rails)

	// One queue pair more than MaxPeerQPs, from a peer with the key.
	if _, err := init.Open(context.Background(), w.desc); !errors.Is(err, ErrHandshake) || !strings.Contains(err.Error(), "too many queue pairs") {
		t.Fatalf("Open beyond MaxPeerQPs: %v; want refusal 3 (too many queue pairs)", err)
	}
	counts(len(idle)+rails, len(idle), rails)

	idle = append(idle, dialIdle(t, targ, maxPendingHandshakes-len(idle))...)
	counts(maxPendingHandshakes+rails, maxPendingHandshakes, rails)
	for i, x := range dialIdle(t, targ, 4) {
		start := time.Now()
		if err := readErr(x, 10*time.Second); !isClosed(err) {
			t.Fatalf("connection %d beyond maxPendingHandshakes: read %v; want it closed", i, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("connection %d beyond maxPendingHandshakes closed after %v", i, d)
		}
	}
	counts(maxPendingHandshakes+rails, maxPendingHandshakes, rails)
	if err := readErr(idle[0], 50*time.Millisecond); !isTimeout(err) {
		t.Fatalf("a connection within the bound: read %v; want it held open", err)
	}
	// Connected queue pairs do not need the handshake slots.
	w.lmem[8] = 0xa5
	postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 64, 2)})
	if err := c.wait(t, 2); err != nil || w.rmem[8] != 0xa5 {
		t.Fatalf("WRITE with the handshakes full: %v", err)
	}

	ep.Close()
	for _, x := range idle {
		x.Close()
	}
	counts(0, 0, 0)
	// With the slots free again, a peer with the key connects at once.
	ep2 := w.open(t)
	postAll(t, ep2, c, []transport.Slice{w.slice(transport.Write, 0, 64, 3)})
	if err := c.wait(t, 3); err != nil {
		t.Fatalf("WRITE after the idle connections ended: %v", err)
	}
}

// Connections that never finish the handshake end after ConnectTimeout,
// and every one when the transport closes; no count, socket or goroutine
// is left behind (TestMain checks the goroutines too).
func TestPendingHandshakesEnd(t *testing.T) {
	tr := needDevice(t, Config{ConnectTimeout: 300 * time.Millisecond})
	defer tr.Close()
	fds, gs := len(leakcheck.FDs()), runtime.NumGoroutine()
	for i, c := range dialIdle(t, tr, 8) {
		if err := readErr(c, 20*time.Second); !isClosed(err) {
			t.Fatalf("idle connection %d: read %v; want it closed after ConnectTimeout", i, err)
		}
		c.Close()
	}
	waitFor(t, "the counts, sockets and goroutines back after the timeouts", func() bool {
		conns, hs, qps := peerCounts(tr)
		return conns == 0 && hs == 0 && qps == 0 && len(leakcheck.FDs()) <= fds && runtime.NumGoroutine() <= gs
	})

	tr2 := needDevice(t, Config{ConnectTimeout: time.Minute})
	idle := dialIdle(t, tr2, 8)
	waitFor(t, "the idle connections in the handshake", func() bool {
		_, hs, _ := peerCounts(tr2)
		return hs == len(idle)
	})
	tr2.Close()
	for i, c := range idle {
		if err := readErr(c, 5*time.Second); !isClosed(err) {
			t.Fatalf("idle connection %d: read %v after Close; want it closed", i, err)
		}
		c.Close()
	}
	if conns, hs, qps := peerCounts(tr2); conns != 0 || hs != 0 || qps != 0 {
		t.Fatalf("after Close: %d connections, %d in the handshake, %d queue pairs counted", conns, hs, qps)
	}
	waitFor(t, "the sockets and goroutines back after Close", func() bool {
		return len(leakcheck.FDs()) <= fds && runtime.NumGoroutine() <= gs
	})
}
