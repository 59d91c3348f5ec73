package shm

// RaceEnabled says whether the race detector is on, for the external tests.
const RaceEnabled = raceEnabled

// Closing reports whether t's Close has begun.
func Closing(t *Transport) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}

// HeldRefs is how many references to e's mappings are held: none when no
// copy runs.
func HeldRefs(e *Endpoint) int {
	n := 0
	e.maps.Ascend(func(_ uint64, g *mapping) bool {
		n += g.ref.InUse()
		return true
	})
	return n
}
