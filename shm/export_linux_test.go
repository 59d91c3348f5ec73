//go:build linux

package shm

import (
	"net"
	"testing"
)

// DialRaw connects to tr's socket as an initiator would, and with prove
// set runs the hello with tr's segment key; the test's cleanup closes it.
func DialRaw(t *testing.T, tr *Transport, prove bool) *net.UnixConn { return dialRaw(t, tr, prove) }
