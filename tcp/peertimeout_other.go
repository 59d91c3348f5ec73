//go:build !linux

package tcp

import (
	"net"
	"time"
)

// setPeerTimeout does nothing here: Config.PeerTimeout is Linux only.
func setPeerTimeout(*net.TCPConn, time.Duration) error { return nil }
