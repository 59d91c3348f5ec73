package tcp

import (
	"bufio"
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/bell"
	"github.com/moonring/moonring/internal/mpsc"
	"github.com/moonring/moonring/internal/uring"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Endpoint is the way to one remote segment: Rails connections, each
// redialed with backoff when it breaks.
type Endpoint struct {
	t      *Transport
	name   string
	dest   atomic.Pointer[dest] // where to dial; a restarted peer's replaces it
	maxLen atomic.Uint32
	bufs   atomic.Pointer[[]remoteBuf]
	rails  []atomic.Pointer[conn]
	closed atomic.Bool
	stop   chan struct{}
	done   chan struct{} // closed when the first Close has finished
	wg     sync.WaitGroup
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
	e := &Endpoint{t: t, name: desc.Name, rails: make([]atomic.Pointer[conn], t.cfg.Rails), stop: make(chan struct{}), done: make(chan struct{})}
	e.dest.Store(&dest{addr, key, pin})
	e.Update(desc)
	first, err := e.dial(ctx)
	// A target that cut the hello short (its bounds on handshakes, a burst
	// of dials from one host) or is busy is dialed again, with backoff,
	// for up to DialTimeout.
	for wait, start := 5*time.Millisecond, time.Now(); err != nil && (errors.Is(err, errCut) || errors.Is(err, errBusy)) && time.Since(start)+wait < t.cfg.DialTimeout; wait = min(2*wait, 500*time.Millisecond) {
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil, fmt.Errorf("tcp: open %s at %s: %w (%v)", desc.Name, addr, err, context.Cause(ctx))
		}
		first, err = e.dial(ctx)
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
	go e.keep(0, first)
	for i := 1; i < len(e.rails); i++ {
		go e.keep(i, nil)
	}
	t.mu.Unlock()
	t.cfg.Logger.Info("tcp: rail connected", "segment", desc.Name, "addr", addr, "rail", 0)
	return e, nil
}

// Rails returns the number of connections.
func (e *Endpoint) Rails() int { return len(e.rails) }

// Update takes the buffers and keys of a republished descriptor. When the
// peer restarted (a new address or segment key), the rails are closed and
// redialed there; their slices fail with ErrPeer and the engine retries
// them.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	if addr, key, pin, err := e.t.parseEndpoint(desc.Endpoints[Name]); err == nil {
		if old := e.dest.Load(); old != nil && (old.addr != addr || !bytes.Equal(old.key, key) || !bytes.Equal(old.pin, pin)) {
			e.dest.Store(&dest{addr, key, pin})
			for i := range e.rails {
				if c := e.rails[i].Load(); c != nil {
					c.close(fmt.Errorf("%w: the peer moved to %s", transport.ErrPeer, addr))
				}
			}
		}
	}
	bs := make([]remoteBuf, 0, len(desc.Buffers))
	for _, b := range desc.Buffers {
		id, key, ok := strings.Cut(b.Keys[Name], ".")
		bid, err1 := strconv.ParseUint(id, 16, 32)
		k, err2 := strconv.ParseUint(key, 16, 64)
		if !ok || err1 != nil || err2 != nil {
			continue // not served over tcp: slices to it are denied
		}
		bs = append(bs, remoteBuf{b.Addr, b.Length, uint32(bid), k})
	}
	e.bufs.Store(&bs)
}

func (e *Endpoint) find(addr, n uint64) *remoteBuf {
	bs := *e.bufs.Load()
	i, j := 0, len(bs)
	for i < j {
		h := int(uint(i+j) >> 1)
		if bs[h].addr+bs[h].length > addr {
			j = h
		} else {
			i = h + 1
		}
	}
	if i == len(bs) || addr < bs[i].addr || n > bs[i].length || addr-bs[i].addr > bs[i].length-n {
		return nil
	}
	return &bs[i]
}

// Post queues the slices on their rails. It accepts slices in order until
// a rail is full (the rest are for later) or down (ErrPeer for the rest, so
// the engine retries them on another rail).
func (e *Endpoint) Post(c transport.Completer, s []transport.Slice) (n int, err error) {
	if e.closed.Load() {
		return 0, transport.ErrClosed
	}
	var touched [4]*conn // the rails posted to, kicked once at the end
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
		cn.kick() // more rails than slots: kick at once
	}
	for i := range s {
		sl := &s[i]
		if sl.Op == transport.Notify {
			// The frame's payload (tag, name, message) must be within the
			// target's MaxLength, or it would fail the connection.
			if sl.Length > transport.MaxNotifyMessage || 10+uint64(len(e.t.self))+sl.Length > uint64(e.maxLen.Load()) {
				c.Complete(sl.Token, transport.ErrRange)
				continue
			}
			cn := e.rail(int(sl.Rail))
			if cn == nil {
				return i, transport.ErrPeer
			}
			ok, err := cn.post(c, sl, &remoteBuf{})
			if err != nil {
				return i, err
			}
			if !ok {
				return i, nil
			}
			touch(cn)
			continue
		}
		if sl.Length > uint64(e.maxLen.Load()) {
			c.Complete(sl.Token, fmt.Errorf("tcp: slice of %d bytes above the peer's limit: %w", sl.Length, transport.ErrRange))
			continue
		}
		b := e.find(sl.Remote, sl.Length)
		if b == nil {
			c.Complete(sl.Token, transport.ErrDenied)
			continue
		}
		cn := e.rail(int(sl.Rail))
		if cn == nil {
			return i, transport.ErrPeer
		}
		ok, err := cn.post(c, sl, b)
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

// Close closes the rails; their slices complete with ErrClosed. A second
// call waits for the first to finish.
func (e *Endpoint) Close() error {
	if e.closed.Swap(true) {
		<-e.done
		return nil
	}
	defer close(e.done)
	close(e.stop)
	for i := range e.rails {
		if c := e.rails[i].Load(); c != nil {
			c.close(transport.ErrClosed)
		}
	}
	e.wg.Wait()
	e.t.mu.Lock()
	delete(e.t.eps, e)
	e.t.mu.Unlock()
	return nil
}

// keep owns rail i: it waits for its connection to die and redials with
// backoff until the endpoint closes.
func (e *Endpoint) keep(i int, c *conn) {
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
			e.rails[i].CompareAndSwap(c, nil)
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
		nc, err := e.dial(ctx)
		cancel()
		if err != nil {
			e.t.cfg.Logger.Info("tcp: dial", "segment", e.name, "addr", e.dest.Load().addr, "err", err, "retry in", backoff)
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
		e.rails[i].Store(c)
		if to := e.dest.Load(); c.to != to {
			// An Update moved the peer while this dialed the old address
			// (its close of the rails came before this one was stored).
			c.close(fmt.Errorf("%w: the peer moved to %s", transport.ErrPeer, to.addr))
			continue
		}
		e.maxLen.Store(c.maxLen) // the current peer's: not one an old address answered
		e.t.cfg.Logger.Info("tcp: rail connected", "segment", e.name, "addr", c.to.addr, "rail", i)
	}
}

// dial connects, runs the hello and starts the connection's goroutines.
func (e *Endpoint) dial(ctx context.Context) (*conn, error) {
	d := net.Dialer{Timeout: e.t.cfg.DialTimeout}
	to := e.dest.Load()
	raw, err := d.DialContext(ctx, "tcp", to.addr)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", transport.ErrPeer, err)
	}
	if tc, ok := raw.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
		if err := setPeerTimeout(tc, e.t.cfg.PeerTimeout); err != nil {
			raw.Close()
			return nil, fmt.Errorf("tcp: set TCP_USER_TIMEOUT: %w", err)
		}
	}
	var nc net.Conn = raw
	// The hello within helloTimeout, or the caller's earlier deadline: a
	// target that accepts and never answers holds Open no longer.
	deadline := time.Now().Add(helloTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	raw.SetDeadline(deadline)
	if cfg := e.tlsConfig(to); cfg != nil {
		tc := tls.Client(raw, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			raw.Close()
			if cutShort(err) {
				return nil, fmt.Errorf("%w: tls: %w (%v)", transport.ErrPeer, errCut, err)
			}
			return nil, fmt.Errorf("tcp: tls: %w", err)
		}
		nc = tc
	}
	// The hello's reads heed only the deadline: closing the socket is what
	// makes ctx's end (Endpoint.Close stopping a redial) cut it short.
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	br := bufio.NewReaderSize(nc, 64<<10)
	maxLen, err := clientHello(nc, br, to.key)
	if !stop() && err == nil {
		err = fmt.Errorf("%w: hello: %v", transport.ErrPeer, context.Cause(ctx))
	}
	if err != nil {
		raw.Close()
		return nil, err
	}
	raw.SetDeadline(time.Time{})
	c := &conn{e: e, to: to, maxLen: maxLen, nc: nc, br: br, bell: bell.New(), hdrs: make([][reqSize]byte, e.t.cfg.Depth), notes: make([][10 + 255]byte, e.t.cfg.Depth),
		parts: make([][3][]byte, e.t.cfg.Depth),
		quit:  make(chan struct{}), sendDone: make(chan struct{}), recvDone: make(chan struct{}), dead: make(chan struct{})}
	c.q, _ = mpsc.New[pending](e.t.cfg.Depth)
	c.iov = make([][]byte, 0, 192)
	c.sizes = make([]int, 0, 192)
	c.uiov = make([]unix.Iovec, 0, 192)
	if tc, ok := nc.(*net.TCPConn); ok {
		c.rc, _ = tc.SyscallConn()
		// Made once: a closure per kick would allocate.
		c.writeFn = func(fd uintptr) bool {
			c.wn, c.werr = c.writev(int(fd), c.wiov)
			return true // never wait: the sender goroutine does that
		}
		if e.t.cfg.IOUring {
			c.useUring()
		}
	}
	go c.send()
	go c.receive()
	return c, nil
}

// tlsConfig is how to dial to: pinned to its certificate when its
// endpoint publishes one (AutoTLS), else ClientTLS; nil for plain TCP.
func (e *Endpoint) tlsConfig(to *dest) *tls.Config {
	if to.pin != nil {
		pin := to.pin
		cfg := &tls.Config{
			// The certificate is self-signed: it is checked against the
			// pin, which the signed descriptor carried, not against a CA.
			InsecureSkipVerify: true,
			MinVersion:         tls.VersionTLS13,
			VerifyConnection: func(cs tls.ConnectionState) error {
				if len(cs.PeerCertificates) == 0 {
					return ErrPinMismatch
				}
				if sum := sha256.Sum256(cs.PeerCertificates[0].Raw); subtle.ConstantTimeCompare(sum[:], pin) != 1 {
					return ErrPinMismatch
				}
				return nil
			},
		}
		if c := e.t.cert; c != nil {
			cfg.Certificates = []tls.Certificate{*c}
		} else if ct := e.t.cfg.ClientTLS; ct != nil {
			cfg.Certificates = ct.Certificates
		}
		return cfg
	}
	cfg := e.t.cfg.ClientTLS
	if cfg != nil && cfg.ServerName == "" {
		// As tls.Dial does: verify the peer as the host dialed. One
		// ClientTLS serves every peer, so it cannot name each of them.
		cfg = cfg.Clone()
		cfg.ServerName, _, _ = net.SplitHostPort(to.addr)
	}
	return cfg
}

// errCut marks a hello (or TLS handshake) that the target cut short by
// closing the connection, and errBusy one it answered busy (MaxConns):
// Open dials again, as a rail's redial would.
var (
	errCut  = errors.New("the target closed the connection during the hello")
	errBusy = errors.New("the target serves as many connections as it takes (its MaxConns)")
)

// cutShort reports whether err is the peer closing or resetting the
// connection.
func cutShort(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// helloErr is the error of a hello that failed reading or writing.
func helloErr(err error) error {
	if cutShort(err) {
		return fmt.Errorf("%w: hello: %w (%v)", transport.ErrPeer, errCut, err)
	}
	return fmt.Errorf("%w: hello: %v", transport.ErrPeer, err)
}

func clientHello(nc net.Conn, br *bufio.Reader, key []byte) (maxLen uint32, err error) {
	var h [24]byte
	copy(h[:], magic)
	binary.BigEndian.PutUint16(h[4:], version)
	cnonce := h[8:24]
	rand.Read(cnonce)
	if _, err := nc.Write(h[:]); err != nil {
		return 0, helloErr(err)
	}
	var ch [32]byte
	if _, err := io.ReadFull(br, ch[:]); err != nil {
		return 0, helloErr(err)
	}
	if string(ch[:4]) != magic {
		return 0, fmt.Errorf("%w: bad magic in challenge", ErrProtocol)
	}
	switch binary.BigEndian.Uint16(ch[6:]) {
	case helloOK:
	case helloBadVersion:
		return 0, fmt.Errorf("%w: we speak %d, it speaks %d", ErrVersion, version, binary.BigEndian.Uint16(ch[4:]))
	case helloTLS:
		return 0, ErrTLSRequired
	default:
		return 0, fmt.Errorf("%w: bad challenge status", ErrProtocol)
	}
	snonce := ch[8:24]
	maxLen = binary.BigEndian.Uint32(ch[24:])
	if _, err := nc.Write(mac(key, "initiator", cnonce, snonce)); err != nil {
		return 0, helloErr(err)
	}
	var acc [36]byte
	if _, err := io.ReadFull(br, acc[:]); err != nil {
		// A wrong key is answered (status 3): a target that closes instead
		// gave up on the connection (a cap, Close), which is no refusal of
		// the key.
		return 0, helloErr(err)
	}
	switch binary.BigEndian.Uint16(acc[:]) {
	case helloBadKey:
		return 0, ErrAuth
	case helloBusy:
		return 0, fmt.Errorf("%w: %w", transport.ErrPeer, errBusy)
	}
	if !hmac.Equal(acc[4:], mac(key, "target", cnonce, snonce)) {
		return 0, fmt.Errorf("%w: the target does not hold the key", ErrAuth)
	}
	return maxLen, nil
}

// pending is one slice on a connection, from Post to its response.
type pending struct {
	s      transport.Slice
	c      transport.Completer
	buffer uint32
	key    uint64
	addr   uint64
}

// conn is one rail. Post appends to q (any poller); send writes frames for
// positions it has not written yet, up to q.Committed(); receive reads the
// responses in order and releases positions from q's head.
type conn struct {
	e      *Endpoint
	to     *dest  // where it was dialed
	maxLen uint32 // the target's MaxLength, from the hello
	nc     net.Conn
	br     *bufio.Reader
	q      *mpsc.Queue[pending]
	bell   *bell.Doorbell
	hdrs   [][reqSize]byte  // request headers by slot, written by send
	notes  [][10 + 255]byte // NOTIFY payload prefixes by slot, written by send
	// parts holds, by slot, the pieces of each frame as first gathered
	// (header, payload or NOTIFY prefix, message): a frame gathered again
	// (not wholly written) is built from them, never from its slot, which
	// the receiver may have released meanwhile. gathered is the first
	// position never gathered: the receiver refuses an answer to one.
	parts    [][3][]byte
	gathered atomic.Uint64

	// posting counts Posts in progress; failed is set once the connection
	// broke. The failer waits for posting to drain after setting failed, so
	// no slice is left behind in a dead queue.
	posting atomic.Int32
	failed  atomic.Bool
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
	wiov      [][]byte
	wn        int
	werr      error

	quit     chan struct{} // closed when the connection fails
	sendDone chan struct{}
	recvDone chan struct{}
	dead     chan struct{} // closed once every queued slice is completed
}

// post queues one slice: false when the rail is full.
func (c *conn) post(comp transport.Completer, s *transport.Slice, b *remoteBuf) (bool, error) {
	c.posting.Add(1)
	defer c.posting.Add(-1)
	if c.failed.Load() {
		return false, transport.ErrPeer
	}
	idle := c.q.Len() == 0
	pos, n := c.q.Reserve(1)
	if n == 0 {
		return false, nil
	}
	if idle {
		c.busySince.Store(time.Now().UnixNano())
	}
	p := c.q.Slot(pos)
	p.s, p.c = *s, comp
	p.buffer, p.key, p.addr = b.id, b.key, s.Remote
	c.q.Commit(pos, 1)
	return true, nil
}

// frame appends the iovecs of the request frame at pos: its header (built
// into hdrs), then a WRITE's payload or a NOTIFY's prefix and message,
// skipping the first skip bytes. It returns the frame's size.
func (c *conn) frame(iov [][]byte, pos uint64, skip int) ([][]byte, int) {
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
	h := c.hdrs[idx][:]
	req := request{op: opRead, id: uint32(pos), buffer: p.buffer, length: uint32(p.s.Length), key: p.key, addr: p.addr}
	parts := [3][]byte{h}
	switch p.s.Op {
	case transport.Notify:
		name := c.e.t.self
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
	}
	req.encode(h)
	c.parts[idx] = parts
	return c.appendParts(iov, &c.parts[idx], skip)
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
		iov, size = c.frame(iov, pos, skip)
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
		if c.sent.Load() == c.q.Committed() {
			c.bell.Arm()
			if c.sent.Load() == c.q.Committed() {
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
			if c.ur != nil {
				n, err = c.uringWrite(bufs)
			} else {
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

// useUring gives the sender an io_uring of its own; where io_uring is not
// available (old kernels, containers that block it) the sender keeps the
// netpoller's writev.
func (c *conn) useUring() {
	r, err := uring.New(8)
	if err != nil {
		c.e.t.cfg.Logger.Info("tcp: io_uring not available, using the netpoller", "err", err)
		return
	}
	c.rc.Control(func(fd uintptr) { c.fd = int(fd) })
	c.ur = r
}

// iovecs fills c.uiov with iov's non-empty buffers. The sending flag must
// be held.
func (c *conn) iovecs(iov [][]byte) []unix.Iovec {
	c.uiov = c.uiov[:0]
	for _, b := range iov {
		if len(b) > 0 {
			v := unix.Iovec{Base: &b[0]}
			v.SetLen(len(b))
			c.uiov = append(c.uiov, v)
		}
	}
	return c.uiov
}

// writev is one writev(2) of iov to fd through c.uiov. unix.Writev would
// make its iovec array on every call, on the heap once there are more than
// eight (a pipelined kick gathers up to 189 iovecs, some 94 WRITE
// frames). The sending flag must be held.
func (c *conn) writev(fd int, iov [][]byte) (int, error) {
	v := c.iovecs(iov)
	if len(v) == 0 {
		return 0, nil
	}
	n, _, e := unix.Syscall(unix.SYS_WRITEV, uintptr(fd), uintptr(unsafe.Pointer(&v[0])), uintptr(len(v)))
	if e != 0 {
		return 0, e
	}
	raceReadIovecs(iov, int(n))
	return int(n), nil
}

// uringWrite writes iov with one IORING_OP_WRITEV and waits for it. The
// memory stays put: registered buffers are pinned or mmap'd, headers live
// in the conn, and the ring keeps the iovec array referenced.
func (c *conn) uringWrite(iov [][]byte) (int64, error) {
	v := c.iovecs(iov)
	sqe := c.ur.SQE()
	if sqe == nil {
		return 0, errors.New("tcp: io_uring submission queue full")
	}
	uring.PrepWritev(sqe, c.fd, v, -1, 1)
	if _, err := c.ur.SubmitAndWait(1); err != nil {
		return 0, err
	}
	_, res, ok := c.ur.PeekCQE()
	if !ok {
		var err error
		if _, res, err = c.ur.WaitCQE(); err != nil {
			return 0, err
		}
	}
	c.ur.CQEAdvance(1)
	if err := uring.ResultError(res); err != nil {
		return 0, err
	}
	return int64(res), nil
}

// receive completes slices in the order of their responses.
func (c *conn) receive() {
	defer close(c.recvDone)
	var hdr [respSize]byte
	r := reader{c: c, last: time.Now().UnixNano(), timeout: int64(c.e.t.cfg.ResponseTimeout)}
	for {
		// The next response answers the oldest frame posted: when that is
		// a large READ and nothing is buffered, its header and payload
		// come straight from the socket (see reader.payload).
		src := io.Reader(c.br)
		if c.br.Buffered() == 0 && c.directNext() {
			src = c.nc
		}
		if err := r.read(src, hdr[:], true); err != nil {
			c.fail(fmt.Errorf("%w: receive: %v", transport.ErrPeer, err))
			return
		}
		r.last = time.Now().UnixNano()
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
			c.fail(err)
			return
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
		if status == stOK && p.s.Op == transport.Read {
			if err := r.payload(unsafe.Slice((*byte)(p.s.Local), p.s.Length)); err != nil {
				c.fail(fmt.Errorf("%w: receive: %v", transport.ErrPeer, err))
				return
			}
		}
		comp, tok := p.c, p.s.Token
		p.c, p.s.Local = nil, nil
		c.q.Release(1)
		comp.Complete(tok, result)
	}
}

// directMin is the READ payload from which the receiver reads from the
// socket into the destination itself rather than through its 64 KiB
// buffer: a copy less per byte for one more read call per response.
const directMin = 16 << 10

// directNext reports whether the next response answers a READ of at least
// directMin bytes. Only the receiver calls it.
func (c *conn) directNext() bool {
	pos := c.q.Head()
	if pos >= c.q.Committed() {
		return false
	}
	p := c.q.Slot(pos)
	return p.s.Op == transport.Read && p.s.Length >= directMin
}

// reader is the receiver's reading of the stream, which keeps the
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
	deadline int64 // the read deadline set, UnixNano
	timeout  int64
}

// read fills dst from src, a response header (header) or payload bytes.
func (r *reader) read(src io.Reader, dst []byte, header bool) error {
	c := r.c
	for got := 0; got < len(dst); {
		owed := r.last
		if header {
			owed = max(r.last, c.busySince.Load())
		}
		if r.timeout > 0 && owed+r.timeout-r.deadline > r.timeout/2 {
			r.deadline = owed + r.timeout
			c.nc.SetReadDeadline(time.Unix(0, r.deadline))
		}
		k, err := src.Read(dst[got:])
		got += k
		if k > 0 && !header {
			r.last = time.Now().UnixNano()
		}
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			now := time.Now().UnixNano()
			if header {
				idle := c.q.Head() == c.q.Committed()
				if idle {
					r.last = now
				}
				if idle || now-max(r.last, c.busySince.Load()) < r.timeout {
					r.deadline = 0 // set a fresh one
					continue
				}
			} else if now-r.last < r.timeout {
				r.deadline = 0
				continue
			}
		}
		return err
	}
	return nil
}

// payload fills dst with the next bytes of the stream: what the buffer
// holds first, and the rest straight from the socket when it is at least
// directMin (the buffer is empty then, so the order of bytes holds).
func (r *reader) payload(dst []byte) error {
	c := r.c
	n := 0
	if k := c.br.Buffered(); k > 0 {
		n, _ = c.br.Read(dst[:min(k, len(dst))])
	}
	if rest := dst[n:]; len(rest) >= directMin {
		return r.read(c.nc, rest, false)
	} else if len(rest) > 0 {
		return r.read(c.br, rest, false)
	}
	return nil
}

// fail breaks the connection: both goroutines stop, and the receiver (or
// the closer) completes every queued slice with err.
func (c *conn) fail(err error) { c.close(err) }

func (c *conn) close(err error) {
	c.once.Do(func() {
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
}

// drain completes what is queued once no Post is adding to the queue and
// the receiver has stopped, then marks the connection dead.
func (c *conn) drain() {
	for c.posting.Load() != 0 {
		time.Sleep(time.Microsecond)
	}
	<-c.sendDone
	<-c.recvDone
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
