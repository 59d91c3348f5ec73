package nvlink

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		// The target process of the GPU tests: see gpu_test.go.
		os.Exit(gpuChild())
	}
	goleak.VerifyTestMain(m)
}
