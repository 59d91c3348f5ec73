package sq_test

import (
	"testing"

	"github.com/leanovate/gopter"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/internal/proptest"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

// properties: see proptest.Properties.
func properties(t *testing.T, runs int) *gopter.Properties { return proptest.Properties(t, runs) }
