//go:build !(linux && (amd64 || arm64))

package nvlink

import (
	"fmt"
	"runtime"

	"github.com/moonring/moonring/transport"
)

// loadCUDA fails: the transport loads libcuda through purego with struct
// arguments, which this build supports only on linux/amd64 and linux/arm64.
func loadCUDA(lib string) (driver, error) {
	return nil, fmt.Errorf("nvlink: no %s: CUDA is loaded only on linux/amd64 and linux/arm64, not %s/%s: %w", lib, runtime.GOOS, runtime.GOARCH, transport.ErrNotSupported)
}

func lockThread()   { runtime.LockOSThread() }
func unlockThread() { runtime.UnlockOSThread() }
