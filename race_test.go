//go:build race

package moonring_test

// raceEnabled: the race detector is on. It drops a quarter of
// sync.Pool's Puts at random (the tcp target's pooled buffers among
// them), so allocation counts through tcp vary from run to run.
const raceEnabled = true
