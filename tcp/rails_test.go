package tcp

// Tests of the rails chosen by measured speed (rails.Picker in Post).

import (
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/rails"
	"github.com/moonring/moonring/transport"
)

// throttle forwards connections to a target. The first connection it
// accepts (an endpoint's rail 0: Open dials it before the others, which
// its keepers dial once it returns) moves at most rate bytes per second
// each way; the others move at full speed.
type throttle struct {
	ln     net.Listener
	target string
	rate   int
	n      atomic.Int32
	mu     sync.Mutex
	closed bool
	conns  []net.Conn
	wg     sync.WaitGroup
}

func newThrottle(t testing.TB, target string, rate int) *throttle {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	th := &throttle{ln: ln, target: target, rate: rate}
	th.wg.Add(1)
	go th.accept()
	t.Cleanup(func() {
		ln.Close()
		th.mu.Lock()
		th.closed = true
		for _, c := range th.conns {
			c.Close()
		}
		th.mu.Unlock()
		th.wg.Wait()
	})
	return th
}

func (th *throttle) addr() string { return th.ln.Addr().String() }

// track records c to be closed at cleanup; false (and c closed) after.
func (th *throttle) track(c net.Conn) bool {
	th.mu.Lock()
	defer th.mu.Unlock()
	if th.closed {
		c.Close()
		return false
	}
	th.conns = append(th.conns, c)
	return true
}

func (th *throttle) accept() {
	defer th.wg.Done()
	for {
		c, err := th.ln.Accept()
		if err != nil {
			return
		}
		slow := th.n.Add(1) == 1
		s, err := net.Dial("tcp", th.target)
		if err != nil {
			c.Close()
			continue
		}
		if !th.track(c) || !th.track(s) {
			c.Close()
			s.Close()
			continue
		}
		th.wg.Add(2)
		go th.pipe(s, c, slow)
		go th.pipe(c, s, slow)
	}
}

// pipe copies src to dst, in chunks of up to 64 KiB paced to th.rate when
// slow (chunks that large keep the sleeps few: each costs more than asked
// on a loaded machine).
func (th *throttle) pipe(dst, src net.Conn, slow bool) {
	defer th.wg.Done()
	defer dst.Close()
	defer src.Close()
	if !slow {
		io.Copy(dst, src)
		return
	}
	buf := make([]byte, 64<<10)
	pause := time.Duration(len(buf)) * time.Second / time.Duration(th.rate)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, err := dst.Write(buf[:n]); err != nil {
				return
			}
			time.Sleep(pause * time.Duration(n) / time.Duration(len(buf)))
		}
		if err != nil {
			return
		}
	}
}

// posted returns how many slices each rail's current connection took.
func posted(e *Endpoint) []uint64 {
	n := make([]uint64, len(e.rails))
	for i := range e.rails {
		if c := e.rails[i].Load(); c != nil {
			n[i] = c.q.Committed()
		}
	}
	return n
}

// TestRailsByRate: the endpoint's Picker spreads slices over the rails in
// proportion to their rates, whatever the engine's Rail hint says. The
// rates are fed into the picker directly: 20 seconds of completions at 4,
// 2 and 1 GB/s on a fake clock that then stands still, so that the
// slices themselves, done in no time by that clock, add nothing (a sample
// weighs the time it covers). The rails get 4/7, 2/7 and 1/7 of the
// slices.
func TestRailsByRate(t *testing.T) {
	const at = int64(time.Hour)
	var clock atomic.Int64
	clock.Store(at)
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 64<<10, 0), true)
	init := newSide(t, Config{Rails: 3, railConfig: rails.Config{Now: clock.Load}})
	ep := open(t, init, targ, remote)
	e := ep.(*Endpoint)
	waitFor(t, "the rails up", func() bool { return railsUp(e) })
	for i, rate := range []uint64{4e9, 2e9, 1e9} { // bytes per second
		for k := range int64(20) {
			e.pick.Done(i, rate, at-(20-k)*int64(time.Second), at-(19-k)*int64(time.Second))
		}
	}
	before := posted(e)
	local := init.alloc(t, 4096, 1)
	const rounds, batch = 35, 40
	comp := make(chanCompleter, batch)
	s := make([]transport.Slice, batch)
	for r := range rounds {
		for i := range s {
			s[i] = localSlice(transport.Write, local, remote.addr, uint64(r*batch+i))
			s[i].Rail = 0 // every hint the same: the picker does not follow it
		}
		if k, err := ep.Post(comp, s); k != batch || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		for tok, err := range comp.await(t, batch) {
			if err != nil {
				t.Fatalf("slice %d: %v", tok, err)
			}
		}
	}
	after := posted(e)
	const n = rounds * batch
	for i, want := range []float64{4.0 / 7, 2.0 / 7, 1.0 / 7} {
		got := after[i] - before[i]
		if d := float64(got) - want*n; d > 5 || d < -5 {
			t.Errorf("rail %d took %d of %d slices, want %.0f", i, got, n, want*n)
		}
	}
}

// TestSlowRail: a rail whose connection moves a tenth or less of what the
// others do (a throttled route) gets proportionally fewer slices once it
// is measured: with the slices spread evenly it would take half of them.
// What the rails move depends on the machine, so the bound is loose; it
// asserts a share, never a speed.
func TestSlowRail(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 4<<20, 3), true)
	th := newThrottle(t, targ.tr.Addr(), 4<<20) // rail 0: 4 MiB/s
	init := newSide(t, Config{Rails: 2})
	ep, err := init.tr.Open(context.Background(), targ.desc(th.addr(), remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	e := ep.(*Endpoint)
	waitFor(t, "both rails up", func() bool { return railsUp(e) })
	const size, depth, warm, total = 64 << 10, 16, 200, 800
	local := init.alloc(t, depth*size, 0)
	comp := make(chanCompleter, depth)
	post := func(tok uint64) {
		i := tok % depth
		s := []transport.Slice{localSlice(transport.Read, local[i*size:(i+1)*size], remote.addr+(tok%64)*size, tok)}
		if k, err := ep.Post(comp, s); k != 1 || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
	}
	var tok uint64
	for ; tok < depth; tok++ {
		post(tok)
	}
	var before []uint64
	timer := time.NewTimer(hang)
	defer timer.Stop()
	for done := 0; done < total; done++ {
		if done == warm {
			before = posted(e)
		}
		select {
		case c := <-comp:
			if c.err != nil {
				t.Fatalf("slice %d: %v", c.token, c.err)
			}
			// A slot is free again when its slice is done: the next one
			// reuses the completed one's buffer.
			if done+depth < total {
				post(c.token + depth)
			}
		case <-timer.C:
			t.Fatalf("hang: %d of %d slices done", done, total)
		}
	}
	after := posted(e)
	slow, fast := after[0]-before[0], after[1]-before[1]
	t.Logf("after %d slices: the slow rail took %d, the fast %d; rates %.3g and %.3g B/s", warm, slow, fast, e.pick.Rate(0), e.pick.Rate(1))
	if 3*slow > slow+fast {
		t.Fatalf("the slow rail took %d of %d slices, want under a third", slow, slow+fast)
	}
}

// TestRailFailureCools: a rail whose connection breaks cools down: it gets
// no slice (though it is redialed at once) until its cooldown ends, then
// one probe, and after the probe's success its share again. The picker's
// clock is a fake one that the test moves.
func TestRailFailureCools(t *testing.T) {
	var clock atomic.Int64
	clock.Store(int64(time.Hour))
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 64<<10, 0), true)
	init := newSide(t, Config{Rails: 2, railConfig: rails.Config{Now: clock.Load}})
	ep := open(t, init, targ, remote)
	e := ep.(*Endpoint)
	waitFor(t, "both rails up", func() bool { return railsUp(e) })
	local := init.alloc(t, 4096, 1)
	var tok uint64
	write := func(n int) []uint64 {
		t.Helper()
		before := posted(e)
		comp := make(chanCompleter, n)
		s := make([]transport.Slice, n)
		for i := range s {
			tok++
			s[i] = localSlice(transport.Write, local, remote.addr, tok)
		}
		if k, err := ep.Post(comp, s); k != n || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		for tk, err := range comp.await(t, n) {
			if err != nil {
				t.Fatalf("slice %d: %v", tk, err)
			}
		}
		after := posted(e)
		for i := range after {
			after[i] -= before[i]
		}
		return after
	}
	if got := write(20); got[0] == 0 || got[1] == 0 {
		t.Fatalf("healthy rails took %v slices, want some each", got)
	}
	old := e.rails[1].Load()
	old.fail(transport.ErrPeer) // as a broken socket would
	<-old.dead
	if !e.pick.Cooling(1) {
		t.Fatal("rail 1 is not cooling after its connection broke")
	}
	waitFor(t, "rail 1 redialed", func() bool { return railsUp(e) && e.rails[1].Load() != old })
	if got := write(20); got[1] != 0 {
		t.Fatalf("rail 1 took %d slices while cooling", got[1])
	}
	clock.Add(int64(rails.DefaultMinCooldown))
	if got := write(1); got[1] != 1 {
		t.Fatalf("the first slice after the cooldown went to rail 0, not as rail 1's probe")
	}
	if e.pick.Cooling(1) {
		t.Fatal("rail 1 still cooling after its probe succeeded")
	}
	if got := write(20); got[1] == 0 {
		t.Fatalf("healed rail 1 took no slice of 20")
	}
}
