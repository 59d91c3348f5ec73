//go:build linux

package shm

import (
	"context"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/segtable"
)

// dialRaw connects to tr's socket as an initiator would, and with prove
// set runs the hello with tr's segment key.
func dialRaw(t *testing.T, tr *Transport, prove bool) *net.UnixConn {
	t.Helper()
	boot, name, key, err := parseEndpoint(tr.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	if key == nil {
		key = tr.cfg.Key
	}
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: "@" + name, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if prove {
		c.SetDeadline(time.Now().Add(30 * time.Second))
		if err := hello(c, boot, key); err != nil {
			t.Fatalf("hello: %v", err)
		}
		c.SetDeadline(time.Time{})
	}
	return c
}

// waitClosed waits until the target hangs up on c, failing after 30 s.
func waitClosed(t *testing.T, c *net.UnixConn, what string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	buf := make([]byte, maxMsg+1)
	for {
		_, err := c.Read(buf)
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("hang: the target kept the connection: %s", what)
		}
		return
	}
}

// TestEmptyPacketRights: descriptors that come with an empty packet (which
// reads as the end of the connection) are closed, not kept: any local
// process may connect and send them, before any proof of the key.
func TestEmptyPacketRights(t *testing.T) {
	tr, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	c := dialRaw(t, tr, false)
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	before := len(leakcheck.FDs())
	fds := []int{p[0], p[0], p[0], p[0], p[0], p[0], p[0], p[0]}
	rights := unix.UnixRights(fds...)
	// sendmsg with no payload at all: Go's and x/sys's wrappers add a byte.
	h := unix.Msghdr{Control: &rights[0]}
	h.SetControllen(len(rights))
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	raw.Write(func(fd uintptr) bool {
		_, _, errno := unix.Syscall(unix.SYS_SENDMSG, fd, uintptr(unsafe.Pointer(&h)), 0)
		if errno != 0 {
			serr = errno
		}
		return true
	})
	if serr != nil {
		t.Fatalf("sendmsg: %v", serr)
	}
	waitClosed(t, c, "after an empty packet")
	if after := len(leakcheck.FDs()); after > before {
		t.Fatalf("%d descriptors open after the target read an empty packet with %d, %d before: it kept them", after, len(fds), before)
	}
}

// TestHelloDeadline: a connection that never says hello is closed after
// ReplyTimeout instead of holding a goroutine and a descriptor until the
// transport closes.
func TestHelloDeadline(t *testing.T) {
	tr, err := New(Config{ReplyTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	c := dialRaw(t, tr, false)
	waitClosed(t, c, "silent before its hello")
}

// TestUnregisterStuckPeer: a peer with the key that asks for grants and
// never reads the answers blocks the target's writes; Unregister still
// ends (the writes fail after ReplyTimeout) instead of waiting for good
// on the connection's write lock.
func TestUnregisterStuckPeer(t *testing.T) {
	tr, err := New(Config{ReplyTimeout: 100 * time.Millisecond, RevokeTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	var bufs segtable.Buffers
	mem := make([]byte, 1<<20) // Go memory: process_vm grants, no descriptors
	b, err := bufs.Register(mem, segtable.CPU(0), true)
	if err != nil {
		t.Fatal(err)
	}
	defer bufs.Unregister(context.Background(), b.ID)
	reg, err := tr.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	var key [16]byte
	if h, err := hex.DecodeString(reg.Key); err != nil || len(h) != 16 {
		t.Fatalf("key %q: %v", reg.Key, err)
	} else {
		copy(key[:], h)
	}
	c := dialRaw(t, tr, true)
	// Ask for grants until the target stops reading (its answers fill this
	// side's queue, then its requests fill the target's).
	flooded := make(chan int, 1)
	go func() {
		var buf [maxMsg]byte
		n := 0
		c.SetWriteDeadline(time.Now().Add(2 * time.Second))
		for ; n < 100000; n++ {
			m := msg{typ: msgGrant, seq: uint32(n + 1), a: uint64(b.Addr), b: b.Length, key: key}
			if _, err := c.Write(m.encode(buf[:])); err != nil {
				break
			}
		}
		flooded <- n
	}()
	if n := <-flooded; n == 100000 {
		t.Fatal("the target read 100000 grant requests without its answers being read: the test proves nothing")
	}
	done := make(chan error, 1)
	go func() { done <- tr.Unregister(b, reg) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("hang: Unregister behind a peer that does not read")
	}
}
