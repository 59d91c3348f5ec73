//go:build linux

package tcp

import (
	"context"
	"net"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

func TestSameHost(t *testing.T) {
	tcp := func(s string) net.Addr { return net.TCPAddrFromAddrPort(netip.MustParseAddrPort(s)) }
	for _, c := range []struct {
		local, remote net.Addr
		want          bool
	}{
		{tcp("127.0.0.1:1000"), tcp("127.0.0.1:2000"), true},
		{tcp("127.0.0.1:1000"), tcp("127.0.0.2:2000"), true},
		{tcp("[::1]:1000"), tcp("[::1]:2000"), true},
		{tcp("10.0.0.5:1000"), tcp("10.0.0.5:2000"), true}, // this host's own address
		{tcp("10.0.0.5:1000"), tcp("10.0.0.6:2000"), false},
		{tcp("[fd00::5]:1000"), tcp("[fd00::6]:2000"), false},
		{&net.UnixAddr{Name: "a"}, &net.UnixAddr{Name: "b"}, false},
	} {
		if got := sameHost(c.local, c.remote); got != c.want {
			t.Errorf("sameHost(%v, %v) = %v, want %v", c.local, c.remote, got, c.want)
		}
	}
}

// sndbuf is c's SO_SNDBUF as the kernel counts it (twice what was set).
func sndbuf(t *testing.T, c net.Conn) int {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	v := -1
	var gerr error
	if err := rc.Control(func(fd uintptr) { v, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF) }); err != nil || gerr != nil {
		t.Fatalf("SO_SNDBUF: %v, %v", err, gerr)
	}
	return v
}

// Both ends of a loopback connection get Config.LoopbackSendBuffer's send
// buffer (the kernel doubles it); negative leaves the kernel's.
func TestLoopbackSendBuffer(t *testing.T) {
	for _, c := range []struct {
		name string
		set  int
		want int // 0: anything but a set one
	}{
		{"default", 0, 2 * DefaultLoopbackSendBuffer},
		{"256KiB", 256 << 10, 512 << 10},
		{"autotuned", -1, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			targ := newSide(t, Config{LoopbackSendBuffer: c.set})
			remote := targ.register(t, targ.alloc(t, 4096, 0), true)
			init := newSide(t, Config{Rails: 2, LoopbackSendBuffer: c.set})
			ep, err := init.tr.Open(context.Background(), targ.desc("", remote))
			if err != nil {
				t.Fatal(err)
			}
			defer ep.Close()
			e := ep.(*Endpoint)
			waitFor(t, "rails up", func() bool { return railsUp(e) })
			check := func(side string, got int) {
				t.Helper()
				if c.want != 0 && got != c.want {
					t.Errorf("%s: SO_SNDBUF %d, want %d", side, got, c.want)
				}
				if c.want == 0 && (got == 2*DefaultLoopbackSendBuffer || got == 512<<10) {
					t.Errorf("%s: SO_SNDBUF %d: set, want the kernel's", side, got)
				}
			}
			for i := range e.rails {
				check("initiator", sndbuf(t, e.rails[i].Load().nc))
			}
			var conns []net.Conn
			waitFor(t, "the target's connections", func() bool {
				targ.tr.mu.Lock()
				defer targ.tr.mu.Unlock()
				conns = conns[:0]
				for nc := range targ.tr.conns {
					conns = append(conns, nc)
				}
				return len(conns) >= len(e.rails)
			})
			for _, nc := range conns {
				check("target", sndbuf(t, nc))
			}
		})
	}
}
