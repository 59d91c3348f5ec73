// Package proptest holds what the packages' gopter property tests share: a
// seed that is logged, and settable with -gopter.seed, so a failure
// replays. Test code only.
package proptest

import (
	"flag"
	"testing"
	"time"

	"github.com/leanovate/gopter"
)

var seedFlag = flag.Int64("gopter.seed", 0, "seed for the gopter properties; 0 takes one from the clock")

// Properties returns gopter properties that run each property runs times
// with a logged seed, so that a failure replays with -gopter.seed.
func Properties(t *testing.T, runs int) *gopter.Properties {
	t.Helper()
	seed := *seedFlag
	if seed == 0 {
		seed = time.Now().UnixNano()
	}
	t.Logf("gopter seed %d; replay: go test -run '^%s$' -gopter.seed=%d", seed, t.Name(), seed)
	p := gopter.DefaultTestParametersWithSeed(seed)
	p.MinSuccessfulTests = runs
	return gopter.NewProperties(p)
}
