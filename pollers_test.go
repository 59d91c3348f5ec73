package moonring_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/prometheus/client_golang/prometheus"
)

// TestPollersSpreadRings: with Config.Pollers, each new ring goes to the
// node's poller with the fewest open rings (a closed ring's poller is
// the next one's), the rings move their bytes at once from goroutines of
// their own, each byte checked, and a Pollers outside 1..64 is refused.
func TestPollersSpreadRings(t *testing.T) {
	for _, n := range []int{-1, 65} {
		if e, err := moonring.New(moonring.Config{Name: fmt.Sprintf("%s-bad%d", t.Name(), n), Pollers: n}); err == nil || !strings.Contains(err.Error(), "Pollers") {
			if e != nil {
				e.Close()
			}
			t.Errorf("Pollers %d: err %v; want a bad config naming Pollers", n, err)
		}
	}
	a, err := moonring.New(moonring.Config{Name: t.Name() + "-a", Pollers: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b := newEngine(t, t.Name()+"-b")
	const rings, size = 4, 1 << 20
	src := make([]byte, rings*size)
	fill(src, 3)
	dst := make([]byte, len(src))
	back := make([]byte, len(src))
	sid, err := a.RegisterLocalMemory(src, "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	bid, err := a.RegisterLocalMemory(back, "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	var rs []*moonring.Ring
	open := func() *moonring.Ring {
		r, err := a.NewRing(moonring.RingConfig{Entries: 64})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		return r
	}
	for range rings {
		rs = append(rs, open())
	}
	want := []int{0, 1, 2, 0} // the fourth shares with the first of equals
	for i, r := range rs {
		if node, idx, ok := moonring.RingPoller(a, r); !ok || node != 0 || idx != want[i] {
			t.Errorf("ring %d on poller %d of node %d (known %v); want poller %d of node 0", i, idx, node, ok, want[i])
		}
	}
	// Each ring WRITEs its quarter in 4 KiB blocks and READs it back.
	dbase := uint64(moonring.AddressOf(dst))
	var wg sync.WaitGroup
	errs := make([]error, rings)
	for i, r := range rs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, op := range []moonring.Op{moonring.OpWrite, moonring.OpRead} {
				buf := sid
				if op == moonring.OpRead {
					buf = bid
				}
				var es []moonring.Entry
				for off := i * size; off < (i+1)*size; off += 4096 {
					es = append(es, moonring.Entry{Op: op, Segment: seg, Buffer: buf, Local: uint64(off), Remote: dbase + uint64(off), Length: 4096, UserData: uint64(off)})
				}
				if errs[i] = drain(ctx, r, es); errs[i] != nil {
					return
				}
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("ring %d: %v", i, err)
		}
	}
	if d := testpattern.FirstDiff(back, src); d >= 0 {
		t.Fatalf("byte %d read back differs", d)
	}
	// Each poller has its series.
	reg := prometheus.NewRegistry()
	reg.MustRegister(a.Collector())
	for i := range 3 {
		if v := metricValue(t, reg, "moonring_poller_up_seconds_total", map[string]string{"node": "0", "poller": fmt.Sprint(i)}); v <= 0 {
			t.Errorf("poller %d: up %v s", i, v)
		}
	}
	// A closed ring's poller takes the next ring.
	rs[1].Close()
	if _, idx, _ := moonring.RingPoller(a, open()); idx != 1 {
		t.Errorf("after closing poller 1's ring the new ring went to poller %d; want 1", idx)
	}
}

// drain submits es to r and reaps their completions, failing on the first
// that did not complete.
func drain(ctx context.Context, r *moonring.Ring, es []moonring.Entry) error {
	cqes := make([]moonring.Completion, 64)
	sent, done := 0, 0
	for done < len(es) {
		if ctx.Err() != nil {
			return fmt.Errorf("%d of %d done: %w", done, len(es), ctx.Err())
		}
		if sent < len(es) {
			n, err := r.Submit(es[sent:])
			if err != nil && err != moonring.ErrSQFull {
				return err
			}
			sent += n
		}
		n := r.PeekBatch(cqes)
		for _, c := range cqes[:n] {
			if err := c.Err(); err != nil {
				return fmt.Errorf("entry %d: %w", c.UserData, err)
			}
		}
		r.Advance(n)
		done += n
	}
	return nil
}
