package tcp

import (
	"net"
	"time"

	"golang.org/x/sys/unix"
)

// setPeerTimeout makes the kernel break the connection when its peer's
// host stays silent for about d (d <= 0 leaves the kernel's
// retransmission and Go's keepalive as they are):
// what was sent stays unacknowledged for d (TCP_USER_TIMEOUT), or, with
// nothing unacknowledged, keepalive probes from d/2 of silence on, a
// second or d/10 apart, go unanswered until d has passed (the kernel
// measures keepalive's silence against TCP_USER_TIMEOUT once a probe is
// out). Without the probes a connection that only waits (an initiator
// whose requests the target acknowledged, waiting for their answers; a
// target waiting for the next request) would outlive a vanished host by
// Go's keepalive, half a minute and more.
func setPeerTimeout(c *net.TCPConn, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	ms := int(max(1, min(d.Milliseconds(), 1<<31-1))) // 0 would turn it off
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, ms)
	}); err != nil {
		return err
	}
	if serr != nil {
		return serr
	}
	return c.SetKeepAliveConfig(peerKeepAlive(d))
}

// peerKeepAlive is the keepalive that setPeerTimeout gives a connection
// with a peer timeout of d > 0: the first probe after d/2 of silence,
// then one every d/10 (whole seconds, from one to keepAliveMax: the
// kernel's unit and bound). TCP_USER_TIMEOUT, not Count, ends the probes.
func peerKeepAlive(d time.Duration) net.KeepAliveConfig {
	return net.KeepAliveConfig{
		Enable:   true,
		Idle:     min(keepAliveMax, max(time.Second, (d/2).Truncate(time.Second))),
		Interval: min(keepAliveMax, max(time.Second, (d/10).Truncate(time.Second))),
		Count:    9,
	}
}

// keepAliveMax is the longest TCP_KEEPIDLE and TCP_KEEPINTVL Linux takes
// (MAX_TCP_KEEPIDLE, MAX_TCP_KEEPINTVL: 32767 s); a longer one fails.
const keepAliveMax = 32767 * time.Second
