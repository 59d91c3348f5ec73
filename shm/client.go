//go:build linux

// client.go holds an endpoint's connection to its target's control
// socket: the calls (grants, notifications) and the goroutine that reads
// their replies and the target's revokes.

package shm

import (
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/transport"
)

// reply is a target's answer to a grant or a notification.
type reply struct {
	status uint16
	err    error
}

// client is an endpoint's connection to its target.
type client struct {
	e   *Endpoint
	c   *net.UnixConn
	pid int
	wmu sync.Mutex

	mu   sync.Mutex
	seq  uint32
	wait map[uint32]chan reply
	dead atomic.Bool
	done chan struct{}
}

// waiter is what a call waits on; pooled, so that a call allocates nothing.
type waiter struct {
	ch chan reply
	t  *time.Timer
}

var waiters = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &waiter{ch: make(chan reply, 1), t: t}
}}

// call sends m and waits for its answer.
func (c *client) call(m *msg) (uint16, error) {
	w := waiters.Get().(*waiter)
	c.mu.Lock()
	if c.dead.Load() {
		c.mu.Unlock()
		waiters.Put(w)
		return 0, transport.ErrPeer
	}
	c.seq++
	m.seq = c.seq
	c.wait[m.seq] = w.ch
	c.mu.Unlock()
	var buf [maxMsg]byte
	c.wmu.Lock()
	_, err := c.write(m.encode(buf[:]))
	c.wmu.Unlock()
	if err != nil {
		c.kill() // w is not put back: the reader answers it as it ends
		return 0, fmt.Errorf("%w: %w", transport.ErrPeer, err)
	}
	w.t.Reset(c.e.t.cfg.ReplyTimeout)
	select {
	case r := <-w.ch:
		w.t.Stop()
		waiters.Put(w) // answer took the channel out of the map before it sent
		return r.status, r.err
	case <-w.t.C:
		c.mu.Lock()
		delete(c.wait, m.seq)
		c.mu.Unlock()
		// Not put back: an answer may still be on its way into w.ch.
		return 0, fmt.Errorf("%w: no answer within %v", transport.ErrPeer, c.e.t.cfg.ReplyTimeout)
	}
}

func statusErr(st uint16) error {
	switch st {
	case statusOK:
		return nil
	case statusRange:
		return transport.ErrRange
	case statusFull:
		return transport.ErrNotifyFull
	}
	return transport.ErrDenied
}

func (c *client) grant(addr, length uint64, key *[16]byte, vm bool) error {
	m := msg{typ: msgGrant, a: addr, b: length, key: *key}
	if vm {
		m.flags = flagVM
	}
	st, err := c.call(&m)
	if err != nil {
		return err
	}
	return statusErr(st)
}

func (c *client) notify(s *transport.Slice) error {
	if s.Length > transport.MaxNotifyMessage {
		return transport.ErrRange
	}
	from := *c.e.t.self.Load()
	if len(from) > maxName {
		from = from[:maxName]
	}
	var room [maxName + transport.MaxNotifyMessage]byte
	tail := append(room[:0], from...)
	if s.Length > 0 {
		tail = append(tail, unsafe.Slice((*byte)(s.Local), s.Length)...)
	}
	st, err := c.call(&msg{typ: msgNotify, a: s.Remote, b: uint64(len(from)), c: s.Length, tail: tail})
	if err != nil {
		return err
	}
	return statusErr(st)
}

// run reads the target's packets until the connection ends, then drops
// every mapping and fails the calls still waiting.
func (c *client) run() {
	defer c.e.t.wg.Done()
	defer close(c.done)
	if pk, err := newPackets(c.c); err == nil {
		for c.step(pk) {
		}
	}
	c.kill()
	c.e.drop(0, true)
	c.mu.Lock()
	for seq, ch := range c.wait {
		ch <- reply{err: transport.ErrPeer}
		delete(c.wait, seq)
	}
	c.mu.Unlock()
}

// step handles one packet and reports whether the connection is still good.
func (c *client) step(pk *packets) bool {
	p, oob, flags, err := pk.read()
	if err != nil {
		return false
	}
	fd := -1
	if len(oob) > 0 {
		fd = oneRight(oob)
		defer func() {
			if fd >= 0 {
				unix.Close(fd) // mapped or refused: the descriptor is not kept
			}
		}()
	}
	var m msg
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 || len(p) > maxMsg || decode(p, &m) != nil {
		return false
	}
	switch m.typ {
	case msgGrantAck:
		r := reply{status: m.status}
		if m.status == statusOK {
			if err := c.e.install(c.pid, &m, fd); err != nil {
				// A file this process must not map, or a grant that
				// makes no sense: the buffer stays out of reach.
				r.status = statusDenied
			}
		}
		c.answer(m.seq, r)
	case msgNotifyAck:
		c.answer(m.seq, reply{status: m.status})
	case msgRevoke:
		if m.handle == allHandles {
			// The target's transport closes: the path goes away, and
			// slices that find their mapping gone fail as the peer's
			// (ErrPeer, which another transport may carry), not as
			// denied. Marked before the mappings go.
			c.mu.Lock()
			c.dead.Store(true)
			c.mu.Unlock()
		}
		c.e.drop(m.handle, m.handle == allHandles)
		var b [frameSize]byte
		ack := msg{typ: msgRevokeAck, handle: m.handle}
		c.wmu.Lock()
		_, err := c.write(ack.encode(b[:]))
		c.wmu.Unlock()
		return err == nil
	default:
		return false
	}
	return true
}

// oneRight returns the one descriptor of a control message; any others are
// closed and -2 returned (a broken peer).
func oneRight(oob []byte) int {
	cms, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return -1
	}
	fd := -1
	for i := range cms {
		fds, _ := unix.ParseUnixRights(&cms[i])
		for _, x := range fds {
			if fd == -1 {
				fd = x
			} else {
				unix.Close(x)
			}
		}
	}
	return fd
}

func (c *client) answer(seq uint32, r reply) {
	c.mu.Lock()
	ch := c.wait[seq]
	delete(c.wait, seq)
	c.mu.Unlock()
	if ch != nil {
		ch <- r
	}
}

// write sends one packet; the caller holds wmu. A target that stops
// reading fails it after ReplyTimeout rather than hold wmu, and the
// caller's goroutine (a poller's, for a notification), for good.
func (c *client) write(p []byte) (int, error) {
	c.c.SetWriteDeadline(time.Now().Add(c.e.t.cfg.ReplyTimeout))
	return c.c.Write(p)
}

// kill marks the connection dead and closes it; the reader then cleans up.
func (c *client) kill() {
	c.mu.Lock()
	c.dead.Store(true)
	c.mu.Unlock()
	c.c.Close()
}

// close drops every mapping, hangs up and waits for the reader.
func (c *client) close() {
	c.e.drop(0, true)
	c.kill()
	<-c.done
}
