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

// RingPoller returns the NUMA node and index of the poller that drains r,
// a ring of e's; ok is false when e does not know r.
func RingPoller(e *Engine, r *Ring) (node, idx int, ok bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	o, ok := e.rings[r]
	return o.poller.node, o.poller.idx, ok
}
