package rails

import (
	"sync"
	"testing"
	"time"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"
)

// TestConcurrent: pollers picking, receivers completing and a redialer
// failing rails, all at once (run with -race): every pick is in range, and
// once every rail is healed the count of cooling rails is back to 0.
func TestConcurrent(t *testing.T) {
	var c clock
	c.set(int64(time.Hour))
	const n = 4
	p := newPicker(t, n, c.config())
	var pollers, redialer sync.WaitGroup
	stop := make(chan struct{})
	bad := make(chan int, 1)
	for range 4 {
		pollers.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				for range 100 {
					r := p.Pick()
					if r < 0 || r >= n {
						select {
						case bad <- r:
						default:
						}
						return
					}
					p.Done(r, 4096, c.now(), c.now()+1000)
				}
			}
		})
	}
	redialer.Go(func() { // and the clock
		for k := range 2000 {
			p.Failed(k % n)
			c.add(50 * ms)
		}
	})
	redialer.Wait()
	close(stop)
	pollers.Wait()
	select {
	case r := <-bad:
		t.Fatalf("Pick returned rail %d of %d", r, n)
	default:
	}
	// Heal every rail: past any cooldown, picks probe each, and a success
	// on each heals it.
	c.add(int64(time.Minute))
	for i := range n {
		if p.Cooling(i) {
			p.rails[i].until.Store(p.rails[i].until.Load() | 1) // as if probed
			ok(p, &c, i)
		}
	}
	if got := p.cooling.Load(); got != 0 {
		t.Fatalf("%d rails counted cooling after all healed", got)
	}
}

// TestAllocs: Pick, Done and Failed allocate nothing, with every
// rail healthy and with one cooling (the clock read, the probe).
func TestAllocs(t *testing.T) {
	var c clock
	c.set(int64(time.Hour))
	p := newPicker(t, 8, c.config())
	step := func() {
		r := p.Pick()
		p.Done(r, 4096, c.now(), c.now()+1000)
	}
	if a := testing.AllocsPerRun(1000, step); a != 0 {
		t.Errorf("Pick, Done: %v allocations, want 0", a)
	}
	p.Failed(3)
	cooling := func() {
		step()
		c.add(ms)
		p.Failed(3)
	}
	if a := testing.AllocsPerRun(1000, cooling); a != 0 {
		t.Errorf("with a rail cooling and probed: %v allocations, want 0", a)
	}
}

// TestPickInRange: whatever a transport feeds it (any number of rails,
// penalties, samples of any size and time, failures, the clock moving by
// any amount), Pick returns a rail in range, and the count of cooling
// rails matches the rails cooling.
func TestPickInRange(t *testing.T) {
	type op struct {
		Kind  int // 0 pick, 1 done, 2 failed, 3 clock
		Rail  int
		Bytes uint64
		Dt    int64
	}
	genOp := gopter.CombineGens(gen.IntRange(0, 3), gen.IntRange(0, MaxRails-1), gen.UInt64(), gen.Int64Range(0, int64(20*time.Second))).
		Map(func(v []any) op { return op{v[0].(int), v[1].(int), v[2].(uint64), v[3].(int64)} })
	ps := properties(t, 300)
	ps.Property("Pick in [0, n)", prop.ForAll(
		func(n int, pen []float64, ops []op) bool {
			var c clock
			cfg := c.config()
			if len(pen) >= n {
				cfg.Penalty = pen[:n]
			}
			p, err := New(n, cfg)
			if err != nil {
				t.Logf("New: %v", err)
				return false
			}
			for _, o := range ops {
				r := o.Rail % n
				switch o.Kind {
				case 0:
					if got := p.Pick(); got < 0 || got >= n {
						t.Logf("Pick: %d of %d", got, n)
						return false
					}
				case 1:
					p.Done(r, o.Bytes, c.now(), c.now()+o.Dt)
				case 2:
					p.Failed(r)
				case 3:
					c.add(o.Dt)
				}
			}
			cooling := 0
			for i := range n {
				if p.Cooling(i) {
					cooling++
				}
			}
			if got := p.Pick(); got < 0 || got >= n || int(p.cooling.Load()) != cooling {
				t.Logf("Pick %d of %d; %d counted cooling, %d are", got, n, p.cooling.Load(), cooling)
				return false
			}
			return true
		},
		gen.IntRange(1, MaxRails),
		gen.SliceOf(gen.Float64Range(0.01, 1)),
		gen.SliceOf(genOp),
	))
	ps.TestingRun(t)
}

// BenchmarkPick measures Pick and Done over 4 rails from parallel
// goroutines (go test -bench Pick ./internal/rails/).
func BenchmarkPick(b *testing.B) {
	p, err := New(4, Config{})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			r := p.Pick()
			now := p.Now()
			p.Done(r, 4096, now, now+1000)
		}
	})
}
