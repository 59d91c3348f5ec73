//go:build efa && cgo

package efa_test

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// newTarget makes a transport on prov with one registered
// remote-accessible buffer of 1 MiB, and the descriptor that publishes it.
func newTarget(t *testing.T, prov string, cfg efa.Config) (*efa.Transport, []byte, *segtable.SegmentDesc) {
	t.Helper()
	tr := newEFA(t, cfg)
	t.Cleanup(func() { tr.Close() })
	mem := make([]byte, 1<<20)
	var bufs segtable.Buffers
	b, err := bufs.Register(mem, "", true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bufs.Unregister(context.Background(), b.ID) })
	reg, err := tr.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "target", Epoch: 1,
		Endpoints: map[string]string{efa.Name: tr.Endpoint()},
		Buffers:   []segtable.BufferDesc{{Addr: uint64(b.Addr), Length: b.Length, Keys: map[string]string{efa.Name: reg.Key}}}}
	return tr, mem, desc
}

// open opens an endpoint of p's initiator to desc.
func (p *pair) open(t *testing.T, desc *segtable.SegmentDesc) transport.Endpoint {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ep, err := p.init.Open(ctx, desc)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return ep
}

// writeCheck WRITEs 4 KiB of a pattern of seed through ep to the start of
// desc's buffer, and checks that it landed in mem.
func (p *pair) writeCheck(t *testing.T, ep transport.Endpoint, desc *segtable.SegmentDesc, mem []byte, seed uint64) {
	t.Helper()
	testpattern.Fill(p.lmem[:4096], seed)
	s := p.slice(transport.Write, 4096)
	s.Remote = desc.Buffers[0].Addr
	w := newWaiter()
	postAll(t, ep, w, []transport.Slice{s})
	if err := w.wait(t, []transport.Slice{s}, 30*time.Second)[0]; err != nil {
		t.Fatalf("WRITE: %v", err)
	}
	if !bytes.Equal(mem[:4096], p.lmem[:4096]) {
		t.Fatalf("WRITE: the target holds other bytes")
	}
}

// waitPeers waits up to limit for tr to hold want peers.
func waitPeers(t *testing.T, tr *efa.Transport, want int, limit time.Duration) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for efa.PeerCount(tr) != want {
		if time.Now().After(deadline) {
			t.Fatalf("the transport holds %d peers after %v; want %d", efa.PeerCount(tr), limit, want)
		}
		time.Sleep(time.Millisecond)
	}
}

// Endpoints to one target share its peer; the peer, and its address in
// the address vector, go when the last of them closes, and come back with
// the next Open.
func TestPeersDropOnClose(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	if n := efa.PeerCount(p.init); n != 1 {
		t.Fatalf("one endpoint open: %d peers; want 1", n)
	}
	var eps []transport.Endpoint
	for i := 0; i < 8; i++ {
		eps = append(eps, p.open(t, p.desc))
	}
	if n := efa.PeerCount(p.init); n != 1 {
		t.Fatalf("9 endpoints to one target: %d peers; want 1", n)
	}
	p.ep.Close()
	for _, ep := range eps[1:] {
		ep.Close()
	}
	if n := efa.PeerCount(p.init); n != 1 {
		t.Fatalf("one endpoint still open: %d peers; want 1", n)
	}
	p.writeCheck(t, eps[0], p.desc, p.tmem, 1)
	eps[0].Close()
	if n := efa.PeerCount(p.init); n != 0 {
		t.Fatalf("every endpoint closed: %d peers; want 0", n)
	}
	// Open and close many times, each time with a new target too: the
	// address vector reuses the removed entries, and the data still goes
	// where it should.
	addrs := map[uint64]bool{}
	for i := 0; i < 20; i++ {
		ep := p.open(t, p.desc)
		p.writeCheck(t, ep, p.desc, p.tmem, uint64(i)+10)
		_, mem, desc := newTarget(t, "tcp", testConfig("tcp"))
		ep2 := p.open(t, desc)
		p.writeCheck(t, ep2, desc, mem, uint64(i)+100)
		if n := efa.PeerCount(p.init); n != 2 {
			t.Fatalf("round %d: %d peers with two endpoints to two targets open; want 2", i, n)
		}
		addrs[efa.PeerAddr(ep)], addrs[efa.PeerAddr(ep2)] = true, true
		ep.Close()
		ep2.Close()
		if n := efa.PeerCount(p.init); n != 0 {
			t.Fatalf("round %d: %d peers after every endpoint closed; want 0", i, n)
		}
	}
	t.Logf("21 targets over 20 rounds took %d fi_addr values", len(addrs))
}

// Update with a restarted peer's new address replaces the peer: the old
// one goes, however often the peer restarts.
func TestPeersDropOnUpdate(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	old := p.targ
	addrs := map[uint64]bool{efa.PeerAddr(p.ep): true}
	for i := 0; i < 16; i++ {
		tr, mem, desc := newTarget(t, "tcp", testConfig("tcp")) // the peer, restarted
		old.Close()
		old = tr
		p.ep.Update(desc)
		if n := efa.PeerCount(p.init); n != 1 {
			t.Fatalf("restart %d: %d peers; want 1", i, n)
		}
		addrs[efa.PeerAddr(p.ep)] = true
		p.writeCheck(t, p.ep, desc, mem, uint64(i)+1)
	}
	t.Logf("17 addresses took %d fi_addr values", len(addrs))
	p.ep.Close()
	if n := efa.PeerCount(p.init); n != 0 {
		t.Fatalf("the endpoint closed: %d peers; want 0", n)
	}
}

// A peer whose operations the provider still holds keeps its address in
// the address vector after its last endpoint closed (the operations were
// failed with ErrClosed, but the provider returns them only later): else a
// new peer could take its fi_addr under them. It goes when they return.
func TestPeerKeptWhileInFlight(t *testing.T) {
	icfg := testConfig("tcp")
	icfg.Linger = 100 * time.Millisecond
	p := newPair(t, "tcp", icfg, testConfig("tcp"))
	p.targ.StopProgress() // the target moves nothing until it polls
	w := newWaiter()
	var s []transport.Slice
	for i := 0; i < 8; i++ {
		s = append(s, p.slice(transport.Write, 256<<10))
	}
	postAll(t, p.ep, w, s)
	p.ep.Close()
	closed := 0
	for _, err := range w.wait(t, s, 10*time.Second) {
		if errors.Is(err, transport.ErrClosed) {
			closed++
		}
	}
	if closed == 0 {
		t.Fatalf("every WRITE to a target that does not poll completed before Close: the test proved nothing")
	}
	if n := efa.PeerCount(p.init); n != 1 {
		t.Fatalf("%d WRITEs still with the provider: %d peers; want 1", closed, n)
	}
	// Another target meanwhile works.
	_, mem, desc := newTarget(t, "tcp", testConfig("tcp"))
	ep := p.open(t, desc)
	defer ep.Close()
	if a, b := efa.PeerAddr(ep), efa.PeerAddr(p.ep); a == b {
		t.Fatalf("the new peer took fi_addr %d of the peer with operations in flight", a)
	}
	p.writeCheck(t, ep, desc, mem, 1)
	if n := efa.PeerCount(p.init); n != 2 {
		t.Fatalf("%d peers; want 2", n)
	}
	// The old target polls again: its WRITEs complete, and the peer goes.
	deadline := time.Now().Add(20 * time.Second)
	for efa.PeerCount(p.init) != 1 && time.Now().Before(deadline) {
		if p.targ.Poll() == 0 {
			time.Sleep(20 * time.Microsecond)
		}
	}
	waitPeers(t, p.init, 1, time.Millisecond)
	p.writeCheck(t, ep, desc, mem, 2)
	t.Logf("%d WRITEs failed by Close; their peer went once they returned", closed)
}

// Posts, Updates between three targets, and Opens and Closes of other
// endpoints, all at once: every slice completes once, and when every
// endpoint closed no peer is left.
func TestPeersConcurrent(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	_, _, d1 := newTarget(t, "tcp", testConfig("tcp"))
	_, _, d2 := newTarget(t, "tcp", testConfig("tcp"))
	descs := []*segtable.SegmentDesc{p.desc, d1, d2}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			p.ep.Update(descs[i%3])
			time.Sleep(100 * time.Microsecond)
		}
	})
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			ep, err := p.init.Open(ctx, descs[i%3])
			cancel()
			if err != nil {
				t.Errorf("Open: %v", err)
				return
			}
			ep.Close()
		}
	})
	w := newWaiter()
	var all []transport.Slice
	for i := 0; i < 1000; i++ {
		// Whichever target the endpoint has now: the others' buffers
		// fail with ErrRange, a key the peer does not know with ErrPeer.
		var s []transport.Slice
		for j := range descs {
			sl := p.slice(transport.Write, 4096)
			sl.Remote = descs[j].Buffers[0].Addr
			s = append(s, sl)
		}
		postAll(t, p.ep, w, s)
		all = append(all, s...)
	}
	ok := 0
	for _, err := range w.wait(t, all, 60*time.Second) {
		if err == nil {
			ok++
		}
	}
	close(stop)
	wg.Wait()
	t.Logf("%d of %d WRITEs landed", ok, len(all))
	p.ep.Close()
	waitPeers(t, p.init, 0, 10*time.Second)
	// Transfers still work.
	_, mem, desc := newTarget(t, "tcp", testConfig("tcp"))
	ep := p.open(t, desc)
	defer ep.Close()
	p.writeCheck(t, ep, desc, mem, 7)
}

// Resets of a peer's address while slices are posted to it, from several
// goroutines: a post never names an address that has left the vector
// (tcp;ofi_rxm dereferences a NULL peer then, and the process dies), and
// every slice completes once.
func TestResetWhilePosting(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	resets := 0
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			efa.ResetPeer(p.ep)
			resets++
			runtime.Gosched()
		}
	})
	w := newWaiter()
	var all []transport.Slice
	var pmu sync.Mutex
	for g := 0; g < 4; g++ {
		wg.Go(func() {
			for i := 0; i < 500; i++ {
				s := []transport.Slice{p.slice(transport.Write, 4096), p.slice(transport.Read, 4096)}
				s[1].Local = unsafe.Add(s[1].Local, 8192)
				postAll(t, p.ep, w, s)
				pmu.Lock()
				all = append(all, s...)
				pmu.Unlock()
			}
		})
	}
	// Wait for the posters (the reset loop runs until stop).
	for {
		pmu.Lock()
		n := len(all)
		pmu.Unlock()
		if n == 4*500*2 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	errs := w.wait(t, all, 60*time.Second)
	close(stop)
	wg.Wait()
	ok := 0
	for _, err := range errs {
		switch {
		case err == nil:
			ok++
		case !errors.Is(err, transport.ErrPeer):
			t.Errorf("slice failed with %v; want nil or ErrPeer", err)
		}
	}
	t.Logf("%d resets; %d of %d slices moved", resets, ok, len(all))
	if resets == 0 {
		t.Fatalf("no reset ran while the slices were in flight: the test proved nothing")
	}
	p.writeCheck(t, p.ep, p.desc, p.tmem, 3)
}

// Endpoint.Close while other goroutines post to the endpoint, with a
// Linger too short for the WRITEs in flight (the target does not poll):
// every slice that Post took completes once, with nil or ErrClosed, and
// the slots all come back.
func TestCloseWhilePosting(t *testing.T) {
	icfg := testConfig("tcp")
	icfg.Linger = time.Millisecond
	icfg.Depth = 256
	p := newPair(t, "tcp", icfg, testConfig("tcp"))
	p.targ.StopProgress()
	for round := 0; round < 20; round++ {
		// The target polls only while the endpoint opens (the probe).
		opened := make(chan struct{})
		go func() {
			for {
				select {
				case <-opened:
					return
				default:
					p.targ.Poll()
				}
			}
		}()
		ep := p.open(t, p.desc)
		close(opened)
		w := newWaiter()
		var mu sync.Mutex
		var taken []transport.Slice
		var wg sync.WaitGroup
		for g := 0; g < 3; g++ {
			wg.Go(func() {
				for i := 0; i < 200; i++ {
					s := []transport.Slice{p.slice(transport.Write, 4096)}
					n, err := ep.Post(w, s)
					if err != nil {
						if !errors.Is(err, transport.ErrClosed) {
							t.Errorf("Post: %v", err)
						}
						return
					}
					if n == 1 {
						mu.Lock()
						taken = append(taken, s[0])
						mu.Unlock()
					}
				}
			})
		}
		time.Sleep(time.Duration(round%5) * 100 * time.Microsecond)
		ep.Close()
		wg.Wait()
		// The target polls again so that the provider returns what it holds.
		deadline := time.Now().Add(20 * time.Second)
		for efa.SlotsFree(p.init) != icfg.Depth && time.Now().Before(deadline) {
			if p.targ.Poll() == 0 {
				time.Sleep(20 * time.Microsecond)
			}
		}
		for _, err := range w.wait(t, taken, 20*time.Second) {
			if err != nil && !errors.Is(err, transport.ErrClosed) {
				t.Fatalf("round %d: slice failed with %v; want nil or ErrClosed", round, err)
			}
		}
		if n := efa.SlotsFree(p.init); n != icfg.Depth {
			t.Fatalf("round %d: %d of %d slots free after every slice returned", round, n, icfg.Depth)
		}
	}
}

// A peer whose address could not be inserted again after a reset is gone:
// Post fails with ErrPeer (it never names the removed address), and an
// Update of the endpoint, even with the same descriptor, inserts the
// address afresh and transfers work again.
func TestLostPeerBackOnUpdate(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	p.writeCheck(t, p.ep, p.desc, p.tmem, 1)
	efa.LosePeer(p.ep)
	if n, err := p.ep.Post(newWaiter(), []transport.Slice{p.slice(transport.Write, 4096)}); n != 0 || !errors.Is(err, transport.ErrPeer) {
		t.Fatalf("Post to a lost peer: %d, %v; want 0 and ErrPeer", n, err)
	}
	if n := efa.PeerCount(p.init); n != 0 {
		t.Fatalf("%d peers after the only one was lost; want 0", n)
	}
	p.ep.Update(p.desc)
	p.writeCheck(t, p.ep, p.desc, p.tmem, 2)
	if n := efa.PeerCount(p.init); n != 1 {
		t.Fatalf("%d peers after Update; want 1", n)
	}
}
