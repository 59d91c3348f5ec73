package moonring

import "time"

// SetHealthClock gives e's health manager the clock it reads and waits
// with (a fake one in tests); set it before opening segments.
func SetHealthClock(e *Engine, c interface {
	Now() time.Time
	After(time.Duration) <-chan time.Time
}) {
	e.health.mu.Lock()
	e.health.clock = c
	e.health.mu.Unlock()
	e.health.wake()
}
