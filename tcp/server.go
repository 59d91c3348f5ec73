package tcp

import (
	"bufio"
	"crypto/hmac"
	"crypto/rand"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/transport"
)

const helloTimeout = 10 * time.Second

// errTLSHandshake wraps the error of a TLS handshake that failed.
var errTLSHandshake = errors.New("tcp: tls")

// serve runs the hello and then the frames of one connection.
func (t *Transport) serve(pc *peerConn) error {
	raw := pc.c
	if tc, ok := raw.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		setLoopbackSendBuffer(tc, t.cfg.LoopbackSendBuffer)
		// A vanished initiator must not hold a region (and its Unregister)
		// until the kernel gives up retransmitting, ~15 minutes.
		setPeerTimeout(tc, t.cfg.PeerTimeout)
	}
	if t.cfg.HandshakeTimeout > 0 {
		raw.SetDeadline(time.Now().Add(t.cfg.HandshakeTimeout))
	}
	nb := newNBReader(raw)
	// The read buffer comes from ins: a storm of connections takes turns
	// in the few that handshakes in progress hold (MaxHandshakes) and
	// makes no buffer a connection. frames gives it back; so does this,
	// on a way out before.
	br := takeIn(nb)
	pooled := true
	defer func() {
		if pooled {
			giveIn(br)
		}
	}()
	first, err := br.Peek(1)
	if err != nil {
		return err
	}
	var conn net.Conn = peekConn{raw, br}
	if first[0] == 0x16 && t.cfg.TLS != nil { // a TLS ClientHello
		tc := tls.Server(conn, t.cfg.TLS)
		if err := tc.Handshake(); err != nil {
			return fmt.Errorf("%w: %w", errTLSHandshake, err)
		}
		conn = tc
		pooled = false // conn reads through it for good
		br = bufio.NewReaderSize(tc, inSize)
		nb = nil // TLS records: no peeking at the socket underneath
	} else if t.cfg.RequireTLS {
		var hello [24]byte
		io.ReadFull(br, hello[:])
		t.challenge(raw, helloTLS, nil)
		return ErrTLSRequired
	}
	if err := t.hello(conn, br, pc); err != nil {
		return err
	}
	raw.SetDeadline(time.Time{})
	pooled = false // frames has it now
	if nb != nil {
		// frames reads through br and nb alone; peekConn would keep a
		// reader frames gives back to ins while it waits.
		conn = raw
	}
	return t.frames(conn, br, nb, pc)
}

// nbReader is the connection as the frames' bufio.Reader sees it. With
// nonblock set, a Read takes what the socket holds and returns
// errWouldBlock instead of waiting: the target uses it to tell "more
// requests are already here" (keep gathering responses) from "the
// initiator is waiting for us" (send them now).
//
// Its reads are raw system calls on the non-blocking socket, waiting in
// the netpoller when they wait (rawio.go says why).
type nbReader struct {
	net.Conn
	rc       syscall.RawConn // nil when the trick is not available
	nonblock bool
	readFn   func(fd uintptr) bool // a read that never waits
	waitFn   func(fd uintptr) bool // a read that waits for bytes
	readvFn  func(fd uintptr) bool // readv's, waiting for bytes
	idleFn   func(fd uintptr) bool // waitIdle's: waits, reading nothing
	waited   bool                  // idleFn peeked once
	peek     [1]byte               // readable's
	p        []byte
	v        []unix.Iovec // readv's
	n        int
	err      error
	// peeked is an error a peek took from the socket (a recv, MSG_PEEK
	// or not, consumes the pending error; the reads after it would see
	// only the end): the next read returns it.
	peeked syscall.Errno
	// over holds bytes of the stream read before they were asked for
	// (the end of a readv, rawio.go, or the bytes a read plan gives back,
	// readplan.go): Read returns them before reading the socket again.
	over []byte
	// ahead is the usual home of over: the start of the next response,
	// read with the payload before it.
	ahead  [respSize]byte
	aheads uint64 // readvs that read past their first buffer (tests read it)
	calls  uint64 // read and readv system calls (tests read it)
	// lowat is the low-water mark the next wait sets (0: one byte), and
	// lowatSet the socket's (lowat.go); lowats counts the marks set
	// (tests read it).
	lowat, lowatSet int
	lowats          uint64
	// limit, when not 0, bounds what a Read takes from the socket: the
	// frames' buffer then reads a frame's headers without the start of
	// the payload behind them, which would be copied out of it.
	limit int
}

var errWouldBlock = errors.New("tcp: would block")

func (r *nbReader) Read(p []byte) (int, error) {
	if len(r.over) > 0 {
		n := copy(p, r.over)
		r.over = r.over[n:]
		if len(r.over) == 0 {
			r.over = nil // a give-back's buffer is not kept alive
		}
		return n, nil
	}
	if r.rc == nil || len(p) == 0 {
		return r.Conn.Read(p)
	}
	if r.limit > 0 && len(p) > r.limit {
		p = p[:r.limit]
	}
	r.p = p
	fn := r.waitFn
	if r.nonblock {
		fn = r.readFn
	}
	if err := r.rc.Read(fn); err != nil {
		r.p = nil
		return 0, err
	}
	r.p = nil
	switch {
	case r.err == unix.EAGAIN:
		return 0, errWouldBlock
	case r.err != nil:
		return 0, r.err
	case r.n == 0:
		return 0, io.EOF
	}
	return r.n, nil
}

// more reports whether a whole request header is already buffered or can
// be read from the socket without waiting.
func more(br *bufio.Reader, nb *nbReader) bool {
	if br.Buffered() >= reqSize {
		return true
	}
	if nb == nil || nb.rc == nil {
		return false
	}
	nb.nonblock = true
	_, err := br.Peek(reqSize)
	nb.nonblock = false
	return err == nil
}

// arrived reports whether bytes wait in the socket after an idle deadline
// fired with nothing read: this goroutine may have run late (a loaded
// machine), and the deadline then ends a read whose bytes are there. It
// clears the read deadline and peeks without waiting; the bytes stay in br.
// Without the non-blocking read (TLS) it reports false.
func arrived(conn net.Conn, br *bufio.Reader, nb *nbReader) bool {
	if nb == nil || nb.rc == nil {
		return false
	}
	conn.SetReadDeadline(time.Time{})
	nb.nonblock = true
	_, err := br.Peek(1)
	nb.nonblock = false
	return err == nil
}

func (t *Transport) challenge(w io.Writer, status uint16, snonce []byte) error {
	var b [32]byte
	copy(b[:], magic)
	binary.BigEndian.PutUint16(b[4:], version)
	binary.BigEndian.PutUint16(b[6:], status)
	copy(b[8:24], snonce)
	binary.BigEndian.PutUint32(b[24:], t.cfg.MaxLength)
	if status == helloOK && !t.cfg.noGroups {
		f := uint32(featGroups | featWide)
		if t.cfg.narrowGroups {
			f = featGroups
		}
		binary.BigEndian.PutUint32(b[28:], f)
	}
	_, err := w.Write(b[:])
	return err
}

// hello proves to each other that both sides hold the segment key, and
// logs pc in (MaxConns) before it accepts.
func (t *Transport) hello(conn net.Conn, br *bufio.Reader, pc *peerConn) error {
	var h [24]byte
	if _, err := io.ReadFull(br, h[:]); err != nil {
		return err
	}
	if string(h[:4]) != magic {
		return fmt.Errorf("%w: bad magic", ErrProtocol)
	}
	if binary.BigEndian.Uint16(h[4:]) != version {
		t.challenge(conn, helloBadVersion, nil)
		return ErrVersion
	}
	if f := binary.BigEndian.Uint16(h[6:]); f != 0 {
		// Version 1 defines no hello flags: a flag that asks for something
		// the target does not do is not ignored.
		return fmt.Errorf("%w: unknown hello flags %#x", ErrProtocol, f)
	}
	cnonce := h[8:24]
	snonce := make([]byte, nonceSize)
	rand.Read(snonce)
	if err := t.challenge(conn, helloOK, snonce); err != nil {
		return err
	}
	var proof [32]byte
	if _, err := io.ReadFull(br, proof[:]); err != nil {
		return err
	}
	var acc [36]byte
	if !hmac.Equal(proof[:], mac(t.key, "initiator", cnonce, snonce)) {
		binary.BigEndian.PutUint16(acc[:], helloBadKey)
		conn.Write(acc[:])
		return ErrAuth
	}
	if err := t.admit(pc); err != nil {
		binary.BigEndian.PutUint16(acc[:], helloBusy)
		conn.Write(acc[:])
		return err
	}
	copy(acc[4:], mac(t.key, "target", cnonce, snonce))
	_, err := conn.Write(acc[:])
	return err
}

// frames serves requests until the connection ends. Responses gather in
// out and go out with the READ payloads in one writev, flushed whenever no
// further request is already buffered. With raw reads (nb.rc set) br must
// come from ins: frames owns it, gives it back while it waits and when it
// returns, and reads through br and nb only, never conn.
func (t *Transport) frames(conn net.Conn, br *bufio.Reader, nb *nbReader, pc *peerConn) error {
	sv := &pc.served
	var (
		hdr  [reqSize]byte
		req  request
		note [maxNotify]byte
		// Responses gather in out; READ payloads join them as iovecs that
		// point into registered memory, whose regions stay held until the
		// flush. out[mark:] is not yet in iovs.
		out  []byte // from outs while the connection has requests; nil while it waits
		buf  *outBuf
		mark int
		iovs = make([][]byte, 0, 64)
		held = make([]*region, 0, 32)
		bufs net.Buffers
		grp  *groupIn // from grps while the connection has group frames or bulk WRITEs in hand
	)
	w := respWriter(conn)
	var rw *rawWriter                // the socket's raw writev, without TLS (rawio.go)
	raw := nb != nil && nb.rc != nil // br is from ins: given back while idle
	if raw {
		rw = newRawWriter(nb.rc)
		pc.holdsIn.Store(true)
	}
	// The deadline bounds the moving of payloads (FrameTimeout): set for a
	// payload, cleared before waiting for the next request, so an idle
	// connection has none and a stalled initiator cannot hold a region for
	// ever.
	// The deadline is renewed per payload move, but set again only when
	// half of it has gone: each frame gets at least half a FrameTimeout,
	// without a timer update per frame.
	deadline := false
	var setAt time.Time
	// While the connection waits for a request with nothing in flight, the
	// read deadline is IdleTimeout's instead. It is armed when the
	// connection goes idle and left alone while requests come (no timer
	// update per frame): when it fires, the connection is closed only if
	// no request came since it was armed, else it is armed again.
	idleArmed := false
	var served, servedAtArm uint64 // requests read, and when the idle deadline was armed
	// armFrame sets the deadline a whole FrameTimeout from now. A group
	// frame (group.go) gets one for its headers and all of its payloads:
	// one timer update per group, and its regions are held no longer.
	armFrame := func(now time.Time) {
		conn.SetDeadline(now.Add(t.cfg.FrameTimeout))
		deadline, setAt = true, now
		idleArmed = false
	}
	setDeadline := func() {
		if now := time.Now(); !deadline || now.Sub(setAt) > t.cfg.FrameTimeout/2 {
			armFrame(now)
		}
	}
	armIdle := func() {
		conn.SetReadDeadline(time.Now().Add(t.cfg.IdleTimeout))
		idleArmed, servedAtArm = true, served
	}
	flush := func() error {
		if mark < len(out) {
			iovs = append(iovs, out[mark:])
		}
		var err error
		if len(iovs) > 0 {
			if len(held) > 0 {
				setDeadline()
			}
			raceRelease()
			if rw != nil {
				_, err = rw.writeAll(iovs)
			} else {
				bufs = iovs
				_, err = bufs.WriteTo(w)
			}
		}
		for _, r := range held {
			r.ref.Release()
		}
		clear(held)
		clear(iovs)
		held, iovs, out, mark = held[:0], iovs[:0], out[:0], 0
		return err
	}
	// On every way out the held regions go back, unwritten: the
	// connection failed, and a flush would wait on it once more.
	defer func() {
		for _, r := range held {
			r.ref.Release()
		}
		clear(held)
		if buf != nil {
			outs.Put(buf)
			pc.holdsOut.Store(false)
		}
		if grp != nil {
			// read and fillOne left it holding no region and no
			// pointer into registered memory, on every way out; a
			// failed read's counts are flushed here.
			t.groups.flush(grp)
			if nb != nil {
				nb.over = nil // may lie in its tail
			}
			grps.Put(grp)
			pc.holdsGroup.Store(false)
		}
		if raw && br != nil {
			// Nothing else reads it once frames returns.
			giveIn(br)
			pc.holdsIn.Store(false)
		}
	}()
	// owed counts the WRITE payload bytes read since the last flush at the
	// loop's top (the others leave it: at worst an ack goes out early).
	owed := 0
	// heads is, after a frame that carried a bulk payload (a group, or a
	// WRITE of at least bulkMin), the header bytes the next frame is
	// expected to take (nextHeads), and 0 after any other: the next
	// header is then read with no more than those (nbReader.limit), as
	// the next payload's bytes read into the frames' buffer would be
	// copied out of it.
	heads := 0
next:
	for {
		if nb != nil && heads > 0 {
			nb.limit = heads
		}
		// Write what is gathered before waiting for more requests, so a
		// pipelined burst leaves in one writev and a lone request at once,
		// and after ackAfter bytes of WRITE payload in any case.
		idle := !more(br, nb)
		// A deadline armed for an earlier payload moves on with the work
		// (else a connection busy for a FrameTimeout met it, in a read or
		// in the flush below), and one is armed while READ regions are
		// held, whatever is read or written next.
		if deadline || len(held) > 0 {
			setDeadline()
		}
		if idle || owed >= ackAfter {
			if err := flush(); err != nil {
				return err
			}
			owed = 0
			if idle && deadline {
				conn.SetDeadline(time.Time{})
				deadline = false
			}
			if idle && !idleArmed && t.cfg.IdleTimeout > 0 {
				armIdle()
			}
			if idle && buf != nil {
				// Written out: while the connection waits, its buffer
				// serves others. A thousand peers taking turns then
				// gather in a few buffers warm in cache, not in a
				// thousand cold ones, and an idle peer holds none.
				outs.Put(buf)
				pc.holdsOut.Store(false)
				buf, out = nil, nil
			}
			if idle && grp != nil && (nb == nil || nb.held() == 0) {
				// Its group state too: about 10 KiB, mostly the
				// headers, destinations and tail of a wide group. Not
				// while nb's over holds bytes read into its tail.
				t.groups.flush(grp)
				grps.Put(grp)
				pc.holdsGroup.Store(false)
				grp = nil
			}
			if idle && raw && br.Buffered() == 0 && nb.held() == 0 {
				// So does its read buffer, empty: the connection waits
				// for the socket with none, and takes one when bytes
				// come. The idle deadline ends the wait as it would
				// the read below, which then sees it too; a closed
				// connection ends it with no buffer taken.
				giveIn(br)
				pc.holdsIn.Store(false)
				pc.idleWaits.Add(1)
				if err := nb.waitIdle(); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
					br = nil // given back
					return err
				}
				br = takeIn(nb)
				pc.holdsIn.Store(true)
			}
		}
		for got, gotAtArm := 0, 0; ; {
			n, err := io.ReadFull(br, hdr[got:])
			got += n
			if err == nil {
				break
			}
			if !idleArmed || !errors.Is(err, os.ErrDeadlineExceeded) {
				return err
			}
			if got == gotAtArm && served == servedAtArm && !arrived(conn, br, nb) {
				// Nothing came since it was armed, IdleTimeout ago: no
				// request, or no byte more of a header begun (which
				// held the connection for good when re-armed regardless).
				return errIdle
			}
			gotAtArm = got
			armIdle()
			if got == 0 && raw {
				// Nothing of a header yet: wait again without a
				// buffer (above), not here with one.
				continue next
			}
		}
		if nb != nil {
			nb.limit = 0
		}
		if buf == nil {
			buf = outs.Get().(*outBuf)
			pc.holdsOut.Store(true)
			out = buf[:0]
		}
		heads = 0
		served++
		if err := req.decode(hdr[:], t.cfg.MaxLength); err != nil {
			return err
		}
		// Make room for this request's response and payload first: READ
		// payloads copied into out can fill it to the byte, and slicing out
		// past its capacity would panic the process.
		if cap(out)-len(out) < respSize || len(iovs) >= cap(iovs)-2 || len(held) == cap(held) {
			if err := flush(); err != nil {
				return err
			}
		}
		if req.op == opGroup {
			// The WRITEs' payloads may change bytes that READ payloads
			// gathered by reference hold: those go first.
			k := int(req.length)
			if t.cfg.narrowGroups && k > maxGroup {
				return fmt.Errorf("%w: a group of %d WRITEs (this target offered %d)", ErrProtocol, k, maxGroup)
			}
			if len(held) > 0 || cap(out)-len(out) < k*respSize {
				if err := flush(); err != nil {
					return err
				}
			}
			if grp == nil {
				grp = grps.Get().(*groupIn)
				pc.holdsGroup.Store(true)
			}
			heads = nextHeads(k)
			armFrame(time.Now())
			if err := grp.read(t, br, nb, k, sv); err != nil {
				return err
			}
			t.groups.add(grp, k)
			for i := range k {
				out = out[:len(out)+respSize]
				encodeResp(out[len(out)-respSize:], grp.reqs[i].id, grp.st[i])
				owed += int(grp.reqs[i].length)
			}
			continue
		}
		if req.op == opNotify {
			if br.Buffered() < int(req.length) {
				setDeadline()
			}
			if _, err := io.ReadFull(br, note[:req.length]); err != nil {
				return err
			}
			status, err := t.notify(note[:req.length])
			if err != nil {
				return err
			}
			out = out[:len(out)+respSize]
			encodeResp(out[len(out)-respSize:], req.id, status)
			continue
		}
		if req.op == opWrite && len(held) > 0 {
			// READ payloads gathered so far are sent by reference: send them
			// before this WRITE may change their bytes.
			if err := flush(); err != nil {
				return err
			}
		}
		r, status := t.check(&req)
		if req.op == opWrite {
			if r == nil {
				if br.Buffered() < int(req.length) {
					setDeadline()
				}
				if _, err := br.Discard(int(req.length)); err != nil {
					return err
				}
				sv.denied.Add(1)
			} else {
				dst := unsafe.Slice((*byte)(unsafe.Add(r.base, req.addr-r.addr)), req.length)
				var err error
				if br.Buffered() < len(dst) {
					setDeadline()
				}
				if len(dst) >= bulkMin && nb != nil && nb.rc != nil {
					// Straight from the socket, not through the frames'
					// buffer and a copy.
					if grp == nil {
						grp = grps.Get().(*groupIn)
						pc.holdsGroup.Store(true)
					}
					heads = nextHeads(1)
					err = grp.fillOne(br, nb, dst)
					t.groups.flush(grp)
				} else {
					_, err = io.ReadFull(br, dst)
				}
				r.ref.Release()
				if err != nil {
					return err
				}
				sv.writes.Add(1)
				sv.writeBytes.Add(uint64(req.length))
			}
			owed += int(req.length)
			out = out[:len(out)+respSize]
			encodeResp(out[len(out)-respSize:], req.id, status)
			continue
		}
		out = out[:len(out)+respSize]
		encodeResp(out[len(out)-respSize:], req.id, status)
		if r == nil {
			sv.denied.Add(1)
			continue
		}
		sv.reads.Add(1)
		sv.readBytes.Add(uint64(req.length))
		payload := unsafe.Slice((*byte)(unsafe.Add(r.base, req.addr-r.addr)), req.length)
		if len(payload) <= cap(out)-len(out) && len(payload) < 16<<10 {
			out = append(out, payload...) // small: one copy beats an iovec
			r.ref.Release()
			continue
		}
		iovs = append(iovs, out[mark:], payload)
		mark = len(out)
		held = append(held, r)
	}
}

// outBuf is where a connection gathers its responses and small READ
// payloads between two flushes.
type outBuf [64 << 10]byte

// outs holds the gathering buffers of connections waiting for requests.
var outs = sync.Pool{New: func() any { return new(outBuf) }}

// grps holds the group state (group.go) of connections waiting for
// requests. A groupIn is given back with its counts flushed
// (groupStats) and its pointers into registered memory dropped
// (groupIn.forget).
var grps = sync.Pool{New: func() any { return new(groupIn) }}

// inSize is the size of the frames' read buffer of a connection.
const inSize = 64 << 10

// ins holds the read buffers of idle raw connections: the target's frames
// waiting for requests, and an initiator's receiver waiting for answers
// with nothing in flight (receive.go). A TLS connection keeps its own.
var ins = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, inSize) }}

// takeIn returns a read buffer of ins reading r.
func takeIn(r io.Reader) *bufio.Reader {
	br := ins.Get().(*bufio.Reader)
	br.Reset(r)
	return br
}

// giveIn gives br back to ins; it keeps no reference to its reader.
func giveIn(br *bufio.Reader) {
	br.Reset(nil)
	ins.Put(br)
}

// bulkMin is the least WRITE payload the target reads straight from the
// socket into its destination; a smaller one comes through the frames'
// buffer (one read system call for many frames) and a copy.
const bulkMin = 16 << 10

// ackAfter bounds how many WRITE payload bytes the target reads while it
// holds a gathered response back. A stream of pipelined WRITEs always has
// the next request waiting, so without a bound the acknowledgements went
// out only when the stream paused: the initiator, its window full of
// unacknowledged WRITEs, stopped sending until they came, and the
// connection idled for a round trip each window (WRITE 16 MiB 4.40 GB/s
// before, 4.77 after, medians of 8 interleaved runs). At 1 MiB a 1 MiB
// slice is acknowledged as soon as it has landed, and 4 KiB WRITEs still
// share a writev 256 to one; 256 KiB was no better at 1 MiB and no better
// at 64 KiB, for four times the acks.
const ackAfter = 1 << 20

// respWriter returns what frames writes its responses to: the socket
// itself when there is no TLS. peekConn (which only reads differently)
// would hide the TCP connection's writev from net.Buffers, which then
// writes each iovec with its own write call (a READ's header and payload
// apart, each its own segment under TCP_NODELAY).
func respWriter(conn net.Conn) io.Writer {
	if pc, ok := conn.(peekConn); ok {
		return pc.Conn
	}
	return conn
}

// notify delivers a NOTIFY payload: tag u64, name length u16, name, msg.
func (t *Transport) notify(p []byte) (uint8, error) {
	tag, nl := binary.BigEndian.Uint64(p), int(binary.BigEndian.Uint16(p[8:]))
	if nl > 255 || 10+nl > len(p) || len(p)-10-nl > transport.MaxNotifyMessage {
		return 0, fmt.Errorf("%w: bad notify payload", ErrProtocol)
	}
	d := t.deliver.Load()
	if d == nil {
		return stDenied, nil
	}
	n := transport.Notification{From: string(p[10 : 10+nl]), Tag: tag, Msg: p[10+nl:]}
	if err := (*d)(&n); err != nil {
		return stBusy, nil
	}
	return stOK, nil
}

// check finds the request's region and holds it; nil with the status to
// answer when the request may not proceed. The buffer and its key are
// checked before the address: a request naming a buffer it holds no key
// for is denied whatever its address, so a peer without a buffer's key
// cannot tell a registered address from another by the status
// (PROTOCOL.md, Checks).
func (t *Transport) check(req *request) (*region, uint8) {
	// A key of another buffer grants nothing here. One BufferID may be
	// registered twice while the first registration drains: the key tells
	// them apart.
	var r *region
	t.regs.Descend(uint64(req.buffer), func(id uint64, x *region) bool {
		if id != uint64(req.buffer) {
			return false
		}
		if x.key == req.key {
			r = x
			return false
		}
		return true
	})
	// The buffer's key grants its own bytes only: an address outside it is
	// denied too (a key of another buffer grants nothing at this one's
	// address), and a request that starts inside it and runs past its end
	// is out of range.
	if r == nil || req.addr < r.addr || req.addr-r.addr >= r.length {
		return nil, stDenied
	}
	if uint64(req.length) > r.length-(req.addr-r.addr) {
		return nil, stRange
	}
	if !r.ref.Acquire() {
		return nil, stDenied // being unregistered
	}
	return r, stOK
}
