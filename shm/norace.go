//go:build !race

package shm

// raceEnabled says whether the race detector is on.
const raceEnabled = false

func raceAcquire(int) {}
