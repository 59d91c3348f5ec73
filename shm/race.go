//go:build race

package shm

import "syscall"

// raceEnabled says whether the race detector is on.
const raceEnabled = true

// raceAcquire gives the race detector the edge from the peer's write(2) to
// this raw recvmsg(2) on fd, which the runtime annotates only for read(2):
// a zero-byte read(2) through package syscall carries the annotation.
func raceAcquire(fd int) { syscall.Read(fd, nil) }
