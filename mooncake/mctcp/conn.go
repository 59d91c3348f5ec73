package mctcp

// conn.go: one initiator connection (a rail). Slices queue in q; a sender
// goroutine writes their requests, gathered into one writev, and hands
// those the target answers (READs, version 2 WRITEs) to pending in
// order; a receiver goroutine reads the answers in that order. Mooncake's
// target serves one request after another, so requests sent ahead wait in
// its socket, and the answers come back in the order they were sent.
//
// Every item is in exactly one place: q, the sender's batch, pending, or
// the receiver's hand; whoever holds it completes it. When the connection
// dies (kill), Post stops pushing (under mu), both goroutines end, and the
// receiver completes what is left in q and pending with the cause, then
// has the rail redialed. A write that fails only stops the sending
// (stopSending): the answers already on their way, a READ's data or a
// refusal sent before a WRITE's payload was read, are still read, and the
// slices they answer complete as the target said.

import (
	"bufio"
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

// maxGather bounds the requests of one writev; gatherBytes the payload
// bytes gathered before it is written.
const (
	maxGather   = 32
	gatherBytes = 1 << 20
)

type conn struct {
	e       *Endpoint
	rail    int
	nc      net.Conn
	mu      sync.Mutex // guards dead, closed, cause and pushes to q
	dead    bool       // takes no more slices
	closed  bool       // done and the socket are closed
	cause   error      // why it died; set once, under mu
	done    chan struct{}
	q       chan item
	pending chan item
	sent    chan struct{} // closed when the sender has ended

	// The sender's own.
	hdrs  [maxGather][headerSize]byte
	iov   [2 * maxGather][]byte
	bufs  net.Buffers
	batch [maxGather]item
	// The receiver's own.
	br      *bufio.Reader
	st      [statusSize]byte
	rc      syscall.RawConn // nil: the idle watch peeks through br
	peekFn  func(fd uintptr) bool
	peekN   int
	peekErr error
	pbuf    [1]byte
}

func newConn(e *Endpoint, rail int, nc net.Conn) *conn {
	d := e.t.cfg.Depth
	cn := &conn{e: e, rail: rail, nc: nc, done: make(chan struct{}), q: make(chan item, d), pending: make(chan item, d),
		sent: make(chan struct{}), br: bufio.NewReaderSize(nc, 64<<10)}
	if sc, ok := nc.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			cn.rc, cn.peekFn = rc, cn.peek
		}
	}
	return cn
}

type pushResult int

const (
	pushOK pushResult = iota
	pushFull
	pushDead
)

// push queues it without blocking.
func (cn *conn) push(it item) pushResult {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	if cn.dead {
		return pushDead
	}
	select {
	case cn.q <- it:
		return pushOK
	default:
		return pushFull
	}
}

// kill marks the connection dead with its cause and closes the socket;
// the first cause stays. Safe for concurrent use.
func (cn *conn) kill(cause error) {
	cn.mu.Lock()
	if !cn.dead {
		cn.dead, cn.cause = true, cause
	}
	if cn.closed {
		cn.mu.Unlock()
		return
	}
	cn.closed = true
	close(cn.done)
	cn.mu.Unlock()
	cn.nc.Close()
}

// stopSending marks the connection dead after a write failed, without
// closing it: the answers already on their way (a READ's data, a refusal
// that came before a WRITE's payload) are still read, and the receiver
// closes the connection once nothing awaits an answer or a read fails.
func (cn *conn) stopSending(cause error) {
	cn.mu.Lock()
	if !cn.dead {
		cn.dead, cn.cause = true, cause
	}
	cn.mu.Unlock()
}

// isDead reports whether the connection takes no more slices.
func (cn *conn) isDead() bool {
	cn.mu.Lock()
	defer cn.mu.Unlock()
	return cn.dead
}

// failure is the error of a broken connection, for the slices it fails:
// transport.ErrPeer (the engine retries them on another rail) wrapping
// what broke it.
func (cn *conn) failure(err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		err = ErrTimeout
	}
	return fmt.Errorf("mctcp: %s rail %d: %w: %w", cn.e.dest.Load().addr, cn.rail, transport.ErrPeer, err)
}

// send writes the queued requests until the connection dies.
func (cn *conn) send() {
	defer cn.e.wg.Done()
	defer close(cn.sent)
	n := 0 // items in batch
	for {
		var it item
		select {
		case it = <-cn.q:
		case <-cn.done:
			return
		}
		n = 0
		iov, bytes := 0, uint64(0)
		for {
			// Into pending before its request is sent: its answer may
			// come as soon as the request has gone.
			if it.answered() {
				select {
				case cn.pending <- it:
				default:
					// pending is full: what is gathered goes out first
					// (its answers are what the receiver waits for).
					if !cn.flush(iov, n) {
						it.c.Complete(it.token, cn.causeErr())
						return
					}
					iov, n, bytes = 0, 0, 0
					select {
					case cn.pending <- it:
					case <-cn.done:
						it.c.Complete(it.token, cn.causeErr())
						return
					}
				}
			}
			cn.batch[n] = it
			h := &cn.hdrs[n]
			op := uint8(opRead)
			if it.write {
				op = opWrite
			}
			putHeader(h[:], header{length: it.length, addr: it.remote, op: op, v2: it.v2})
			cn.iov[iov] = h[:]
			iov++
			if it.write {
				cn.iov[iov] = unsafe.Slice((*byte)(it.local), it.length)
				iov++
				bytes += it.length
			}
			n++
			if n == maxGather || bytes >= gatherBytes {
				break
			}
			select {
			case it = <-cn.q:
				continue
			default:
			}
			break
		}
		if !cn.flush(iov, n) {
			return
		}
	}
}

// flush writes the gathered requests and completes the version 1 WRITEs
// among the n items of the batch (their bytes are in the socket, which is
// all version 1 can say); false when the connection died.
func (cn *conn) flush(iov, n int) bool {
	if iov > 0 {
		cn.bufs = cn.iov[:iov]
		cn.nc.SetWriteDeadline(time.Now().Add(cn.e.t.cfg.StatusTimeout))
		raceRelease()
		_, err := cn.bufs.WriteTo(cn.nc)
		clear(cn.iov[:iov])
		if err != nil {
			cn.stopSending(cn.failure(err))
			cause := cn.causeErr()
			for i := range n {
				if it := &cn.batch[i]; !it.answered() {
					it.c.Complete(it.token, cause)
				}
			}
			clear(cn.batch[:n])
			return false
		}
	}
	for i := range n {
		if it := &cn.batch[i]; !it.answered() {
			it.c.Complete(it.token, nil)
		}
	}
	clear(cn.batch[:n])
	return true
}

// receive reads the answers until the connection dies, then completes
// what is left and has the rail redialed.
func (cn *conn) receive() {
	defer cn.e.wg.Done()
	for {
		var it item
		select {
		case it = <-cn.pending:
		case <-cn.done:
			cn.end()
			return
		default:
			if cn.isDead() {
				// The sender stopped (a write failed): once it has, and
				// every answer it waits for has been read, close.
				<-cn.sent
				if len(cn.pending) > 0 {
					continue
				}
				cn.kill(nil)
				cn.end()
				return
			}
			// Nothing awaits an answer: watch the socket, so that a
			// target that closes an idle connection (its IdleTimeout, a
			// restart) is seen now, and the rail redialed, rather than by
			// the next slice sent into it. An answer's first byte ends
			// the wait too: its item is in pending before the request
			// was sent.
			if err := cn.idle(); err != nil {
				cn.kill(err)
				cn.end()
				return
			}
			continue
		}
		if err := cn.answer(&it); err != nil {
			refused := errors.Is(err, ErrRefused)
			if refused {
				cn.kill(cn.failure(errClosedAfterRefusal))
			} else {
				cn.kill(err)
			}
			// The sender may still be writing its payload (a refusal
			// comes before it): the slice completes, and its memory goes
			// back to the engine, only once the sender has stopped.
			<-cn.sent
			if !refused {
				err = cn.causeErr()
			}
			it.c.Complete(it.token, err)
			cn.end()
			return
		}
		it.c.Complete(it.token, nil)
	}
}

// idleProbe is how long the receiver waits on an idle socket before it
// looks at pending again: it bounds how late StatusTimeout may start for
// a request sent while the receiver waited.
const idleProbe = 2 * time.Second

// errUnsolicited: the target sent bytes no request asked for.
var errUnsolicited = errors.New("mctcp: the target sent bytes no request asked for")

// idle waits, up to idleProbe, for the socket to have something to read
// while nothing is pending; nil when the caller should look at pending
// again, else why the connection is dead.
func (cn *conn) idle() error {
	if cn.br.Buffered() == 0 {
		cn.nc.SetReadDeadline(time.Now().Add(idleProbe))
		var err error
		if cn.rc != nil {
			cn.peekN, cn.peekErr = 0, nil
			if err = cn.rc.Read(cn.peekFn); err == nil {
				switch {
				case cn.peekErr != nil:
					err = cn.peekErr
				case cn.peekN == 0:
					err = io.EOF
				}
			}
		} else {
			_, err = cn.br.Peek(1)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil
		}
		if err != nil {
			return cn.failure(err)
		}
	}
	if len(cn.pending) == 0 {
		return cn.failure(errUnsolicited)
	}
	return nil
}

// peek is the idle watch's look at the socket, in the RawConn's Read: a
// byte peeked (left in the socket, so that a large READ's bytes go
// straight to their memory, not through the bufio.Reader), the end of the
// stream, or nothing yet (wait for the socket to be readable).
func (cn *conn) peek(fd uintptr) bool {
	n, err := peekByte(int(fd), &cn.pbuf[0])
	if err == unix.EAGAIN || err == unix.EINTR {
		return false
	}
	cn.peekN, cn.peekErr = n, err
	return true
}

// directRead is the size from which a READ's bytes (and the status word
// before them) are read from the socket straight into their memory rather
// than through the bufio.Reader, which would copy what it read ahead.
const directRead = 16 << 10

// read fills p with the next bytes of the stream: through the
// bufio.Reader, or with direct, what it holds and then the socket itself.
func (cn *conn) read(p []byte, direct bool) error {
	if !direct {
		_, err := io.ReadFull(cn.br, p)
		return err
	}
	n := 0
	if b := cn.br.Buffered(); b > 0 {
		n, _ = cn.br.Read(p[:min(b, len(p))])
	}
	if n < len(p) {
		_, err := io.ReadFull(cn.nc, p[n:])
		return err
	}
	return nil
}

// answer reads the item's answer: the status word (version 2), then a READ's
// data. A refusal fails it with ErrRefused (transport.ErrDenied); the
// connection dies with any error, as the target closes it after a refusal.
func (cn *conn) answer(it *item) error {
	cn.nc.SetReadDeadline(time.Now().Add(cn.e.t.cfg.StatusTimeout))
	direct := !it.write && it.length >= directRead
	if it.v2 {
		if err := cn.read(cn.st[:], direct); err != nil {
			return cn.failure(err)
		}
		code, ok := parseStatus(cn.st[:])
		switch {
		case !ok:
			return cn.failure(fmt.Errorf("%w: % x", ErrBadStatus, cn.st[:]))
		case code == statusRefused:
			return fmt.Errorf("mctcp: %s: %d bytes at %#x: %w: %w", cn.e.dest.Load().addr, it.length, it.remote, ErrRefused, transport.ErrDenied)
		case code != statusOK:
			return cn.failure(fmt.Errorf("%w: code %d", ErrBadStatus, code))
		}
	}
	if !it.write {
		if err := cn.read(unsafe.Slice((*byte)(it.local), it.length), direct); err != nil {
			return cn.failure(err)
		}
	}
	return nil
}

// errClosedAfterRefusal is why the slices sent on a connection after a
// request the target refused fail: it closes the connection.
var errClosedAfterRefusal = errors.New("mctcp: the target closed the connection after refusing a request")

// causeErr is the error slices of the dead connection complete with: its
// cause, or transport.ErrClosed once the endpoint is closing.
func (cn *conn) causeErr() error {
	cn.mu.Lock()
	cause := cn.cause
	cn.mu.Unlock()
	if cn.e.closed.Load() && !errors.Is(cause, transport.ErrClosed) {
		return fmt.Errorf("mctcp: endpoint %s: %w", cn.e.name, transport.ErrClosed)
	}
	return cause
}

// end waits for the sender, completes every slice still queued or
// awaiting its answer with the connection's cause, and, unless the
// endpoint is closing, has the rail redialed.
func (cn *conn) end() {
	<-cn.sent
	cause := cn.causeErr()
	for {
		select {
		case it := <-cn.pending:
			it.c.Complete(it.token, cause)
			continue
		case it := <-cn.q:
			it.c.Complete(it.token, cause)
			continue
		default:
		}
		break
	}
	cn.e.mu.Lock()
	defer cn.e.mu.Unlock()
	if cn.e.closed.Load() {
		return
	}
	cn.e.rails[cn.rail].CompareAndSwap(cn, nil)
	cn.e.wg.Add(1)
	go cn.e.redial(cn.rail)
}
