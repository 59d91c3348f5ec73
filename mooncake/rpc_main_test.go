package mooncake

import (
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
)

// TestMain fails the package's run when a goroutine outlives its tests:
// daemons, their connections, watches and clients must all end with
// Close.
func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }
