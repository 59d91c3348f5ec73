//go:build race

package tcp

import (
	"runtime"
	"syscall"
	"unsafe"
)

// raceEnabled says whether the race detector is on.
const raceEnabled = true

// raceRelease tells the race detector that what this goroutine wrote
// happens before the peer reads the bytes about to be sent. The runtime
// annotates plain write(2) and read(2) this way but not writev(2), which
// net.Buffers uses: a zero-byte write to no descriptor carries the
// annotation and nothing else.
func raceRelease() { syscall.Write(-1, nil) }

// raceAcquire is raceRelease's counterpart for bytes read with a raw
// read(2) from fd: a zero-byte read(2) through package syscall carries the
// annotation.
func raceAcquire(fd int) { syscall.Read(fd, nil) }

// raceReadIovecs tells the race detector that a writev(2) read the first n
// bytes of iov, as unix.Writev does: a caller changing a WRITE's buffer
// while it is being sent is then reported.
func raceReadIovecs(iov [][]byte, n int) {
	for _, b := range iov {
		if n <= 0 {
			return
		}
		if m := min(len(b), n); m > 0 {
			runtime.RaceReadRange(unsafe.Pointer(&b[0]), m)
			n -= m
		}
	}
}
