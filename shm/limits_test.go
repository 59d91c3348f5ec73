//go:build linux

package shm_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/transport"
)

// dialSilent connects to tr's socket and says nothing: a connection that
// never proves the key. The test's cleanup closes it.
func dialSilent(t *testing.T, tr *shm.Transport) *net.UnixConn {
	t.Helper()
	f := strings.Split(tr.Endpoint(), "/")
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: "@" + f[1], Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// waitStats polls tr's counters until ok says yes, failing after 30 s.
func waitStats(t *testing.T, tr *shm.Transport, what string, ok func(shm.Stats) bool) shm.Stats {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		st := tr.Stats()
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: stats %+v", what, st)
		}
	}
}

// closedByPeer reports whether the target closed c (a read ends without
// data within 200 ms).
func closedByPeer(c *net.UnixConn) bool {
	c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	var b [128]byte
	_, err := c.Read(b[:])
	return err != nil && !isTimeout(err)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// transferVerified moves bytes both ways between w's initiator and a
// mapped buffer of its target, and checks them.
func transferVerified(t *testing.T, w *world, ep *shm.Endpoint, rmem []byte, raddr uint64) {
	t.Helper()
	lm := w.local.Bytes()
	testpattern.Fill(lm[:64<<10], 1)
	s := w.slice(transport.Write, 0, raddr, 64<<10)
	if err := ep.Copy(&s); err != nil {
		t.Fatalf("write: %v", err)
	}
	if !bytes.Equal(rmem[:64<<10], lm[:64<<10]) {
		t.Fatal("write: the target's bytes differ")
	}
	testpattern.Fill(rmem[64<<10:128<<10], 2)
	s = w.slice(transport.Read, 64<<10, raddr+64<<10, 64<<10)
	if err := ep.Copy(&s); err != nil {
		t.Fatalf("read: %v", err)
	}
	if !bytes.Equal(lm[64<<10:128<<10], rmem[64<<10:128<<10]) {
		t.Fatal("read: the bytes differ")
	}
}

// TestPendingLimits: more connections that never prove the key than
// MaxPending (or MaxPendingPerUID: they are all of this user) do not
// lock an honest peer out: the oldest are closed to make room, counted,
// and the peer's Open and copies work. (Without the limits every one of
// them held a goroutine and a descriptor for ReplyTimeout, and there was
// no bound on how many.)
func TestPendingLimits(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  shm.Config
		of   func(shm.Stats) uint64
	}{
		{"MaxPending", shm.Config{MaxPending: 4, MaxPendingPerUID: 100}, func(s shm.Stats) uint64 { return s.Evicted }},
		{"MaxPendingPerUID", shm.Config{MaxPending: 100, MaxPendingPerUID: 4}, func(s shm.Stats) uint64 { return s.EvictedUID }},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.RevokeTimeout = 5 * time.Second
			c.cfg.ReplyTimeout = time.Minute // the silent ones are not timed out meanwhile
			w := newWorldTarget(t, shm.Config{}, c.cfg)
			b, rmem := w.shared(1<<20, true)
			var silent []*net.UnixConn
			for range 12 {
				silent = append(silent, dialSilent(t, w.targ))
			}
			st := waitStats(t, w.targ, "12 silent connections, 4 kept", func(s shm.Stats) bool { return c.of(s) >= 8 && s.Pending == 4 })
			closed := 0
			for _, sc := range silent {
				if closedByPeer(sc) {
					closed++
				}
			}
			if closed < 8 {
				t.Errorf("%d of 12 silent connections closed; want the 8 oldest", closed)
			}
			ep := w.open()
			transferVerified(t, w, ep, rmem, uint64(b.Addr))
			after := w.targ.Stats()
			if c.of(after) <= c.of(st) || after.Peers != 1 {
				t.Errorf("stats %+v after the peer's Open (before %+v): want one more eviction and one peer", after, st)
			}
		})
	}
}

// TestMaxConns: past MaxConns peers, a new connection is refused (and
// counted); once one peer leaves, a new one is served.
func TestMaxConns(t *testing.T) {
	w := newWorldTarget(t, shm.Config{}, shm.Config{MaxConns: 2, RevokeTimeout: 5 * time.Second})
	b, rmem := w.shared(1<<20, true)
	first := shm.DialRaw(t, w.targ, true)
	shm.DialRaw(t, w.targ, true)
	waitStats(t, w.targ, "two peers", func(s shm.Stats) bool { return s.Peers == 2 })
	_, err := w.init.Open(context.Background(), w.desc())
	if !errors.Is(err, transport.ErrUnreachable) {
		t.Fatalf("Open past MaxConns: %v; want ErrUnreachable", err)
	}
	if st := w.targ.Stats(); st.Refused == 0 {
		t.Errorf("stats %+v: the refusal is not counted", st)
	}
	first.Close()
	waitStats(t, w.targ, "one peer left", func(s shm.Stats) bool { return s.Peers == 1 })
	ep := w.open()
	transferVerified(t, w, ep, rmem, uint64(b.Addr))
}

// TestBadKeyCounted: a connection with the wrong key is counted.
func TestBadKeyCounted(t *testing.T) {
	tr, err := shm.New(shm.Config{Key: []byte("right")})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	in, err := shm.New(shm.Config{Key: []byte("wrong")})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "keyed", Epoch: 1,
		Endpoints: map[string]string{shm.Name: tr.Endpoint()}}
	if _, err := in.Open(context.Background(), d); !errors.Is(err, transport.ErrDenied) {
		t.Fatalf("Open with the wrong key: %v; want ErrDenied", err)
	}
	waitStats(t, tr, "a bad key", func(s shm.Stats) bool { return s.BadKey == 1 && s.Pending == 0 && s.Peers == 0 })
}
