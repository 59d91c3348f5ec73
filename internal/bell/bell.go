// Package bell is the doorbell that wakes a parked goroutine (a poller, a
// sender) without a syscall or channel operation while it is awake: the
// waiter arms it, checks for work once more and sleeps; a producer rings
// it only when armed (io_uring's SQ_NEED_WAKEUP).
package bell

import "sync/atomic"

// Doorbell wakes a parked poller. One Doorbell serves all the queues of one
// poller. Its zero value is not usable; use New. Safe for concurrent
// use: any goroutine may Ring, only the poller Arms and Waits.
type Doorbell struct {
	armed atomic.Bool
	ch    chan struct{}
}

// New returns a disarmed doorbell.
func New() *Doorbell { return &Doorbell{ch: make(chan struct{}, 1)} }

// Ring wakes the poller if it is armed. It costs one atomic load when not.
func (d *Doorbell) Ring() {
	if d.armed.Load() && d.armed.CompareAndSwap(true, false) {
		select {
		case d.ch <- struct{}{}:
		default:
		}
	}
}

// Armed reports whether the waiter is parked (or about to park).
func (d *Doorbell) Armed() bool { return d.armed.Load() }

// Arm announces that the poller is about to park. The poller must check for
// work after Arm and before Wait, and Disarm if it finds any.
func (d *Doorbell) Arm() { d.armed.Store(true) }

// Disarm cancels Arm.
func (d *Doorbell) Disarm() { d.armed.Store(false) }

// C returns the channel that receives a value when the doorbell rings.
func (d *Doorbell) C() <-chan struct{} { return d.ch }
