//go:build !race

package mctcp

func raceRelease() {}
