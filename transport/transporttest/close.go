// close.go holds the subtests of closing: posts after an endpoint, the
// initiator or the target closed, each of them closed with slices in
// flight, and a target buffer unregistered while an endpoint is open; none
// may strand a slice or move bytes after the close.

package transporttest

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// closedOK checks the outcome of posting s after something closed: Post
// may refuse it with an error, or accept it and complete it with one; either
// way nothing may move. Only the bytes s addresses (and a margin) are
// compared: over a network, slices accepted before the Close may still land
// elsewhere in the target's memory, which the suite must not read while the
// target writes it.
func (f *fixture) closedOK(ep transport.Endpoint, c *collector, what string, s transport.Slice) {
	f.t.Helper()
	tw := window(f.tarena, uintptr(s.Remote), s.Length)
	iw := window(f.iarena, uintptr(s.Local), s.Length)
	wantT := slices.Clone(tw)
	wantI := slices.Clone(iw)
	if err := f.runOne(ep, c, s); err == nil {
		f.t.Errorf("%s: slice succeeded; want an error", what)
	}
	expectArena(f.t, what+": target", tw, wantT)
	expectArena(f.t, what+": initiator", iw, wantI)
}

// window returns the part of arena that [addr, addr+n) touches, widened by
// 64 bytes on each side and clipped to the arena.
func window(arena []byte, addr uintptr, n uint64) []byte {
	base := uintptr(unsafe.Pointer(unsafe.SliceData(arena)))
	lo := int(addr-base) - 64
	hi := int(addr-base) + int(n) + 64
	return arena[max(lo, 0):min(max(hi, 0), len(arena))]
}

func testPostAfterEndpointClose(t *testing.T, su suite) {
	f := newFixture(t, su)
	ep := f.open(f.desc)
	other := f.open(f.desc)
	c := newCollector()
	testpattern.Fill(f.iarena[page:page+4096], 1)
	if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.a.Addr), 4096, 0)); err != nil {
		t.Fatalf("WRITE before Close: %v", err)
	}
	if err := ep.Close(); err != nil {
		t.Fatalf("endpoint Close: %v", err)
	}
	for _, op := range []transport.Op{transport.Read, transport.Write} {
		f.closedOK(ep, c, fmt.Sprintf("%s after endpoint Close", opName(op)), f.slice(op, 0, uint64(f.a.Addr)+8192, 4096, 0))
	}
	// Closing one endpoint leaves the others alone.
	if err := f.runOne(other, c, f.slice(transport.Write, 0, uint64(f.a.Addr)+8192, 4096, 0)); err != nil {
		t.Errorf("WRITE through another endpoint after one closed: %v", err)
	}
	c.check(t, nil)
}

func testPostAfterTransportClose(t *testing.T, su suite, initiator bool) {
	f := newFixture(t, su)
	ep := f.open(f.desc)
	c := newCollector()
	if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.a.Addr), 64, 0)); err != nil {
		t.Fatalf("WRITE before Close: %v", err)
	}
	who := "target"
	if initiator {
		who = "initiator"
		f.init.close(t)
	} else {
		f.targ.close(t)
	}
	for _, op := range []transport.Op{transport.Read, transport.Write} {
		f.closedOK(ep, c, fmt.Sprintf("%s after %s Close", opName(op), who), f.slice(op, 0, uint64(f.a.Addr)+128, 64, 0))
	}
	if initiator {
		ctx, cancel := context.WithTimeout(context.Background(), hang)
		defer cancel()
		if ep2, err := f.init.tr.Open(ctx, f.desc); err == nil {
			ep2.Close()
			t.Errorf("Open after the initiator's Close succeeded")
		}
	}
	c.check(t, nil)
}

const (
	closeEndpoint = iota
	closeInitiator
	closeTarget
)

func testCloseInFlight(t *testing.T, su suite, what int) {
	f := newFixture(t, su)
	const workers = 3
	c := newCollector()
	var mu sync.Mutex
	accepted := map[uint64]bool{}
	eps := make([]transport.Endpoint, workers)
	for i := range eps {
		eps[i] = f.open(f.desc)
	}
	var (
		wg      sync.WaitGroup
		started sync.WaitGroup
		stop    atomic.Bool
	)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		started.Add(1)
		go func() {
			defer wg.Done()
			ep := eps[w]
			first := true
			// Each of 16 regions (of L and of A) takes a new slice only
			// once its last one completed: slices in flight never share a
			// byte, so an asynchronous transport's copies do not race.
			var last [16]uint64
			var ks []int
			for i := 0; !stop.Load(); i++ {
				var s []transport.Slice
				ks = ks[:0]
				for k := range last {
					if last[k] != 0 && !c.completed(last[k]) {
						continue
					}
					off := uint64(w<<20 + k<<16)
					s = append(s, f.slice(transport.Op(1+(i+k)%2), off, uint64(f.a.Addr)+off, 1+uint64(i*k%4096), k%ep.Rails()))
					ks = append(ks, k)
				}
				if len(s) == 0 {
					runtime.Gosched()
					continue
				}
				n, err := ep.Post(c, s)
				mu.Lock()
				for j, x := range s[:n] {
					accepted[x.Token] = true
					last[ks[j]] = x.Token
				}
				mu.Unlock()
				if first {
					first = false
					started.Done()
				}
				if err != nil {
					return // the endpoint cannot take slices any more
				}
				if n < len(s) {
					runtime.Gosched()
				}
			}
		}()
	}
	started.Wait()
	time.Sleep(time.Millisecond) // let the posting overlap Close; not a timing assertion
	switch what {
	case closeEndpoint:
		for _, ep := range eps {
			if err := ep.Close(); err != nil {
				t.Errorf("endpoint Close: %v", err)
			}
		}
	case closeInitiator:
		f.init.close(t)
	case closeTarget:
		f.targ.close(t)
	}
	// Posting goes on for a while after Close, then stops.
	time.Sleep(time.Millisecond)
	stop.Store(true)
	wg.Wait()
	mu.Lock()
	all := make([]transport.Slice, 0, len(accepted))
	for tok := range accepted {
		all = append(all, transport.Slice{Token: tok})
	}
	mu.Unlock()
	c.wait(t, all)
	// No completion arrives twice or for a slice never accepted.
	c.check(t, accepted)
	// After Close every new slice fails.
	for w, ep := range eps {
		c2 := newCollector()
		f.closedOK(ep, c2, fmt.Sprintf("WRITE on endpoint %d after Close", w), f.slice(transport.Write, 0, uint64(f.c.Addr), 8, 0))
	}
	if len(accepted) == 0 {
		t.Fatalf("no slice was accepted before Close: the test proved nothing")
	}
}

func testUnregisterTarget(t *testing.T, su suite) {
	f := newFixture(t, su)
	ep := f.open(f.desc)
	c := newCollector()
	testpattern.Fill(f.iarena[page:page+4096], 3)
	if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.c.Addr), 4096, 0)); err != nil {
		t.Fatalf("WRITE to C before Unregister: %v", err)
	}
	if err := f.targ.tr.Unregister(f.c, f.targ.regs[f.c]); err != nil {
		t.Fatalf("target Unregister(C): %v", err)
	}
	for _, op := range []transport.Op{transport.Read, transport.Write} {
		f.closedOK(ep, c, fmt.Sprintf("%s to C after the target unregistered it", opName(op)), f.slice(op, 0, uint64(f.c.Addr)+5, 100, 0))
	}
	// The other buffers are untouched by C's unregistration.
	if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.b.Addr), 4096, 0)); err != nil {
		t.Errorf("WRITE to B after C was unregistered: %v", err)
	}
	c.check(t, nil)
}
