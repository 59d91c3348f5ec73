package tcp

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/internal/testwait"
	"github.com/moonring/moonring/transport"
)

// proxy forwards connections to a target. It can hold back what the target
// sends (the responses stay in flight, counted in held), and black-hole new
// connections (accept, read, never answer).
type proxy struct {
	ln        net.Listener
	target    string
	hold      atomic.Bool
	held      atomic.Int64
	blackhole atomic.Bool
	holes     atomic.Int64
	trickle   atomic.Int64 // when set, the pause (ns) after each 8 KiB the target sends
	delay     atomic.Int64 // when set, the pause (ns) before passing on what the target sent
	mu        sync.Mutex
	closed    bool
	conns     map[net.Conn]struct{}
	wg        sync.WaitGroup
}

func newProxy(t testing.TB, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		p.kill()
		p.wg.Wait()
	})
	return p
}

func (p *proxy) addr() string { return p.ln.Addr().String() }

// track records c to be closed by kill; false (and c closed) once the
// proxy is closed.
func (p *proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

// kill closes every connection the proxy holds, on both sides.
func (p *proxy) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
}

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			continue
		}
		p.wg.Add(1)
		if p.blackhole.Load() {
			p.holes.Add(1)
			go func() {
				defer p.wg.Done()
				io.Copy(io.Discard, c)
			}()
			continue
		}
		go p.forward(c)
	}
}

func (p *proxy) forward(c net.Conn) {
	defer p.wg.Done()
	defer c.Close()
	s, err := net.Dial("tcp", p.target)
	if err != nil || !p.track(s) {
		return
	}
	defer s.Close()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		io.Copy(s, c)
		s.Close()
		c.Close()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			if d := time.Duration(p.delay.Load()); d > 0 {
				time.Sleep(d)
			}
			if p.hold.Load() {
				p.held.Add(int64(n))
			} else if d := time.Duration(p.trickle.Load()); d > 0 {
				for off := 0; off < n; off += 8 << 10 {
					if _, err := c.Write(buf[off:min(n, off+8<<10)]); err != nil {
						return
					}
					time.Sleep(d)
				}
			} else if _, err := c.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// waitFor polls cond until it holds; hang is the hang detector.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	testwait.For(t, hang, what, cond)
}

func railsUp(e *Endpoint) bool {
	for i := range e.rails {
		if c := e.rails[i].Load(); c == nil || c.failed.Load() {
			return false
		}
	}
	return true
}

// inTime runs f and fails the test if it does not return within hang.
func inTime(t testing.TB, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		f()
	}()
	select {
	case <-done:
	case <-time.After(hang):
		t.Fatalf("hang: %s did not return", what)
	}
}

// TestTargetCloseInFlight: the target closes while the initiator has
// slices on both rails whose requests the target served but whose
// responses a proxy holds back. Every slice completes exactly once, with
// ErrPeer (the engine retries it elsewhere), none before the close.
func TestTargetCloseInFlight(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 1<<20, 0), true)
	px := newProxy(t, targ.tr.Addr())
	init := newSide(t, Config{Rails: 2})
	local := init.alloc(t, 1<<20, 1)
	ep, err := init.tr.Open(context.Background(), targ.desc(px.addr(), remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	e := ep.(*Endpoint)
	waitFor(t, "both rails up", func() bool { return railsUp(e) })
	px.hold.Store(true)

	const n, size = 32, 16 << 10
	s := make([]transport.Slice, n)
	var want int64 // the bytes of the responses the target will send
	for i := range s {
		op := transport.Write
		want += specRespLen
		if i%2 == 0 {
			op = transport.Read
			want += size
		}
		s[i] = localSlice(op, local[i*size:(i+1)*size], remote.addr+uint64(i*size), uint64(i+1))
		s[i].Rail = uint16(i % 2)
	}
	comp := make(chanCompleter, 2*n)
	if k, err := ep.Post(comp, s); k != n || err != nil {
		t.Fatalf("Post: %d, %v; want %d, nil", k, err, n)
	}
	waitFor(t, "the target to answer every request", func() bool { return px.held.Load() >= want })
	if len(comp) != 0 {
		t.Fatalf("%d slices completed while their responses were held back", len(comp))
	}
	inTime(t, "the target's Close", func() {
		if err := targ.tr.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	for tok, err := range comp.await(t, n) {
		if !errors.Is(err, transport.ErrPeer) {
			t.Errorf("slice %d: %v, want ErrPeer", tok, err)
		}
	}
	inTime(t, "Endpoint.Close", func() { ep.Close() })
	if len(comp) != 0 {
		t.Fatalf("%d more completions after every slice had completed", len(comp))
	}
}

// TestReconnect: when the target drops a connection, the rail is redialed
// and a later Post succeeds on the new connection.
func TestReconnect(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 64<<10, 0), true)
	init := newSide(t, Config{Rails: 1})
	ep := open(t, init, targ, remote)
	e := ep.(*Endpoint)
	roundTrip(t, ep, init, remote, 4096)

	for round := range 3 {
		old := e.rails[0].Load()
		// The connection closed the round before leaves the target's set
		// on its own goroutine.
		waitFor(t, "the target to serve one connection", func() bool { return targ.serverConns() == 1 })
		targ.tr.mu.Lock()
		if len(targ.tr.conns) != 1 {
			t.Fatalf("the target serves %d connections, want 1", len(targ.tr.conns))
		}
		for c := range targ.tr.conns {
			c.Close()
		}
		targ.tr.mu.Unlock()

		src := init.alloc(t, 4096, byte(round+1))
		comp := make(chanCompleter, 1)
		s := []transport.Slice{localSlice(transport.Write, src, remote.addr+8192, 0)}
		deadline := time.Now().Add(hang)
		for tries := 0; ; tries++ {
			if time.Now().After(deadline) {
				t.Fatalf("hang: no Post succeeded after the connection was killed (%d tries)", tries)
			}
			s[0].Token++
			k, err := ep.Post(comp, s)
			if k == 0 {
				if !errors.Is(err, transport.ErrPeer) {
					t.Fatalf("Post while the rail is down: %d, %v; want ErrPeer", k, err)
				}
				time.Sleep(time.Millisecond)
				continue
			}
			err = comp.await(t, 1)[s[0].Token]
			if err == nil {
				break
			}
			if !errors.Is(err, transport.ErrPeer) {
				t.Fatalf("slice on the dropped connection: %v, want ErrPeer", err)
			}
		}
		if e.rails[0].Load() == old {
			t.Fatal("the WRITE succeeded on the connection the target dropped")
		}
		if i := testpattern.FirstDiff(remote.mem[8192:8192+4096], src); i >= 0 {
			t.Fatalf("round %d: target memory differs at %d after the WRITE", round, i)
		}
	}
}

// TestEndpointCloseUnreachable: Endpoint.Close returns while its rails
// cannot reach the peer, whether the peer refuses connections or accepts
// them and never answers the hello (Config.DialTimeout is far longer than
// the hang detector, so only a dial that honours Close passes).
func TestEndpointCloseUnreachable(t *testing.T) {
	for _, blackhole := range []bool{false, true} {
		name := "refused"
		if blackhole {
			name = "black hole"
		}
		t.Run(name, func(t *testing.T) {
			targ := newSide(t, Config{})
			remote := targ.register(t, targ.alloc(t, page, 0), true)
			px := newProxy(t, targ.tr.Addr())
			init := newSide(t, Config{Rails: 2, DialTimeout: time.Hour})
			ep, err := init.tr.Open(context.Background(), targ.desc(px.addr(), remote))
			if err != nil {
				t.Fatal(err)
			}
			e := ep.(*Endpoint)
			waitFor(t, "both rails up", func() bool { return railsUp(e) })
			if blackhole {
				px.blackhole.Store(true)
				px.kill()
				waitFor(t, "both rails to redial into the black hole", func() bool { return px.holes.Load() >= 2 })
			} else {
				targ.tr.Close()
				waitFor(t, "both rails down", func() bool { return e.rail(0) == nil })
			}
			comp := make(chanCompleter, 1)
			if k, err := ep.Post(comp, []transport.Slice{localSlice(transport.Read, make([]byte, 8), remote.addr, 1)}); k != 0 || !errors.Is(err, transport.ErrPeer) {
				t.Errorf("Post with no rail up: %d, %v; want 0, ErrPeer", k, err)
			}
			inTime(t, "Endpoint.Close", func() { ep.Close() })
		})
	}
}

// TestKickWriteRefused: when the socket refuses a poller's write before
// writing anything (closed under it, or a write deadline passed), kick
// must not count bytes from an earlier write as written. A past write
// deadline makes the refusal deterministic; the rail then fails, the slice
// completes with ErrPeer, and the rail is redialed.
func TestKickWriteRefused(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 64<<10, 0), true)
	init := newSide(t, Config{Rails: 1})
	ep := open(t, init, targ, remote)
	e := ep.(*Endpoint)
	roundTrip(t, ep, init, remote, 4096) // the poller's last write: a 4 KiB frame

	c := e.rails[0].Load()
	c.nc.SetWriteDeadline(time.Unix(1, 0))
	comp := make(chanCompleter, 1)
	s := []transport.Slice{localSlice(transport.Read, init.alloc(t, 8, 0), remote.addr, 7)}
	if k, err := ep.Post(comp, s); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	if err := comp.await(t, 1)[7]; !errors.Is(err, transport.ErrPeer) {
		t.Fatalf("slice on a rail whose writes fail: %v, want ErrPeer", err)
	}
	waitFor(t, "the rail redialed", func() bool { return railsUp(e) && e.rails[0].Load() != c })
	roundTrip(t, ep, init, remote, 4096)
}
