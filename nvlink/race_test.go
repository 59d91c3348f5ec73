//go:build race

package nvlink

// raceEnabled: the race detector is on; sync.Pool drops a share of what
// is put back, so allocation counts mean nothing.
const raceEnabled = true
