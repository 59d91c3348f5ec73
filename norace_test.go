//go:build !race

package moonring_test

// raceEnabled: the race detector is on (see race_test.go).
const raceEnabled = false
