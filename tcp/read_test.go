package tcp

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// READs of sizes around directMin, pipelined on one connection: each
// response's payload comes partly from the receive buffer and partly
// straight from the socket, or wholly from either, and every byte lands
// where its READ asked and nowhere else.
func TestReadMixedSizes(t *testing.T) {
	const size = 4 << 20
	targ := newSide(t, Config{})
	tm := targ.alloc(t, size, 0)
	for i := range tm {
		tm[i] = byte(i*7 + 3)
	}
	remote := targ.register(t, tm, true)
	init := newSide(t, Config{Rails: 1})
	local := init.alloc(t, size, 0xee)
	ep, err := init.tr.Open(context.Background(), targ.desc("", remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	sizes := []int{1, 100, directMin - 1, directMin, directMin + 1, 70000, 1 << 20, 4096, 32}
	rng := rand.New(rand.NewPCG(1, 2))
	var s []transport.Slice
	want := make([]byte, size)
	copy(want, local)
	off := 0
	for round := 0; round < 3; round++ {
		for _, n := range sizes {
			if off+n+7 > size {
				break
			}
			r := rng.IntN(size - n)
			s = append(s, localSlice(transport.Read, local[off:off+n], remote.addr+uint64(r), uint64(len(s)+1)))
			copy(want[off:off+n], tm[r:r+n])
			off += n + 7 // a gap that no READ may touch
		}
	}
	comp := make(chanCompleter, len(s))
	deadline := time.Now().Add(hang)
	for done := 0; done < len(s); {
		k, err := ep.Post(comp, s[done:])
		if err != nil {
			t.Fatalf("Post: %v", err)
		}
		done += k
		if time.Now().After(deadline) {
			t.Fatalf("hang: %d of %d slices posted", done, len(s))
		}
	}
	for tok, err := range comp.await(t, len(s)) {
		if err != nil {
			t.Errorf("READ %d: %v", tok, err)
		}
	}
	if !bytes.Equal(local, want) {
		for i := range local {
			if local[i] != want[i] {
				t.Fatalf("local byte %d is %#x, want %#x", i, local[i], want[i])
			}
		}
	}
}

// Endpoint.Close twice and Open, all racing Transport.Close: every call
// returns, an Open that succeeds gives a working endpoint or one that
// Close already closed, and no rail goroutine outlives the transport
// (TestMain's goleak check).
func TestCloseRaces(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 1<<16, 0), true)
	for i := 0; i < 20; i++ {
		init, err := New(Config{})
		if err != nil {
			t.Fatal(err)
		}
		ep, err := init.Open(context.Background(), targ.desc("", remote))
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		wg.Go(func() { ep.Close() })
		wg.Go(func() { ep.Close() })
		wg.Go(func() {
			if ep2, err := init.Open(context.Background(), targ.desc("", remote)); err == nil {
				ep2.Close()
			} else if !errors.Is(err, transport.ErrClosed) {
				t.Errorf("round %d: Open racing Close: %v", i, err)
			}
		})
		time.Sleep(time.Duration(i%4) * 50 * time.Microsecond)
		if err := init.Close(); err != nil {
			t.Errorf("round %d: Close: %v", i, err)
		}
		wg.Wait()
		init.mu.Lock()
		n := len(init.eps)
		init.mu.Unlock()
		if n != 0 {
			t.Errorf("round %d: %d endpoints left after Close", i, n)
		}
	}
}

// The target's responses go to the TCP connection itself, whose writev
// net.Buffers uses: through the peekConn wrapper each iovec took its own
// write call (READ 4 KiB moved 0.7 GB/s instead of 1.6-2.0).
func TestResponsesUseWritev(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	w := respWriter(peekConn{c, bufio.NewReader(c)})
	if _, ok := w.(*net.TCPConn); !ok {
		t.Fatalf("responses go to a %T, not the *net.TCPConn whose writev net.Buffers uses", w)
	}
}

// A READ whose connection closes in the middle of its payload fails with
// ErrPeer as soon as the close arrives, not after the response timeout:
// the payload's read in progress ends with the connection.
func TestReadPeerClosesMidPayload(t *testing.T) {
	tp := newTimeoutPair(t, time.Minute, 9, true)
	ep, local, remote, px := tp.ep, tp.local, tp.remote, tp.px
	px.trickle.Store(int64(5 * time.Millisecond)) // 8 KiB each: 1 MiB in 640 ms and more
	comp := make(chanCompleter, 1)
	s := []transport.Slice{localSlice(transport.Read, local, remote.addr, 1)}
	start := time.Now()
	if k, err := ep.Post(comp, s); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	time.Sleep(150 * time.Millisecond)
	px.kill()
	for _, err := range comp.await(t, 1) {
		if err == nil {
			t.Fatalf("the READ completed within %v, before the proxy closed: the test proved nothing", time.Since(start))
		}
		if !errors.Is(err, transport.ErrPeer) {
			t.Fatalf("READ: %v, want ErrPeer", err)
		}
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("the READ failed after %v, not when its connection closed", el)
	}
}

// TestPeekKeepsSocketError: a reset that a peek took from the socket (a
// recv consumes the pending error, MSG_PEEK or not) is what the next read
// returns, not the end that the socket shows after it.
func TestPeekKeepsSocketError(t *testing.T) {
	c, s := socketPair(t)
	nb := newNBReader(c)
	s.SetLinger(0)
	s.Close() // a reset
	// The reset arrives before the peek, so that the peek is what takes it.
	time.Sleep(50 * time.Millisecond)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if err := nb.waitIdle(); err != nil { // peeks: takes the reset
		t.Fatal(err)
	}
	if _, err := nb.Read(make([]byte, 16)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read after a peek took the reset: %v, want ECONNRESET", err)
	}
	if _, err := nb.Read(make([]byte, 16)); err != io.EOF {
		t.Fatalf("the read after that: %v, want EOF", err)
	}
}

// socketPair returns the two ends of a loopback TCP connection, closed
// when the test ends: the one dialed and the one accepted.
func socketPair(t *testing.T) (dialed, accepted *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan net.Conn, 1)
	go func() {
		s, err := ln.Accept()
		if err != nil {
			close(got)
			return
		}
		got <- s
	}()
	c, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	s, ok := <-got
	if !ok {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { s.Close() })
	return c, s.(*net.TCPConn)
}
