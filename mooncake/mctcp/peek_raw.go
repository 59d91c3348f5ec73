//go:build linux && (amd64 || arm64)

package mctcp

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// peekByte peeks at one byte of socket fd without waiting or taking it:
// recvfrom(2) with MSG_PEEK|MSG_DONTWAIT, called raw so that nothing is
// allocated (unix.Recvfrom's address buffer escapes). err is nil or an
// unix.Errno.
func peekByte(fd int, b *byte) (int, error) {
	n, _, e := unix.Syscall6(unix.SYS_RECVFROM, uintptr(fd), uintptr(unsafe.Pointer(b)), 1, unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}
