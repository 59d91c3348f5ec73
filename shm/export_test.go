package shm

// RaceEnabled says whether the race detector is on, for the external tests.
const RaceEnabled = raceEnabled
