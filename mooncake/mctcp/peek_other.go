//go:build unix && !(linux && (amd64 || arm64))

package mctcp

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// peekByte peeks at one byte of socket fd without waiting or taking it
// (recvfrom(2) with MSG_PEEK|MSG_DONTWAIT).
func peekByte(fd int, b *byte) (int, error) {
	n, _, err := unix.Recvfrom(fd, unsafe.Slice(b, 1), unix.MSG_PEEK|unix.MSG_DONTWAIT)
	return n, err
}
