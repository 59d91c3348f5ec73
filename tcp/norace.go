//go:build !race

package tcp

func raceRelease() {}
