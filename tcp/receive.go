// receive.go holds the receiving side of a rail: the receiver goroutine
// that completes slices in the order of their responses, its bounded
// reads, and the failing and draining of a broken connection.

package tcp

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"time"
	"unsafe"

	"github.com/moonring/moonring/transport"
	"golang.org/x/sys/unix"
)

// receive is the receiver goroutine: it reads the answers while it holds
// the connection's reading (rdRecv, see drive.go) and parks while a
// driving caller holds it or nothing is in flight after driven slices.
func (c *conn) receive() {
	defer close(c.recvDone)
	// watch wakes the parked receiver to look at an idle connection
	// again (see watch in drive.go).
	watch := time.NewTimer(time.Hour)
	watch.Stop()
	defer watch.Stop()
	for {
		if c.rd.Load() != rdRecv {
			select {
			case <-c.resume:
			case <-c.quit:
				return
			case <-watch.C:
				c.watch(watch)
			}
			continue
		}
		if err := c.receiveOne(); err != nil {
			c.fail(err)
			return
		}
		if c.settle() {
			watch.Reset(c.idleWatch())
		}
	}
}

// receiveOne reads the next answer and completes its slice. The holder of
// the connection's reading calls it: the receiver goroutine, or a driving
// caller. Its error breaks the connection (fail), but errLeave: a driver's
// wait ended before an answer began.
func (c *conn) receiveOne() error {
	hdr := &c.hdr // a field: a local passed to Read would escape, once per answer
	r := &c.rdr
	c.holdIn()
	// An answer the last payload's readv took (readplan.go) is taken from
	// the plan, its header and as much of its payload as came: in bytes
	// of the planned payload, planned, which the answer is checked
	// against. Else (planned -1) it is read from the stream.
	in, planned := 0, -1
	if c.plan.pending() {
		in, planned = c.plan.take(hdr)
	} else if err := c.readHeader(); err != nil {
		return err
	}
	id, status, err := decodeResp(hdr[:])
	pos := c.q.Head()
	// A response answers the oldest frame posted. On loopback it often
	// arrives while the writev that carried its frame is still copying
	// later frames, so "written" cannot be asked of the sender here; a
	// target that answers a frame it has not wholly received (broken or
	// hostile) is caught by the sender instead (see frame).
	if err == nil && (pos >= c.gathered.Load() || id != uint32(pos)) {
		// Not even gathered, so not sent: the target made it up.
		err = fmt.Errorf("%w: response %d not expected (next is %d)", ErrProtocol, id, uint32(pos))
	}
	if err != nil {
		return err
	}
	p := c.q.Slot(pos)
	var result error
	switch status {
	case stDenied:
		result = transport.ErrDenied
	case stRange:
		result = transport.ErrRange
	case stBusy:
		result = transport.ErrNotifyFull
	}
	size := 0 // the payload that follows the header
	if status == stOK && p.s.Op == transport.Read {
		size = int(p.s.Length)
	}
	if planned >= 0 && size != planned {
		// A READ planned that failed: what came after its header is
		// the stream's next answers.
		var cur []byte
		if in > 0 {
			cur = unsafe.Slice((*byte)(p.s.Local), in)
		}
		c.unplan(cur)
		in = 0
	}
	if in < size {
		if err := r.payload(unsafe.Slice((*byte)(p.s.Local), size), in); err != nil {
			return fmt.Errorf("%w: receive: %v", transport.ErrPeer, err)
		}
	}
	if result == nil && c.rail >= 0 {
		// The rail's measured speed (rails.Picker.Done): the slice
		// was posted when the poller queued it, and is done now, when
		// its answer is wholly in (a READ's payload too). A
		// connection answers in order, so the slice reached the front
		// of its queue when the answer before it was in, or when it
		// was posted if that came later: the picker keeps the time of
		// each rail's last answer, so it tells a slice that waited its
		// turn (the rail is backed up: what it completes is what it
		// can move) from one that found room, and counts what the rail
		// completes per second of wall time. Only answers with status
		// OK count; the failures of a connection are fail's.
		c.e.pick.Done(c.rail, p.s.Length, p.posted, c.rdr.at)
	}
	comp, tok := p.c, p.s.Token
	p.c, p.s.Local = nil, nil
	c.q.Release(1)
	if c.growing.Load() && c.q.Len() == 0 {
		c.bell.Ring() // the last answer the connection waited for to grow
	}
	comp.Complete(tok, result)
	return nil
}

// readHeader reads the next answer's header from the stream into c.hdr.
func (c *conn) readHeader() error {
	r := &c.rdr
	// The next response answers the oldest frame posted: when that is
	// a large READ and nothing is buffered, its header and payload
	// come straight from the socket (see reader.payload).
	// A header read ahead with the last payload (reader.payload) comes
	// first from either: src returns those bytes before the socket's.
	src := io.Reader(c.br)
	if c.br.Buffered() == 0 && c.directNext() {
		src = c.src
	}
	// An answer's time is when its bytes came. A header read ahead with
	// the last payload, or wholly in the buffer, came with an earlier
	// read and keeps that read's time (r.last and r.at): a burst of
	// answers read together costs one reading of the clocks, not one
	// each.
	came := c.held() >= respSize || src == io.Reader(c.br) && c.br.Buffered() >= respSize
	if err := r.read(src, c.hdr[:], true); err != nil {
		if err == errLeave {
			return err
		}
		return fmt.Errorf("%w: receive: %v", transport.ErrPeer, err)
	}
	if !came {
		r.stamp()
	}
	return nil
}

// directNext reports whether the next response answers a READ of at least
// directMin bytes. Only the holder of the reading calls it (drive.go).
func (c *conn) directNext() bool {
	pos := c.q.Head()
	if pos >= c.q.Committed() {
		return false
	}
	p := c.q.Slot(pos)
	return p.s.Op == transport.Read && p.s.Length >= directMin
}

// held is how many bytes of the next responses were read with the last
// payload (reader.payload) and wait in the read plan and c.src: the next
// answer has begun.
func (c *conn) held() int {
	if nb, ok := c.src.(*nbReader); ok {
		return c.plan.held() + nb.held()
	}
	return 0
}

// reader is the reading of the stream by whoever holds it (the receiver
// or a driver, drive.go), which keeps the
// response deadline. A response must come within ResponseTimeout of the
// last one, or of the moment requests went out on an idle connection, and
// a payload must keep arriving within it (each read that brings bytes
// counts): a target that keeps the connection up but stops answering must
// not hold slices (and their ring slots) for ever. The read deadline is a
// wake-up, moved only when it lags by half a timeout: when it fires early
// (the connection was idle, or bytes came since), the read goes on.
type reader struct {
	c        *conn
	last     int64 // UnixNano of the last response, or payload bytes (or the start)
	at       int64 // when the last answer's bytes came, on the rails picker's clock (its Done's)
	deadline int64 // the read deadline set, UnixNano
	timeout  int64
	// until is a driving caller's deadline (UnixNano), 0 for the
	// receiver: a driver waiting for an answer to begin leaves then
	// (errLeave), or when interrupted (conn.interrupt).
	until int64
}

// errLeave ends a driver's read between two answers: its wait is over.
var errLeave = errors.New("tcp: driver leaves")

// stamp records that answer bytes came now: r.last for the response
// deadline, r.at for the rails picker.
func (r *reader) stamp() {
	r.last = time.Now().UnixNano()
	r.at = r.c.e.pick.Now()
}

// read fills dst from src, a response header (header) or payload bytes.
func (r *reader) read(src io.Reader, dst []byte, header bool) error {
	c := r.c
	for got := 0; got < len(dst); {
		between := header && got == 0 && c.br.Buffered() == 0 && c.held() == 0 // no answer begun
		owed := r.last
		if header {
			owed = max(r.last, c.busySince.Load())
		}
		// The deadline wanted: the response timeout's, moved only when it
		// lags by half a timeout (none without a timeout); between two
		// answers, a driver's own when sooner. r.deadline is what the
		// socket has, or -1 when that is not known (an Interrupt moved it).
		want := r.deadline
		if r.timeout <= 0 {
			want = 0
		} else if owed+r.timeout-r.deadline > r.timeout/2 {
			want = owed + r.timeout
		}
		if between && r.until > 0 && r.until != math.MaxInt64 && (want <= 0 || r.until < want) {
			want = r.until
		}
		if want != r.deadline {
			r.deadline = want
			var at time.Time
			if want > 0 {
				at = time.Unix(0, want)
			}
			c.nc.SetReadDeadline(at)
		}
		// After the deadline is set: Interrupt stores the flag before it
		// moves the deadline, so this sees the flag or the read the
		// deadline it moved.
		if between && r.until != 0 && c.interrupt.Load() {
			return errLeave
		}
		if between && r.until == 0 && src == io.Reader(c.br) && c.idle() {
			// The receiver, with nothing in flight: it waits for the
			// socket holding no read buffer (idleWait).
			if err := c.idleWait(); err != nil {
				return err
			}
			src = c.br
			if c.directNext() {
				// A large READ posted meanwhile: its header and
				// payload come straight from the socket (readHeader).
				src = c.src
			}
		}
		buffered := src == io.Reader(c.br) && c.br.Buffered() >= len(dst)-got // came with an earlier read
		k, err := src.Read(dst[got:])
		got += k
		if k > 0 && !header && !buffered {
			r.stamp()
		}
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			now := time.Now().UnixNano()
			r.deadline = -1 // whoever reads next sets a fresh one
			if between && r.until != 0 && (now >= r.until || c.interrupt.Load()) {
				return errLeave
			}
			if r.timeout <= 0 {
				continue // an Interrupt's, or a driver's deadline mid-answer: no response timeout
			}
			if header {
				idle := c.q.Head() == c.q.Committed()
				if idle {
					r.last = now
				}
				if idle || now-max(r.last, c.busySince.Load()) < r.timeout {
					continue
				}
			} else if now-r.last < r.timeout {
				continue
			}
		}
		return err
	}
	return nil
}

// idle reports whether the receiver may wait for the next answer holding
// no read buffer: reads are raw (not TLS) and nothing is in flight, so
// that a connection that waits for answers keeps its buffer and one that
// waits for requests to post does not.
func (c *conn) idle() bool {
	nb, ok := c.src.(*nbReader)
	return ok && nb.rc != nil && c.q.Head() == c.q.Committed()
}

// holdIn gives the holder of the reading a read buffer when the last
// holder let go of it (letGoIn): at the start of each answer's reading.
func (c *conn) holdIn() {
	if c.br == nil {
		c.br = takeIn(c.src)
		c.holdsIn.Store(true)
	}
}

// letGoIn gives the read buffer back to ins when the holder of the
// reading lets go of it with nothing in flight and nothing read ahead
// (settle, leave): whoever holds the reading next takes one (holdIn). A
// connection left to drivers so holds no buffer between their requests.
func (c *conn) letGoIn() {
	if c.br != nil && c.idle() && c.br.Buffered() == 0 && c.held() == 0 {
		c.giveBackIn()
	}
}

// giveBackIn gives the read buffer, empty, back to ins.
func (c *conn) giveBackIn() {
	giveIn(c.br)
	c.br = nil
	c.holdsIn.Store(false)
}

// idleWait gives the receiver's empty read buffer back to ins (server.go)
// and waits until the socket has bytes, an end or an error, reading none;
// then it takes a buffer from ins again. An idle peer so holds no 64 KiB
// of its own, as the target's idle connections do not. Its error is the
// one the read would have had: at the read deadline it takes a buffer and
// returns nil, and the caller's read loop sees the deadline through the
// next Read; any other error breaks the connection, which then holds no
// buffer (whoever reads next would take one, holdIn).
func (c *conn) idleWait() error {
	c.giveBackIn()
	if err := c.src.(*nbReader).waitIdle(); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		return err
	}
	c.holdIn()
	return nil
}

// payload fills dst[off:] with the next bytes of the stream, the rest of
// a payload whose first off bytes are in (a read plan's): what the buffer
// holds first, and the rest straight from the socket when the payload is
// at least directMin (the buffer is empty then, so the order of bytes
// holds). When other answers are owed after this one, the last read of
// the rest takes them with it (conn.readPlanned): their headers and
// READ payloads, each into its destination, and a header's worth more. A
// stream of large READs then costs one read system call per up to
// planMax responses, not one for each header and payload, and none of
// the next payloads passes through the buffer.
func (r *reader) payload(dst []byte, off int) error {
	c := r.c
	n := off
	if k := c.br.Buffered(); k > 0 {
		k, _ = c.br.Read(dst[n:min(n+k, len(dst))])
		n += k
	}
	// The rest of a large payload is read straight from the socket
	// whatever its size: through the buffer, it would fill the buffer with
	// the next response's header and payload, and the next payload would
	// come partly through the buffer again, one copy more per byte for as
	// long as READs stream.
	if rest := dst[n:]; len(rest) >= directMin || len(rest) > 0 && len(dst) >= directMin {
		src := c.src
		if nb, ok := src.(*nbReader); ok && nb.rc != nil {
			src = (*planReader)(c)
		}
		return r.read(src, rest, false)
	} else if len(rest) > 0 {
		return r.read(c.br, rest, false)
	}
	return nil
}

// fail breaks the connection: both goroutines stop, and the receiver (or
// the closer) completes every queued slice with err. It is the rail's
// failure to the endpoint's picker, which cools the rail (its slices go
// to the others) until a probe shows it healthy.
func (c *conn) fail(err error) {
	if c.close(err) && c.rail >= 0 {
		c.e.pick.Failed(c.rail)
	}
}

// close breaks the connection for err, as fail does, but is no failure of
// the rail (Close, a peer that moved); it reports whether this call broke
// it (false: it was broken already).
func (c *conn) close(err error) (broke bool) {
	c.once.Do(func() {
		broke = true
		c.err = err
		if !errors.Is(err, transport.ErrClosed) {
			c.e.t.cfg.Logger.Info("tcp: rail lost", "segment", c.e.name, "err", err)
		}
		c.failed.Store(true)
		close(c.quit)
		if c.ur != nil {
			// An io_uring write holds the socket open past Close, and
			// the ring names the descriptor by number: shut the socket
			// down so that the write ends and the sender can leave, and
			// close it only once the sender has (drain), so that its
			// next submission cannot reach a descriptor reused since.
			c.rc.Control(func(fd uintptr) { unix.Shutdown(int(fd), unix.SHUT_RDWR) })
		} else {
			c.nc.Close()
		}
		go c.drain()
	})
	return broke
}

// drain completes what is queued once no Post is adding to the queue and
// the receiver has stopped, then marks the connection dead.
func (c *conn) drain() {
	for c.posting.Load() != 0 {
		time.Sleep(time.Microsecond)
	}
	<-c.sendDone
	<-c.recvDone
	// A driver (drive.go) reads until it sees the connection failed; one
	// owed the reading is on its way to Drive, which lets it go at once.
	for r := c.rd.Load(); r == rdOwed || r == rdDriven; r = c.rd.Load() {
		time.Sleep(time.Microsecond)
	}
	if c.ur != nil {
		c.nc.Close()
		c.ur.Close()
	}
	// Take the sending flag for good: a kick on a poller may be gathering
	// frames from the slots about to be cleared.
	for !c.sending.CompareAndSwap(false, true) {
		runtime.Gosched()
	}
	for {
		pos, n := c.q.Readable(c.q.Cap())
		if n == 0 {
			break
		}
		for i := 0; i < n; i++ {
			p := c.q.Slot(pos + uint64(i))
			comp, tok := p.c, p.s.Token
			p.c, p.s.Local = nil, nil
			comp.Complete(tok, c.err)
		}
		c.q.Release(n)
	}
	close(c.dead)
}

// directMin is the READ payload from which the receiver reads from the
// socket into the destination itself rather than through its 64 KiB
// buffer: a copy less per byte, and the answers queued behind it come in
// the same read (readplan.go).
const directMin = 16 << 10
