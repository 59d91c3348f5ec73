//go:build efa && cgo

package efa_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// waiter is a Completer that the tests wait on.
type waiter struct {
	mu   sync.Mutex
	cond *sync.Cond
	got  map[uint64]error
	dups int
}

func newWaiter() *waiter {
	w := &waiter{got: map[uint64]error{}}
	w.cond = sync.NewCond(&w.mu)
	return w
}

func (w *waiter) Complete(token uint64, err error) {
	w.mu.Lock()
	if _, ok := w.got[token]; ok {
		w.dups++
	}
	w.got[token] = err
	w.mu.Unlock()
	w.cond.Broadcast()
}

// wait returns the errors of s once all completed, or fails t after
// limit.
func (w *waiter) wait(t *testing.T, s []transport.Slice, limit time.Duration) []error {
	t.Helper()
	timer := time.AfterFunc(limit, w.cond.Broadcast)
	defer timer.Stop()
	deadline := time.Now().Add(limit)
	w.mu.Lock()
	defer w.mu.Unlock()
	for {
		done := 0
		for i := range s {
			if _, ok := w.got[s[i].Token]; ok {
				done++
			}
		}
		if done == len(s) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d slices completed within %v", done, len(s), limit)
		}
		w.cond.Wait()
	}
	if w.dups > 0 {
		t.Fatalf("%d slices completed twice", w.dups)
	}
	errs := make([]error, len(s))
	for i := range s {
		errs[i] = w.got[s[i].Token]
	}
	return errs
}

// postAll posts s, retrying what the endpoint did not take yet.
func postAll(t *testing.T, ep transport.Endpoint, c transport.Completer, s []transport.Slice) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for done := 0; done < len(s); {
		n, err := ep.Post(c, s[done:])
		done += n
		if err != nil {
			t.Fatalf("Post: %v", err)
		}
		if done < len(s) {
			if time.Now().After(deadline) {
				t.Fatalf("the endpoint took %d of %d slices in 30 s", done, len(s))
			}
			time.Sleep(10 * time.Microsecond)
		}
	}
}

var tokens struct {
	sync.Mutex
	n uint64
}

func token() uint64 {
	tokens.Lock()
	defer tokens.Unlock()
	tokens.n++
	return tokens.n
}

// cut slices n bytes from local to remote into slices of at most max.
func cut(op transport.Op, handle uint64, local []byte, remote, max uint64) []transport.Slice {
	var s []transport.Slice
	n := uint64(len(local))
	for off := uint64(0); off < n; off += max {
		s = append(s, transport.Slice{Op: op, LocalHandle: handle, Local: unsafe.Pointer(&local[off]),
			Remote: remote + off, Length: min(max, n-off), Token: token()})
	}
	return s
}

func TestTwoProcessesTCP(t *testing.T) { twoProcesses(t, "tcp") }
func TestTwoProcessesSHM(t *testing.T) { twoProcesses(t, "shm") }

// twoProcesses moves data up to 16 MiB each way between this process and
// a child target, checks it on both sides, then kills the child and
// checks that slices to it end with errors within the timeout.
func twoProcesses(t *testing.T, prov string) {
	const size = 16<<20 + 64<<10
	tg := startTarget(t, prov, size, "EFA_PROGRESS_SLEEP=20us")
	cfg := testConfig(prov)
	cfg.Timeout = 3 * time.Second
	tr := newEFA(t, cfg)
	defer tr.Close()
	var bufs segtable.Buffers
	mem := make([]byte, size)
	lb, err := bufs.Register(mem, "", false)
	if err != nil {
		t.Fatal(err)
	}
	defer bufs.Unregister(context.Background(), lb.ID)
	reg, err := tr.Register(lb)
	if err != nil {
		t.Fatal(err)
	}
	if reg.Key != "" {
		t.Errorf("a local-only buffer got the key %q", reg.Key)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ep, err := tr.Open(ctx, tg.desc)
	if err != nil {
		t.Fatalf("Open the child's segment: %v", err)
	}
	defer ep.Close()
	base := tg.desc.Buffers[0].Addr
	w := newWaiter()
	for i, n := range []int{1, 4097, 64<<10 + 3, 1<<20 + 5, 16 << 20} {
		off := uint64(i*4096 + 1) // odd offsets, both sides
		loff := 4093 + 7*i
		if int(off)+n > size || loff+n > size {
			off, loff = 3, 5
		}
		// WRITE: mem[loff:] -> child[off:], checked by the child's hash.
		src := mem[loff : loff+n]
		testpattern.Fill(src, uint64(i)+100)
		for j, err := range w.wait(t, postWait(t, ep, w, cut(transport.Write, reg.Handle, src, base+off, tr.SliceSize())), 30*time.Second) {
			if err != nil {
				t.Fatalf("WRITE of %d bytes, slice %d: %v", n, j, err)
			}
		}
		sum := sha256.Sum256(src)
		if got := tg.Ask(t, "sum %d %d", off, n); got != hex.EncodeToString(sum[:]) {
			t.Fatalf("WRITE of %d bytes at +%d: the child holds other bytes (sha256 %s, sent %x)", n, off, got, sum)
		}
		// READ: the child fills child[off:], we read it into mem[loff:].
		if got := tg.Ask(t, "fill %d %d %d", off, n, i+200); got != "ok" {
			t.Fatalf("child fill: %s", got)
		}
		clear(src)
		for j, err := range w.wait(t, postWait(t, ep, w, cut(transport.Read, reg.Handle, src, base+off, tr.SliceSize())), 30*time.Second) {
			if err != nil {
				t.Fatalf("READ of %d bytes, slice %d: %v", n, j, err)
			}
		}
		want := make([]byte, n)
		testpattern.Fill(want, uint64(i)+200)
		if !bytes.Equal(src, want) {
			t.Fatalf("READ of %d bytes at +%d: data differs", n, off)
		}
	}

	// The child dies with WRITEs in flight: every slice ends, and new ones
	// fail within the timeout (plus the reconnection retries).
	var inflight []transport.Slice
	for k := 0; k < 16; k++ {
		inflight = append(inflight, cut(transport.Write, reg.Handle, mem[k<<20:(k+1)<<20], base+uint64(k<<20), tr.SliceSize())...)
	}
	postAll(t, ep, w, inflight)
	tg.KillWait()
	ended := w.wait(t, inflight, 2*cfg.Timeout+10*time.Second)
	start := time.Now()
	after := cut(transport.Write, reg.Handle, mem[:4096], base, tr.SliceSize())
	if prov == "shm" {
		// A slice in flight that failed and waited for a retry is not
		// posted again into the region the child left: its failure made
		// the peer suspect, the retry asked, and it ends saying why.
		kinds := map[string]int{}
		for j, err := range ended {
			if errors.Is(err, efa.ErrPeerRetry) {
				t.Errorf("in-flight slice %d to the dead shm peer ended %v, want ErrPeerExited (its process was asked before the retry)", j, err)
			}
			kinds[fmt.Sprint(err)]++
		}
		t.Logf("shm: the %d slices in flight ended: %v", len(ended), kinds)
		// Once its operations failed or timed out (those in flight, as a
		// rule; else the first after them), Post asks whether the
		// process is there and posts nothing into the region it left,
		// whose lock it may hold.
		_, err := ep.Post(w, after)
		if err == nil {
			errs := w.wait(t, after, 2*cfg.Timeout+10*time.Second)
			if !errors.Is(errs[0], transport.ErrPeer) {
				t.Fatalf("WRITE to a dead shm peer: %v, want ErrPeer", errs[0])
			}
			_, err = ep.Post(w, after)
		}
		if !errors.Is(err, efa.ErrPeerExited) {
			t.Fatalf("Post to a dead shm peer whose operations failed: %v, want ErrPeerExited", err)
		}
		t.Logf("shm: Post to the dead child refused after %v: %v", time.Since(start).Round(time.Millisecond), err)
		return
	}
	postAll(t, ep, w, after)
	errs := w.wait(t, after, 2*cfg.Timeout+10*time.Second)
	if errs[0] == nil {
		t.Fatalf("WRITE to a dead child succeeded")
	}
	if errors.Is(errs[0], transport.ErrDenied) || errors.Is(errs[0], transport.ErrRange) {
		t.Errorf("WRITE to a dead child: %v; want a retryable error", errs[0])
	}
	t.Logf("%s: WRITE to the dead child failed after %v: %v", prov, time.Since(start).Round(time.Millisecond), errs[0])
}

// postWait posts s and returns it, for w.wait.
func postWait(t *testing.T, ep transport.Endpoint, w *waiter, s []transport.Slice) []transport.Slice {
	t.Helper()
	postAll(t, ep, w, s)
	return s
}
