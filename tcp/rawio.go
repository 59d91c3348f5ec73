// rawio.go holds the raw system calls on non-blocking TCP sockets: reads
// and readv (nbReader: the target's requests, the initiator's answers,
// readv's buffers planned by readplan.go) and writev
// (rawWriter: the target's responses, the initiator's sender).
//
// A plain system call enters and leaves the Go scheduler's syscall state.
// When the process had gone idle, that entry wakes sysmon, which then
// polls every 20 µs for a millisecond and more, and a call that lasts
// past a tick (a read or write that copies a large payload) has sysmon
// hand the goroutine's P to another thread. On a bulk stream that went
// idle between bursts this was a sixth of the receiving side's CPU. A
// call on a non-blocking socket never blocks, so the scheduler need not
// know of it: a raw call skips all of that, and a wait for the socket is
// still the netpoller's (syscall.RawConn's Read and Write), deadlines
// included.

package tcp

import (
	"io"
	"math"
	"net"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// newNBReader returns the reader of raw's bytes for a bufio.Reader: raw
// reads on a TCP connection, raw's own Read on anything else.
func newNBReader(raw net.Conn) *nbReader {
	r := &nbReader{Conn: raw}
	if tc, ok := raw.(*net.TCPConn); ok {
		r.rc, _ = tc.SyscallConn()
		r.readFn = func(fd uintptr) bool {
			r.rawRead(fd)
			return true // never wait: the caller asked not to
		}
		r.waitFn = func(fd uintptr) bool {
			r.rawRead(fd)
			return r.ready(fd) // else the netpoller waits
		}
		r.readvFn = func(fd uintptr) bool {
			r.rawReadv(fd)
			return r.ready(fd)
		}
		r.idleFn = func(fd uintptr) bool {
			if r.waited {
				// Woken: bytes came (or an end, an error) since the
				// peek below found none. A wake with nothing to read
				// would only make the next read wait, with a buffer.
				return true
			}
			r.waited = true
			// After RawConn.Read reset the poller's readiness: a byte
			// that came before is seen here, not lost.
			return r.readable(fd)
		}
	}
	return r
}

// waitIdle waits until the socket has bytes to read (or an end, an error,
// the read deadline), reading none, so that the caller holds no buffer
// for it meanwhile: the target's frames wait for the next request so
// (server.go). Its error is the one the next read gets; only raw reads
// (rc set) wait here.
func (r *nbReader) waitIdle() error {
	r.waited = false
	return r.rc.Read(r.idleFn)
}

// readable reports whether the socket has bytes to read, an end or an
// error, peeking at one byte without taking it; when it has none it sets
// the low-water mark the wait takes and reports false.
func (r *nbReader) readable(fd uintptr) bool {
	for {
		r.calls++
		_, _, e := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&r.peek[0])), 1, unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
		switch e {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			r.setLowat(fd, r.lowat)
			return false
		}
		r.keep(e)
		return true
	}
}

// keep keeps e, what a peek at the socket returned, for the next read
// when it is an error the peek took from the socket (not "no bytes").
func (r *nbReader) keep(e syscall.Errno) {
	if e != 0 && e != unix.EAGAIN && e != unix.EINTR {
		r.peeked = e
	}
}

// takePeeked reports, as a read's result, the error a peek took from the
// socket, if any (true: the read is not made).
func (r *nbReader) takePeeked() bool {
	if r.peeked == 0 {
		return false
	}
	r.n, r.err, r.peeked = 0, r.peeked, 0
	return true
}

// readv is Read (waiting for bytes) into the buffers of v, in order, in
// one system call: a read plan (readplan.go) puts there the rest of a
// payload and the answers that follow it, and sees to the bytes that came
// past the first buffer. The caller reads what over holds first (with
// Read), and uses readv only with raw reads (rc set: not TLS).
func (r *nbReader) readv(v []unix.Iovec) (int, error) {
	r.v = v
	err := r.rc.Read(r.readvFn)
	r.v = nil
	switch {
	case err != nil:
		return 0, err
	case r.err != nil:
		return 0, r.err
	case r.n == 0:
		return 0, io.EOF
	}
	return r.n, nil
}

// ready reports whether the read just made is done (bytes, an error, the
// end); when it found nothing it sets the low-water mark the wait takes
// (lowat.go) and reports false, and the netpoller waits.
func (r *nbReader) ready(fd uintptr) bool {
	if r.err != unix.EAGAIN {
		return true
	}
	r.setLowat(fd, r.lowat)
	return false
}

// held is how many bytes of the stream were read before they were asked
// for and wait for the next Read (over).
func (r *nbReader) held() int { return len(r.over) }

// maxIovecs is the most iovecs one writev takes (Linux's IOV_MAX).
const maxIovecs = 1024

// rawWriter writes buffers to a non-blocking socket with raw writev
// calls, waiting in the netpoller while the socket is full. It belongs to
// one goroutine.
type rawWriter struct {
	rc   syscall.RawConn
	fn   func(fd uintptr) bool
	bufs [][]byte
	iov  []unix.Iovec
	n    int64 // written by this writeAll
	err  error
}

func newRawWriter(rc syscall.RawConn) *rawWriter {
	w := &rawWriter{rc: rc, iov: make([]unix.Iovec, 0, 64)}
	w.fn = w.write
	return w
}

// writeAll writes every byte of bufs, or returns why it could not
// (a deadline passed, the connection broke), with the bytes written. It
// moves bufs' elements on as their bytes go out.
func (w *rawWriter) writeAll(bufs [][]byte) (int64, error) {
	w.bufs, w.n, w.err = bufs, 0, nil
	err := w.rc.Write(w.fn)
	w.bufs = nil
	// Nothing of the written buffers stays reachable from here: a
	// connection's pooled response buffer (server.go) goes back to the
	// pool, and registered memory may be unregistered.
	clear(w.iov[:cap(w.iov)])
	w.iov = w.iov[:0]
	if err == nil {
		err = w.err
	}
	return w.n, err
}

// write is fn: writev until every buffer is out (true), the socket is
// full (false: the netpoller waits), or an error (true, in w.err).
func (w *rawWriter) write(fd uintptr) bool {
	for len(w.bufs) > 0 {
		w.iov = appendIovecs(w.iov[:0], w.bufs)
		if len(w.iov) == 0 {
			w.bufs = nil
			break
		}
		n, e := rawWritev(fd, w.iov, w.bufs)
		switch e {
		case 0:
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		default:
			w.err = e
			return true
		}
		w.n += int64(n)
		for k := n; k > 0; {
			if k < len(w.bufs[0]) {
				w.bufs[0] = w.bufs[0][k:]
				break
			}
			k -= len(w.bufs[0])
			w.bufs = w.bufs[1:]
		}
		for len(w.bufs) > 0 && len(w.bufs[0]) == 0 {
			w.bufs = w.bufs[1:]
		}
	}
	return true
}

// appendIovecs appends to dst an iovec for each non-empty buffer of bufs,
// up to maxIovecs in all.
func appendIovecs(dst []unix.Iovec, bufs [][]byte) []unix.Iovec {
	for _, b := range bufs {
		if len(dst) == maxIovecs {
			break
		}
		if len(b) > 0 {
			v := unix.Iovec{Base: &b[0]}
			v.SetLen(len(b))
			dst = append(dst, v)
		}
	}
	return dst
}

// rawWritev is one raw writev(2) of v, the iovecs of bufs, to fd. For
// the race detector it reads bufs and releases before the call, so that
// the peer's read of the bytes (an acquire) follows both even when it
// comes before the call returns.
func rawWritev(fd uintptr, v []unix.Iovec, bufs [][]byte) (int, syscall.Errno) {
	raceReadIovecs(bufs, math.MaxInt)
	raceRelease()
	n, _, e := unix.RawSyscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&v[0])), uintptr(len(v)))
	return int(n), e
}

// rawReadv reads what the socket holds into the buffers of r.v, without
// blocking: readv(2), as rawRead.
func (r *nbReader) rawReadv(fd uintptr) {
	if r.takePeeked() {
		return
	}
	var n uintptr
	var e syscall.Errno
	for {
		r.calls++
		n, _, e = unix.RawSyscall(unix.SYS_READV, fd, uintptr(unsafe.Pointer(unsafe.SliceData(r.v))), uintptr(len(r.v)))
		if e != unix.EINTR {
			break
		}
	}
	r.n, r.err = int(n), nil
	if e != 0 {
		r.n, r.err = 0, e
	}
	if r.n > 0 {
		raceAcquire(int(fd))
	}
}

// rawRead reads what the socket holds into r.p, without blocking.
func (r *nbReader) rawRead(fd uintptr) {
	if r.takePeeked() {
		return
	}
	var n uintptr
	var e syscall.Errno
	for {
		r.calls++
		n, _, e = unix.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(unsafe.SliceData(r.p))), uintptr(len(r.p)))
		if e != unix.EINTR {
			break
		}
	}
	r.n, r.err = int(n), nil
	if e != 0 {
		r.n, r.err = 0, e
	}
	if r.n > 0 {
		raceAcquire(int(fd))
	}
}
