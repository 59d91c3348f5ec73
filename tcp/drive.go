// drive.go holds who reads a connection's answers: the receiver goroutine,
// or a caller that posted Driven slices and reads their answers on its own
// goroutine while it waits (transport.Driver), and the hand-over of that
// reading between them.
//
// A caller waiting on the receiver pays a hand-off per answer: the
// receiver reads it, makes the caller's goroutine ready, and the runtime
// wakes an idle thread for it. On this project's 2-vCPU VM that costs more
// than the loopback round trip. A driver reads the answer itself, as a
// plain ping-pong does.

package tcp

import (
	"math"
	"time"

	"github.com/moonring/moonring/transport"
)

// Who reads a connection's answers (conn.rd).
const (
	// rdRecv: the receiver goroutine (the initial state).
	rdRecv int32 = iota
	// rdIdle: nobody; nothing was in flight when the holder let go after
	// a driven slice. The receiver is parked.
	rdIdle
	// rdOwed: a Driven slice was posted to an idle connection; its poster
	// is on its way to Drive. The receiver is parked.
	rdOwed
	// rdDriven: a driving caller. The receiver is parked.
	rdDriven
)

// posted sees to the reading of a slice just committed to a connection
// found idle: a Driven slice's poster will read it (Drive), any other
// wakes the receiver.
func (c *conn) posted(driven bool) {
	to := rdRecv
	if driven {
		to = rdOwed
	}
	if c.rd.CompareAndSwap(rdIdle, to) && !driven {
		c.wakeReceiver()
	}
	// Else the holder (receiver, or a driver) changed it meanwhile: it
	// looks at the queue after it lets go (settle, leave).
}

// wakeReceiver wakes the receiver goroutine parked in receive.
func (c *conn) wakeReceiver() {
	select {
	case c.resume <- struct{}{}:
	default: // a wake-up is pending already
	}
}

// settle runs after each answer the receiver read: when the last slice
// posted was Driven and nothing is in flight, it lets go of the reading
// (rdIdle), so that the next Driven slice's poster reads its answer, and
// reports true: the receiver parks. A post that raced in finds the state
// idle (posted) or is seen here.
func (c *conn) settle() bool {
	if !c.lastDriven.Load() || c.q.Head() != c.q.Committed() {
		return false
	}
	c.letGoIn()
	c.rd.Store(rdIdle)
	// From here another goroutine may hold the reading: the queue's
	// consumer side is no longer ours, only its atomic ends are.
	if c.q.Released() != c.q.Committed() && c.rd.CompareAndSwap(rdIdle, rdRecv) {
		return false // else a poster took it
	}
	return true
}

// defaultIdleWatch is how long a connection may sit idle with nobody
// reading it (rdIdle) before the receiver reads it again.
const defaultIdleWatch = time.Second

func (c *conn) idleWatch() time.Duration {
	if d := c.e.t.cfg.idleWatch; d > 0 {
		return d
	}
	return defaultIdleWatch
}

// watch runs on the parked receiver when its timer fires. A connection
// left idle to drivers is not read, so a peer closing it (its
// IdleTimeout, a crash) would go unseen until the next request, which
// would then fail over instead of finding the rail redialed. After
// idleWatch with no answer read, the receiver takes the reading back and
// blocks in its read again, which sees a close at once; the next Driven
// slice then finds it reading, is answered through it, and the receiver
// lets go after that answer. While drivers keep the connection busy the
// receiver only looks again later.
func (c *conn) watch(t *time.Timer) {
	d := c.idleWatch()
	if !c.rd.CompareAndSwap(rdIdle, rdRecv) {
		t.Reset(d) // a driver holds it, or is owed it
		return
	}
	if wait := c.rdr.last + int64(d) - time.Now().UnixNano(); wait > 0 {
		// An answer came within the watch: not idle, hand it back.
		if c.settle() {
			t.Reset(time.Duration(wait))
		}
	}
}

// Drive implements transport.Driver: it takes the reading of one
// connection owed to a driver (a Driven slice was posted to it while it
// was idle) and reads its answers until w.Done(), nothing is in flight on
// it, deadline passes, or Interrupt; other owed connections go back to
// the receiver. Safe for concurrent use.
func (e *Endpoint) Drive(w transport.Until, deadline int64) {
	var mine *conn
	e.eachConn(func(c *conn) {
		if c.rd.Load() != rdOwed {
			return
		}
		if mine == nil && c.rd.CompareAndSwap(rdOwed, rdDriven) {
			mine = c
			return
		}
		if c.rd.CompareAndSwap(rdOwed, rdRecv) {
			c.wakeReceiver()
		}
	})
	if mine != nil {
		mine.drive(w, deadline)
	}
}

// Interrupt implements transport.Driver: a driver of any of the
// endpoint's connections leaves once no answer is being read.
func (e *Endpoint) Interrupt() {
	e.eachConn(func(c *conn) {
		if c.rd.Load() == rdDriven {
			c.interrupt.Store(true)
			c.nc.SetReadDeadline(time.Unix(1, 0)) // a read waiting ends now
		}
	})
}

// eachConn calls fn with each connection of the endpoint that is up: the
// rails and the express lane.
func (e *Endpoint) eachConn(fn func(*conn)) {
	for i := range e.rails {
		if c := e.rails[i].Load(); c != nil {
			fn(c)
		}
	}
	if c := e.express.Load(); c != nil {
		fn(c)
	}
}

// drive reads answers on the calling goroutine, which holds the reading
// (rdDriven), then hands it back (leave).
func (c *conn) drive(w transport.Until, deadline int64) {
	c.interrupt.Store(false)
	if deadline <= 0 {
		deadline = math.MaxInt64
	}
	c.rdr.until = deadline
	c.holdIn() // spin looks at it
	for !w.Done() && !c.failed.Load() && c.q.Head() != c.q.Committed() {
		var start int64
		var caught bool
		if c.held() == 0 { // else the answer has begun (read ahead)
			start, caught = c.spin()
		}
		if err := c.receiveOne(); err != nil {
			if err != errLeave {
				c.fail(err)
			}
			break
		}
		if start != 0 {
			c.sp.done(start, c.rdr.last, caught)
		}
	}
	c.rdr.until = 0
	c.leave()
}

// leave hands a driver's reading back: idle when nothing is in flight
// and the last slice posted was Driven (the next Driven slice's poster
// reads it), else to the receiver, which it wakes.
func (c *conn) leave() {
	if c.interrupt.Swap(false) {
		c.rdr.deadline = -1 // Interrupt moved the socket's: the next read sets it
	}
	if c.lastDriven.Load() && c.q.Head() == c.q.Committed() {
		c.letGoIn()
		c.rd.Store(rdIdle)
		// As in settle, the consumer side is no longer ours.
		if c.q.Released() == c.q.Committed() || !c.rd.CompareAndSwap(rdIdle, rdRecv) {
			return // idle, or a poster took it (posted)
		}
	} else {
		c.rd.Store(rdRecv)
	}
	c.wakeReceiver()
}
