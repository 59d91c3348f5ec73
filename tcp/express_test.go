package tcp

// Tests of the express lane (express.go).

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// expressUp waits until e's express lane is up.
func expressUp(t testing.TB, e *Endpoint) *conn {
	t.Helper()
	var c *conn
	waitFor(t, "the express lane up", func() bool {
		c = e.express.Load()
		return c != nil && !c.failed.Load()
	})
	return c
}

// order collects completions in the order they come.
type order struct {
	ch chanCompleter
}

// next returns the next n tokens completed, in order, failing t on an
// error or a hang.
func (o order) next(t testing.TB, n int) []uint64 {
	t.Helper()
	toks := make([]uint64, 0, n)
	timer := time.NewTimer(hang)
	defer timer.Stop()
	for len(toks) < n {
		select {
		case c := <-o.ch:
			if c.err != nil {
				t.Fatalf("slice %d: %v", c.token, c.err)
			}
			toks = append(toks, c.token)
		case <-timer.C:
			t.Fatalf("hang: %d of %d slices done", len(toks), n)
		}
	}
	return toks
}

// TestExpressLane: a high-class 4 KiB READ posted after many queued 1 MiB
// low-class WRITEs on the same endpoint completes before them, where a
// normal-class READ posted with it, on the one rail, completes after all
// of them (the rail's connection is a FIFO). The rail is throttled so
// that the WRITEs stay queued for a while whatever the machine. An
// endpoint that never posted a high-class slice holds no express lane,
// and until the lane is up high-class slices take the rail.
func TestExpressLane(t *testing.T) {
	const bulk, size = 16, 1 << 20
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, bulk*size+4096, 5), true)
	th := newThrottle(t, targ.tr.Addr(), 32<<20) // the rail: 32 MiB/s each way
	init := newSide(t, Config{Rails: 1})
	ep, err := init.tr.Open(context.Background(), targ.desc(th.addr(), remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	e := ep.(*Endpoint)
	local := init.alloc(t, bulk*size+8192, 1)
	o := order{make(chanCompleter, bulk+8)}

	normal := localSlice(transport.Read, local[bulk*size:bulk*size+4096], remote.addr+bulk*size, 100)
	if k, err := ep.Post(o.ch, []transport.Slice{normal}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	o.next(t, 1)
	if e.expressOn.Load() || e.express.Load() != nil {
		t.Fatal("an endpoint with no high-class slice started the express lane")
	}

	// The first high-class slice starts the lane, and takes the rail.
	high := normal
	high.Class, high.Token = transport.ClassHigh, 200
	railBefore := e.rails[0].Load().q.Committed()
	if k, err := ep.Post(o.ch, []transport.Slice{high}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	o.next(t, 1)
	if !e.expressOn.Load() {
		t.Fatal("a high-class slice did not start the express lane")
	}
	if got := e.rails[0].Load().q.Committed() - railBefore; got != 1 {
		t.Fatalf("the first high-class slice did not take the rail while the lane was down (%d slices on it)", got)
	}
	lane := expressUp(t, e)
	if targ.serverConns() != 2 {
		t.Fatalf("the target serves %d connections, want the rail and the express lane", targ.serverConns())
	}

	s := make([]transport.Slice, bulk)
	for i := range s {
		s[i] = localSlice(transport.Write, local[i*size:(i+1)*size], remote.addr+uint64(i*size), uint64(i+1))
		s[i].Class = transport.ClassLow
	}
	high.Token = 300
	normal.Token = 400
	if k, err := ep.Post(o.ch, append(s, high, normal)); k != bulk+2 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	got := o.next(t, bulk+2)
	hi, no := slices.Index(got, 300), slices.Index(got, 400)
	t.Logf("completion order: %v", got)
	if no != bulk+1 {
		t.Fatalf("the normal READ completed %dth of %d: the rail is not a FIFO", no+1, bulk+2)
	}
	if hi > 1 { // the first WRITE may have been on the wire already
		t.Fatalf("the high-class READ completed %dth, behind %d bulk WRITEs posted before it", hi+1, hi)
	}
	if lane.q.Committed() != 1 {
		t.Fatalf("the express lane took %d slices, want the one high-class READ", lane.q.Committed())
	}
}

// TestExpressLaneDown: while the express lane is down (broken, redialed),
// high-class slices take the rails, and once it is back they take it.
func TestExpressLaneDown(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 64<<10, 0), true)
	init := newSide(t, Config{Rails: 2})
	ep := open(t, init, targ, remote)
	e := ep.(*Endpoint)
	local := init.alloc(t, 4096, 1)
	comp := make(chanCompleter, 1)
	tok := uint64(0)
	read := func() {
		t.Helper()
		tok++
		s := localSlice(transport.Read, local, remote.addr, tok)
		s.Class = transport.ClassHigh
		if k, err := ep.Post(comp, []transport.Slice{s}); k != 1 || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		if err := comp.await(t, 1)[tok]; err != nil {
			t.Fatalf("READ: %v", err)
		}
	}
	read()
	lane := expressUp(t, e)
	read()
	if lane.q.Committed() != 1 {
		t.Fatalf("the express lane took %d slices, want 1", lane.q.Committed())
	}
	lane.fail(transport.ErrPeer)
	<-lane.dead
	if e.pick.Cooling(0) || e.pick.Cooling(1) {
		t.Fatal("the express lane's failure cooled a rail")
	}
	read() // on a rail, or on the lane redialed already
	again := expressUp(t, e)
	if again == lane {
		t.Fatal("the broken lane is still the lane")
	}
	before := again.q.Committed()
	read()
	if again.q.Committed() != before+1 {
		t.Fatal("the redialed express lane did not take the high-class READ")
	}
}

// TestExpressLaneClose: an endpoint closed while its express lane dials
// (into a target that accepts and never answers, with a dial timeout far
// past the hang detector) or just as the first high-class slice starts it
// returns, and its keeper goes (TestMain's leak check counts the
// goroutines left).
func TestExpressLaneClose(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, page, 0), true)
	px := newProxy(t, targ.tr.Addr())
	init := newSide(t, Config{Rails: 1, DialTimeout: time.Hour})
	high := localSlice(transport.Read, init.alloc(t, 8, 0), remote.addr, 1)
	high.Class = transport.ClassHigh
	for round := range 20 {
		ep, err := init.tr.Open(context.Background(), targ.desc(px.addr(), remote))
		if err != nil {
			t.Fatal(err)
		}
		e := ep.(*Endpoint)
		if round == 0 {
			px.blackhole.Store(true) // the lane's dial never ends
		}
		comp := make(chanCompleter, 1)
		if k, err := ep.Post(comp, []transport.Slice{high}); k != 1 || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		if round == 0 {
			waitFor(t, "the lane to dial into the black hole", func() bool { return px.holes.Load() >= 1 })
		}
		inTime(t, "Endpoint.Close", func() { ep.Close() })
		comp.await(t, 1)
		if e.expressOn.Load() && e.express.Load() != nil && !e.express.Load().failed.Load() {
			t.Fatal("the express lane is up after Close")
		}
		if round == 0 {
			px.blackhole.Store(false)
		}
	}
	// A Post after Close starts nothing.
	ep, err := init.tr.Open(context.Background(), targ.desc(px.addr(), remote))
	if err != nil {
		t.Fatal(err)
	}
	ep.Close()
	if k, err := ep.Post(make(chanCompleter, 1), []transport.Slice{high}); k != 0 || err == nil {
		t.Fatalf("Post after Close: %d, %v", k, err)
	}
	if ep.(*Endpoint).expressOn.Load() {
		t.Fatal("a Post after Close started the express lane")
	}
}

// TestExpressAllocs: high-class 4 KiB READs and WRITEs over the express
// lane allocate nothing per slice, one at a time and 64 at once (the
// process is counted: sender, receiver, target).
func TestExpressAllocs(t *testing.T) {
	for _, batch := range []int{1, 64} {
		for _, op := range []transport.Op{transport.Write, transport.Read} {
			sp := newSteadyBatch(t, op, batch)
			for i := range sp.s {
				sp.s[i].Class = transport.ClassHigh
			}
			sp.one() // starts the lane
			lane := expressUp(t, sp.ep.(*Endpoint))
			for range max(50, 200/batch) {
				sp.one()
			}
			before := lane.q.Committed()
			runs := max(100, 500/batch)
			allocs := testing.AllocsPerRun(runs, sp.one)
			if sp.fails != 0 {
				t.Fatalf("op %d, %d at a time: %d slices failed or hung", op, batch, sp.fails)
			}
			if got := lane.q.Committed() - before; got != uint64((runs+1)*batch) {
				t.Fatalf("op %d: the express lane took %d of %d slices", op, got, (runs+1)*batch)
			}
			if allocs != 0 && countAllocs(t) {
				t.Errorf("op %d: %v allocations per batch of %d high-class slices, want 0", op, allocs, batch)
			}
		}
	}
}

// TestExpressLaneGroups: high-class WRITEs posted together go on the
// express lane as group frames when the target offers them, as a rail's
// do, and every one lands where it was sent; the rail carries none.
func TestExpressLaneGroups(t *testing.T) {
	const n, size = 64, 32 << 10
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, n*size, 0), true)
	init := newSide(t, Config{Rails: 1})
	ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	e := ep.(*Endpoint)
	local := init.alloc(t, n*size, 0)
	o := order{make(chanCompleter, n)}
	// The first high-class slice starts the lane (and takes the rail).
	start := localSlice(transport.Read, local[:size], remote.addr, 1000)
	start.Class = transport.ClassHigh
	if k, err := ep.Post(o.ch, []transport.Slice{start}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	o.next(t, 1)
	lane := expressUp(t, e)
	testpattern.Fill(local, 4)
	framesBefore := targ.tr.groups.frames.Load()
	railBefore := e.rails[0].Load().q.Committed()
	s := make([]transport.Slice, n)
	for i := range s { // every block to another place, in reverse
		j := n - 1 - i
		s[i] = localSlice(transport.Write, local[i*size:(i+1)*size], remote.addr+uint64(j*size), uint64(i+1))
		s[i].Class = transport.ClassHigh
	}
	if k, err := ep.Post(o.ch, s); k != n || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	o.next(t, n)
	for i := range n {
		j := n - 1 - i
		if d := testpattern.FirstDiff(remote.mem[j*size:(j+1)*size], local[i*size:(i+1)*size]); d >= 0 {
			t.Fatalf("block %d differs at %d", j, d)
		}
	}
	if got := e.rails[0].Load().q.Committed() - railBefore; got != 0 {
		t.Fatalf("the rail took %d high-class slices while the express lane was up", got)
	}
	if got := lane.q.Committed(); got != n {
		t.Fatalf("the express lane took %d slices, want %d", got, n)
	}
	if g := targ.tr.groups.frames.Load() - framesBefore; g == 0 {
		t.Fatal("the express lane sent no group frame")
	}
}
