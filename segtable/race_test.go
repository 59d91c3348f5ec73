//go:build race

package segtable_test

// raceEnabled: the race detector is on. It drops a quarter of
// sync.Pool's Puts at random, so allocation counts vary from run to run.
const raceEnabled = true
