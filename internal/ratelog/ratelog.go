// Package ratelog bounds how often a kind of event is logged: what a
// stranger can provoke (refused connections, forged descriptors) must not
// flood the log. A Limit lets one event through per interval and counts
// those it holds back, so the next line can say how many there were.
package ratelog

import (
	"sync/atomic"
	"time"
)

// Limit passes on at most one event per Every (a second when zero). Its
// zero value is ready for use; it is safe for concurrent use and never
// blocks. It must not be copied after first use.
type Limit struct {
	Every time.Duration

	last       atomic.Int64 // unix nanoseconds of the last event passed on; 0: none yet
	suppressed atomic.Uint64
}

// Allow reports whether to log this event, and, when it does, how many
// events it held back since the last one it let through.
func (l *Limit) Allow() (ok bool, suppressed uint64) {
	every := l.Every
	if every <= 0 {
		every = time.Second
	}
	now := time.Now().UnixNano()
	last := l.last.Load()
	if (last != 0 && now-last < int64(every)) || !l.last.CompareAndSwap(last, now) {
		l.suppressed.Add(1)
		return false, 0
	}
	return true, l.suppressed.Swap(0)
}
