//go:build !race

package nvlink

const raceEnabled = false
