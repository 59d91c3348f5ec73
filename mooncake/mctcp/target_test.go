package mctcp_test

// target_test.go: a raw socket plays a Mooncake initiator against the
// target, byte by byte as Mooncake's tcp_transport writes and reads them
// (FORMATS.md): golden exchanges of versions 1 and 2, READ and WRITE,
// refusals and the close that follows them.

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/segtable"
)

// The status words of version 2 as they travel: 8 bytes little-endian,
// the magic "MCTV" (0x4D435456) in the top 32 bits.
var (
	goldenOK      = mustHex("0000000056544" + "34d")
	goldenRefused = mustHex("0100000056544" + "34d")
)

func mustHex(s string) []byte {
	b, err := hex.DecodeString(s)
	if err != nil {
		panic(err)
	}
	return b
}

// mcHeader is a request header as Mooncake's initiator sends it: its
// struct's 7 padding bytes hold whatever was in memory (0xEE here).
func mcHeader(length, addr uint64, opcode byte) []byte {
	h := make([]byte, 24)
	binary.LittleEndian.PutUint64(h[0:], length)
	binary.LittleEndian.PutUint64(h[8:], addr)
	h[16] = opcode
	copy(h[17:], bytes.Repeat([]byte{0xEE}, 7))
	return h
}

// target is a Transport with one remote-accessible and one local-only
// buffer registered.
type target struct {
	tr     *mctcp.Transport
	bufs   segtable.Buffers
	remote *segtable.Buffer
	local  *segtable.Buffer
}

func newTarget(t *testing.T, cfg mctcp.Config) *target {
	t.Helper()
	tg := &target{tr: newT(t, cfg)}
	reg := func(n int, remote bool) *segtable.Buffer {
		mem := make([]byte, n)
		testpattern.Fill(mem, uint64(n))
		b, err := tg.bufs.Register(mem, "", remote)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tg.tr.Register(b); err != nil {
			t.Fatal(err)
		}
		return b
	}
	tg.remote = reg(64<<10, true)
	tg.local = reg(8<<10, false)
	t.Cleanup(func() {
		tg.tr.Close()
		for _, b := range tg.bufs.All() {
			tg.bufs.Unregister(t.Context(), b.ID)
		}
	})
	return tg
}

func (tg *target) dial(t *testing.T) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", tg.tr.Endpoint())
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	t.Cleanup(func() { c.Close() })
	return c
}

func readN(t *testing.T, c net.Conn, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatalf("read %d bytes: %v", n, err)
	}
	return b
}

// expectClosed checks that the target closes the connection with nothing
// more to say.
func expectClosed(t *testing.T, c net.Conn) {
	t.Helper()
	b, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, net.ErrClosed) && !isReset(err) {
		t.Fatalf("want the connection closed, read %d bytes and %v", len(b), err)
	}
	if len(b) != 0 {
		t.Fatalf("want the connection closed, read % x", b)
	}
}

func isReset(err error) bool {
	var op *net.OpError
	return errors.As(err, &op)
}

// One connection carries version 1 and version 2 requests one after
// another, as a Mooncake initiator sends them.
func TestTargetGolden(t *testing.T) {
	tg := newTarget(t, mctcp.Config{})
	c := tg.dial(t)
	mem := tg.remote.Bytes()
	addr := uint64(tg.remote.Addr)

	// v1 WRITE: header, payload; no answer.
	p1 := bytes.Repeat([]byte("v1-write"), 100)
	c.Write(append(mcHeader(uint64(len(p1)), addr+10, 0x01), p1...))
	// v1 READ of what it wrote: the bytes, nothing before them. (Served
	// in order: the READ sees the WRITE.)
	c.Write(mcHeader(uint64(len(p1)), addr+10, 0x00))
	if got := readN(t, c, len(p1)); !bytes.Equal(got, p1) {
		t.Fatal("v1 READ after v1 WRITE: data differs")
	}
	// v2 WRITE: the status word after the payload has landed.
	p2 := bytes.Repeat([]byte("v2-write"), 1000)
	c.Write(append(mcHeader(uint64(len(p2)), addr+4096, 0x81), p2...))
	if st := readN(t, c, 8); !bytes.Equal(st, goldenOK) {
		t.Fatalf("v2 WRITE: status % x, want % x", st, goldenOK)
	}
	if !bytes.Equal(mem[4096:4096+len(p2)], p2) {
		t.Fatal("v2 WRITE acknowledged before its bytes were in the buffer")
	}
	// v2 READ: the status word, then the bytes.
	c.Write(mcHeader(100, addr+4096, 0x80))
	if st := readN(t, c, 8); !bytes.Equal(st, goldenOK) {
		t.Fatalf("v2 READ: status % x, want % x", st, goldenOK)
	}
	if got := readN(t, c, 100); !bytes.Equal(got, p2[:100]) {
		t.Fatal("v2 READ: data differs")
	}
	// Pipelined: three requests in one write, answered in order.
	var burst []byte
	burst = append(burst, mcHeader(8, addr, 0x80)...)
	burst = append(burst, append(mcHeader(4, addr+60000, 0x81), "tail"...)...)
	burst = append(burst, mcHeader(4, addr+60000, 0x00)...)
	c.Write(burst)
	want := append(append(append(bytes.Clone(goldenOK), mem[:8]...), goldenOK...), "tail"...)
	if got := readN(t, c, len(want)); !bytes.Equal(got, want) {
		t.Fatalf("pipelined: got % x, want % x", got, want)
	}
	// The whole buffer, to its last byte.
	c.Write(mcHeader(64<<10, addr, 0x80))
	readN(t, c, 8)
	if got := readN(t, c, 64<<10); !bytes.Equal(got, mem) {
		t.Fatal("READ of the whole buffer: data differs")
	}
}

// Each refused range in version 2: the refusal status instead of anything
// else, then the close. In version 1: the close alone.
func TestTargetRefusals(t *testing.T) {
	tg := newTarget(t, mctcp.Config{MaxLength: 32 << 10})
	addr := uint64(tg.remote.Addr)
	end := addr + tg.remote.Length
	before := bytes.Clone(tg.remote.Bytes())
	cases := []struct {
		name         string
		length, addr uint64
	}{
		{"past the end", 16, end - 8},
		{"one past the end", 1, end},
		{"before the start", 16, addr - 8},
		{"zero length", 0, addr},
		{"wrapping", 16, ^uint64(0) - 7},
		{"above MaxLength", 32<<10 + 1, addr},
		{"a local-only buffer", 16, uint64(tg.local.Addr)},
		{"huge", 1 << 62, addr},
	}
	for _, tc := range cases {
		for _, op := range []byte{0x00, 0x01, 0x80, 0x81} {
			c := tg.dial(t)
			h := mcHeader(tc.length, tc.addr, op)
			if op&1 == 1 {
				h = append(h, bytes.Repeat([]byte{0x55}, int(min(tc.length, 64)))...)
			}
			c.Write(h)
			if op&0x80 != 0 {
				st := make([]byte, 8)
				if _, err := io.ReadFull(c, st); err != nil || !bytes.Equal(st, goldenRefused) {
					t.Fatalf("%s, opcode %#x: status % x (%v), want % x", tc.name, op, st, err, goldenRefused)
				}
			}
			expectClosed(t, c)
			c.Close()
		}
	}
	if !bytes.Equal(tg.remote.Bytes(), before) {
		t.Fatal("a refused WRITE changed the buffer")
	}
	if r := tg.tr.Refusals(); r.Range != uint64(4*len(cases)) {
		t.Fatalf("Refusals().Range = %d, want %d", r.Range, 4*len(cases))
	}
}

// An opcode other than READ and WRITE closes the connection (Mooncake's
// target would take it for a READ).
func TestTargetBadOpcode(t *testing.T) {
	tg := newTarget(t, mctcp.Config{})
	for _, op := range []byte{0x02, 0x7f, 0x82, 0xff} {
		c := tg.dial(t)
		c.Write(mcHeader(8, uint64(tg.remote.Addr), op))
		expectClosed(t, c)
	}
	if r := tg.tr.Refusals(); r.BadHeader != 4 {
		t.Fatalf("Refusals().BadHeader = %d, want 4", r.BadHeader)
	}
}

// A connection that sends no whole header within IdleTimeout is closed; a
// payload that stalls is cut off after FrameTimeout, and the buffer's
// Unregister does not wait longer.
func TestTargetTimeouts(t *testing.T) {
	tg := newTarget(t, mctcp.Config{IdleTimeout: 200 * time.Millisecond, FrameTimeout: 300 * time.Millisecond, MinRate: 1 << 40})
	c := tg.dial(t)
	c.Write(mcHeader(8, uint64(tg.remote.Addr), 0x80)[:10]) // half a header
	expectClosed(t, c)

	c = tg.dial(t)
	c.Write(append(mcHeader(1024, uint64(tg.remote.Addr), 0x81), 1, 2, 3)) // 3 of 1024 bytes
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	if err := tg.tr.Unregister(tg.remote, segtable.Registration{}); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Unregister waited %v for a stalled WRITE", d)
	}
	expectClosed(t, c)
	r := tg.tr.Refusals()
	if r.Idle != 1 || r.Stalled != 1 {
		t.Fatalf("Refusals() = %+v, want one Idle and one Stalled", r)
	}
}

// At MaxConns the connection idle longest makes room, if it has waited for
// a request for a second; when every one is busy, the new one is closed.
func TestTargetMaxConns(t *testing.T) {
	tg := newTarget(t, mctcp.Config{MaxConns: 2, FrameTimeout: 5 * time.Second})
	a := tg.dial(t)
	time.Sleep(1100 * time.Millisecond) // idle long enough to be closed for room
	b := tg.dial(t)
	time.Sleep(20 * time.Millisecond)
	// b is busy: a WRITE waits for its payload.
	b.Write(mcHeader(16, uint64(tg.remote.Addr), 0x81))
	time.Sleep(50 * time.Millisecond)
	c := tg.dial(t) // evicts a, the idle one
	expectClosed(t, a)
	// c works.
	c.Write(mcHeader(4, uint64(tg.remote.Addr), 0x80))
	readN(t, c, 12)
	// b finishes its WRITE, undisturbed.
	b.Write(make([]byte, 16))
	if st := readN(t, b, 8); !bytes.Equal(st, goldenOK) {
		t.Fatalf("the busy connection's WRITE: status % x", st)
	}
	if r := tg.tr.Refusals(); r.ConnCap != 1 {
		t.Fatalf("Refusals().ConnCap = %d, want 1", r.ConnCap)
	}
}

// Answers gathered for the requests before a refused one (or a bad
// header) still go out, before the refusal and the close.
func TestTargetAnswersBeforeRefusal(t *testing.T) {
	tg := newTarget(t, mctcp.Config{})
	addr := uint64(tg.remote.Addr)
	mem := tg.remote.Bytes()
	for _, last := range [][]byte{mcHeader(8, addr-8, 0x80), mcHeader(8, addr, 0x05)} {
		c := tg.dial(t)
		var burst []byte
		burst = append(burst, append(mcHeader(4, addr+8, 0x81), "abcd"...)...)
		burst = append(burst, mcHeader(16, addr, 0x80)...)
		burst = append(burst, last...)
		c.Write(burst)
		got, _ := io.ReadAll(c)
		want := append(append(bytes.Clone(goldenOK), goldenOK...), mem[:16]...)
		if last[16] == 0x80 {
			want = append(want, goldenRefused...)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("got % x\nwant % x", got, want)
		}
	}
}

// One source at MaxConnsPerSource makes room among its own connections.
func TestTargetMaxConnsPerSource(t *testing.T) {
	tg := newTarget(t, mctcp.Config{MaxConnsPerSource: 2})
	a := tg.dial(t)
	time.Sleep(1100 * time.Millisecond) // idle long enough to be closed for room
	b := tg.dial(t)
	time.Sleep(20 * time.Millisecond)
	c := tg.dial(t) // evicts a, its source's idle longest
	expectClosed(t, a)
	for _, x := range []net.Conn{b, c} {
		x.Write(mcHeader(4, uint64(tg.remote.Addr), 0x80))
		readN(t, x, 12)
	}
	if r := tg.tr.Refusals(); r.SourceCap != 1 || r.ConnCap != 0 {
		t.Fatalf("Refusals() = %+v, want one SourceCap", r)
	}
}

// A connection idle only a moment is not closed to make room: Mooncake's
// client writes its request as soon as it has connected (a connection per
// request by default), so a fresh connection's request may be unread in
// the socket. The new connection is closed instead, and the one before it
// is served.
func TestTargetKeepsFreshConnections(t *testing.T) {
	tg := newTarget(t, mctcp.Config{MaxConnsPerSource: 1})
	a := tg.dial(t)
	b := tg.dial(t) // a is fresh: b is the one closed
	expectClosed(t, b)
	a.Write(mcHeader(4, uint64(tg.remote.Addr), 0x80))
	readN(t, a, 12)
	if r := tg.tr.Refusals(); r.SourceCap != 1 {
		t.Fatalf("Refusals() = %+v, want one SourceCap", r)
	}
}
