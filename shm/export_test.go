package shm

// RaceEnabled says whether the race detector is on, for the external tests.
const RaceEnabled = raceEnabled

// Closing reports whether t's Close has begun.
func Closing(t *Transport) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}
