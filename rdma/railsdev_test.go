//go:build rdma && cgo

package rdma

// Tests on the device of the rails chosen by measured speed (choose.go
// through Post, Done at reap, Failed when a queue pair fails). The
// pickers' clock is the test's (choose_test.go): the rates fed to it stay
// what they were fed while the slices move, and cooldowns end when the
// test says.

import (
	"bytes"
	"context"
	"testing"
	"unsafe"

	"github.com/moonring/moonring/internal/rails"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// localAt registers n more bytes of local memory at loc on the world's
// initiator, for the length of the test.
func localAt(t *testing.T, w *world, loc segtable.Location, n int) ([]byte, segtable.Registration) {
	t.Helper()
	mem := make([]byte, n)
	b, err := w.ibufs.Register(mem, loc, false)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := w.init.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.init.Unregister(b, reg)
		w.ibufs.Unregister(context.Background(), b.ID)
	})
	return mem, reg
}

// railCount is what each rail of an endpoint has posted since it was
// taken: its queue pair and that pair's head then.
type railCount struct {
	q    *qp
	head uint64
}

func countRails(e *Endpoint) []railCount {
	e.postMu.Lock()
	defer e.postMu.Unlock()
	out := make([]railCount, len(e.rails))
	for i := range e.rails {
		if q := e.rails[i].q; q != nil {
			out[i] = railCount{q, q.head.Load()}
		}
	}
	return out
}

// since returns the work requests each rail posted since c was taken,
// over one reconnect at most (a new queue pair's head starts at 0).
func since(e *Endpoint, c []railCount) []int {
	now := countRails(e)
	out := make([]int, len(c))
	for i := range c {
		if c[i].q != nil {
			out[i] = int(c[i].q.head.Load() - c[i].head)
		}
		if now[i].q != nil && now[i].q != c[i].q {
			out[i] += int(now[i].head)
		}
	}
	return out
}

// writeAll WRITEs n slices of 4 KiB from mem (registered as reg) to the
// target, 64 to a Post (no queue pair fills), each batch done before the
// next; it fails the test unless every one succeeds and the bytes landed,
// and returns how many each rail carried.
func writeAll(t *testing.T, w *world, e *Endpoint, mem []byte, reg segtable.Registration, n int) []int {
	t.Helper()
	const size = 4096
	span := len(w.rmem) / size
	for i := range mem {
		mem[i] = byte(i*7 + n)
	}
	before := countRails(e)
	c := newWaiter()
	tok := uint64(0)
	for done := 0; done < n; {
		var s []transport.Slice
		for k := 0; k < 64 && done+k < n; k++ {
			off := uint64((done+k)%span) * size
			tok++
			s = append(s, transport.Slice{Op: transport.Write, LocalHandle: reg.Handle, Local: unsafe.Pointer(&mem[off]),
				Remote: uint64(w.r.Addr) + off, Length: size, Token: tok})
		}
		postAll(t, e, c, s)
		for i := range s {
			if err := c.wait(t, s[i].Token); err != nil {
				t.Fatalf("WRITE %d: %v", s[i].Token, err)
			}
		}
		done += len(s)
	}
	if m := min(len(mem), len(w.rmem)); !bytes.Equal(w.rmem[:m], mem[:m]) {
		t.Fatal("WRITEs: data differs")
	}
	return since(e, before)
}

// share returns counts[i] over the sum of counts.
func share(counts []int, i int) float64 {
	sum := 0
	for _, k := range counts {
		sum += k
	}
	return float64(counts[i]) / float64(sum)
}

// TestRailsFarDevice: two devices, rxe0 made NUMA node 0 and rxe1 node 1
// (the test's hook: Soft-RoCE devices have no node), rails alike in
// measured speed. WRITEs from memory on node 0 put a third of the slices
// on rxe1's rails (FarNUMA, half the share of a near device: not none, as
// when near memory kept to near devices). Then, from memory of no node,
// with rail 3 measured at a quarter of the others' speed, rail 3 gets a
// quarter of their share: 1/13 of the slices.
func TestRailsFarDevice(t *testing.T) {
	addRXE1(t)
	var clock fakeClock
	w := newWorld(t, Config{QPsPerDevice: 2, railConfig: steadyRails(&clock)}, 64<<12)
	if n := len(w.init.devs); n != 2 {
		t.Fatalf("the transport opened %d devices, want rxe0 and rxe1", n)
	}
	w.init.devs[0].numa, w.init.devs[1].numa = 0, 1 // before the registration reads them
	mem, reg := localAt(t, w, segtable.CPU(0), 64<<12)
	ep := w.open(t)
	e := ep.(*Endpoint)
	if e.Rails() != 4 || e.rails[2].li != 1 || e.rails[3].li != 1 {
		t.Fatalf("rails on devices %v; want 0, 0, 1, 1", []int{e.rails[0].li, e.rails[1].li, e.rails[2].li, e.rails[3].li})
	}
	seedRates(e.ch.pick, &clock, 1e9, 1e9, 1e9, 1e9)
	got := writeAll(t, w, e, mem, reg, 960)
	t.Logf("memory on node 0, rails alike: slices per rail %v", got)
	if far := share(got, 2) + share(got, 3); far < 0.28 || far > 0.39 {
		t.Errorf("rxe1 (far) carried %.3f of the slices %v; want about 1/3", far, got)
	}
	for i, want := range []float64{1.0 / 3, 1.0 / 3, 1.0 / 6, 1.0 / 6} {
		if d := share(got, i) - want; d < -0.05 || d > 0.05 {
			t.Errorf("rail %d carried %.3f of the slices %v; want about %.3f", i, share(got, i), got, want)
		}
	}
	seedRates(e.ch.pick, &clock, 1e9, 1e9, 1e9, 0.25e9)
	got = writeAll(t, w, e, w.lmem, w.lreg, 1040)
	t.Logf("memory of no node, rail 3 at a quarter: slices per rail %v", got)
	if s := share(got, 3); s < 0.05 || s > 0.11 {
		t.Errorf("slow rail 3 carried %.3f of the slices %v; want about 1/13", s, got)
	}
	for i := range 3 {
		if s := share(got, i); s < 0.26 || s > 0.36 {
			t.Errorf("rail %d carried %.3f of the slices %v; want about 4/13", i, s, got)
		}
	}
}

// TestRailFailureCools: a queue pair that fails cools its rail. The next
// Post reconnects the rail, but its slices go to the other rail for the
// cooldown (the picker's clock stands still), reconnected or not; when the
// cooldown ends, a probe goes to it, and once the probe succeeded the rail
// has its share again.
func TestRailFailureCools(t *testing.T) {
	var clock fakeClock
	w := newWorld(t, Config{QPsPerDevice: 2, railConfig: steadyRails(&clock)}, 64<<12)
	ep := w.open(t)
	e := ep.(*Endpoint)
	seedRates(e.ch.pick, &clock, 1e9, 1e9)
	if got := writeAll(t, w, e, w.lmem, w.lreg, 128); got[0] == 0 || got[1] == 0 {
		t.Fatalf("slices per rail %v before the failure; want both used", got)
	}
	e.postMu.Lock()
	e.rails[0].q.fail()
	e.postMu.Unlock()
	if !e.ch.pick.Cooling(0) || e.ch.pick.Cooling(1) {
		t.Fatal("the failed queue pair did not cool its rail (and its rail only)")
	}
	if got := writeAll(t, w, e, w.lmem, w.lreg, 128); got[0] != 0 {
		t.Fatalf("slices per rail %v just after rail 0 failed; want none on it", got)
	}
	waitFor(t, "rail 0 reconnected", func() bool {
		e.postMu.Lock()
		defer e.postMu.Unlock()
		r := &e.rails[0]
		return r.q != nil && r.q.state.Load() == qpLive
	})
	if got := writeAll(t, w, e, w.lmem, w.lreg, 128); got[0] != 0 {
		t.Fatalf("slices per rail %v with rail 0 reconnected but cooling; want none on it", got)
	}
	clock.add(rails.DefaultMinCooldown)
	if got := writeAll(t, w, e, w.lmem, w.lreg, 64); got[0] == 0 {
		t.Fatalf("slices per rail %v after the cooldown; want rail 0's probe", got)
	}
	if e.ch.pick.Cooling(0) {
		t.Fatal("rail 0 still cooling after its probe succeeded")
	}
	got := writeAll(t, w, e, w.lmem, w.lreg, 640)
	if s := share(got, 0); s < 0.4 || s > 0.6 {
		t.Errorf("rail 0 carried %.3f of the slices %v after it healed; want about a half", s, got)
	}
	if st := w.init.Stats(); st.Reconnects == 0 {
		t.Errorf("no reconnect counted: %+v", st)
	}
}
