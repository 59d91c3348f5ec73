package mctcp

// endpoint.go: the initiator's way to one remote segment: Rails
// connections to the target's data port, each redialed with backoff when
// it breaks. Post checks each slice against the segment's descriptor (a
// range outside every buffer is refused here, without a round trip) and
// queues it on its rail's connection (conn.go).

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Endpoint is an Endpoint of the transport to one segment. Use
// Transport.Open; safe for concurrent use (rings of several pollers may
// Post at once). It lives until its Close or the transport's.
type Endpoint struct {
	t      *Transport
	name   string
	dest   atomic.Pointer[dest]
	spans  atomic.Pointer[segtable.Mirror[span]] // the descriptor's buffers, by address
	rails  []atomic.Pointer[conn]
	mu     sync.Mutex // orders connection installs against Close
	closed atomic.Bool
	stop   chan struct{}
	wg     sync.WaitGroup
}

// dest is where and how to reach the target.
type dest struct {
	addr string
	v2   bool
	rpc  string // the segment's RPC port (notifications), or ""
}

// span is a buffer of the segment's descriptor.
type span struct{ addr, length uint64 }

var _ transport.Endpoint = (*Endpoint)(nil)

// Open dials the segment's rails. It needs Endpoints[Name] ("host:port");
// Endpoints[VersionEndpoint] (absent: 1) picks the protocol unless
// Config.Version does. At least one rail must connect before Open returns
// (an unreachable peer fails it with an error wrapping transport.ErrPeer);
// the others are redialed in the background.
func (t *Transport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	if t.closed.Load() {
		return nil, fmt.Errorf("mctcp: open %s: %w", desc.Name, transport.ErrClosed)
	}
	d, err := t.destOf(desc)
	if err != nil {
		return nil, fmt.Errorf("mctcp: open %s: %w", desc.Name, err)
	}
	e := &Endpoint{t: t, name: desc.Name, rails: make([]atomic.Pointer[conn], t.cfg.Rails), stop: make(chan struct{})}
	e.dest.Store(d)
	e.setSpans(desc)
	t.warnV1(d)
	var first error
	up := 0
	for i := range e.rails {
		nc, err := t.dial(ctx, d.addr)
		if err != nil {
			if first == nil {
				first = err
			}
			continue
		}
		e.install(i, nc)
		up++
	}
	if up == 0 {
		e.Close()
		return nil, fmt.Errorf("mctcp: open %s: %w", desc.Name, first)
	}
	for i := range e.rails {
		if e.rails[i].Load() == nil {
			e.wg.Add(1)
			go e.redial(i)
		}
	}
	t.mu.Lock()
	if t.closed.Load() {
		t.mu.Unlock()
		e.Close()
		return nil, fmt.Errorf("mctcp: open %s: %w", desc.Name, transport.ErrClosed)
	}
	t.eps[e] = struct{}{}
	t.mu.Unlock()
	return e, nil
}

// destOf reads the target's address and protocol version from desc.
func (t *Transport) destOf(desc *segtable.SegmentDesc) (*dest, error) {
	addr, ok := desc.Endpoints[Name]
	if !ok || addr == "" {
		return nil, transport.ErrUnreachable
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, fmt.Errorf("%w: bad endpoint %q: %w", segtable.ErrBadDesc, addr, err)
	}
	v := 1
	if s, ok := desc.Endpoints[VersionEndpoint]; ok && s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			return nil, fmt.Errorf("%w: bad %s %q", segtable.ErrBadDesc, VersionEndpoint, s)
		}
		v = max(n, 1) // Mooncake's 0 (absent) is 1
	}
	if t.cfg.Version != 0 {
		v = t.cfg.Version
	}
	return &dest{addr: addr, v2: v >= 2, rpc: desc.Endpoints[mooncake.EndpointRPC]}, nil
}

// warnV1 logs, once per peer address, that a version 1 peer's WRITEs are
// reported complete before their bytes land.
func (t *Transport) warnV1(d *dest) {
	if d.v2 {
		return
	}
	if _, seen := t.warnedV1.LoadOrStore(d.addr, struct{}{}); !seen {
		t.cfg.Logger.Warn("mctcp: peer speaks Mooncake TCP protocol version 1: its WRITEs are reported complete once sent, before the bytes land, and a refused range only closes the connection (failing as a path error)", "peer", d.addr)
	}
}

// dial connects to addr within DialTimeout and ctx.
func (t *Transport) dial(ctx context.Context, addr string) (net.Conn, error) {
	d := net.Dialer{Timeout: t.cfg.DialTimeout}
	nc, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w: %w", addr, transport.ErrPeer, err)
	}
	if tc, ok := nc.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	return nc, nil
}

// install starts a connection on rail i, unless the endpoint closed.
func (e *Endpoint) install(i int, nc net.Conn) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		nc.Close()
		return
	}
	cn := newConn(e, i, nc)
	e.rails[i].Store(cn)
	e.wg.Add(2)
	go cn.send()
	go cn.receive()
}

// redial dials rail i again, with backoff, until it connects or the
// endpoint closes.
func (e *Endpoint) redial(i int) {
	defer e.wg.Done()
	backoff := 10 * time.Millisecond
	for {
		select {
		case <-e.stop:
			return
		case <-time.After(backoff):
		}
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			select {
			case <-e.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		nc, err := e.t.dial(ctx, e.dest.Load().addr)
		cancel()
		if err == nil {
			e.install(i, nc)
			return
		}
		backoff = min(2*backoff, time.Second)
	}
}

// setSpans takes desc's buffers. The Mirror shares the tables of the
// chunks desc shares with the descriptor before it, so a republish after
// one registration among n buffers costs a chunk's spans, not n.
func (e *Endpoint) setSpans(desc *segtable.SegmentDesc) {
	e.spans.Store(segtable.NewMirror(e.spans.Load(), segtable.ChunksOf(desc), spanOf))
}

// spanOf is a buffer's span: Mooncake's descriptors give a buffer no key
// for TCP, so every buffer is kept.
func spanOf(b *segtable.BufferDesc) (span, bool) { return span{b.Addr, b.Length}, true }

// inside reports whether [addr, addr+n) lies wholly in one buffer of the
// descriptor.
func (e *Endpoint) inside(addr, n uint64) bool {
	if n == 0 || addr+n < addr {
		return false
	}
	s, _ := e.spans.Load().Floor(addr)
	return s != nil && addr-s.addr < s.length && n <= s.length-(addr-s.addr)
}

// Rails returns Config.Rails.
func (e *Endpoint) Rails() int { return len(e.rails) }

// Post queues the slices on their rails' connections and returns how many
// it took. A slice whose range lies in no buffer of the descriptor
// completes at once with transport.ErrRange, a Notify slice goes to the
// segment's RPC port (notify.go), an empty slice completes with success (as Mooncake's
// initiator completes one, unsent). It returns early (nil error) when the rail's queue
// is full, and with an error wrapping transport.ErrPeer when no rail is
// connected. It does not block and, in steady state, does not allocate.
func (e *Endpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	if e.closed.Load() {
		return 0, fmt.Errorf("mctcp: post to %s: %w", e.name, transport.ErrClosed)
	}
	v2 := e.dest.Load().v2
	for i := range s {
		sl := &s[i]
		switch {
		case sl.Op == transport.Notify:
			e.notify(c, sl)
			continue
		case sl.Op != transport.Read && sl.Op != transport.Write:
			c.Complete(sl.Token, fmt.Errorf("mctcp: op %d: %w", sl.Op, transport.ErrDenied))
			continue
		case sl.Length == 0:
			// Done by definition, as Mooncake's initiator has it (its
			// target would refuse the request).
			c.Complete(sl.Token, nil)
			continue
		case !e.inside(sl.Remote, sl.Length):
			c.Complete(sl.Token, transport.ErrRange)
			continue
		}
		it := item{c: c, token: sl.Token, local: sl.Local, remote: sl.Remote, length: sl.Length, v2: v2, write: sl.Op == transport.Write}
		n := len(e.rails)
		full := false
		posted := false
	rails:
		for k := range n {
			cn := e.rails[(int(sl.Rail)+k)%n].Load()
			if cn == nil {
				continue
			}
			switch cn.push(it) {
			case pushOK:
				posted = true
				break rails
			case pushFull:
				full = true
				break rails
			}
		}
		switch {
		case posted:
		case full:
			return i, nil
		default:
			return i, fmt.Errorf("mctcp: post to %s: no connection: %w", e.name, transport.ErrPeer)
		}
	}
	return len(s), nil
}

// Update takes the segment's new descriptor: its buffers and protocol
// version for the slices posted from now on, its address for the
// connections dialed from now on (a restarted peer breaks the old ones,
// which are then redialed).
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	if d, err := e.t.destOf(desc); err == nil {
		e.t.warnV1(d)
		e.dest.Store(d)
	}
	e.setSpans(desc)
}

// Close completes the endpoint's slices in flight with transport.ErrClosed
// and waits for its goroutines. It is idempotent.
func (e *Endpoint) Close() error {
	if e.closed.Swap(true) {
		return nil
	}
	close(e.stop)
	e.mu.Lock()
	for i := range e.rails {
		if cn := e.rails[i].Load(); cn != nil {
			cn.kill(fmt.Errorf("mctcp: endpoint %s: %w", e.name, transport.ErrClosed))
		}
	}
	e.mu.Unlock()
	e.wg.Wait()
	e.t.mu.Lock()
	delete(e.t.eps, e)
	e.t.mu.Unlock()
	return nil
}

// item is a slice on its way: queued, sent, or awaiting its answer.
type item struct {
	c      transport.Completer
	token  uint64
	local  unsafe.Pointer
	remote uint64
	length uint64
	v2     bool
	write  bool
}

// answered reports whether the target answers the item: READs always,
// WRITEs in version 2.
func (it *item) answered() bool { return !it.write || it.v2 }
