package rails

import (
	"sync/atomic"
	"testing"

	"github.com/leanovate/gopter"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/internal/proptest"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

// properties: see proptest.Properties.
func properties(t *testing.T, runs int) *gopter.Properties { return proptest.Properties(t, runs) }

// clock is a fake clock for Config.Now: it moves only when a test moves it.
type clock struct{ ns atomic.Int64 }

func (c *clock) now() int64     { return c.ns.Load() }
func (c *clock) set(ns int64)   { c.ns.Store(ns) }
func (c *clock) add(ns int64)   { c.ns.Add(ns) }
func (c *clock) config() Config { return Config{Now: c.now} }
func newPicker(t testing.TB, n int, cfg Config) *Picker {
	t.Helper()
	p, err := New(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// shares picks n times and returns each rail's share of the picks.
func shares(p *Picker, n int) []float64 {
	counts := make([]int, p.Len())
	for range n {
		counts[p.Pick()]++
	}
	out := make([]float64, len(counts))
	for i, c := range counts {
		out[i] = float64(c) / float64(n)
	}
	return out
}

// near fails t unless every share is within tol of its wanted value.
func near(t *testing.T, what string, got, want []float64, tol float64) {
	t.Helper()
	for i := range want {
		if d := got[i] - want[i]; d > tol || d < -tol {
			t.Fatalf("%s: shares %.4f, want %.4f within %v", what, got, want, tol)
		}
	}
}
