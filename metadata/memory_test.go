package metadata_test

import (
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/storetest"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func TestMemory(t *testing.T) {
	storetest.Run(t, func(t *testing.T) metadata.Store { return metadata.NewMemory() })
}

// The zero Memory is a usable store.
func TestMemoryZeroValue(t *testing.T) {
	storetest.Run(t, func(t *testing.T) metadata.Store { return new(metadata.Memory) })
}
