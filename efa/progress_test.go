//go:build efa && cgo

package efa_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// returns runs fn in a goroutine; its result waits up to d for fn to
// return, and reports whether it did.
func returns(fn func()) func(d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	return func(d time.Duration) bool {
		select {
		case <-done:
			return true
		case <-time.After(d):
			return false
		}
	}
}

// TestProgressPastPostInProvider: while a Post is inside the provider
// (HoldGuard: it holds the guard shared, as a post that waits on the
// peer's or this side's progress does, for as long as it takes), no
// writer of the guard holds Poll back, and the Poll path itself never
// waits for the guard. It used to: a timeout scan waited for the write
// lock inside Poll, every other Poll then waited behind it (a waiting
// writer blocks new readers), nothing polled, and the post that waited on
// progress never returned (a 10-minute hang of TestTwoProcessesSHM).
//
// Each subtest fails within seconds on the old code; after a failure it
// lets the guard go so that what it blocked returns.
func TestProgressPastPostInProvider(t *testing.T) {
	const limit = 3 * time.Second

	// A user's writer (Unregister) waits for the guard: Poll and Post go
	// on, Post taking nothing until the writer is done.
	t.Run("waiting writer", func(t *testing.T) {
		p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
		var bufs segtable.Buffers
		b, err := bufs.Register(make([]byte, 4096), "", false)
		if err != nil {
			t.Fatal(err)
		}
		defer bufs.Unregister(context.Background(), b.ID)
		reg, err := p.init.Register(b)
		if err != nil {
			t.Fatal(err)
		}
		release := efa.HoldGuard(p.init)
		unreg := returns(func() { p.init.Unregister(b, reg) })
		for !efa.WriterWaiting(p.init) {
			time.Sleep(100 * time.Microsecond)
		}
		polled := returns(func() { p.init.Poll() })
		if !polled(limit) {
			release()
			t.Fatalf("Poll did not return in %v while Unregister waited behind a Post in the provider", limit)
		}
		var n int
		var perr error
		posted := returns(func() { n, perr = p.ep.Post(newWaiter(), []transport.Slice{p.slice(transport.Write, 8)}) })
		if !posted(limit) {
			release()
			t.Fatalf("Post did not return in %v while Unregister waited behind a Post in the provider", limit)
		}
		if n != 0 || perr != nil {
			t.Errorf("Post while a writer waited: %d, %v; want 0 taken, no error", n, perr)
		}
		release()
		if !unreg(limit) {
			t.Fatalf("Unregister did not return in %v once the Post was out", limit)
		}
		p.writeCheck(t, p.ep, p.desc, p.tmem, 1)
	})

	// Poll's timeout scan finds the guard held: it neither waits for it
	// nor fails the Post's slot, and a later scan runs.
	t.Run("timeout scan", func(t *testing.T) {
		icfg := testConfig("tcp")
		icfg.Progress = false
		icfg.Timeout = 20 * time.Millisecond // a scan each 5 ms of polling
		p := newPair(t, "tcp", icfg, testConfig("tcp"))
		w := newWaiter()
		release := efa.HoldGuard(p.init)
		undo := efa.PlantBusy(p.ep, w, 1) // the Post's slot, an hour old
		polled := returns(func() {
			for range 2000 {
				p.init.Poll()
				time.Sleep(20 * time.Microsecond)
			}
		})
		if !polled(10 * time.Second) {
			undo()
			release()
			t.Fatalf("Poll with a timeout scan due did not return in 10 s while a Post was in the provider")
		}
		w.mu.Lock()
		got := len(w.got)
		w.mu.Unlock()
		if got != 0 {
			t.Errorf("the scan failed the slot of a Post in progress")
		}
		undo()
		release()
		// Now the provider's: the next scans fail it.
		efa.PlantBusy(p.ep, w, 2)
		deadline := time.Now().Add(limit)
		for {
			p.init.Poll()
			w.mu.Lock()
			err, ok := w.got[2]
			w.mu.Unlock()
			if ok {
				if !errors.Is(err, transport.ErrPeer) {
					t.Fatalf("an overdue slot failed with %v; want ErrPeer", err)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no scan failed an overdue slot within %v", limit)
			}
			time.Sleep(20 * time.Microsecond)
		}
	})

	// An operation failed as if its connection broke: the reset of its
	// peer does not wait for the guard, Poll goes on while the reset
	// waits, and the reset and the retry happen once the guard is free.
	t.Run("reset", func(t *testing.T) {
		icfg := testConfig("tcp")
		icfg.Progress = false
		p := newPair(t, "tcp", icfg, testConfig("tcp"))
		gen := efa.PeerGen(p.ep)
		w := newWaiter()
		release := efa.HoldGuard(p.init)
		if !returns(func() { efa.PlantBroken(p.ep, w, 1) })(limit) {
			release()
			t.Fatalf("queueing a retry did not return in %v while a Post was in the provider", limit)
		}
		polled := returns(func() {
			for range 100 {
				p.init.Poll()
				time.Sleep(50 * time.Microsecond) // past the retry's due time
			}
		})
		if !polled(limit) {
			release()
			t.Fatalf("Poll did not return in %v while a reset waited behind a Post in the provider", limit)
		}
		if g := efa.PeerGen(p.ep); g != gen {
			t.Errorf("the peer was reset under a Post in the provider")
		}
		release()
		deadline := time.Now().Add(limit)
		for {
			p.init.Poll()
			w.mu.Lock()
			err, ok := w.got[1]
			w.mu.Unlock()
			if ok && efa.PeerGen(p.ep) != gen {
				if !errors.Is(err, transport.ErrPeer) {
					t.Errorf("the retry failed with %v; want ErrPeer", err)
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after %v: retry completed %v, peer's generation %d (was %d)", limit, ok, efa.PeerGen(p.ep), gen)
			}
			time.Sleep(20 * time.Microsecond)
		}
	})

	// The last operation to a peer no endpoint uses returns while the
	// guard is held: the Poll that delivers it does not wait to drop the
	// peer, and the peer goes once the guard is free.
	t.Run("drop", func(t *testing.T) {
		icfg := testConfig("tcp")
		icfg.Progress = false
		icfg.Linger = 100 * time.Millisecond
		p := newPair(t, "tcp", icfg, testConfig("tcp"))
		p.targ.StopProgress() // the WRITEs stay with the provider
		w := newWaiter()
		var s []transport.Slice
		for range 8 {
			s = append(s, p.slice(transport.Write, 256<<10))
		}
		postAll(t, p.ep, w, s)
		p.ep.Close() // fails them with ErrClosed; the peer stays
		if efa.PeerOps(p.ep) == 0 {
			t.Skip("every WRITE completed before Close: nothing left to return under the guard")
		}
		release := efa.HoldGuard(p.init)
		stop := make(chan struct{})
		target := returns(func() {
			for {
				select {
				case <-stop:
					return
				default:
					if p.targ.Poll() == 0 {
						time.Sleep(20 * time.Microsecond)
					}
				}
			}
		})
		polled := returns(func() {
			deadline := time.Now().Add(limit)
			for efa.PeerOps(p.ep) != 0 && time.Now().Before(deadline) {
				if p.init.Poll() == 0 {
					time.Sleep(20 * time.Microsecond)
				}
			}
		})
		ok := polled(2 * limit)
		if !ok {
			release()
		}
		close(stop)
		target(limit)
		if !ok {
			t.Fatalf("Poll delivering a peer's last operation did not return in %v while a Post was in the provider", 2*limit)
		}
		if n := efa.PeerOps(p.ep); n != 0 {
			release()
			t.Fatalf("%d operations still with the provider after %v: the test proved nothing", n, limit)
		}
		release()
		waitPeers(t, p.init, 0, limit)
	})
}

// TestResetsQueuedOnce: the resets that a batch of failed operations asks
// for while a Post is in the provider each wait in a goroutine (soon);
// the first to get the locks resets the peer, and the others give up
// under peerMu without taking the guard's write lock, which would hold
// every Post of the transport back for nothing.
func TestResetsQueuedOnce(t *testing.T) {
	icfg := testConfig("tcp")
	icfg.Progress = false
	p := newPair(t, "tcp", icfg, testConfig("tcp"))
	release := efa.HoldGuard(p.init)
	gen := uint64(0)
	for range 16 {
		gen = efa.ResetSoon(p.ep)
	}
	if waiting, wrote := efa.SoonCounts(p.init); waiting != 16 || wrote != 1 {
		// One goroutine has peerMu and waits for the guard; the others
		// wait for peerMu.
		deadline := time.Now().Add(time.Second)
		for time.Now().Before(deadline) {
			if waiting, wrote = efa.SoonCounts(p.init); waiting == 16 && wrote == 1 {
				break
			}
			time.Sleep(time.Millisecond)
		}
		if waiting != 16 || wrote != 1 {
			release()
			t.Fatalf("with the guard held: %d resets waiting (want 16), %d asked for the write lock (want 1)", waiting, wrote)
		}
	}
	release()
	deadline := time.Now().Add(3 * time.Second)
	for {
		waiting, wrote := efa.SoonCounts(p.init)
		if waiting == 0 {
			if wrote != 1 {
				t.Errorf("%d of the 16 queued resets took the guard's write lock; want 1", wrote)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d resets still waiting %v after the guard was let go", waiting, 3*time.Second)
		}
		time.Sleep(time.Millisecond)
	}
	if g := efa.PeerGen(p.ep); g != gen+1 {
		t.Errorf("the peer's generation is %d after 16 resets asked at %d; want %d", g, gen, gen+1)
	}
}
