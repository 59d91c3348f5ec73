// spin.go holds a driver's poll of its socket before its read parks: a
// bounded spin whose length adapts as a hypervisor's halt-polling does,
// kept only while it measurably beats parking.
//
// A driver whose read finds nothing parks its goroutine in the netpoller,
// and the answer then costs the runtime a wake-up: epoll_wait returns, the
// goroutine is made ready, and an idle thread is woken for it (a futex and
// an IPI on a VM). When the answer is a few tens of µs away, polling the
// socket for it on the running thread skips all of that. The spin grows
// while the waits it missed were short enough for a longer spin to catch,
// and shrinks (to nothing) while they were not, so a caller whose answers
// come slowly burns no CPU on them.
//
// Spinning can also slow the answer: the peer woken on the spinner's CPU
// is placed on another, which may have to be woken itself. Which way it
// goes depends on where the scheduler puts the two ends (on this
// project's VM spinning halves the round trip with the ends on two
// vCPUs, and adds a fifth to it when the scheduler keeps them on one), so
// the spinner measures: it keeps a moving average of the waits the spin
// caught and of those that did not spin, spins only while the first is the
// lower, and sends a few waits in every probeEvery the other way to keep
// both current.

package tcp

import (
	"runtime"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// DefaultDriveSpin is Config.DriveSpin's default: the longest a driving
// caller polls its connection before its read parks.
const DefaultDriveSpin = 50 * time.Microsecond

// spinFirst is the spin a driver starts with once a wait short enough to
// catch was seen; each such miss doubles it, up to Config.DriveSpin.
const spinFirst = 5 * time.Microsecond

// The probes: of every probeEvery waits, the last probeLen go the way the
// averages do not prefer.
const (
	probeEvery = 256
	probeLen   = 16
)

// spinner is one connection's spin state; it belongs to whoever holds the
// reading (conn.rd).
type spinner struct {
	max   int64 // Config.DriveSpin in ns; <= 0: never spin
	cur   int64 // the spin now, ns; 0: none
	ready bool  // peekFn's result
	b     [1]byte
	// withSpin and parked are moving averages (1/8 per wait) of the
	// waits, start to answer, that the spin caught and that did not spin
	// (0: none yet): a spin that misses is halt-polling's to shorten;
	// spun is whether the wait in progress spins.
	withSpin, parked int64
	spun             bool
	// looked and caught count the waits the driver measured and those
	// the spin caught (tests read them).
	looked, caught uint64
}

// peek reports whether the socket has bytes to read, or an end or error
// that a read would return, without blocking.
func (c *conn) peek() bool {
	if c.rc.Control(c.peekFn) != nil {
		return true // closed: the read says so
	}
	return c.sp.ready
}

// peekOn is peekFn's body: recv(MSG_PEEK|MSG_DONTWAIT) of one byte. Raw:
// it never blocks, so it needs nothing from the scheduler.
func (c *conn) peekOn(fd uintptr) {
	_, _, e := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&c.sp.b[0])), 1,
		unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
	c.sp.ready = e != unix.EAGAIN && e != unix.EWOULDBLOCK
	if nb, ok := c.src.(*nbReader); ok {
		nb.keep(e) // the driver peeking holds the reading
	}
}

// spin polls the socket for the next answer, before the driver reads it,
// when the spin is on and preferred. It returns when the wait started (0:
// it did not look, as on TLS, with bytes buffered, or spinning off) and
// whether bytes came within the spin.
func (c *conn) spin() (start int64, caught bool) {
	s := &c.sp
	if s.max <= 0 || c.rc == nil || c.br.Buffered() > 0 {
		return 0, false
	}
	start = time.Now().UnixNano()
	s.looked++
	s.spun = s.cur > 0 && s.prefer()
	if !s.spun {
		return start, false
	}
	for {
		if c.peek() {
			s.caught++
			return start, true
		}
		if c.interrupt.Load() || time.Now().UnixNano()-start >= s.cur {
			return start, false
		}
		// The peer may be waiting for this CPU: a goroutine of this
		// process that is runnable, or another process on this vCPU.
		// Let both run; with nothing else runnable each returns at once.
		// (One that waits on the network is not runnable: on one P the
		// scheduler polls the network only when it has nothing else to
		// run, so an in-process peer waits out the spin, which then
		// misses and shrinks; a peer in another process does not.)
		runtime.Gosched()
		unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
	}
}

// prefer reports whether this wait spins: while the waits with the spin
// average no longer than those without (or either is not known yet),
// except during a probe, which goes the other way.
func (s *spinner) prefer() bool {
	spin := s.withSpin == 0 || s.parked == 0 || s.withSpin <= s.parked
	if s.looked%probeEvery >= probeEvery-probeLen {
		return !spin
	}
	return spin
}

// done records a wait that began at start and whose answer began at got,
// caught or not by the spin: its regime's average, and the next spin.
func (s *spinner) done(start, got int64, caught bool) {
	switch w := max(got-start, 1); {
	case caught:
		s.withSpin = average(s.withSpin, w)
	case !s.spun:
		s.parked = average(s.parked, w)
	}
	if !caught && (s.spun || s.cur == 0) {
		s.adapt(start, got)
	}
}

// average moves a moving average (0: none yet) by an eighth towards w.
func average(avg, w int64) int64 {
	if avg == 0 {
		return w
	}
	return avg + (w-avg)/8
}

// adapt sets the next spin from a wait that began at start and whose
// answer began at got, when the spin did not catch it: longer when a
// spin of at most max would have, else shorter (halved, then none).
func (s *spinner) adapt(start, got int64) {
	if got-start <= s.max {
		s.cur = min(max(2*s.cur, int64(spinFirst)), s.max)
		return
	}
	if s.cur /= 2; s.cur < int64(spinFirst) {
		s.cur = 0
	}
}
