package nvlink

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// peer is another target process on the fake driver: a transport with
// one exported buffer of GPU 0, as a restarted target publishes it.
type peer struct {
	tr   *Transport
	mem  []byte
	bufs *segtable.Buffers
	b    *segtable.Buffer
	reg  segtable.Registration
}

func newPeer(t *testing.T, fake *fakeDriver, n int) *peer {
	t.Helper()
	pr := &peer{bufs: new(segtable.Buffers)}
	var err error
	if pr.tr, err = newTransport(Config{}, fake); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pr.close)
	if pr.mem, err = pr.tr.Alloc(n, 0); err != nil {
		t.Fatal(err)
	}
	if pr.b, err = pr.bufs.Register(pr.mem, segtable.CUDA(0), true); err != nil {
		t.Fatal(err)
	}
	if pr.reg, err = pr.tr.Register(pr.b); err != nil {
		t.Fatal(err)
	}
	return pr
}

// close ends the peer, as its process exits. Idempotent.
func (pr *peer) close() {
	if pr.b != nil {
		pr.bufs.Unregister(context.Background(), pr.b.ID)
	}
	pr.tr.Close()
}

func (pr *peer) desc() *segtable.SegmentDesc {
	return &segtable.SegmentDesc{Version: 1, Name: "target", Epoch: 2, Endpoints: map[string]string{Name: pr.tr.Endpoint()},
		Buffers: []segtable.BufferDesc{{Addr: uint64(pr.b.Addr), Length: pr.b.Length, Keys: map[string]string{Name: pr.reg.Key}}}}
}

// openIPC returns how many IPC mappings the fake has open.
func openIPC(f *fakeDriver) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.opens - f.closes
}

// mappings returns how many times the grant table at path is mapped into
// this process: once by its target while it lives, once per initiator
// transport's endpoint that reaches it. It skips the test where
// /proc/self/maps cannot be read.
func mappings(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	return strings.Count(string(b), path)
}

// write copies lmem[0:64] to the remote address and returns the copy's
// result.
func write(t *testing.T, tr *Transport, ep *Endpoint, lmem []byte, lreg segtable.Registration, remote uint64, tok uint64) error {
	t.Helper()
	r := newRecorder()
	if n, err := ep.Post(r, []transport.Slice{{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: remote, Length: 64, Token: tok}}); n != 1 || err != nil {
		t.Fatalf("Post = %d, %v", n, err)
	}
	pollUntil(t, tr, r, 1)
	return r.result(t, tok)
}

// A peer that restarts again and again must not make the endpoint hold
// more mappings and tables: only what the current descriptor needs.
func TestUpdateRestartsBounded(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	_, _, _, lmem, lreg, ep := p.target(4096)
	var prev *peer
	prevTab := ""
	for i := 0; i < 20; i++ {
		pr := newPeer(t, fake, 4096)
		ep.Update(pr.desc())
		if prev != nil {
			prev.close() // the old process is gone
		}
		lmem[0] = byte(i + 1)
		if err := write(t, p.init, ep, lmem, lreg, uint64(pr.b.Addr), uint64(i+1)); err != nil || pr.mem[0] != byte(i+1) {
			t.Fatalf("restart %d: WRITE to the new peer: %v (byte %#x)", i, err, pr.mem[0])
		}
		if n := openIPC(fake); n != 1 {
			t.Fatalf("restart %d: %d IPC mappings open, want 1 (the current peer's buffer)", i, n)
		}
		if prev != nil && mappings(t, prevTab) != 0 {
			t.Fatalf("restart %d: the old peer's grant table %s is still mapped", i, prevTab)
		}
		if n := p.init.retiring.Load(); n != 0 {
			t.Fatalf("restart %d: %d replaced views not dropped with no copy in flight", i, n)
		}
		prev, prevTab = pr, pr.tr.tab.path
	}
	ep.Close()
	if n := openIPC(fake); n != 0 {
		t.Errorf("%d IPC mappings open after Close", n)
	}
	prev.close()
	if n := mappings(t, prevTab); n != 0 {
		t.Errorf("the peer's grant table is mapped %d times after Close", n)
	}
}

// A copy to the old peer posted before the Update keeps its mapping and
// grant table until it completed; then the next Poll drops them.
func TestUpdateKeepsMappingInFlight(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	tmem, tb, _, lmem, lreg, ep := p.target(1 << 16)
	oldTab := p.targ.tab.path
	for i := range lmem {
		lmem[i] = 0x5a
	}
	r := newRecorder()
	// The fake runs queued copies only when their event is queried:
	// nothing runs until the Poll below.
	ep.Post(r, []transport.Slice{{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 1 << 16, Token: 1}})
	pr := newPeer(t, fake, 4096)
	ep.Update(pr.desc())
	ep.Update(pr.desc()) // an Update with the copy still in flight drops nothing of it either
	if n := openIPC(fake); n != 2 {
		t.Fatalf("%d IPC mappings open with a copy to the old peer in flight, want 2", n)
	}
	if n := mappings(t, oldTab); n != 2 {
		t.Fatalf("the old peer's grant table is mapped %d times with a copy in flight, want 2 (the target's and the endpoint's)", n)
	}
	if p.init.retiring.Load() == 0 {
		t.Fatalf("nothing retired")
	}
	pollUntil(t, p.init, r, 1)
	if err := r.result(t, 1); err != nil {
		t.Fatalf("the copy to the old peer: %v", err)
	}
	if tmem[0] != 0x5a || tmem[len(tmem)-1] != 0x5a {
		t.Fatalf("the copy to the old peer did not land")
	}
	if n := openIPC(fake); n != 1 {
		t.Errorf("%d IPC mappings open after the copy completed, want 1", n)
	}
	if n := mappings(t, oldTab); n != 1 {
		t.Errorf("the old peer's grant table is mapped %d times after the copy completed, want 1 (the target's own)", n)
	}
	if n := p.init.retiring.Load(); n != 0 {
		t.Errorf("%d replaced views left after the copy completed", n)
	}
	if err := write(t, p.init, ep, lmem, lreg, uint64(pr.b.Addr), 2); err != nil || pr.mem[0] != 0x5a {
		t.Errorf("WRITE to the new peer: %v", err)
	}
}

// A buffer the new descriptor no longer lists loses its mapping; the
// others keep theirs.
func TestUpdateDropsRemovedBuffer(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	var bs [2]*segtable.Buffer
	var regs [2]segtable.Registration
	for i := range bs {
		mem, err := p.targ.Alloc(4096, 0)
		if err != nil {
			t.Fatal(err)
		}
		bs[i], regs[i] = p.register(p.targ, &p.tbufs, mem, segtable.CUDA(0), true)
	}
	lmem, err := p.init.Alloc(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, lreg := p.register(p.init, &p.ibufs, lmem, segtable.CUDA(0), false)
	ep := p.open(p.desc(map[*segtable.Buffer]segtable.Registration{bs[0]: regs[0], bs[1]: regs[1]}))
	defer ep.Close()
	if n := openIPC(fake); n != 2 {
		t.Fatalf("%d IPC mappings for two allocations, want 2", n)
	}
	ep.Update(p.desc(map[*segtable.Buffer]segtable.Registration{bs[0]: regs[0]}))
	if n := openIPC(fake); n != 1 {
		t.Errorf("%d IPC mappings after one of two buffers left the descriptor, want 1", n)
	}
	if err := write(t, p.init, ep, lmem, lreg, uint64(bs[0].Addr), 1); err != nil {
		t.Errorf("WRITE to the buffer kept: %v", err)
	}
	if err := write(t, p.init, ep, lmem, lreg, uint64(bs[1].Addr), 2); !errors.Is(err, transport.ErrRange) {
		t.Errorf("WRITE to the buffer removed: %v, want ErrRange", err)
	}
}

// Posts and polls racing Updates that swap peers: no copy may run on a
// dropped mapping (the fake fails it) or count on an unmapped table (a
// fault), and in the end only the current peer's mapping is open.
func TestUpdateRacesPost(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{Depth: 16})
	_, tb, treg, lmem, lreg, ep := p.target(4096)
	pr := newPeer(t, fake, 4096)
	da, db := p.desc(map[*segtable.Buffer]segtable.Registration{tb: treg}), pr.desc()
	r := newRecorder()
	var posted atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			addrs := [2]uint64{uint64(tb.Addr), uint64(pr.b.Addr)}
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				tok := uint64(posted.Add(1))
				sl := []transport.Slice{{Op: transport.Op(1 + i%2), LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[g*64]), Remote: addrs[i%2] + uint64(g*64), Length: 64, Token: tok}}
				for {
					n, err := ep.Post(r, sl)
					if err != nil {
						t.Error(err)
						return
					}
					if n == 1 {
						break
					}
					p.init.Poll()
				}
				p.init.Poll()
			}
		}()
	}
	deadline := time.Now().Add(time.Minute)
	for i := 0; i < 200 && time.Now().Before(deadline); i++ {
		if i%2 == 0 {
			ep.Update(db)
		} else {
			ep.Update(da)
		}
		time.Sleep(100 * time.Microsecond)
	}
	close(stop)
	wg.Wait()
	pollUntil(t, p.init, r, posted.Load())
	r.mu.Lock()
	for tok, errs := range r.got {
		for _, err := range errs {
			if err != nil && !errors.Is(err, transport.ErrRange) {
				t.Errorf("token %d: %v, want nil or ErrRange (the other peer's address)", tok, err)
			}
		}
		if len(errs) != 1 {
			t.Errorf("token %d completed %d times", tok, len(errs))
		}
	}
	r.mu.Unlock()
	if n := openIPC(fake); n != 1 {
		t.Errorf("%d IPC mappings open after the last Poll, want 1", n)
	}
	if n := p.init.retiring.Load(); n != 0 {
		t.Errorf("%d replaced views left after the last Poll", n)
	}
}

// TestUnregisterTwice: of two Unregisters of one exported buffer, the
// second is refused rather than free its grant slot a second time (two
// later exports then shared the slot, each revoking the other), and an
// Unregister after Close returns at once instead of reading the unmapped
// grant table.
func TestUnregisterTwice(t *testing.T) {
	fake := newFake(1)
	pr := newPeer(t, fake, 1<<20)
	free := len(pr.tr.slots)
	if err := pr.tr.Unregister(pr.b, pr.reg); err != nil {
		t.Fatal(err)
	}
	if err := pr.tr.Unregister(pr.b, pr.reg); !errors.Is(err, segtable.ErrNotFound) {
		t.Fatalf("a second Unregister: %v; want ErrNotFound", err)
	}
	if got := len(pr.tr.slots); got != free+1 {
		t.Fatalf("%d free slots after one export went, %d before: want one more", got, free)
	}
	first := pr.b
	pr.bufs.Unregister(context.Background(), first.ID)
	pr.b = nil
	// A fresh export, unregistered while another Unregister of it runs:
	// exactly one succeeds.
	b, err := pr.bufs.Register(pr.mem[:4096], segtable.CUDA(0), true)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := pr.tr.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	free = len(pr.tr.slots)
	var wg sync.WaitGroup
	var ok atomic.Int32
	for range 2 {
		wg.Go(func() {
			if pr.tr.Unregister(b, reg) == nil {
				ok.Add(1)
			}
		})
	}
	wg.Wait()
	if ok.Load() != 1 || len(pr.tr.slots) != free+1 {
		t.Fatalf("two concurrent Unregisters: %d succeeded, %d slots freed; want 1 and 1", ok.Load(), len(pr.tr.slots)-free)
	}
	pr.bufs.Unregister(context.Background(), b.ID)
	pr.tr.Close()
	if err := pr.tr.Unregister(first, pr.reg); err != nil {
		t.Fatalf("Unregister after Close: %v", err)
	}
}
