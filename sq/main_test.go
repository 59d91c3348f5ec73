package sq_test

import (
	"testing"

	"github.com/leanovate/gopter"
	"go.uber.org/goleak"

	"github.com/moonring/moonring/internal/proptest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// properties: see proptest.Properties.
func properties(t *testing.T, runs int) *gopter.Properties { return proptest.Properties(t, runs) }
