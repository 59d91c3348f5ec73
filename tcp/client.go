// client.go holds the initiator's Endpoint: Open, the descriptor's
// buffers it may address, Post's choice of connection (a rail by measured
// speed, or the express lane for a high-class slice), and the connections
// kept (redialed with backoff when one breaks). A connection's frames are
// conn.go's, its dial and hello dial.go's, its responses receive.go's.

package tcp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/internal/rails"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Endpoint is the way to one remote segment: Rails connections, each
// redialed with backoff when it breaks, over which slices are spread by
// measured speed, and, from the first high-class slice on, an express
// lane for those. Safe for concurrent use. It lives until its Close or
// its Transport's.
type Endpoint struct {
	t      *Transport
	name   string
	dest   atomic.Pointer[dest] // where to dial; a restarted peer's replaces it
	maxLen atomic.Uint32
	bufs   atomic.Pointer[segtable.Mirror[remoteBuf]] // the descriptor's buffers served over tcp
	rails  []atomic.Pointer[conn]
	pick   *rails.Picker // which rail takes the next slice (see Post)
	// express is the express lane's connection while it is up (express.go);
	// expressOn says its keeper was started. mu orders that start with
	// Close.
	express   atomic.Pointer[conn]
	expressOn atomic.Bool
	mu        sync.Mutex
	closed    atomic.Bool
	stop      chan struct{}
	done      chan struct{} // closed when the first Close has finished
	wg        sync.WaitGroup
}

type dest struct {
	addr string
	key  []byte
	pin  []byte // the SHA-256 of the peer's certificate (AutoTLS), or nil
}

type remoteBuf struct {
	addr, length uint64
	id           uint32
	key          uint64
}

var _ transport.Endpoint = (*Endpoint)(nil)

// Open dials the segment's rails. The first connection is made before Open
// returns, so a wrong key or an unreachable peer is reported at once; the
// others are dialed in the background.
func (t *Transport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	if t.closed.Load() {
		return nil, fmt.Errorf("tcp: open %s: %w", desc.Name, transport.ErrClosed)
	}
	ep, ok := desc.Endpoints[Name]
	if !ok {
		return nil, fmt.Errorf("tcp: open %s: %w", desc.Name, transport.ErrUnreachable)
	}
	addr, key, pin, err := t.parseEndpoint(ep)
	if err != nil {
		return nil, fmt.Errorf("tcp: open %s: %w", desc.Name, err)
	}
	pick, err := rails.New(t.cfg.Rails, t.cfg.railConfig) // TCP rails: no NUMA penalty
	if err != nil {
		return nil, fmt.Errorf("tcp: open %s: %w", desc.Name, err)
	}
	e := &Endpoint{t: t, name: desc.Name, rails: make([]atomic.Pointer[conn], t.cfg.Rails), pick: pick, stop: make(chan struct{}), done: make(chan struct{})}
	e.dest.Store(&dest{addr, key, pin})
	e.Update(desc)
	first, err := e.dial(ctx, 0)
	// A target that cut the hello short (its bounds on handshakes, a burst
	// of dials from one host) or is busy is dialed again, with backoff,
	// for up to DialTimeout.
	for wait, start := 5*time.Millisecond, time.Now(); err != nil && (errors.Is(err, errCut) || errors.Is(err, errBusy)) && time.Since(start)+wait < t.cfg.DialTimeout; wait = min(2*wait, 500*time.Millisecond) {
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil, fmt.Errorf("tcp: open %s at %s: %w (%v)", desc.Name, addr, err, context.Cause(ctx))
		}
		first, err = e.dial(ctx, 0)
	}
	if err != nil {
		return nil, fmt.Errorf("tcp: open %s at %s: %w", desc.Name, addr, err)
	}
	e.maxLen.Store(first.maxLen)
	t.mu.Lock()
	if t.closed.Load() {
		t.mu.Unlock()
		first.close(transport.ErrClosed)
		return nil, fmt.Errorf("tcp: open %s: %w", desc.Name, transport.ErrClosed)
	}
	// The rails start under the lock: a Transport.Close either finds the
	// endpoint whole (and closes it) or made Open give up above.
	t.eps[e] = struct{}{}
	e.rails[0].Store(first)
	e.wg.Add(len(e.rails))
	go e.keep(&e.rails[0], 0, first)
	for i := 1; i < len(e.rails); i++ {
		go e.keep(&e.rails[i], i, nil)
	}
	t.mu.Unlock()
	t.cfg.Logger.Info("tcp: rail connected", "segment", desc.Name, "addr", addr, "rail", 0)
	return e, nil
}

// Rails returns the number of rails, Config.Rails: the express lane is
// not one (the engine's rail hints need not count it).
func (e *Endpoint) Rails() int { return len(e.rails) }

// Update takes the buffers and keys of a republished descriptor. When the
// peer restarted (a new address or segment key), the rails are closed and
// redialed there; their slices fail with ErrPeer and the engine retries
// them. The buffers are kept in the shape of the descriptor's chunks
// (segtable.Mirror): a republish parses the keys of the chunks that
// changed since the last Update, not of every buffer.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	if addr, key, pin, err := e.t.parseEndpoint(desc.Endpoints[Name]); err == nil {
		if old := e.dest.Load(); old != nil && (old.addr != addr || !bytes.Equal(old.key, key) || !bytes.Equal(old.pin, pin)) {
			e.dest.Store(&dest{addr, key, pin})
			for i := range e.rails {
				if c := e.rails[i].Load(); c != nil {
					c.close(fmt.Errorf("%w: the peer moved to %s", transport.ErrPeer, addr))
				}
			}
			if c := e.express.Load(); c != nil {
				c.close(fmt.Errorf("%w: the peer moved to %s", transport.ErrPeer, addr))
			}
		}
	}
	e.bufs.Store(segtable.NewMirror(e.bufs.Load(), segtable.ChunksOf(desc), remoteBufOf))
}

// remoteBufOf parses a descriptor's buffer's tcp key; ok is false for a
// buffer not served over tcp (slices to it are denied).
func remoteBufOf(b *segtable.BufferDesc) (remoteBuf, bool) {
	id, key, ok := strings.Cut(b.Keys[Name], ".")
	bid, err1 := strconv.ParseUint(id, 16, 32)
	k, err2 := strconv.ParseUint(key, 16, 64)
	if !ok || err1 != nil || err2 != nil {
		return remoteBuf{}, false
	}
	return remoteBuf{b.Addr, b.Length, uint32(bid), k}, true
}

// find returns the buffer served over tcp that holds [addr, addr+n), or
// nil. Lock-free; it allocates nothing.
func (e *Endpoint) find(addr, n uint64) *remoteBuf {
	b, _ := e.bufs.Load().Floor(addr)
	if b == nil || n > b.length || addr-b.addr > b.length-n {
		return nil
	}
	return b
}

// Post queues the slices on their connections. It accepts slices in order
// until a connection is full (the rest are for later) or none is up
// (ErrPeer for the rest, so the engine retries them).
//
// A slice's connection is the express lane's when the slice is of
// transport.ClassHigh and the lane is up (the first such slice starts it;
// until it is up they take the rails), else the rail the endpoint's
// Picker chooses, in proportion to each rail's measured speed (the
// slice's Rail, the engine's round robin, is not needed: see
// rails.Picker.Pick), or, while that rail is down, the next one up.
func (e *Endpoint) Post(c transport.Completer, s []transport.Slice) (n int, err error) {
	if e.closed.Load() {
		return 0, transport.ErrClosed
	}
	var touched [4]*conn // the connections posted to, kicked once at the end
	defer func() {
		for _, cn := range touched {
			if cn != nil {
				cn.kick()
			}
		}
	}()
	touch := func(cn *conn) {
		for i, t := range touched {
			if t == cn {
				return
			}
			if t == nil {
				touched[i] = cn
				return
			}
		}
		cn.kick() // more connections than slots: kick at once
	}
	var none remoteBuf // a NOTIFY's: it names no buffer
	now := int64(-1)   // the picker's clock, read once, at the first slice posted
	for i := range s {
		sl := &s[i]
		b := &none
		if sl.Op == transport.Notify {
			// The frame's payload (tag, name, message) must be within the
			// target's MaxLength, or it would fail the connection.
			if sl.Length > transport.MaxNotifyMessage || 10+uint64(len(e.t.self))+sl.Length > uint64(e.maxLen.Load()) {
				c.Complete(sl.Token, transport.ErrRange)
				continue
			}
		} else {
			if sl.Length > uint64(e.maxLen.Load()) {
				c.Complete(sl.Token, fmt.Errorf("tcp: slice of %d bytes above the peer's limit: %w", sl.Length, transport.ErrRange))
				continue
			}
			if b = e.find(sl.Remote, sl.Length); b == nil {
				c.Complete(sl.Token, transport.ErrDenied)
				continue
			}
		}
		cn := e.conn(sl.Class)
		if cn == nil {
			return i, transport.ErrPeer
		}
		if now < 0 {
			now = e.pick.Now()
		}
		ok, err := cn.post(c, sl, b, now)
		if err != nil {
			return i, err
		}
		if !ok {
			return i, nil
		}
		touch(cn)
	}
	return len(s), nil
}

// conn returns the connection for a slice of class cl: the express lane's
// for a high-class slice while it is up, else a rail's (see Post); nil
// when none is up.
func (e *Endpoint) conn(cl transport.Class) *conn {
	if cl == transport.ClassHigh {
		if c := e.expressLane(); c != nil {
			return c
		}
	}
	return e.rail(e.pick.Pick())
}

// rail returns the connection of rail i or, while it is down, the next one
// up; nil when none is.
func (e *Endpoint) rail(i int) *conn {
	for k := range e.rails {
		if c := e.rails[(i+k)%len(e.rails)].Load(); c != nil && !c.failed.Load() {
			return c
		}
	}
	return nil
}

// Close closes the rails and the express lane; their slices complete with
// ErrClosed. A second call waits for the first to finish.
func (e *Endpoint) Close() error {
	if e.closed.Swap(true) {
		<-e.done
		return nil
	}
	defer close(e.done)
	// Under mu: a start of the express lane (express.go) either came
	// first, and its keeper is counted in wg, or sees closed and starts
	// nothing. No wg.Add can come after the Wait below.
	e.mu.Lock()
	close(e.stop)
	e.mu.Unlock()
	for i := range e.rails {
		if c := e.rails[i].Load(); c != nil {
			c.close(transport.ErrClosed)
		}
	}
	if c := e.express.Load(); c != nil {
		c.close(transport.ErrClosed)
	}
	e.wg.Wait()
	e.t.mu.Lock()
	delete(e.t.eps, e)
	e.t.mu.Unlock()
	return nil
}

// keep owns a connection's slot, a rail's (rail is its index) or the
// express lane's (rail is -1): it waits for the connection to die and
// redials with backoff until the endpoint closes. A rail's failed dial is
// its failure to the picker, as a broken connection is (conn.fail).
func (e *Endpoint) keep(slot *atomic.Pointer[conn], rail int, c *conn) {
	defer e.wg.Done()
	backoff := 10 * time.Millisecond
	for {
		if c != nil {
			select {
			case <-c.dead:
			case <-e.stop:
				c.close(transport.ErrClosed)
				<-c.dead
				return
			}
			slot.CompareAndSwap(c, nil)
			c = nil
		}
		ctx, cancel := context.WithTimeout(context.Background(), e.t.cfg.DialTimeout)
		go func() {
			select {
			case <-e.stop:
			case <-ctx.Done():
			}
			cancel()
		}()
		nc, err := e.dial(ctx, rail)
		cancel()
		if err != nil {
			e.t.cfg.Logger.Info("tcp: dial", "segment", e.name, "addr", e.dest.Load().addr, "rail", rail, "err", err, "retry in", backoff)
			if rail >= 0 {
				e.pick.Failed(rail)
			}
			select {
			case <-time.After(backoff):
			case <-e.stop:
				return
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		if e.closed.Load() {
			nc.close(transport.ErrClosed)
			<-nc.dead
			return
		}
		backoff = 10 * time.Millisecond
		c = nc
		slot.Store(c)
		if to := e.dest.Load(); c.to != to {
			// An Update moved the peer while this dialed the old address
			// (its close of the connections came before this one was
			// stored).
			c.close(fmt.Errorf("%w: the peer moved to %s", transport.ErrPeer, to.addr))
			continue
		}
		e.maxLen.Store(c.maxLen) // the current peer's: not one an old address answered
		if rail < 0 {
			e.t.cfg.Logger.Info("tcp: express lane connected", "segment", e.name, "addr", c.to.addr)
		} else {
			e.t.cfg.Logger.Info("tcp: rail connected", "segment", e.name, "addr", c.to.addr, "rail", rail)
		}
	}
}
