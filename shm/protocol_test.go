//go:build linux

package shm

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// FuzzDecode: no packet makes decode panic, and what decodes encodes back
// to the same bytes.
func FuzzDecode(f *testing.F) {
	var buf [maxMsg]byte
	for _, m := range []msg{
		{typ: msgHello, a: version, key: [16]byte{1, 2}},
		{typ: msgGrantAck, flags: flagVM, status: statusDenied, seq: 7, handle: 3, a: 1 << 40, b: 4096},
		{typ: msgNotify, a: 99, b: 3, c: 2, tail: []byte("abcde")},
	} {
		f.Add(bytes.Clone(m.encode(buf[:])))
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		var m msg
		if decode(p, &m) != nil {
			return
		}
		if got := m.encode(buf[:]); !bytes.Equal(got, p) {
			t.Fatalf("re-encoded %x, decoded from %x", got, p)
		}
	})
}

// fakeTarget answers the hello, then every grant with the descriptor that
// file returns and the given range and size.
func fakeTarget(t *testing.T, file func() int, off, size uint64) string {
	boot, err := bootID()
	if err != nil {
		t.Fatal(err)
	}
	name := "moonring-shm-fake-" + strings.ReplaceAll(t.Name(), "/", "-")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: "@" + name, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { ln.Close(); <-done })
	go func() {
		defer close(done)
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, maxMsg)
		var m msg
		var ci, ct [2]uint64
		for {
			n, err := c.Read(buf)
			if err != nil || decode(buf[:n], &m) != nil {
				return
			}
			var ack msg
			var oob []byte
			switch m.typ {
			case msgHello:
				ci, ct = [2]uint64{m.c, m.d}, nonce()
				ack = msg{typ: msgHelloAck, a: version, key: boot, c: ct[0], d: ct[1]}
			case msgProof:
				ack = msg{typ: msgProofAck}
				ack.putProof(proof(nil, "target", ci, ct))
			case msgGrant:
				ack = msg{typ: msgGrantAck, seq: m.seq, handle: 1, a: m.a, b: m.b, c: off, d: size}
				fd := file()
				defer unix.Close(fd)
				oob = unix.UnixRights(fd)
			default:
				return
			}
			if _, _, err := c.WriteMsgUnix(ack.encode(buf), oob, nil); err != nil {
				return
			}
		}
	}()
	return segtableEndpoint(boot, name)
}

func segtableEndpoint(boot [16]byte, name string) string {
	const hexdigits = "0123456789abcdef"
	var b []byte
	for _, x := range boot {
		b = append(b, hexdigits[x>>4], hexdigits[x&15])
	}
	return string(b) + "/" + name
}

// TestHostileTarget: a target that hands over a file it could truncate, or
// one smaller than the range it grants, gets nothing mapped: a later
// truncation could otherwise kill the initiator with SIGBUS.
func TestHostileTarget(t *testing.T) {
	memfd := func(size int64, seal bool) func() int {
		return func() int {
			fd, err := unix.MemfdCreate("hostile", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
			if err != nil {
				t.Fatal(err)
			}
			unix.Ftruncate(fd, size)
			if seal {
				unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
			}
			return fd
		}
	}
	cases := []struct {
		name      string
		file      func() int
		off, size uint64
	}{
		{"unsealed", memfd(1<<20, false), 0, 1 << 20},
		{"smaller than the range", memfd(4096, true), 0, 4096},
		{"size that lies", memfd(4096, true), 0, 1 << 20},
		{"offset past the end", memfd(1<<20, true), 1 << 20, 1 << 20},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ep := fakeTarget(t, tc.file, tc.off, tc.size)
			tr, err := New(Config{})
			if err != nil {
				t.Fatal(err)
			}
			defer tr.Close()
			d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "hostile", Epoch: 1,
				Endpoints: map[string]string{Name: ep},
				Buffers:   []segtable.BufferDesc{{Addr: 1 << 30, Length: 1 << 20, Keys: map[string]string{Name: "00"}}}}
			e, err := tr.Open(context.Background(), d)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			if mp, v := e.(*Endpoint).Granted(); mp+v != 0 {
				t.Fatalf("granted %d mapped, %d vm", mp, v)
			}
			var x [8]byte
			s := transport.Slice{Op: transport.Read, Local: unsafePointer(x[:]), Remote: 1 << 30, Length: 8}
			if err := e.(*Endpoint).Copy(&s); !errors.Is(err, transport.ErrDenied) {
				t.Fatalf("read: %v, want ErrDenied", err)
			}
		})
	}
}

// TestSegmentKey: a target with a secret segment key admits only
// initiators that prove they hold it; a target without one publishes a
// random key that whoever reads the descriptor uses.
func TestSegmentKey(t *testing.T) {
	targ, err := New(Config{Key: []byte("the deployment's secret")})
	if err != nil {
		t.Fatal(err)
	}
	defer targ.Close()
	if strings.Count(targ.Endpoint(), "/") != 1 {
		t.Fatalf("endpoint %q publishes the secret key", targ.Endpoint())
	}
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "keyed", Epoch: 1,
		Endpoints: map[string]string{Name: targ.Endpoint()}}
	for _, tc := range []struct {
		key []byte
		ok  bool
	}{{[]byte("the deployment's secret"), true}, {[]byte("a guess"), false}, {nil, false}} {
		init, err := New(Config{Key: tc.key})
		if err != nil {
			t.Fatal(err)
		}
		e, err := init.Open(context.Background(), d)
		switch {
		case tc.ok && err != nil:
			t.Errorf("key %q: %v", tc.key, err)
		case !tc.ok && !errors.Is(err, transport.ErrDenied):
			t.Errorf("key %q: Open: %v, want ErrDenied", tc.key, err)
		}
		if e != nil {
			e.Close()
		}
		init.Close()
	}
	open, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	if strings.Count(open.Endpoint(), "/") != 2 {
		t.Fatalf("endpoint %q publishes no key", open.Endpoint())
	}
	d.Endpoints[Name] = open.Endpoint()
	init, err := New(Config{Key: []byte("unrelated")})
	if err != nil {
		t.Fatal(err)
	}
	defer init.Close()
	e, err := init.Open(context.Background(), d)
	if err != nil {
		t.Fatalf("open mode: %v", err)
	}
	e.Close()
}
