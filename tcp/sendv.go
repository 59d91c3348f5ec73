// sendv.go holds the system calls of a rail's sending: writev(2) over the
// conn's iovec array, and the io_uring sender of Config.IOUring.

package tcp

import (
	"errors"

	"github.com/moonring/moonring/internal/uring"
	"golang.org/x/sys/unix"
)

// useUring gives the sender an io_uring of its own; where io_uring is not
// available (old kernels, containers that block it) the sender keeps the
// netpoller's writev.
func (c *conn) useUring() {
	r, err := uring.New(8)
	if err != nil {
		c.e.t.cfg.Logger.Info("tcp: io_uring not available, using the netpoller", "err", err)
		return
	}
	c.rc.Control(func(fd uintptr) { c.fd = int(fd) })
	c.ur = r
}

// iovecs fills c.uiov with iov's non-empty buffers. The sending flag must
// be held.
func (c *conn) iovecs(iov [][]byte) []unix.Iovec {
	c.uiov = appendIovecs(c.uiov[:0], iov)
	return c.uiov
}

// writev is one writev(2) of iov to fd through c.uiov. unix.Writev would
// make its iovec array on every call, on the heap once there are more than
// eight (a pipelined kick gathers up to 189 iovecs, some 94 WRITE
// frames). The sending flag must be held.
func (c *conn) writev(fd int, iov [][]byte) (int, error) {
	v := c.iovecs(iov)
	if len(v) == 0 {
		return 0, nil
	}
	n, e := rawWritev(uintptr(fd), v, iov)
	if e != 0 {
		return 0, e
	}
	return n, nil
}

// uringWrite writes iov with one IORING_OP_WRITEV and waits for it. The
// memory stays put: registered buffers are pinned or mmap'd, headers live
// in the conn, and the ring keeps the iovec array referenced.
func (c *conn) uringWrite(iov [][]byte) (int64, error) {
	v := c.iovecs(iov)
	sqe := c.ur.SQE()
	if sqe == nil {
		return 0, errors.New("tcp: io_uring submission queue full")
	}
	uring.PrepWritev(sqe, c.fd, v, -1, 1)
	if _, err := c.ur.SubmitAndWait(1); err != nil {
		return 0, err
	}
	_, res, ok := c.ur.PeekCQE()
	if !ok {
		var err error
		if _, res, err = c.ur.WaitCQE(); err != nil {
			return 0, err
		}
	}
	c.ur.CQEAdvance(1)
	if err := uring.ResultError(res); err != nil {
		return 0, err
	}
	return int64(res), nil
}
