//go:build !linux

package shm

import (
	"fmt"

	"github.com/moonring/moonring/transport"
)

// Name is the transport's name in segment descriptors.
const Name = "shm"

// Config configures a Transport.
type Config struct{}

// Transport is the same-host transport; it exists only on Linux.
type Transport struct{ transport.Transport }

// New reports that the transport needs Linux.
func New(cfg Config) (*Transport, error) {
	return nil, fmt.Errorf("shm: %w: needs Linux", transport.ErrNotSupported)
}
