package tcp

import (
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// setPeerTimeout makes the kernel break the connection when what was sent
// on it stays unacknowledged for d (TCP_USER_TIMEOUT); d <= 0 keeps the
// kernel's default.
func setPeerTimeout(c *net.TCPConn, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	ms := int(min(d.Milliseconds(), 1<<31-1))
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, ms)
	}); err != nil {
		return err
	}
	return serr
}
