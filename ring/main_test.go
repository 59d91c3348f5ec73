package ring

import (
	"flag"
	"testing"
	"time"

	"github.com/leanovate/gopter"

	"github.com/moonring/moonring/internal/leakcheck"
)

var seedFlag = flag.Int64("ring.seed", 0, "seed of the property tests (0: time-based, logged)")

func TestMain(m *testing.M) {
	flag.Parse()
	leakcheck.VerifyTestMain(m)
}

// propParams returns gopter parameters with a logged seed, so a failure
// replays with -ring.seed.
func propParams(t *testing.T, runs int) *gopter.TestParameters {
	t.Helper()
	seed := *seedFlag
	if seed == 0 {
		seed = time.Now().UnixNano()
	}
	t.Logf("seed %d (replay with -ring.seed=%d)", seed, seed)
	p := gopter.DefaultTestParametersWithSeed(seed)
	p.MinSuccessfulTests = runs
	return p
}
