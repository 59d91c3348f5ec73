package mctcp

// server.go: the target's request loop. One goroutine per connection reads
// a header, checks its range against the registered buffers, moves the
// payload straight between the socket and the buffer, and (version 2)
// answers with a status word: before a READ's data, after a WRITE's last
// byte is in the buffer, and instead of anything else for a refused range,
// after which the connection closes. While the next request is already
// buffered, status words and small READs gather and go out in one write,
// before anything that may wait on the peer. Nothing is allocated per
// request, and nothing in proportion to a length the peer sends.

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"
)

var (
	errIdle         = errors.New("mctcp: idle for IdleTimeout")
	errBadHeader    = errors.New("mctcp: bad request header")
	errStalled      = errors.New("mctcp: payload did not move within FrameTimeout")
	errRefusedRange = errors.New("mctcp: range refused")
)

// readBufSize is the target's read buffer per connection: headers of
// pipelined requests are read together; a payload larger than what is
// buffered is read straight into the registered buffer.
const readBufSize = 16 << 10

// outSize is the target's buffer of answers per connection; READs of at
// most smallRead bytes are copied into it.
const (
	outSize   = 16 << 10
	smallRead = 4 << 10
)

// lingerMax and lingerTime bound what the target reads and throws away
// after refusing a WRITE in version 2: closing a socket with unread bytes
// sends a reset, which may destroy the refusal before the initiator has
// read it.
const (
	lingerMax  = 4 << 20
	lingerTime = time.Second
)

// readers and outs keep the connections' read and answer buffers between
// connections: Mooncake's TCP client opens a connection per request by
// default, and 32 KiB made and zeroed per request was most of what the
// target allocated.
var (
	readers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, readBufSize) }}
	outs    = sync.Pool{New: func() any { b := make([]byte, 0, outSize); return &b }}
)

// serve runs the requests of one connection until it ends or fails.
func (t *Transport) serve(sc *srvConn) error {
	c := sc.c
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	br := readers.Get().(*bufio.Reader)
	br.Reset(c)
	outp := outs.Get().(*[]byte)
	defer func() {
		br.Reset(nil) // nothing of this connection stays reachable
		readers.Put(br)
		outs.Put(outp)
	}()
	var (
		hdr  [headerSize]byte
		iov  [2][]byte
		bufs net.Buffers
		// Status words and small READs' bytes gather in out while the
		// next request is already buffered, and go out in one write
		// before anything that may wait on the peer.
		out = (*outp)[:0]
	)
	flush := func() error {
		if len(out) == 0 {
			return nil
		}
		raceRelease()
		_, err := c.Write(out)
		out = out[:0]
		return err
	}
	readDeadline := false // a read deadline is set on c
	for {
		if br.Buffered() < headerSize {
			// The next header may keep us waiting: answer first. The last
			// payload's deadline bounds the write.
			if err := flush(); err != nil {
				return err
			}
		}
		// Idle from here until a whole header has come.
		now := time.Now()
		for {
			old := sc.idle.Load()
			if old == evicted {
				return nil
			}
			if sc.idle.CompareAndSwap(old, now.UnixNano()) {
				break
			}
		}
		mark := now.UnixNano()
		switch {
		case br.Buffered() >= headerSize:
			// The header is here: no wait to bound.
		case t.cfg.IdleTimeout > 0:
			c.SetReadDeadline(now.Add(t.cfg.IdleTimeout))
			readDeadline = true
		case readDeadline:
			c.SetReadDeadline(time.Time{})
			readDeadline = false
		}
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return errIdle
			}
			return err
		}
		if !sc.idle.CompareAndSwap(mark, 0) {
			return nil // evicted while it waited: serve nothing more
		}
		h, ok := parseHeader(hdr[:])
		if !ok {
			flush() // the answers to the requests before it
			return fmt.Errorf("%w: opcode %#x", errBadHeader, hdr[16])
		}
		var r *region
		if h.length <= t.cfg.MaxLength {
			r = t.hold(h.addr, h.length)
		}
		if r == nil {
			if err := flush(); err != nil {
				return err
			}
			return t.refuseRange(c, br, h)
		}
		// The payload's deadline, for reads and writes alike.
		c.SetDeadline(time.Now().Add(t.payloadTime(h.length)))
		readDeadline = true
		p := r.bytes(h.addr, h.length)
		var err error
		if cap(out)-len(out) < statusSize {
			err = flush()
		}
		switch {
		case err != nil:
			r.ref.Release()
		case h.op == opWrite:
			if uint64(br.Buffered()) < h.length {
				err = flush() // the payload may keep us waiting
			}
			if err == nil {
				_, err = io.ReadFull(br, p)
			}
			r.ref.Release()
			if err == nil && h.v2 {
				out = appendStatus(out, statusOK)
			}
		default:
			if h.v2 {
				out = appendStatus(out, statusOK)
			}
			if len(p) <= smallRead && len(p) <= cap(out)-len(out) {
				out = append(out, p...) // a copy beats an iovec
				r.ref.Release()
				break
			}
			iov[0], iov[1] = out, p
			bufs = iov[:]
			raceRelease()
			_, err = bufs.WriteTo(c)
			r.ref.Release()
			iov = [2][]byte{}
			out = out[:0]
		}
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return fmt.Errorf("%w: %d bytes at %#x", errStalled, h.length, h.addr)
			}
			return err
		}
	}
}

// payloadTime is how long the target gives a payload of n bytes to move.
func (t *Transport) payloadTime(n uint64) time.Duration {
	return t.cfg.FrameTimeout + time.Duration(float64(n)/float64(t.cfg.MinRate)*float64(time.Second))
}

// refuseRange ends a connection whose request names a range the target
// does not serve: version 2 gets the refusal status first, and a WRITE's
// payload is read (a bounded amount, for a bounded time) and dropped, so
// that the close does not reset the connection before the initiator has
// read the status. Version 1 has no refusal: the connection just closes.
func (t *Transport) refuseRange(c net.Conn, br *bufio.Reader, h header) error {
	t.refuse(rRange, c.RemoteAddr(), nil, "addr", h.addr, "length", h.length, "write", h.op == opWrite, "v2", h.v2)
	if !h.v2 {
		return errRefusedRange
	}
	c.SetDeadline(time.Now().Add(lingerTime))
	var st [statusSize]byte
	putStatus(st[:], statusRefused)
	if _, err := c.Write(st[:]); err != nil {
		return errRefusedRange
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	if h.op == opWrite {
		io.CopyN(io.Discard, br, int64(min(h.length, lingerMax)))
	}
	return errRefusedRange
}

// isEOF reports a peer that closed its side cleanly.
func isEOF(err error) bool { return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) }
