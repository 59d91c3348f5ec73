//go:build linux

package shm

import (
	"io"
	"net"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// packets reads the packets of one connection with recvmsg(2), without the
// peer's address that net.UnixConn.ReadMsgUnix fetches and allocates for
// every packet. One goroutine reads; it allocates nothing per packet.
type packets struct {
	rc  syscall.RawConn
	buf []byte // one packet, and a byte more to see one too long
	oob []byte // room for a few descriptors

	n, oobn, flags int
	err            error
	fn             func(fd uintptr) bool // built once: a closure per read would allocate
}

func newPackets(c *net.UnixConn) (*packets, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	p := &packets{rc: rc, buf: make([]byte, maxMsg+1), oob: make([]byte, unix.CmsgSpace(4*16))}
	p.fn = func(fd uintptr) bool {
		iov := unix.Iovec{Base: &p.buf[0]}
		iov.SetLen(len(p.buf))
		h := unix.Msghdr{Iov: &iov, Iovlen: 1, Control: &p.oob[0]}
		h.SetControllen(len(p.oob))
		r, _, errno := unix.Syscall(unix.SYS_RECVMSG, fd, uintptr(unsafe.Pointer(&h)), unix.MSG_CMSG_CLOEXEC)
		if errno == unix.EAGAIN {
			return false // wait until readable
		}
		raceAcquire(int(fd))
		p.n, p.oobn, p.flags, p.err = int(r), int(h.Controllen), int(h.Flags), nil
		if errno != 0 {
			p.err = errno
		}
		return true
	}
	return p, nil
}

// read returns the next packet and its control data, valid until the next
// read. A connection the peer closed reads as io.EOF.
func (p *packets) read() (pkt, oob []byte, flags int, err error) {
	if err := p.rc.Read(p.fn); err != nil {
		return nil, nil, 0, err
	}
	if p.err != nil {
		return nil, nil, 0, p.err
	}
	if p.n == 0 {
		// Our packets are never empty; an empty one may still carry
		// descriptors, which must not stay open in this process.
		if p.oobn > 0 {
			closeRights(p.oob[:p.oobn])
		}
		return nil, nil, 0, io.EOF
	}
	return p.buf[:p.n], p.oob[:p.oobn], p.flags, nil
}
