package tcp

// Tests of the data port's connection limits: MaxHandshakes,
// MaxHandshakesPerSource, HandshakeTimeout, MaxConns, IdleTimeout, the
// accept loop out of descriptors, and Refusals with its bounded log.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// idleSockets opens n connections to addr from the loopback address src
// ("127.0.0.2") that never send a byte, as an attacker holding descriptors
// does. Dials the kernel cannot complete (a full backlog) are skipped; the
// cleanup closes the rest.
func idleSockets(t testing.TB, addr, src string, n int) []net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	cs := make([]net.Conn, 0, n)
	for range n {
		c, err := d.Dial("tcp", addr)
		if err != nil {
			continue
		}
		cs = append(cs, c)
	}
	t.Cleanup(func() {
		for _, c := range cs {
			c.Close()
		}
	})
	if len(cs) < n/2 {
		t.Fatalf("only %d of %d idle connections from %s", len(cs), n, src)
	}
	return cs
}

// admitted is the target's account of connections not yet logged in:
// in all, and per source.
func (s *side) admitted() (pending int, sources map[netip.Addr]int, loggedIn int) {
	s.tr.mu.Lock()
	defer s.tr.mu.Unlock()
	n := 0
	for pc := s.tr.adm.head; pc != nil; pc = pc.next {
		n++
	}
	if n != s.tr.adm.npending {
		panic(fmt.Sprintf("pending list holds %d, count says %d", n, s.tr.adm.npending))
	}
	sources = map[netip.Addr]int{}
	for k, v := range s.tr.adm.sources {
		sources[k] = v
	}
	return n, sources, s.tr.adm.loggedIn
}

// accepted is how many connections the target's accept loop took: those
// it closed for a cap, and those it holds, logged in or not (a connection
// closed for a cap leaves the count at once, its goroutine later). It
// misses connections that ended on their own.
func (s *side) accepted() int {
	s.tr.mu.Lock()
	defer s.tr.mu.Unlock()
	r := s.tr.Refusals()
	return int(r.HandshakeCap+r.SourceCap+r.Descriptors) + s.tr.adm.npending + s.tr.adm.loggedIn
}

// TestIdleSocketsCapped: hundreds of idle connections (no byte sent, from
// nine source addresses, the initiator's among them) leave the target
// holding at most MaxHandshakes of them, at most MaxHandshakesPerSource a
// source, and an initiator with the key still opens the segment and moves
// bytes. The target used to hold every one of them (the issue's ~1,100
// idle sockets exhausted its descriptors).
func TestIdleSocketsCapped(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 1<<20, 0), true)
	const perSource = 40
	total := 0
	for i := 1; i <= 9; i++ {
		total += len(idleSockets(t, targ.tr.Addr(), fmt.Sprintf("127.0.0.%d", i), perSource))
	}
	waitFor(t, "the target to accept every idle connection", func() bool { return targ.accepted() >= total })
	pending, sources, _ := targ.admitted()
	if pending > DefaultMaxHandshakes {
		t.Fatalf("the target holds %d connections that proved nothing, want at most %d", pending, DefaultMaxHandshakes)
	}
	for src, n := range sources {
		if n > DefaultMaxHandshakesPerSource {
			t.Fatalf("the target holds %d connections from %v that proved nothing, want at most %d", n, src, DefaultMaxHandshakesPerSource)
		}
	}
	r := targ.tr.Refusals()
	if got := int(r.HandshakeCap + r.SourceCap); got != total-pending {
		t.Fatalf("Refusals: %d closed for a cap (%+v), want %d - %d held", got, r, total, pending)
	}

	init := newSide(t, Config{})
	roundTrip(t, open(t, init, targ, remote), init, remote, 1<<20)
}

// TestSourceCap: past MaxHandshakesPerSource, a new connection from a
// source closes that source's oldest one not logged in; other sources keep
// theirs. Past MaxHandshakes, the oldest of all goes. A peer that proves
// the key from a source at its cap gets in.
func TestSourceCap(t *testing.T) {
	t.Run("per source", func(t *testing.T) {
		targ := newSide(t, Config{MaxHandshakesPerSource: 4})
		a := idleSockets(t, targ.tr.Addr(), "127.0.0.2", 10)
		b := idleSockets(t, targ.tr.Addr(), "127.0.0.3", 4)
		if len(a) != 10 || len(b) != 4 {
			t.Fatalf("dialed %d and %d", len(a), len(b))
		}
		waitFor(t, "the target to accept them", func() bool { return targ.accepted() >= 14 })
		if r := targ.tr.Refusals(); r.SourceCap != 6 || r.HandshakeCap != 0 {
			t.Fatalf("Refusals %+v, want SourceCap 6 (10 from one source, 4 allowed), HandshakeCap 0", r)
		}
		for i, c := range a[:6] {
			expectEOF(t, c, fmt.Sprintf("the %d-th oldest idle connection of a source past its cap", i))
		}
		_, sources, _ := targ.admitted()
		if n2, n3 := sources[netip.MustParseAddr("127.0.0.2")], sources[netip.MustParseAddr("127.0.0.3")]; n2 != 4 || n3 != 4 {
			t.Fatalf("the target holds %d and %d idle connections of the two sources, want 4 and 4", n2, n3)
		}
		// From the crowded source, a peer with the key gets in (closing
		// another idle one).
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
		c, err := d.Dial("tcp", targ.tr.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(hang))
		helloRaw(t, c, targ.k)
		expectEOF(t, a[6], "the oldest idle connection left when a peer came from its source")
	})
	t.Run("overall", func(t *testing.T) {
		targ := newSide(t, Config{MaxHandshakes: 8})
		cs := idleSockets(t, targ.tr.Addr(), "127.0.0.4", 12)
		waitFor(t, "the target to accept them", func() bool { return targ.accepted() >= 12 })
		if r := targ.tr.Refusals(); r.HandshakeCap != 4 || r.SourceCap != 0 {
			t.Fatalf("Refusals %+v, want HandshakeCap 4, SourceCap 0", r)
		}
		for _, c := range cs[:4] {
			expectEOF(t, c, "an idle connection past MaxHandshakes")
		}
		if pending, _, _ := targ.admitted(); pending != 8 {
			t.Fatalf("the target holds %d idle connections, want 8", pending)
		}
	})
}

// TestOpenBurstFromOneSource: many initiators on one host (one source
// address) open the same target at once, more than MaxHandshakesPerSource
// together: the target closes the oldest handshakes past its bound, and
// every Open still succeeds, dialing again.
func TestOpenBurstFromOneSource(t *testing.T) {
	targ := newSide(t, Config{MaxHandshakesPerSource: 4})
	remote := targ.register(t, targ.alloc(t, page, 0), true)
	const n = 32
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		// DialTimeout bounds Open's dialing again: a hang detector here.
		init := newSide(t, Config{Rails: 1, DialTimeout: hang})
		wg.Add(1)
		go func() {
			defer wg.Done()
			ep, err := init.tr.Open(context.Background(), targ.desc("", remote))
			if err == nil {
				ep.Close()
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("Open in a burst: %v", err)
		}
	}
	t.Logf("handshakes closed for the per-source bound: %d", targ.tr.Refusals().SourceCap)
}

// TestHelloCut: a target that closes the connection after the proof,
// before its accept (as one does when it closes a handshake for its
// bounds), is no refusal of the key: Open dials again and gets in. It used
// to fail Open with ErrAuth.
func TestHelloCut(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, page, 0), true)
	var conns atomic.Int64
	px := newTamperProxy(t, targ.tr.Addr(), nil, func() bool { return conns.Add(1) == 1 }) // cut the first connection
	init := newSide(t, Config{Rails: 1})
	ep, err := init.tr.Open(context.Background(), targ.desc(px.addr(), remote))
	if err != nil {
		t.Fatalf("Open through a first connection cut before the accept: %v", err)
	}
	ep.Close()
	if conns.Load() < 2 {
		t.Fatalf("%d connections, want the cut one and another", conns.Load())
	}
}

// TestHandshakeTimeout: a connection that does not prove the key within
// HandshakeTimeout is closed, whether it sent nothing or half a hello.
func TestHandshakeTimeout(t *testing.T) {
	targ := newSide(t, Config{HandshakeTimeout: 200 * time.Millisecond})
	silent := dialRaw(t, targ.tr.Addr())
	half := dialRaw(t, targ.tr.Addr())
	half.Write(specHello(1, make([]byte, 16))[:10])
	expectEOF(t, silent, "a silent connection past HandshakeTimeout")
	expectEOF(t, half, "half a hello past HandshakeTimeout")
	waitFor(t, "both counted", func() bool { return targ.tr.Refusals().HandshakeTimeout == 2 })
}

// TestMaxConns: past MaxConns connections that proved the key, a hello is
// answered busy (accept status 4) and closed; Open fails with ErrPeer (the
// engine retries), not ErrAuth. Once a connection ends, another gets in.
func TestMaxConns(t *testing.T) {
	targ := newSide(t, Config{MaxConns: 2})
	remote := targ.register(t, targ.alloc(t, page, 0), true)
	first := targ.raw(t)
	targ.raw(t)

	c := dialRaw(t, targ.tr.Addr())
	cnonce := make([]byte, 16)
	c.Write(specHello(1, cnonce))
	ch, err := readChallenge(c)
	if err != nil || ch.status != 0 {
		t.Fatalf("challenge: %+v, %v", ch, err)
	}
	c.Write(specMAC(targ.k, "initiator", cnonce, ch.snonce))
	var acc [specAcceptLen]byte
	if _, err := io.ReadFull(c, acc[:]); err != nil {
		t.Fatalf("accept: %v", err)
	}
	if st := binary.BigEndian.Uint16(acc[:]); st != 4 || allEqual(acc[2:], 0) >= 0 {
		t.Fatalf("accept past MaxConns: % x, want status 4 and zeros", acc)
	}
	expectEOF(t, c, "past MaxConns")

	// Open tries again for DialTimeout, then fails with ErrPeer. A second
	// for the tries: on a loaded machine one dial and hello can take a
	// few hundred milliseconds, and the check is that Open tries again.
	init := newSide(t, Config{DialTimeout: time.Second})
	_, err = init.tr.Open(context.Background(), targ.desc("", remote))
	if !errors.Is(err, transport.ErrPeer) || !errors.Is(err, errBusy) || errors.Is(err, ErrAuth) {
		t.Fatalf("Open past MaxConns: %v, want ErrPeer (busy)", err)
	}
	if r := targ.tr.Refusals(); r.ConnCap < 2 || r.Auth != 0 {
		t.Fatalf("Refusals %+v, want ConnCap 2 or more (Open tries again)", r)
	}
	first.c.Close()
	waitFor(t, "a slot to free", func() bool { _, _, n := targ.admitted(); return n < 2 })
	targ.raw(t)
}

// TestIdleTimeout: a logged-in connection with no request and nothing in
// flight for IdleTimeout is closed; one whose requests keep coming, or
// that is moving a payload however slowly (a READ the initiator does not
// read, a WRITE whose bytes pause), is not.
func TestIdleTimeout(t *testing.T) {
	const idle = 300 * time.Millisecond
	targ := newSide(t, Config{IdleTimeout: idle})
	// A READ of 16 MiB is more than loopback's socket buffers take: the
	// target is still writing it while the initiator does not read.
	const big = 16 << 20
	remote := targ.register(t, targ.alloc(t, big, 0), true)
	testpattern.Fill(remote.mem, 9)
	want := bytes.Clone(remote.mem)

	t.Run("idle", func(t *testing.T) {
		rc := targ.raw(t)
		if st, got := rc.do(specReq{op: specRead, id: 1, buffer: remote.id, length: 64, key: remote.key, addr: remote.addr}, nil); st != 0 || !bytes.Equal(got, want[:64]) {
			t.Fatalf("READ: status %d", st)
		}
		before := targ.tr.Refusals().Idle
		rc.expectClosed("a connection idle past IdleTimeout")
		waitFor(t, "the idle close counted", func() bool { return targ.tr.Refusals().Idle == before+1 })
	})
	t.Run("a header begun and left", func(t *testing.T) {
		// A few bytes of a request header, then nothing: closed within
		// two IdleTimeouts (it was re-armed for good while a byte of a
		// header was in).
		rc := targ.raw(t)
		frame := specReq{op: specRead, id: 1, buffer: remote.id, length: 64, key: remote.key, addr: remote.addr}.frame(nil)
		rc.send(frame[:5])
		before := targ.tr.Refusals().Idle
		rc.expectClosed("a connection with a header begun and left past IdleTimeout")
		waitFor(t, "the idle close counted", func() bool { return targ.tr.Refusals().Idle == before+1 })
	})
	t.Run("requests keep coming", func(t *testing.T) {
		rc := targ.raw(t)
		for i := range 12 { // 12 × 75 ms: three IdleTimeouts, never idle for one
			if st, _ := rc.do(specReq{op: specRead, id: uint32(i), buffer: remote.id, length: 64, key: remote.key, addr: remote.addr}, nil); st != 0 {
				t.Fatalf("READ %d: status %d", i, st)
			}
			time.Sleep(idle / 4)
		}
	})
	t.Run("a READ not read for a while", func(t *testing.T) {
		rc := targ.raw(t)
		rc.send(specReq{op: specRead, id: 7, buffer: remote.id, length: big, key: remote.key, addr: remote.addr}.frame(nil))
		time.Sleep(4 * idle) // the target is stuck writing the payload
		if id, st := rc.resp(); id != 7 || st != 0 {
			t.Fatalf("response %d status %d", id, st)
		}
		if got := rc.payload(big); !bytes.Equal(got, want) {
			t.Fatalf("READ payload differs at %d", testpattern.FirstDiff(got, want))
		}
		// Still up: the connection was busy, not idle.
		if st, _ := rc.do(specReq{op: specRead, id: 8, buffer: remote.id, length: 64, key: remote.key, addr: remote.addr}, nil); st != 0 {
			t.Fatalf("READ after the long one: status %d", st)
		}
	})
	t.Run("a WRITE whose payload pauses", func(t *testing.T) {
		rc := targ.raw(t)
		p := make([]byte, 1<<20)
		testpattern.Fill(p, 10)
		f := specReq{op: specWrite, id: 8, buffer: remote.id, length: 1 << 20, key: remote.key, addr: remote.addr}.frame(p)
		rc.send(f[:len(f)/2])
		time.Sleep(4 * idle)
		rc.send(f[len(f)/2:])
		if id, st := rc.resp(); id != 8 || st != 0 {
			t.Fatalf("response %d status %d", id, st)
		}
		if !bytes.Equal(remote.mem[:1<<20], p) {
			t.Fatal("the WRITE's bytes did not land")
		}
		copy(want, p)
	})
}

// TestRefusalCounts: a bad hello, a wrong key and a bad frame are each
// counted under their reason, and the refusals are logged at most once a
// second per reason, with the count of those left out since.
func TestRefusalCounts(t *testing.T) {
	var log logBuffer
	targ := newSide(t, Config{Logger: slog.New(slog.NewTextHandler(&log, nil))})
	start := time.Now()
	const wrong = 20
	for range wrong {
		c := dialRaw(t, targ.tr.Addr())
		cnonce := make([]byte, 16)
		c.Write(specHello(1, cnonce))
		ch, err := readChallenge(c)
		if err != nil {
			t.Fatal(err)
		}
		c.Write(specMAC([]byte("another key"), "initiator", cnonce, ch.snonce))
		expectEOFAfterAccept(t, c)
	}
	bad := dialRaw(t, targ.tr.Addr())
	bad.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	expectEOF(t, bad, "a hello that is not one")
	rc := targ.raw(t)
	rc.send(specReq{op: 9, id: 1, length: 8}.frame(nil))
	rc.expectClosed("an unknown op")
	waitFor(t, "the refusals counted", func() bool {
		r := targ.tr.Refusals()
		return r.Auth == wrong && r.BadHello == 1 && r.BadFrame == 1
	})
	// One more wrong key a second after the first line: it is logged, with
	// the count of those left out.
	time.Sleep(time.Second + 100*time.Millisecond)
	c := dialRaw(t, targ.tr.Addr())
	cnonce := make([]byte, 16)
	c.Write(specHello(1, cnonce))
	if ch, err := readChallenge(c); err == nil {
		c.Write(specMAC([]byte("another key"), "initiator", cnonce, ch.snonce))
	}
	expectEOFAfterAccept(t, c)
	// The last refusal is logged (a second after the first line), with the
	// count of those left out: the lines account for every refusal.
	re := regexp.MustCompile(`reason="wrong key".* suppressed=(\d+)`)
	var lines, sum int
	waitFor(t, "the last refusal logged", func() bool {
		lines, sum = 0, 0
		for _, l := range strings.Split(log.String(), "\n") {
			if m := re.FindStringSubmatch(l); m != nil {
				n, _ := strconv.Atoi(m[1])
				lines++
				sum += 1 + n
			}
		}
		return sum == wrong+1
	})
	elapsed := time.Since(start)
	if lines < 2 || lines > int(elapsed/time.Second)+1 {
		t.Errorf("%d log lines for wrong keys over %v, want at least 2 and at most one a second:\n%s", lines, elapsed, log.String())
	}
	if r := targ.tr.Refusals(); r.Auth != wrong+1 {
		t.Errorf("Refusals.Auth %d, want %d", r.Auth, wrong+1)
	}
	if !strings.Contains(log.String(), `reason="bad hello"`) || !strings.Contains(log.String(), `reason="bad frame"`) {
		t.Errorf("the bad hello and the bad frame were not logged:\n%s", log.String())
	}
}

// expectEOFAfterAccept reads the accept message of a refused proof and
// then the end of the connection.
func expectEOFAfterAccept(t testing.TB, c net.Conn) {
	t.Helper()
	var acc [specAcceptLen]byte
	if _, err := io.ReadFull(c, acc[:]); err != nil {
		t.Fatalf("accept: %v", err)
	}
	if st := binary.BigEndian.Uint16(acc[:]); st != 3 {
		t.Fatalf("accept status %d, want 3", st)
	}
	expectEOF(t, c, "after a wrong key")
}

// lowFDChild is the environment variable that makes TestLowFDChild the
// target of TestIdleFloodLowFDs.
const lowFDChild = "MOONRING_TCP_CHILD_LOWFD"

// childFDLimit is the child's RLIMIT_NOFILE: below what the default
// MaxHandshakes alone would take, so that accept runs out of descriptors.
const childFDLimit = 48

// TestLowFDChild is the target process of TestIdleFloodLowFDs; it skips
// unless started by it. Under an RLIMIT_NOFILE of childFDLimit it serves a
// 1 MiB buffer with the default Config, prints its descriptor as JSON,
// then answers "sum" with the SHA-256 of the buffer and "refusals" with
// its Refusals as JSON, until stdin closes.
func TestLowFDChild(t *testing.T) {
	if os.Getenv(lowFDChild) == "" {
		t.Skip("the child of TestIdleFloodLowFDs")
	}
	lim := syscall.Rlimit{Cur: childFDLimit, Max: childFDLimit}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 1<<20, 0), true)
	d, err := json.Marshal(targ.desc("", remote))
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("%s\n", d)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch in.Text() {
		case "sum":
			s := sha256.Sum256(remote.mem)
			fmt.Println(hex.EncodeToString(s[:]))
		case "refusals":
			r, _ := json.Marshal(targ.tr.Refusals())
			fmt.Printf("%s\n", r)
		default:
			fmt.Println("?")
		}
	}
}

// TestIdleFloodLowFDs: a target process whose descriptor limit is
// childFDLimit (below the default MaxHandshakes) faces 3,000 idle
// connections from six addresses, held open by the attacker; an initiator
// with the key still opens the segment, writes 1 MiB (the target's buffer
// then hashes to what was written) and reads it back. The target used to
// keep every idle connection until the hello's 10 s deadline and to wait
// for a descriptor while thousands queued in front of the peer: Open
// failed.
func TestIdleFloodLowFDs(t *testing.T) {
	if testing.Short() {
		t.Skip("3,000 connections")
	}
	child := childproc.Start(t, childproc.Config{Env: []string{lowFDChild + "=1"}, Args: []string{"-test.run=^TestLowFDChild$"}, Name: "low-fd target"})
	var desc segtable.SegmentDesc
	if err := json.Unmarshal([]byte(child.Line), &desc); err != nil {
		t.Fatalf("the child's descriptor %q: %v", child.Line, err)
	}
	addr, _, _ := strings.Cut(desc.Endpoints[Name], "/")
	for i := 2; i <= 7; i++ {
		idleSockets(t, addr, fmt.Sprintf("127.0.0.%d", i), 500)
	}

	init := newSide(t, Config{})
	ep, err := init.tr.Open(context.Background(), &desc)
	if err != nil {
		t.Fatalf("Open under the flood: %v (the target's refusals: %s)", err, child.Ask(t, "refusals"))
	}
	defer ep.Close()
	const n = 1 << 20
	src := init.alloc(t, n, 0)
	dst := init.alloc(t, n, 0)
	testpattern.Fill(src, 11)
	remote := desc.Buffers[0].Addr
	comp := make(chanCompleter, 2)
	if k, err := ep.Post(comp, []transport.Slice{localSlice(transport.Write, src, remote, 1)}); k != 1 || err != nil {
		t.Fatalf("Post WRITE: %d, %v", k, err)
	}
	if err := comp.await(t, 1)[1]; err != nil {
		t.Fatalf("WRITE: %v", err)
	}
	if sum := sha256.Sum256(src); child.Ask(t, "sum") != hex.EncodeToString(sum[:]) {
		t.Fatal("the target's buffer does not hash to what was written")
	}
	if k, err := ep.Post(comp, []transport.Slice{localSlice(transport.Read, dst, remote, 2)}); k != 1 || err != nil {
		t.Fatalf("Post READ: %d, %v", k, err)
	}
	if err := comp.await(t, 1)[2]; err != nil {
		t.Fatalf("READ: %v", err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatalf("READ brought other bytes (first difference at %d)", testpattern.FirstDiff(dst, src))
	}
	var r Refusals
	line := child.Ask(t, "refusals")
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		t.Fatalf("refusals %q: %v", line, err)
	}
	t.Logf("the target's refusals: %+v", r)
	if r.Descriptors == 0 || r.AcceptErrors == 0 {
		t.Errorf("refusals %+v: want accepts out of descriptors, and idle connections closed for them", r)
	}
}
