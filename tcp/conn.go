// conn.go holds one rail of an endpoint, the frames it sends: a slice
// queued as a frame, the gathering of queued frames into one writev, the
// poller's non-blocking kick and the sender goroutine.

package tcp

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/bell"
	"github.com/moonring/moonring/internal/mpsc"
	"github.com/moonring/moonring/internal/uring"
	"github.com/moonring/moonring/transport"
	"golang.org/x/sys/unix"
)

// pending is one slice on a connection, from Post to its response.
type pending struct {
	s      transport.Slice
	c      transport.Completer
	buffer uint32
	key    uint64
	addr   uint64
	posted int64 // when Post queued it, on the picker's clock (receive.go)
}

// conn is one rail. Post appends to q (any poller); send writes frames for
// positions it has not written yet, up to q.Committed(); receive reads the
// responses in order and releases positions from q's head.
type conn struct {
	e      *Endpoint
	rail   int    // its index in e.rails; -1 for the express lane
	to     *dest  // where it was dialed
	maxLen uint32 // the target's MaxLength, from the hello
	nc     net.Conn
	src    io.Reader // nc's bytes: raw reads without TLS (rawio.go)
	// br reads over src. Without TLS it comes from ins (server.go) and
	// goes back there while the receiver waits on an idle connection
	// (idleWait, receive.go): nil then, and holdsIn false (tests read it).
	br      *bufio.Reader
	holdsIn atomic.Bool
	q       *mpsc.Queue[pending]
	bell    *bell.Doorbell
	hdrs    [][reqSize]byte // request headers by slot, written by send
	// notes are NOTIFY payload prefixes by slot, written by send, made
	// at the connection's first NOTIFY (a connection that sends none
	// keeps 265 bytes a slot less).
	notes [][10 + 255]byte
	// parts holds, by slot, the pieces of each frame as first gathered
	// (header, payload or NOTIFY prefix, message): a frame gathered again
	// (not wholly written) is built from them, never from its slot, which
	// the receiver may have released meanwhile. gathered is the first
	// position never gathered: the receiver refuses an answer to one.
	parts    [][3][]byte
	gathered atomic.Uint64
	// groupMax is the most WRITEs a group frame takes to this target
	// (its hello's features: maxWide, maxGroup, or 0 for no group
	// frames): runs of WRITEs then go out as one group frame, every
	// header first (group.go has the target's side). pre holds each group
	// frame's own header, by the slot of its first WRITE; groupEnd is the
	// position after the last WRITE a group frame announced. Written by
	// send.
	groupMax int
	pre      [][reqSize]byte
	groupEnd uint64

	// posting counts Posts in progress; failed is set once the connection
	// broke. The failer waits for posting to drain after setting failed, so
	// no slice is left behind in a dead queue.
	posting atomic.Int32
	failed  atomic.Bool
	// growing is set by a post that found the queue full below
	// Config.Depth: posts are refused until the sender has grown the
	// connection (grow.go).
	growing atomic.Bool
	once    sync.Once
	err     error // why it failed; written once, read after dead closes
	// sending is held by whoever writes frames: kick (on a poller, with
	// non-blocking writes) or send. next and off (the first frame not fully
	// written and how much of it is) belong to the holder; sent mirrors next
	// for the sender's parking check.
	sending atomic.Bool
	next    uint64
	off     int
	sent    atomic.Uint64
	broken  bool // a slot to send was released early (the holder of sending)
	// busySince is when a post found the connection idle (UnixNano): the
	// response timeout counts from it.
	busySince atomic.Int64
	iov       [][]byte
	sizes     []int           // of the frames gather last gathered
	rc        syscall.RawConn // nil on TLS: every frame goes through send
	ur        *uring.Ring     // the sender's io_uring (Config.IOUring), or nil
	fd        int             // the socket, for ur
	uiov      []unix.Iovec    // the iovecs of the write in progress (writev or io_uring)
	writeFn   func(fd uintptr) bool
	peekFn    func(fd uintptr) // peekOn, made once (spin.go)
	rw        *rawWriter       // the sender's raw writev (rawio.go); nil on TLS
	sp        spinner
	wiov      [][]byte
	wn        int
	werr      error

	// The reading of answers (drive.go): rd says who holds it, the
	// receiver goroutine or a driving caller; the holder owns rdr, br, plan and
	// the queue's consumer side. lastDriven is whether the last slice
	// posted was Driven; resume wakes the parked receiver; interrupt asks
	// a driver to leave.
	rd         atomic.Int32
	lastDriven atomic.Bool
	interrupt  atomic.Bool
	resume     chan struct{}
	rdr        reader
	hdr        [respSize]byte
	plan       readPlan // the answers the last payload read took (readplan.go)

	quit     chan struct{} // closed when the connection fails
	sendDone chan struct{}
	recvDone chan struct{}
	dead     chan struct{} // closed once every queued slice is completed
}

// post queues one slice, posted at now on the picker's clock: false when
// the connection is full, or waits to grow (grow.go).
func (c *conn) post(comp transport.Completer, s *transport.Slice, b *remoteBuf, now int64) (bool, error) {
	c.posting.Add(1)
	ok, err := c.enqueue(comp, s, b, now)
	c.posting.Add(-1)
	if !ok && err == nil && c.growing.Load() {
		// After the count: the sender grows the connection once no post
		// is in progress, and parks until one rings past it.
		c.bell.Ring()
	}
	return ok, err
}

// enqueue is post's work, counted in posting.
func (c *conn) enqueue(comp transport.Completer, s *transport.Slice, b *remoteBuf, now int64) (bool, error) {
	if c.failed.Load() {
		return false, transport.ErrPeer
	}
	if c.growing.Load() {
		return false, nil
	}
	idle := c.q.Len() == 0
	pos, n := c.q.Reserve(1)
	if n == 0 {
		if c.q.Cap() < c.e.t.cfg.Depth {
			c.growing.CompareAndSwap(false, true)
		}
		return false, nil
	}
	if idle {
		c.busySince.Store(time.Now().UnixNano())
	}
	p := c.q.Slot(pos)
	p.s, p.c = *s, comp
	p.buffer, p.key, p.addr = b.id, b.key, s.Remote
	p.posted = now
	c.q.Commit(pos, 1)
	if c.lastDriven.Load() != s.Driven {
		c.lastDriven.Store(s.Driven)
	}
	if c.rd.Load() == rdIdle {
		c.posted(s.Driven)
	}
	return true, nil
}

// frame appends the iovecs of the request frame at pos: its header (built
// into hdrs), then a WRITE's payload or a NOTIFY's prefix and message,
// skipping the first skip bytes. It returns the frame's size. A WRITE
// that starts a group (groupLen) is sent as the group frame, the headers
// of its run and its own payload; one of the run after it, as its
// payload alone. end is the first position not committed.
func (c *conn) frame(iov [][]byte, pos, end uint64, skip int) ([][]byte, int) {
	idx := int(pos) & (len(c.hdrs) - 1)
	if pos < c.gathered.Load() {
		// Gathered before and not wholly written: built again from what
		// was gathered. A frame the receiver released meanwhile was
		// answered before the target had it all (broken or hostile):
		// send nothing more; the writer fails the connection.
		if c.q.Released() > pos {
			return iov, -1
		}
		return c.appendParts(iov, &c.parts[idx], skip)
	}
	// Never gathered: the receiver refuses answers to it, so the slot
	// stays as Post filled it while it is read here.
	p := c.q.Slot(pos)
	if pos < c.groupEnd {
		// Its header went out in its group's frame.
		c.parts[idx] = [3][]byte{unsafe.Slice((*byte)(p.s.Local), p.s.Length)}
		return c.appendParts(iov, &c.parts[idx], skip)
	}
	h := c.hdrs[idx][:]
	req := request{op: opRead, id: uint32(pos), buffer: p.buffer, length: uint32(p.s.Length), key: p.key, addr: p.addr}
	parts := [3][]byte{h}
	switch p.s.Op {
	case transport.Notify:
		name := c.e.t.self
		if c.notes == nil {
			c.notes = make([][10 + 255]byte, len(c.hdrs))
		}
		pre := c.notes[int(pos)&(len(c.notes)-1)][:10+len(name)]
		binary.BigEndian.PutUint64(pre, p.s.Remote)
		binary.BigEndian.PutUint16(pre[8:], uint16(len(name)))
		copy(pre[10:], name)
		req = request{op: opNotify, id: uint32(pos), length: uint32(len(pre)) + uint32(p.s.Length)}
		parts[1] = pre
		if p.s.Length > 0 {
			parts[2] = unsafe.Slice((*byte)(p.s.Local), p.s.Length)
		}
	case transport.Write:
		req.op = opWrite
		parts[1] = unsafe.Slice((*byte)(p.s.Local), p.s.Length)
		if k := c.groupLen(pos, end, idx); k >= 2 {
			for i := 1; i < k; i++ {
				m := c.q.Slot(pos + uint64(i))
				r := request{op: opWrite, id: uint32(pos) + uint32(i), buffer: m.buffer, length: uint32(m.s.Length), key: m.key, addr: m.addr}
				r.encode(c.hdrs[idx+i][:])
			}
			g := request{op: opGroup, length: uint32(k)}
			g.encode(c.pre[idx][:])
			parts = [3][]byte{c.pre[idx][:], unsafe.Slice(&c.hdrs[idx][0], k*reqSize), parts[1]}
			c.groupEnd = pos + uint64(k)
		}
	}
	req.encode(h)
	c.parts[idx] = parts
	return c.appendParts(iov, &c.parts[idx], skip)
}

// groupBytes bounds the payload bytes of one group: the target answers a
// group's WRITEs after all of its payloads (its ackAfter), and takes no
// more (maxGroupBytes).
const groupBytes = min(ackAfter, maxGroupBytes)

// groupLen is how many WRITEs from pos (of slot idx) one group frame
// takes: a run of committed WRITEs before end, at most c.groupMax and
// groupBytes, whose headers lie in hdrs without wrapping (they go out as
// one iovec). Less than 2 means no group. The sending flag must be held.
func (c *conn) groupLen(pos, end uint64, idx int) int {
	k, bytes := 0, uint64(0)
	for ; k < c.groupMax && pos+uint64(k) < end && idx+k < len(c.hdrs); k++ {
		p := c.q.Slot(pos + uint64(k))
		if p.s.Op != transport.Write || bytes+p.s.Length > groupBytes {
			break
		}
		bytes += p.s.Length
	}
	return k
}

// appendParts appends a frame's parts to iov, less its first skip bytes,
// and returns the frame's size.
func (c *conn) appendParts(iov [][]byte, parts *[3][]byte, skip int) ([][]byte, int) {
	size := 0
	for _, b := range parts {
		size += len(b)
	}
	if skip >= size {
		return iov, -1 // cannot be: a frame is resumed within itself
	}
	for _, b := range parts {
		if skip >= len(b) {
			skip -= len(b)
			continue
		}
		iov = append(iov, b[skip:])
		skip = 0
	}
	return iov, size
}

// gather builds the iovecs of the frames from c.next (less c.off bytes
// already written) up to end. The sending flag must be held.
// It records the frames' sizes for advance: once written, a frame's slot
// may be completed and cleared by the receiver at any moment.
func (c *conn) gather(end uint64) [][]byte {
	iov := c.iov[:0]
	c.sizes = c.sizes[:0]
	skip := c.off
	// Not past a queue's length from c.next: a slot's header and parts
	// serve one frame at a time.
	end = min(end, c.next+uint64(len(c.hdrs)))
	pos := c.next
	for ; pos < end && len(iov) < cap(iov)-3; pos++ {
		var size int
		iov, size = c.frame(iov, pos, end, skip)
		if size < 0 {
			c.broken = true
			break
		}
		c.sizes = append(c.sizes, size)
		skip = 0
	}
	if pos > c.gathered.Load() {
		c.gathered.Store(pos) // before the write: an answer cannot come sooner
	}
	return iov
}

// advance moves c.next and c.off past n written bytes. The sending flag
// must be held.
func (c *conn) advance(n int) {
	for k := 0; n > 0; k++ {
		if left := c.sizes[k] - c.off; n >= left {
			n -= left
			c.next++
			c.off = 0
		} else {
			c.off += n
			n = 0
		}
	}
	c.sent.Store(c.next)
}

// kick gets the queued frames going: on the caller's goroutine with
// non-blocking writes when the socket takes them (no hand-off, no wakeup),
// else through the sender goroutine.
func (c *conn) kick() {
	if c.rc == nil || c.e.t.cfg.senderOnly || !c.sending.CompareAndSwap(false, true) {
		c.bell.Ring()
		return
	}
	for c.next < c.q.Committed() {
		c.wiov = c.gather(c.q.Committed())
		if c.broken {
			break // send leaves it to the sender, which fails the connection
		}
		raceRelease()
		if c.rc.Write(c.writeFn) != nil {
			// Refused before writeFn ran (closed, a deadline passed): c.wn
			// still holds the last write's count. The sender fails the rail.
			break
		}
		n, err := c.wn, c.werr
		if n > 0 {
			c.advance(n)
		}
		if err != nil || n == 0 {
			break // the socket is full (or broken): leave it to the sender
		}
	}
	pending := c.next < c.q.Committed()
	c.sending.Store(false)
	if pending {
		c.bell.Ring()
	}
}

// send writes the frames that kick left, blocking as the socket needs.
func (c *conn) send() {
	defer close(c.sendDone)
	var bufs net.Buffers
	for {
		if c.sent.Load() == c.q.Committed() && !c.growReady() {
			c.bell.Arm()
			if c.sent.Load() == c.q.Committed() && !c.growReady() {
				select {
				case <-c.bell.C():
				case <-c.quit:
					return
				}
				continue
			}
			c.bell.Disarm()
		}
		if !c.sending.CompareAndSwap(false, true) {
			runtime.Gosched() // a kick is writing; it hands over what it leaves
			continue
		}
		c.grow()
		end := c.q.Committed()
		for c.next < end {
			bufs = c.gather(end)
			if c.broken {
				c.sending.Store(false)
				c.fail(fmt.Errorf("%w: the target answered a request it had not wholly received", ErrProtocol))
				return
			}
			raceRelease()
			var n int64
			var err error
			switch {
			case c.ur != nil:
				n, err = c.uringWrite(bufs)
			case c.rw != nil:
				n, err = c.rw.writeAll(bufs)
			default:
				n, err = bufs.WriteTo(c.nc)
			}
			c.advance(int(n))
			if err != nil {
				c.sending.Store(false)
				c.fail(fmt.Errorf("%w: send: %v", transport.ErrPeer, err))
				return
			}
		}
		c.sending.Store(false)
	}
}
