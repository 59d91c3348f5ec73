package mctcp_test

// lifetime_test.go: Unregister waits for the requests moving the buffer's
// bytes, and Close leaves no descriptor open.

import (
	"bytes"
	"context"
	"io"
	"net"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// A WRITE whose payload is arriving holds the buffer: Unregister returns
// only once its last byte has landed (and the status word is sent), and
// requests after it are refused.
func TestUnregisterWaitsForPayload(t *testing.T) {
	tg := newTarget(t, mctcp.Config{})
	c := tg.dial(t)
	addr := uint64(tg.remote.Addr)
	c.Write(append(mcHeader(64, addr, 0x81), bytes.Repeat([]byte{7}, 32)...))
	time.Sleep(50 * time.Millisecond)
	done := make(chan error, 1)
	go func() { done <- tg.tr.Unregister(tg.remote, segtable.Registration{}) }()
	select {
	case err := <-done:
		t.Fatalf("Unregister returned (%v) while a WRITE's payload was still coming", err)
	case <-time.After(200 * time.Millisecond):
	}
	c.Write(bytes.Repeat([]byte{7}, 32))
	if st := readN(t, c, 8); !bytes.Equal(st, goldenOK) {
		t.Fatalf("status % x", st)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Unregister did not return after the WRITE ended")
	}
	if !bytes.Equal(tg.remote.Bytes()[:64], bytes.Repeat([]byte{7}, 64)) {
		t.Fatal("the WRITE's bytes did not land")
	}
	c.Write(mcHeader(8, addr, 0x80))
	if st := readN(t, c, 8); !bytes.Equal(st, goldenRefused) {
		t.Fatalf("READ after Unregister: status % x, want the refusal", st)
	}
}

// After traffic both ways, with raw peers connected too, closing every
// endpoint and transport leaves the process's descriptors as they were
// (goroutines are checked by leakcheck in TestMain).
func TestCloseLeavesNoDescriptors(t *testing.T) {
	fds := func() []string {
		return slices.DeleteFunc(leakcheck.FDs(), func(s string) bool { return !strings.Contains(s, "socket:") })
	}
	before := fds()
	if before == nil {
		t.Skip("no /proc/self/fd here")
	}
	func() {
		it, tt := newT(t, mctcp.Config{Version: 2}), newT(t, mctcp.Config{})
		var bufs segtable.Buffers
		mem := make([]byte, 1<<20)
		b, err := bufs.Register(mem, "", true)
		if err != nil {
			t.Fatal(err)
		}
		defer bufs.Unregister(context.Background(), b.ID)
		tt.Register(b)
		ep, err := it.Open(context.Background(), &segtable.SegmentDesc{Name: "x", Endpoints: map[string]string{mctcp.Name: tt.Endpoint()},
			Buffers: []segtable.BufferDesc{{Addr: uint64(b.Addr), Length: b.Length}}})
		if err != nil {
			t.Fatal(err)
		}
		local := make([]byte, 1<<20)
		c := make(tokenCh, 64)
		for i := range 32 {
			op := transport.Op(1 + i%2)
			ep.Post(c, []transport.Slice{{Op: op, Rail: uint16(i), Local: unsafe.Pointer(&local[i<<15]), Remote: uint64(b.Addr) + uint64(i<<15), Length: 1 << 15, Token: uint64(i)}})
		}
		for range 32 {
			<-c
		}
		raw, err := net.Dial("tcp", tt.Endpoint())
		if err != nil {
			t.Fatal(err)
		}
		defer raw.Close()
		raw.Write(mcHeader(8, uint64(b.Addr), 0x80))
		io.ReadFull(raw, make([]byte, 16))
		ep.Close()
		it.Close()
		tt.Close()
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		after := fds()
		if len(after) <= len(before) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d sockets open before, %d after Close:\n%s", len(before), len(after), strings.Join(after, "\n"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A target that closes idle connections (its IdleTimeout) does not fail
// the next slices: the initiator sees the close while idle and redials.
func TestIdleCloseRedials(t *testing.T) {
	const idle = 300 * time.Millisecond
	tg := newT(t, mctcp.Config{IdleTimeout: idle})
	p := newPairWith(t, mctcp.Config{Rails: 2}, tg, 64<<10)
	c := make(tokenCh, 4)
	for round := range 3 {
		for rail := range 2 {
			s := []transport.Slice{{Op: transport.Write, Rail: uint16(rail), Local: unsafe.Pointer(&p.local[0]), Remote: p.remote, Length: 4096, Token: 1}}
			if n, err := p.ep.Post(c, s); n != 1 || err != nil {
				t.Fatalf("round %d: Post = %d, %v", round, n, err)
			}
			if tok := <-c; tok != 1 {
				t.Fatalf("round %d, rail %d: the WRITE failed after the target closed the idle connection", round, rail)
			}
		}
		// Both connections idle out; the redialed ones are fresh for
		// another IdleTimeout.
		deadline := time.Now().Add(10 * time.Second)
		for tg.Refusals().Idle < uint64(2*(round+1)) {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: the target closed %d idle connections, want %d", round, tg.Refusals().Idle, 2*(round+1))
			}
			time.Sleep(5 * time.Millisecond)
		}
		time.Sleep(idle / 4)
	}
}

// Many small slices through shallow pipelines (pending full most of the
// time): every one completes without error, in both versions.
func TestPipelineStress(t *testing.T) {
	for _, cfg := range []mctcp.Config{{Rails: 1, Depth: 1, Version: 2}, {Rails: 2, Depth: 2, Version: 2}, {Rails: 1, Depth: 3, Version: 1}, {Rails: 4, Depth: 64, Version: 2}} {
		p := newPair(t, cfg, mctcp.Config{}, 1<<20)
		c := make(completer, 256)
		const total, size = 3000, 4096
		posted, done := 0, 0
		for done < total {
			for posted < total && posted-done < 200 {
				off := (posted * size) % (1 << 20)
				s := []transport.Slice{{Op: transport.Op(1 + posted%2), Rail: uint16(posted), Local: unsafe.Pointer(&p.local[off]), Remote: p.remote + uint64(off), Length: size, Token: uint64(posted)}}
				n, err := p.ep.Post(c, s)
				if err != nil {
					t.Fatalf("%+v: Post: %v", cfg, err)
				}
				if n == 0 {
					break
				}
				posted++
			}
			if r := c.wait(t); r.err != nil {
				t.Fatalf("%+v: slice %d: %v", cfg, r.token, r.err)
			}
			done++
		}
	}
}
