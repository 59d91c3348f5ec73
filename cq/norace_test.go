//go:build !race

package cq_test

const raceEnabled = false
