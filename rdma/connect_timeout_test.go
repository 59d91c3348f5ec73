//go:build rdma && cgo

package rdma

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// The connect tests' ConnectTimeout, and the most a connect may take past
// it here: a bound on a hang, generous for a slow emulated guest, not a
// measure of speed. The callers' contexts give an hour, and
// mooncake.RPCClient's own bound is 10 s: a connect that waited for either
// would fail it.
const (
	connTimeout = time.Second
	connSlack   = 5 * time.Second
)

// gatePeer stands between an initiator and a target's port: while silent
// it accepts connections and holds them without a byte (a target that took
// the handshake's connection and never answers); otherwise it relays them
// to the target.
type gatePeer struct {
	ln      net.Listener
	silent  atomic.Bool
	accepts atomic.Int32
}

func newGatePeer(t *testing.T, target string) *gatePeer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &gatePeer{ln: ln}
	var (
		mu   sync.Mutex
		held []net.Conn
		wg   sync.WaitGroup
	)
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range held {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.accepts.Add(1)
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
			if p.silent.Load() {
				continue // held until the test ends
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				s, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer s.Close()
				done := make(chan struct{})
				go func() {
					io.Copy(s, c)
					s.(*net.TCPConn).CloseWrite()
					close(done)
				}()
				io.Copy(c, s)
				c.(*net.TCPConn).CloseWrite()
				<-done
			}()
		}
	}()
	return p
}

// openBounded opens desc under a context of an hour and fails the test if
// Open takes more than ConnectTimeout and the slack.
func openBounded(t *testing.T, tr *Transport, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	start := time.Now()
	ep, err := tr.Open(ctx, desc)
	if d := time.Since(start); d > connTimeout+connSlack {
		t.Errorf("Open took %v; ConnectTimeout is %v", d, connTimeout)
	}
	return ep, err
}

// checkNoQPs fails the test if the initiator holds a queue pair or a
// reservation of one.
func checkNoQPs(t *testing.T, tr *Transport, when string) {
	t.Helper()
	tr.qpMu.Lock()
	n := len(tr.qps)
	tr.qpMu.Unlock()
	if q := tr.Stats().QPs; n != 0 || q != 0 {
		t.Errorf("%s: %d queue pairs, %d reserved; want none", when, n, q)
	}
}

// A Mooncake target that takes the handshake's connection and never
// answers: Open fails within ConnectTimeout, though its context allows an
// hour, with transport.ErrPeer, and leaves no queue pair behind. A rail's
// reconnect to it fails within ConnectTimeout too, and once the target
// answers again the rails reconnect and the bytes land.
func TestMooncakeConnectTimeout(t *testing.T) {
	rpc, err := mooncake.ListenRPC(mooncake.RPCConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rpc.Close() })
	targ := needDevice(t, Config{Mooncake: &MooncakeMode{Server: rpc.Name(), RPC: rpc.Name()}})
	rpc.SetHandshake(targ.MooncakeHandshake)
	init := needDevice(t, Config{QPsPerDevice: 2, ConnectTimeout: connTimeout,
		Mooncake: &MooncakeMode{Server: "initiator:1", RPC: "127.0.0.1:1"}})
	w := newWorldWith(t, init, targ, 1<<16, true)
	gate := newGatePeer(t, rpc.Name())
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: rpc.Name(),
		Endpoints: map[string]string{MooncakeName: gate.ln.Addr().String(),
			mooncake.EndpointRDMANICs: targ.ExtraEndpoints()[mooncake.EndpointRDMANICs]},
		Buffers: []segtable.BufferDesc{{Addr: uint64(w.r.Addr), Length: w.r.Length, Keys: map[string]string{MooncakeName: w.rreg.Key}}}}

	gate.silent.Store(true)
	ep, err := openBounded(t, init, desc)
	if err == nil {
		ep.Close()
		t.Fatal("Open against a target that never answers succeeded")
	}
	if !errors.Is(err, transport.ErrPeer) {
		t.Errorf("Open against a target that never answers: %v; want transport.ErrPeer", err)
	}
	if gate.accepts.Load() == 0 {
		t.Error("Open never reached the target")
	}
	if init.Stats().ConnectFailures == 0 {
		t.Error("Stats().ConnectFailures is 0 after a failed connect")
	}
	checkNoQPs(t, init, "after the failed Open")

	// The target answers: Open works.
	gate.silent.Store(false)
	ep, err = openBounded(t, init, desc)
	if err != nil {
		t.Fatalf("Open once the target answers: %v", err)
	}
	e := ep.(*Endpoint)
	c := newWaiter()
	write := func(tok uint64) {
		t.Helper()
		postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 4096, tok)})
		if err := c.wait(t, tok); err != nil {
			t.Fatalf("WRITE %d: %v", tok, err)
		}
	}
	write(1)

	// Silent again; rail 0's queue pair fails, and the next Post starts
	// its group's reconnect, which must end within ConnectTimeout.
	gate.silent.Store(true)
	before := gate.accepts.Load()
	e.postMu.Lock()
	e.rails[0].q.fail()
	e.postMu.Unlock()
	start := time.Now()
	n, err := postNoWait(t, ep, c, w.slice(transport.Write, 0, 4096, 2))
	if err != nil {
		t.Fatalf("Post as the rail starts reconnecting: %v", err)
	}
	waitFor(t, "the reconnect to the silent target to fail", func() bool {
		e.postMu.Lock()
		defer e.postMu.Unlock()
		return !e.rails[0].dialing && e.rails[0].connErr != nil
	})
	if d := time.Since(start); d > connTimeout+connSlack {
		t.Errorf("the reconnect took %v to fail; ConnectTimeout is %v", d, connTimeout)
	}
	if gate.accepts.Load() == before {
		t.Error("the reconnect never reached the target")
	}
	e.postMu.Lock()
	if err := e.rails[0].connErr; !errors.Is(err, transport.ErrPeer) {
		t.Errorf("the reconnect's error %v; want transport.ErrPeer", err)
	}
	e.postMu.Unlock()
	if n == 0 {
		postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 4096, 2)})
	}
	if err := c.wait(t, 2); err != nil {
		t.Fatalf("WRITE 2 (on another rail): %v", err)
	}

	// The target answers again: once the wait after the failure is over,
	// a Post reconnects the rail's group. The new set replaces its live
	// sibling's queue pair, whose WRITE in flight may fail (the engine
	// would retry it).
	gate.silent.Store(false)
	tok := uint64(100)
	waitFor(t, "every rail live again", func() bool {
		tok++
		postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 4096, tok)})
		if err := c.wait(t, tok); err != nil && !errors.Is(err, transport.ErrPeer) {
			t.Fatalf("WRITE %d as the rails reconnect: %v", tok, err)
		}
		e.postMu.Lock()
		defer e.postMu.Unlock()
		for _, r := range e.rails {
			if r.q == nil || r.q.state.Load() != qpLive {
				return false
			}
		}
		return true
	})
	write(tok + 1)
	ep.Close()
	checkNoQPs(t, init, "after Close")
}

// moonring's own handshake: a target that takes the control connection
// and never answers fails Open within ConnectTimeout, though the caller's
// context allows an hour, and leaves no queue pair behind; the real target
// is reached after.
func TestConnectTimeoutCallerDeadline(t *testing.T) {
	w := newWorld(t, Config{QPsPerDevice: 1, ConnectTimeout: connTimeout}, 1<<16)
	quiet := newQuietPeer(t, w)
	ep, err := openBounded(t, w.init, quiet.desc)
	if err == nil {
		ep.Close()
		t.Fatal("Open against a target that never answers succeeded")
	}
	if !errors.Is(err, transport.ErrPeer) {
		t.Errorf("Open against a target that never answers: %v; want transport.ErrPeer", err)
	}
	if quiet.accepts.Load() == 0 {
		t.Error("Open never reached the target")
	}
	checkNoQPs(t, w.init, "after the failed Open")
	ep, err = openBounded(t, w.init, w.desc)
	if err != nil {
		t.Fatalf("Open of the real target after: %v", err)
	}
	c := newWaiter()
	postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 4096, 1)})
	if err := c.wait(t, 1); err != nil {
		t.Fatal(err)
	}
	ep.Close()
	checkNoQPs(t, w.init, "after Close")
}
