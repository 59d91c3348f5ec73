package tcp

// Faults at the target's accept and on its connections: the server's error
// paths (an accept that fails, reads and writes that fail before, inside
// and after the hello, the discard of a denied WRITE, a NOTIFY with no
// handler), reached through acceptHook and faultConn, with what the target
// must do on each: close the connection, give back every region it held,
// count the right refusal or none, leave its admission accounting clean,
// and leave no goroutine (TestMain checks for leaks).

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

var (
	hookOnce sync.Once
	plans    sync.Map // *Transport -> *acceptPlan
)

// acceptPlan is what a test does to the accepts of one transport: the next
// len(errs) accepts fail with errs in turn (the connection each took is
// closed), and the connections accepted after them are wrapped by wrap.
type acceptPlan struct {
	mu    sync.Mutex
	errs  []error
	wrap  func(net.Conn) net.Conn
	taken int // accepts seen
}

// faults installs acceptHook (once for the test binary; a transport
// without a plan is left alone) and returns tr's plan, which ends with t.
func faults(t testing.TB, tr *Transport) *acceptPlan {
	hookOnce.Do(func() {
		h := func(tr *Transport, c net.Conn, err error) (net.Conn, error) {
			if p, ok := plans.Load(tr); ok && err == nil {
				return p.(*acceptPlan).accept(c)
			}
			return c, err
		}
		acceptHook.Store(&h)
	})
	p := &acceptPlan{}
	plans.Store(tr, p)
	t.Cleanup(func() { plans.Delete(tr) })
	return p
}

func (p *acceptPlan) accept(c net.Conn) (net.Conn, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.taken++
	if len(p.errs) > 0 {
		err := p.errs[0]
		p.errs = p.errs[1:]
		c.Close()
		return nil, err
	}
	if p.wrap != nil {
		return p.wrap(c), nil
	}
	return c, nil
}

// failNext makes the next accepts fail with errs.
func (p *acceptPlan) failNext(errs ...error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.errs = append(p.errs, errs...)
}

// faultAt makes each connection accepted from now on a faultConn failing
// at readAt and writeAt, and returns the channel the connections come on.
func (p *acceptPlan) faultAt(readAt, writeAt int64, readErr, writeErr error) <-chan *faultConn {
	ch := make(chan *faultConn, 16)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.wrap = func(c net.Conn) net.Conn {
		fc := &faultConn{Conn: c, readAt: readAt, writeAt: writeAt, readErr: readErr, writeErr: writeErr, closed: make(chan struct{})}
		ch <- fc
		return fc
	}
	return ch
}

// faultConn is the target's side of a connection failing at chosen bytes:
// the read that would pass byte readAt of what the peer sent returns the
// bytes before it, and every read after fails with readErr; a write that
// would pass byte writeAt of what the target sends writes the bytes before
// it and fails with writeErr, as does every write after. A negative offset
// never fails. Not a *net.TCPConn, so the target reads it only through
// Read (no peeking at the socket underneath).
type faultConn struct {
	net.Conn
	readAt, writeAt   int64
	readErr, writeErr error
	read, written     atomic.Int64
	closed            chan struct{} // closed at the first Close
	once              sync.Once
}

func (c *faultConn) Read(p []byte) (int, error) {
	n := c.read.Load()
	if c.readAt >= 0 {
		if n >= c.readAt {
			return 0, c.readErr
		}
		p = p[:min(int64(len(p)), c.readAt-n)]
	}
	k, err := c.Conn.Read(p)
	c.read.Add(int64(k))
	return k, err
}

func (c *faultConn) Write(p []byte) (int, error) {
	n := c.written.Load()
	if c.writeAt >= 0 && n+int64(len(p)) > c.writeAt {
		k := 0
		if n < c.writeAt {
			k, _ = c.Conn.Write(p[:c.writeAt-n])
			c.written.Add(int64(k))
		}
		return k, c.writeErr
	}
	k, err := c.Conn.Write(p)
	c.written.Add(int64(k))
	return k, err
}

func (c *faultConn) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// waitClosed waits for the target to close c.
func (c *faultConn) waitClosed(t testing.TB, what string) {
	t.Helper()
	select {
	case <-c.closed:
	case <-time.After(hang):
		t.Fatalf("hang: %s: the target did not close the connection", what)
	}
}

// sockErr is err as a socket's read or write returns it.
func sockErr(op string, err syscall.Errno) error {
	return &net.OpError{Op: op, Net: "tcp", Err: os.NewSyscallError(op, err)}
}

// The bytes the target reads and writes in a hello (PROTOCOL.md).
const (
	helloIn  = specHelloLen + specProofLen      // hello, proof
	helloOut = specChallengeLen + specAcceptLen // challenge, accept
)

// nextFault dials s, and returns the connection and the faultConn the
// target serves it through.
func nextFault(t testing.TB, s *side, conns <-chan *faultConn) (net.Conn, *faultConn) {
	t.Helper()
	c := dialRaw(t, s.tr.Addr())
	select {
	case fc := <-conns:
		return c, fc
	case <-time.After(hang):
		t.Fatal("hang: the target accepted no connection")
	}
	return nil, nil
}

// clean checks what the target holds after its connections ended: none
// served, no handshake pending, none logged in, and refusals as want.
func (s *side) clean(t testing.TB, want Refusals) {
	t.Helper()
	s.waitServed(t)
	pending, sources, loggedIn := s.admitted()
	if pending != 0 || len(sources) != 0 || loggedIn != 0 {
		t.Errorf("after the connection ended: %d pending, sources %v, %d logged in; want none", pending, sources, loggedIn)
	}
	if got := s.tr.Refusals(); got != want {
		t.Errorf("Refusals %+v, want %+v", got, want)
	}
}

// unregisterAtOnce unregisters b and fails the test if a region of b is
// still held: a connection that ended must have given back every region.
func (s *side) unregisterAtOnce(t testing.TB, b testBuf) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := s.tr.UnregisterContext(ctx, b.b, b.r); err != nil {
		t.Fatalf("Unregister after the connection ended: %v (a region still held)", err)
	}
}

// TestAcceptErrors: an accept that fails is counted (AcceptErrors) and the
// listener goes on; one that finds no descriptor (EMFILE) first closes the
// oldest connection that has not proved the key (Descriptors), or backs
// off when there is none. A connection after them is served.
func TestAcceptErrors(t *testing.T) {
	serves := func(t *testing.T, s *side) {
		t.Helper()
		b := s.register(t, s.alloc(t, page, 3), true)
		rc := s.raw(t)
		if st, p := rc.do(specReq{op: specRead, id: 1, buffer: b.id, length: 8, key: b.key, addr: b.addr}, nil); st != 0 || !bytes.Equal(p, bytes.Repeat([]byte{3}, 8)) {
			t.Fatalf("READ after the failed accepts: status %d, % x", st, p)
		}
		rc.c.Close()
	}
	t.Run("aborted", func(t *testing.T) {
		s := newSide(t, Config{})
		faults(t, s.tr).failNext(sockErr("accept4", syscall.ECONNABORTED))
		expectEOF(t, dialRaw(t, s.tr.Addr()), "a connection whose accept failed")
		waitFor(t, "the failed accept counted", func() bool { return s.tr.Refusals().AcceptErrors == 1 })
		serves(t, s)
		s.clean(t, Refusals{AcceptErrors: 1})
	})
	t.Run("out of descriptors, a handshake pending", func(t *testing.T) {
		s := newSide(t, Config{})
		p := faults(t, s.tr)
		idle := dialRaw(t, s.tr.Addr())
		waitFor(t, "the idle connection pending", func() bool { n, _, _ := s.admitted(); return n == 1 })
		p.failNext(sockErr("accept4", syscall.EMFILE))
		expectEOF(t, dialRaw(t, s.tr.Addr()), "a connection whose accept found no descriptor")
		expectEOF(t, idle, "the pending connection closed to free a descriptor")
		serves(t, s)
		s.clean(t, Refusals{AcceptErrors: 1, Descriptors: 1})
	})
	t.Run("out of descriptors, none pending", func(t *testing.T) {
		s := newSide(t, Config{})
		faults(t, s.tr).failNext(sockErr("accept4", syscall.EMFILE), sockErr("accept4", syscall.ENFILE))
		expectEOF(t, dialRaw(t, s.tr.Addr()), "the first connection whose accept found no descriptor")
		expectEOF(t, dialRaw(t, s.tr.Addr()), "the second")
		serves(t, s)
		s.clean(t, Refusals{AcceptErrors: 2})
	})
}

// TestReadErrorsBeforeHello: a read that fails anywhere in the hello (the
// first byte, inside the hello, before or inside the proof) ends the
// connection: the target answers nothing more, counts no refusal (the peer
// or the network failed, not the protocol), and drops the connection from
// its handshake accounting.
func TestReadErrorsBeforeHello(t *testing.T) {
	for _, tc := range []struct {
		name string
		at   int64
		err  syscall.Errno
	}{
		{"first byte", 0, syscall.ECONNRESET},
		{"inside the hello", 10, syscall.ECONNRESET},
		{"before the proof", specHelloLen, syscall.ECONNRESET},
		{"inside the proof", specHelloLen + 20, syscall.ECONNRESET},
		{"inside the proof, the kernel's timeout", specHelloLen + 20, syscall.ETIMEDOUT},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSide(t, Config{})
			c, fc := nextFault(t, s, faults(t, s.tr).faultAt(tc.at, -1, sockErr("read", tc.err), nil))
			cnonce := make([]byte, 16)
			rand.Read(cnonce)
			c.Write(specHello(1, cnonce))
			if tc.at >= specHelloLen {
				ch, err := readChallenge(c)
				if err != nil {
					t.Fatalf("challenge: %v", err)
				}
				c.Write(specMAC(s.k, "initiator", cnonce, ch.snonce))
			}
			expectEOF(t, c, "a read failed in the hello")
			fc.waitClosed(t, "a read failed in the hello")
			s.clean(t, Refusals{})
		})
	}
}

// TestReadErrorsAfterHello: a read that fails after the hello, in a
// request header, a WRITE's payload (its region held), the payload of a
// denied WRITE being discarded, or a NOTIFY's payload (behind a READ whose
// region waits to be written), ends the connection without a response to
// that request and without a refusal; every region goes back (Unregister
// does not wait), and of the WRITE the bytes read before the failure
// landed, the rest not.
func TestReadErrorsAfterHello(t *testing.T) {
	const n = 256 << 10
	payload := make([]byte, n)
	testpattern.Fill(payload, 9)
	for _, tc := range []struct {
		name   string
		at     int64 // bytes read past the hello when the read fails
		req    func(b testBuf) []byte
		landed int    // bytes of the WRITE's payload that land
		reads  uint64 // READs served (their regions held, not written)
	}{
		{"in a request header", 10, func(b testBuf) []byte {
			return specReq{op: specRead, id: 1, buffer: b.id, length: 64, key: b.key, addr: b.addr}.frame(nil)
		}, 0, 0},
		{"in a WRITE's payload", specReqLen + 100_000, func(b testBuf) []byte {
			return specReq{op: specWrite, id: 1, buffer: b.id, length: n, key: b.key, addr: b.addr}.frame(payload)
		}, 100_000, 0},
		{"in a denied WRITE's payload", specReqLen + 100_000, func(b testBuf) []byte {
			return specReq{op: specWrite, id: 1, buffer: b.id, length: n, key: b.key ^ 1, addr: b.addr}.frame(payload)
		}, 0, 0},
		{"in a NOTIFY's payload", specReqLen + 5, func(b testBuf) []byte {
			return notifyFrame(1, 2, "peer", []byte("a message of some length"))
		}, 0, 0},
		{"in a NOTIFY's payload, a READ's region held", 2*specReqLen + 5, func(b testBuf) []byte {
			return append(specReq{op: specRead, id: 1, buffer: b.id, length: n, key: b.key, addr: b.addr}.frame(nil),
				notifyFrame(2, 2, "peer", []byte("a message of some length"))...)
		}, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSide(t, Config{})
			s.tr.SetNotify("target", func(*transport.Notification) error { return nil })
			b := s.register(t, s.alloc(t, n, canaryByte), true)
			conns := faults(t, s.tr).faultAt(helloIn+tc.at, -1, sockErr("read", syscall.ECONNRESET), nil)
			c, fc := nextFault(t, s, conns)
			helloRaw(t, c, s.k)
			wrote := make(chan struct{})
			go func() {
				defer close(wrote)
				c.Write(tc.req(b)) // fails once the target is gone
			}()
			io.Copy(io.Discard, c)
			fc.waitClosed(t, tc.name)
			c.Close()
			<-wrote
			s.clean(t, Refusals{})
			s.unregisterAtOnce(t, b)
			if i := testpattern.FirstDiff(b.mem[:tc.landed], payload[:tc.landed]); i >= 0 {
				t.Errorf("WRITE byte %d, read before the failure, did not land", i)
			}
			if i := allEqual(b.mem[tc.landed:], canaryByte); i >= 0 {
				t.Errorf("byte %d, past what the target read, changed", tc.landed+i)
			}
			var sv Served
			s.tr.Served(func(x Served) { sv = x })
			if sv.Writes != 0 || sv.Denied != 0 || sv.Reads != tc.reads {
				t.Errorf("Served %+v; want %d READs and nothing else: the failed request was not served", sv, tc.reads)
			}
		})
	}
}

// TestWriteErrors: a write that fails ends the connection without a
// refusal, in the hello (the challenge, the accept) as after it (a flush
// of small responses, or one that sends a READ's payload from its region):
// the region goes back (Unregister does not wait), and the target's
// accounting drops the connection, logged in or not.
func TestWriteErrors(t *testing.T) {
	const n = 256 << 10
	for _, tc := range []struct {
		name  string
		at    int64 // bytes written when the write fails
		read  uint32
		hello bool // the hello completes
	}{
		{"the challenge", 0, 0, false},
		{"inside the challenge", 10, 0, false},
		{"the accept", specChallengeLen, 0, false},
		{"inside the accept", specChallengeLen + 10, 0, false},
		{"a response", helloOut + 3, 64, true},
		{"a READ's payload from its region", helloOut + specRespLen + 1000, n, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSide(t, Config{})
			b := s.register(t, s.alloc(t, n, 4), true)
			conns := faults(t, s.tr).faultAt(-1, tc.at, nil, sockErr("write", syscall.EPIPE))
			c, fc := nextFault(t, s, conns)
			cnonce := make([]byte, 16)
			rand.Read(cnonce)
			c.Write(specHello(1, cnonce))
			var got []byte
			if tc.hello {
				helloRaw2(t, c, s.k, cnonce)
				c.Write(specReq{op: specRead, id: 1, buffer: b.id, length: tc.read, key: b.key, addr: b.addr}.frame(nil))
			} else if ch, err := readChallenge(c); err == nil {
				c.Write(specMAC(s.k, "initiator", cnonce, ch.snonce))
			}
			got, _ = io.ReadAll(c)
			fc.waitClosed(t, tc.name)
			if want := tc.at; tc.hello && int64(len(got)) != want-helloOut {
				t.Errorf("%d bytes after the hello before the close, want the %d before the failed write", len(got), want-helloOut)
			}
			s.clean(t, Refusals{})
			s.unregisterAtOnce(t, b)
		})
	}
}

// helloRaw2 completes a hello whose first message the caller sent.
func helloRaw2(t testing.TB, c net.Conn, k, cnonce []byte) {
	t.Helper()
	ch, err := readChallenge(c)
	if err != nil {
		t.Fatalf("challenge: %v", err)
	}
	c.Write(specMAC(k, "initiator", cnonce, ch.snonce))
	var acc [specAcceptLen]byte
	if _, err := io.ReadFull(c, acc[:]); err != nil || acc[0]|acc[1] != 0 {
		t.Fatalf("accept: % x, %v", acc[:4], err)
	}
}

// TestBadMagic: a hello that does not start with "MRNG" is closed without
// an answer and counted as a bad hello, whatever follows it (here a valid
// hello, then frames: none is served).
func TestBadMagic(t *testing.T) {
	s := newSide(t, Config{})
	b := s.register(t, s.alloc(t, page, canaryByte), true)
	for i, magic := range []string{"mrng", "MRN\x00", "\x16\x03\x01\x00", "GET "} {
		c := dialRaw(t, s.tr.Addr())
		h := specHello(1, make([]byte, 16))
		copy(h, magic)
		w := specReq{op: specWrite, id: 1, buffer: b.id, length: 8, key: b.key, addr: b.addr}.frame(bytes.Repeat([]byte{1}, 8))
		c.Write(append(append(h, specHello(1, make([]byte, 16))...), w...))
		expectEOF(t, c, "a hello with magic "+magic)
		waitFor(t, "the bad hello counted", func() bool { return s.tr.Refusals().BadHello == uint64(i+1) })
	}
	s.clean(t, Refusals{BadHello: 4})
	if i := allEqual(b.mem, canaryByte); i >= 0 {
		t.Errorf("byte %d of the buffer changed: a frame after a bad hello was served", i)
	}
}

// TestDeniedWriteDiscarded: a WRITE the target refuses (a wrong key, out
// of range) has its payload read and dropped, however long (here past the
// target's 64 KiB read buffer, and made of valid request frames that a
// target reading it as requests would answer): the connection stays in
// step, the next request is answered, the buffer is unchanged, and the
// refusals are counted in Served.
func TestDeniedWriteDiscarded(t *testing.T) {
	s := newSide(t, Config{})
	const n = 1 << 20
	b := s.register(t, s.alloc(t, n, canaryByte), true)
	evil := specReq{op: specRead, id: 0xbad, buffer: b.id, length: 8, key: b.key, addr: b.addr}.frame(nil)
	payload := bytes.Repeat(evil, n/len(evil))
	rc := s.raw(t)
	for i, r := range []specReq{
		{op: specWrite, id: 1, buffer: b.id, length: n, key: b.key ^ 1, addr: b.addr},            // wrong key
		{op: specWrite, id: 2, buffer: b.id, length: n, key: b.key, addr: b.addr + 1},            // out of range
		{op: specWrite, id: 3, buffer: b.id, length: n, key: b.key, addr: b.addr + n},            // past the end
		{op: specWrite, id: 4, buffer: b.id + 1, length: 100_000, key: b.key, addr: b.addr + 64}, // no such buffer
	} {
		want := []uint8{1, 2, 1, 1}[i]
		if st, _ := rc.do(r, payload[:r.length]); st != want {
			t.Errorf("WRITE %d: status %d, want %d", r.id, st, want)
		}
		if st, p := rc.do(specReq{op: specRead, id: 10 + r.id, buffer: b.id, length: 8, key: b.key, addr: b.addr}, nil); st != 0 || allEqual(p, canaryByte) >= 0 {
			t.Fatalf("READ after denied WRITE %d: status %d, % x", r.id, st, p)
		}
	}
	rc.c.Close()
	s.clean(t, Refusals{})
	if i := allEqual(b.mem, canaryByte); i >= 0 {
		t.Errorf("byte %d of the buffer changed by a denied WRITE", i)
	}
	var sv Served
	s.tr.Served(func(x Served) { sv = x })
	if sv.Denied != 4 || sv.Writes != 0 || sv.Reads != 4 {
		t.Errorf("Served %+v; want 4 denied, no WRITE, 4 READs", sv)
	}
}

// TestNotifyWithoutHandler: a NOTIFY to a target with no handler (no
// SetNotify) is answered denied (status 1) and the connection goes on; a
// handler that refuses it (a full queue) gets busy (status 3); a NOTIFY
// whose payload breaks the format ends the connection as a bad frame.
func TestNotifyWithoutHandler(t *testing.T) {
	s := newSide(t, Config{})
	b := s.register(t, s.alloc(t, page, 6), true)
	read := func(rc *rawConn, id uint32) {
		t.Helper()
		if st, p := rc.do(specReq{op: specRead, id: id, buffer: b.id, length: 8, key: b.key, addr: b.addr}, nil); st != 0 || !bytes.Equal(p, bytes.Repeat([]byte{6}, 8)) {
			t.Fatalf("READ after the NOTIFY: status %d, % x", st, p)
		}
	}
	rc := s.raw(t)
	rc.send(notifyFrame(1, 7, "peer", []byte("hello")))
	if id, st := rc.resp(); id != 1 || st != 1 {
		t.Errorf("NOTIFY without a handler: id %d status %d, want 1, 1 (denied)", id, st)
	}
	read(rc, 2)
	var mu sync.Mutex
	var got []transport.Notification
	s.tr.SetNotify("target", func(n *transport.Notification) error {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, transport.Notification{From: n.From, Tag: n.Tag, Msg: bytes.Clone(n.Msg)})
		return transport.ErrNotifyFull
	})
	rc.send(notifyFrame(3, 8, "peer", []byte("again")))
	if id, st := rc.resp(); id != 3 || st != 3 {
		t.Errorf("NOTIFY refused by its handler: id %d status %d, want 3, 3 (busy)", id, st)
	}
	read(rc, 4)
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 1 || got[0].From != "peer" || got[0].Tag != 8 || string(got[0].Msg) != "again" {
		t.Errorf("handler got %+v, want the one NOTIFY sent after SetNotify", got)
	}
	bad := notifyFrame(5, 9, "peer", []byte("x"))
	binary.BigEndian.PutUint16(bad[specReqLen+8:], 200) // a name longer than the payload
	rc.send(bad)
	rc.expectClosed("a NOTIFY whose name runs past its payload")
	rc.c.Close()
	s.clean(t, Refusals{BadFrame: 1})
}
