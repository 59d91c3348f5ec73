//go:build race

package cq_test

// raceEnabled is set in -race builds, where the race detector's annotations
// of unix.Read and unix.Write move their buffers to the heap.
const raceEnabled = true
