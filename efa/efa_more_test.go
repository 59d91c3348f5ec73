//go:build efa && cgo

package efa_test

import (
	"context"
	"errors"
	"os/exec"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// pair is an initiator and a target in this process, each with a
// registered buffer, and an endpoint from the first to the second.
type pair struct {
	init, targ *efa.Transport
	lmem, tmem []byte
	lreg       segtable.Registration
	desc       *segtable.SegmentDesc
	ep         transport.Endpoint
}

func newPair(t *testing.T, prov string, icfg, tcfg efa.Config) *pair {
	t.Helper()
	p := &pair{init: newEFA(t, icfg), targ: newEFA(t, tcfg), lmem: make([]byte, 1<<20), tmem: make([]byte, 1<<20)}
	t.Cleanup(func() { p.init.Close(); p.targ.Close() })
	var lb, tb segtable.Buffers
	l, err := lb.Register(p.lmem, "", false)
	if err != nil {
		t.Fatal(err)
	}
	r, err := tb.Register(p.tmem, "", true)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		lb.Unregister(context.Background(), l.ID)
		tb.Unregister(context.Background(), r.ID)
	})
	if p.lreg, err = p.init.Register(l); err != nil {
		t.Fatal(err)
	}
	treg, err := p.targ.Register(r)
	if err != nil {
		t.Fatal(err)
	}
	p.desc = &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "target", Epoch: 1,
		Endpoints: map[string]string{efa.Name: p.targ.Endpoint()},
		Buffers:   []segtable.BufferDesc{{Addr: uint64(r.Addr), Length: r.Length, Keys: map[string]string{efa.Name: treg.Key}}}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if p.ep, err = p.init.Open(ctx, p.desc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.ep.Close() })
	return p
}

func (p *pair) slice(op transport.Op, n uint64) transport.Slice {
	return transport.Slice{Op: op, LocalHandle: p.lreg.Handle, Local: unsafe.Pointer(&p.lmem[0]),
		Remote: p.desc.Buffers[0].Addr, Length: n, Token: token()}
}

// A round of one 4 KiB WRITE, posted and polled as the engine does,
// allocates nothing.
func TestNoAllocs(t *testing.T) {
	cfg := testConfig("tcp")
	cfg.Progress = false
	p := newPair(t, "tcp", cfg, testConfig("tcp"))
	c := &benchCompleter{ready: make([]uint64, 0, 4)}
	s := []transport.Slice{p.slice(transport.Write, 4096)}
	round := func() {
		for {
			n, err := p.ep.Post(c, s)
			if err != nil {
				t.Fatal(err)
			}
			if n == 1 {
				break
			}
			p.init.Poll()
		}
		for {
			p.init.Poll()
			c.mu.Lock()
			k, err := len(c.ready), c.err
			c.ready = c.ready[:0]
			c.mu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			if k > 0 {
				return
			}
		}
	}
	round()
	if a := testing.AllocsPerRun(100, round); a != 0 {
		t.Errorf("a Post and Poll round allocates %v times", a)
	}
}

// Slices that cannot be valid complete at once with final errors; bad
// descriptors make Open fail without a panic.
func TestRefusals(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	w := newWaiter()
	bad := []struct {
		what string
		s    transport.Slice
		want error
	}{
		{"a notification", p.slice(transport.Notify, 8), transport.ErrDenied},
		{"an unknown op", p.slice(9, 8), transport.ErrRange},
		{"an unknown local handle", func() transport.Slice { s := p.slice(transport.Write, 8); s.LocalHandle = 999; return s }(), transport.ErrRange},
		{"a local range past its buffer", func() transport.Slice {
			s := p.slice(transport.Write, 8)
			s.Local = unsafe.Add(s.Local, len(p.lmem)-4)
			return s
		}(), transport.ErrRange},
		{"a zero length", p.slice(transport.Write, 0), transport.ErrRange},
	}
	for _, b := range bad {
		postAll(t, p.ep, w, []transport.Slice{b.s})
		if err := w.wait(t, []transport.Slice{b.s}, 10*time.Second)[0]; !errors.Is(err, b.want) {
			t.Errorf("%s: %v; want an error wrapping %v", b.what, err, b.want)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, ep := range []string{"", "fi1/shm/6100", "fi1/tcp;ofi_rxm/00", "fi1/tcp;ofi_rxm/zz", "tcp://127.0.0.1:1", "fi1/tcp;ofi_rxm/" + string(make([]byte, 600))} {
		d := *p.desc
		d.Endpoints = map[string]string{efa.Name: ep}
		if e, err := p.init.Open(ctx, &d); err == nil || !errors.Is(err, transport.ErrUnreachable) {
			if e != nil {
				e.Close()
			}
			t.Errorf("Open with endpoint %q: %v; want an error wrapping ErrUnreachable", ep, err)
		}
	}
}

// A target that stops polling (a software provider's target then moves
// nothing) makes slices fail with a retryable error within the timeout.
func TestTimeout(t *testing.T) {
	for _, prov := range []string{"tcp", "shm"} {
		t.Run(prov, func(t *testing.T) {
			icfg := testConfig(prov)
			icfg.Timeout = 500 * time.Millisecond
			p := newPair(t, prov, icfg, testConfig(prov))
			p.targ.StopProgress()
			w := newWaiter()
			var s []transport.Slice
			for i := 0; i < 8; i++ {
				s = append(s, p.slice(transport.Write, 256<<10))
			}
			start := time.Now()
			postAll(t, p.ep, w, s)
			errs := w.wait(t, s, 20*time.Second)
			failed := 0
			for _, err := range errs {
				if err != nil {
					failed++
					if !errors.Is(err, transport.ErrPeer) {
						t.Errorf("slice failed with %v; want an error wrapping ErrPeer", err)
					}
				}
			}
			if failed == 0 {
				t.Fatalf("every slice to a target that does not poll completed: the test proved nothing")
			}
			t.Logf("%d of %d slices failed after %v", failed, len(s), time.Since(start).Round(time.Millisecond))
		})
	}
}

// Update with the descriptor of a restarted peer (a new address, new
// keys) moves the endpoint's slices to it.
func TestUpdateRestartedPeer(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	q := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp")) // its target plays the restarted peer
	w := newWaiter()
	for i := range p.lmem[:4096] {
		p.lmem[i] = byte(i*13 + 1)
	}
	p.ep.Update(q.desc)
	s := p.slice(transport.Write, 4096)
	s.Remote = q.desc.Buffers[0].Addr
	postAll(t, p.ep, w, []transport.Slice{s})
	if err := w.wait(t, []transport.Slice{s}, 30*time.Second)[0]; err != nil {
		t.Fatalf("WRITE after Update: %v", err)
	}
	if string(q.tmem[:4096]) != string(p.lmem[:4096]) {
		t.Fatalf("WRITE after Update did not land in the new peer's buffer")
	}
	// The old peer's buffer is no longer in the endpoint's descriptor.
	s = p.slice(transport.Write, 16)
	postAll(t, p.ep, w, []transport.Slice{s})
	if err := w.wait(t, []transport.Slice{s}, 30*time.Second)[0]; !errors.Is(err, transport.ErrRange) {
		t.Fatalf("WRITE to the old peer's buffer after Update: %v; want ErrRange", err)
	}
}

// TestExpireSparesPostInProgress: the timeout scan does not take a slot
// that a Post has marked busy but not yet handed to the provider, or given
// back as not taken. It used to: the slice completed with a timeout while
// Post reported it not taken, so the caller posted it again.
func TestExpireSparesPostInProgress(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	free := efa.SlotsFree(p.init)
	w := newWaiter()
	release := efa.HoldGuard(p.init)
	undo := efa.PlantBusy(p.ep, w, 1)
	scanned := make(chan int, 1)
	go func() { scanned <- efa.ExpireAll(p.init) }()
	// The scan's chance to take the slot, were it not held off.
	time.Sleep(20 * time.Millisecond)
	undo()
	release()
	if n := <-scanned; n != 0 {
		t.Errorf("the scan failed %d slices of a Post in progress", n)
	}
	w.mu.Lock()
	got := len(w.got)
	w.mu.Unlock()
	if got != 0 {
		t.Errorf("%d completions for a slice Post did not take", got)
	}
	if n := efa.SlotsFree(p.init); n != free {
		t.Errorf("%d slots free after the undo, want %d", n, free)
	}
}

// TestRetryToExitedPeer: a slice waiting for its retry to a shm peer whose
// process is gone is not posted into the region that process left (whose
// lock it may hold): it fails with ErrPeerExited, an ErrPeer that says
// why, and Post refuses the next slice the same way.
func TestRetryToExitedPeer(t *testing.T) {
	icfg := testConfig("shm")
	icfg.Progress = false
	p := newPair(t, "shm", icfg, testConfig("shm"))
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	efa.WatchPeerPid(p.ep, gone.Process.Pid) // as if the target's process had ended
	free := efa.SlotsFree(p.init)
	w := newWaiter()
	efa.PlantRetry(p.ep, w, 9)
	deadline := time.Now().Add(5 * time.Second) // the retry is due in about 64 ms
	var err error
	for done := false; !done; {
		if time.Now().After(deadline) {
			t.Fatal("the retry did not complete")
		}
		p.init.Poll()
		w.mu.Lock()
		err, done = w.got[9]
		w.mu.Unlock()
	}
	if !errors.Is(err, efa.ErrPeerExited) || !errors.Is(err, transport.ErrPeer) {
		t.Fatalf("the retry to an exited shm peer ended %v; want ErrPeerExited (an ErrPeer)", err)
	}
	if n := efa.SlotsFree(p.init); n != free {
		t.Errorf("%d slots free, want %d", n, free)
	}
	if n, err := p.ep.Post(w, []transport.Slice{p.slice(transport.Write, 64)}); n != 0 || !errors.Is(err, efa.ErrPeerExited) {
		t.Fatalf("Post to the exited peer: %d taken, %v; want 0, ErrPeerExited", n, err)
	}
}

// TestCloseFailsRetries: Endpoint.Close completes with ErrClosed the
// slices waiting on the retry list, before it returns, and no completion
// follows. It used to leave them for a later Poll.
func TestCloseFailsRetries(t *testing.T) {
	icfg := testConfig("tcp")
	icfg.Linger = time.Millisecond
	icfg.Progress = false
	p := newPair(t, "tcp", icfg, testConfig("tcp"))
	free := efa.SlotsFree(p.init)
	w := newWaiter()
	efa.PlantRetry(p.ep, w, 7)
	if err := p.ep.Close(); err != nil {
		t.Fatal(err)
	}
	w.mu.Lock()
	err, ok := w.got[7]
	w.mu.Unlock()
	if !ok || !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("a retry after Close returned: completed %v, %v; want ErrClosed", ok, err)
	}
	deadline := time.Now().Add(150 * time.Millisecond) // past the retry's due time
	for time.Now().Before(deadline) {
		p.init.Poll()
	}
	w.mu.Lock()
	dups := w.dups
	w.mu.Unlock()
	if dups != 0 {
		t.Errorf("the retry completed %d more times", dups)
	}
	if n := efa.SlotsFree(p.init); n != free {
		t.Errorf("%d slots free, want %d", n, free)
	}
}
