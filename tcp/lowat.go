// lowat.go holds the receive low-water mark of the target's payload
// reads: before waiting for the rest of the WRITE payloads whose headers
// came, the target asks the kernel (SO_RCVLOWAT) not to wake it until
// that much is in (up to maxLowat), instead of at every segment that
// arrives. Reading groups of 32 KiB WRITEs it woke and read about four
// times per group; each wake costs a readv, an epoll_pwait and two
// context switches, which on one host the two sides take from each
// other's CPU.
//
// The mark is raised only for bytes the initiator has committed to send:
// a frame's payloads must follow its headers within the frame timeout
// (PROTOCOL.md), and this initiator writes a frame whole, so the
// payloads of a group or a WRITE whose header came are on their way.
// Every other wait (the next request) puts the mark back to one byte
// before it waits. The kernel caps the mark at half the receive buffer
// and wakes the reader anyway when the receive window has closed or
// memory is short, so a mark never stalls a connection; an initiator
// that stops mid-payload meets the frame's deadline, which bounds the
// whole payload, as before.
//
// The initiator's reads of READ payloads take no mark: its response
// timeout bounds the wait for each part of a payload, and a mark would
// hide a slow payload's progress until the mark's worth was in. One was
// tried, with the deadline counting bytes the mark left unread as come
// when TCP_INFO said the last one did: 1 MiB READs took 40 % fewer
// readvs and half the epoll waits, and no less CPU per GB (5 interleaved
// rounds), so it was left out.

package tcp

import "golang.org/x/sys/unix"

// maxLowat bounds the low-water mark: a payload larger than this is read
// in pieces about this big, the copy of one overlapping the arrival of
// the next.
const maxLowat = 256 << 10

// setLowat sets the socket's SO_RCVLOWAT to n bytes (at least 1), with a
// system call only when it changes. It fails only on a socket closed
// under it (EBADF), whose wait then fails too.
func (r *nbReader) setLowat(fd uintptr, n int) {
	n = max(n, 1)
	if n == max(r.lowatSet, 1) { // 0: never set, the kernel's 1
		return
	}
	if unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT, n) == nil {
		r.lowatSet = n
		r.lowats++
	}
}

// expect sets the mark the next waits take: n bytes are on their way
// (0: none known, the default of one byte).
func (r *nbReader) expect(n int) { r.lowat = min(n, maxLowat) }
