package nvlink

import (
	"os"
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		// The target process of the GPU tests: see gpu_test.go.
		os.Exit(gpuChild())
	}
	if os.Getenv(engineChildEnv) != "" {
		// The target engine of the engine-level GPU tests: engine_test.go.
		os.Exit(engineChild())
	}
	leakcheck.VerifyTestMain(m)
}
