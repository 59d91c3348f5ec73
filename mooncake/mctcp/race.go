//go:build race

package mctcp

import "syscall"

// raceRelease tells the race detector that what this goroutine wrote
// happens before the peer reads the bytes about to be sent. The runtime
// annotates plain write(2) and read(2) this way but not writev(2), which
// net.Buffers uses: a zero-byte write to no descriptor carries the
// annotation and nothing else.
func raceRelease() { syscall.Write(-1, nil) }
