package mctcp_test

// fuzz_answers_test.go: FuzzAnswers plays a hostile or broken version 2
// target against the initiator: whatever bytes it answers with, every
// slice completes exactly once, with the outcome the protocol gives those
// bytes, and a READ that succeeds holds exactly the bytes the target sent.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// requestBytes is what the initiator sends for fuzzSlices: a 24-byte
// header each, and the WRITE's payload.
const requestBytes = 3*24 + 16

// The slices each run posts, in order, on one rail.
var fuzzSlices = []struct {
	op     transport.Op
	length int
}{{transport.Read, 16}, {transport.Write, 16}, {transport.Read, 20000}}

func FuzzAnswers(f *testing.F) {
	tr := newT(f, mctcp.Config{Rails: 1, Version: 2, StatusTimeout: 5 * time.Second})
	f.Cleanup(func() { tr.Close() })
	ok, refused := goldenOK, goldenRefused
	data := bytes.Repeat([]byte("0123456789abcdef"), 1250)
	cat := func(p ...[]byte) []byte { return bytes.Join(p, nil) }
	f.Add([]byte{})
	f.Add(cat(ok, data[:16], ok, ok, data[:20000]))
	f.Add(cat(ok, data[:16], refused))
	f.Add(cat(refused))
	f.Add(cat(ok, data[:10]))
	f.Add(cat(data[:8], data[:16]))
	f.Add(cat(ok, data[:16], ok, ok, data[:20000], ok))
	f.Add(cat(ok, data[:16], mustHex("0200000056544"+"34d")))
	f.Fuzz(func(t *testing.T, in []byte) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		served := make(chan struct{})
		// The target accepts (the kernel has completed the connection)
		// only once Post has queued every slice: an answer that came
		// before a slice was queued would end the connection first, and
		// the slice would fail for a reason the bytes do not give (the
		// test's model assumes every request was sent).
		posted := make(chan struct{})
		var once sync.Once
		release := func() { once.Do(func() { close(posted) }) }
		defer release() // a failure before Post: the target gives up at Accept
		go func() {
			defer close(served)
			<-posted
			c, err := ln.Accept()
			ln.Close() // redials find no one
			if err != nil {
				return
			}
			defer c.Close()
			// Answer once every request has come (the initiator sends
			// them all before any answer: one rail, pipelined): an
			// answer to a request not yet wholly sent is unsolicited and
			// ends the connection, an outcome the model below does not
			// give the bytes. The deadline only bounds a broken run.
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadFull(c, make([]byte, requestBytes)); err != nil {
				return
			}
			go io.Copy(io.Discard, c)
			c.Write(in)
			c.(*net.TCPConn).CloseWrite()
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			var b [1]byte
			for {
				if _, err := c.Read(b[:]); err != nil {
					return
				}
			}
		}()
		desc := &segtable.SegmentDesc{Name: "fuzz", Endpoints: map[string]string{mctcp.Name: ln.Addr().String()},
			Buffers: []segtable.BufferDesc{{Addr: fakeAddr, Length: fakeLen}}}
		ep, err := tr.Open(context.Background(), desc)
		if err != nil {
			t.Fatal(err)
		}
		c := make(completer, len(fuzzSlices))
		locals := make([][]byte, len(fuzzSlices))
		s := make([]transport.Slice, len(fuzzSlices))
		for i, fs := range fuzzSlices {
			locals[i] = make([]byte, fs.length)
			s[i] = transport.Slice{Op: fs.op, Local: unsafe.Pointer(&locals[i][0]), Remote: fakeAddr, Length: uint64(fs.length), Token: uint64(i)}
		}
		got := make([]error, len(s))
		seen := make([]bool, len(s))
		n, err := ep.Post(c, s)
		release()
		for i := n; i < len(s); i++ {
			got[i], seen[i] = err, true // not taken: the rail died first
		}
		for range n {
			select {
			case r := <-c:
				if seen[r.token] {
					t.Fatalf("slice %d completed twice", r.token)
				}
				got[r.token], seen[r.token] = r.err, true
			case <-time.After(20 * time.Second):
				t.Fatal("a slice did not complete")
			}
		}
		ep.Close()
		<-served
		select {
		case r := <-c:
			t.Fatalf("slice %d completed again after Close", r.token)
		default:
		}
		// What the protocol makes of the bytes.
		rest := in
		dead := false
		for i, fs := range fuzzSlices {
			var want error // nil: success
			switch {
			case dead:
				want = transport.ErrPeer
			case len(rest) < 8 || binary.LittleEndian.Uint64(rest)>>32 != 0x4D435456:
				want, dead = transport.ErrPeer, true
			case uint32(binary.LittleEndian.Uint64(rest)) == 1:
				want, dead = transport.ErrDenied, true
			case uint32(binary.LittleEndian.Uint64(rest)) != 0:
				want, dead = transport.ErrPeer, true
			default:
				rest = rest[8:]
				if fs.op == transport.Read {
					if len(rest) < fs.length {
						want, dead = transport.ErrPeer, true
					} else {
						if got[i] == nil && !bytes.Equal(locals[i], rest[:fs.length]) {
							t.Fatalf("READ %d succeeded with other bytes than the target sent", i)
						}
						rest = rest[fs.length:]
					}
				}
			}
			switch {
			case want == nil && got[i] != nil:
				t.Fatalf("slice %d failed (%v); the answers say it succeeded", i, got[i])
			case want != nil && !errors.Is(got[i], want):
				t.Fatalf("slice %d: %v; the answers say %v", i, got[i], want)
			}
		}
	})
}
