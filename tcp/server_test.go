package tcp

// Raw-frame tests of the target: they speak PROTOCOL.md by hand, with
// encoders written here from the spec rather than the package's own, so
// they check the server against the document and not against itself.

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// hang bounds every wait of these tests. It is a hang detector, never a
// performance assertion: a correct transport needs a tiny fraction of it.
const hang = 20 * time.Second

var page = os.Getpagesize()

// Wire sizes, from PROTOCOL.md.
const (
	specHelloLen     = 24
	specChallengeLen = 32
	specProofLen     = 32
	specAcceptLen    = 36
	specReqLen       = 32
	specRespLen      = 8
)

const canaryByte = 0xA5

// specMAC is the hello's HMAC-SHA256(K, "moonring/1 <role>" | cnonce | snonce).
func specMAC(k []byte, role string, cnonce, snonce []byte) []byte {
	h := hmac.New(sha256.New, k)
	h.Write([]byte("moonring/1 " + role))
	h.Write(cnonce)
	h.Write(snonce)
	return h.Sum(nil)
}

// specHello is the initiator's first message: "MRNG" | version | flags 0 | cnonce.
func specHello(version uint16, cnonce []byte) []byte {
	b := append(make([]byte, 0, specHelloLen), "MRNG"...)
	b = binary.BigEndian.AppendUint16(b, version)
	b = binary.BigEndian.AppendUint16(b, 0)
	return append(b, cnonce...)
}

// specChallenge is the target's answer to the hello, decoded.
type specChallenge struct {
	version, status uint16
	snonce          []byte
	maxLen          uint32
	features        uint32 // bit 0: group frames; bit 1: wide ones
}

func readChallenge(r io.Reader) (specChallenge, error) {
	var b [specChallengeLen]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return specChallenge{}, err
	}
	if string(b[:4]) != "MRNG" {
		return specChallenge{}, fmt.Errorf("challenge magic %q", b[:4])
	}
	return specChallenge{
		version:  binary.BigEndian.Uint16(b[4:]),
		status:   binary.BigEndian.Uint16(b[6:]),
		snonce:   bytes.Clone(b[8:24]),
		maxLen:   binary.BigEndian.Uint32(b[24:]),
		features: binary.BigEndian.Uint32(b[28:]),
	}, nil
}

// specReq is a request header, every field settable, the reserved ones too.
type specReq struct {
	op, flags          byte
	reserved           uint16
	id, buffer, length uint32
	key, addr          uint64
}

const (
	specRead  = 1
	specWrite = 2
	specGroup = 4
)

// frame encodes the header per PROTOCOL.md, followed by payload.
func (r specReq) frame(payload []byte) []byte {
	b := make([]byte, 0, specReqLen+len(payload))
	b = append(b, r.op, r.flags)
	b = binary.BigEndian.AppendUint16(b, r.reserved)
	b = binary.BigEndian.AppendUint32(b, r.id)
	b = binary.BigEndian.AppendUint32(b, r.buffer)
	b = binary.BigEndian.AppendUint32(b, r.length)
	b = binary.BigEndian.AppendUint64(b, r.key)
	b = binary.BigEndian.AppendUint64(b, r.addr)
	return append(b, payload...)
}

// side is one Transport with the memory it registered. Its memory is
// guarded (internal/mem.AllocGuarded): a byte touched past a buffer faults.
// The cleanup closes the transport before it frees the memory.
type side struct {
	tr    *Transport
	k     []byte // the segment key K, from the open-mode endpoint
	bufs  segtable.Buffers
	frees []func() error
}

// testBuf is a buffer registered with a side.
type testBuf struct {
	mem  []byte
	id   uint32
	addr uint64
	key  uint64 // the buffer key; 0 for a local-only buffer
	reg  string // the registration's published key
	b    *segtable.Buffer
	r    segtable.Registration
}

func (b testBuf) end() uint64 { return b.addr + uint64(len(b.mem)) }

func newSide(t testing.TB, cfg Config) *side {
	t.Helper()
	tr, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := &side{tr: tr}
	ep, _, _ := strings.Cut(tr.Endpoint(), "?") // less an AutoTLS pin
	if _, k, ok := strings.Cut(ep, "/"); ok {
		if s.k, err = hex.DecodeString(k); err != nil || len(s.k) != 32 {
			t.Fatalf("endpoint %q: key is not 64 hex digits", tr.Endpoint())
		}
	}
	t.Cleanup(func() {
		if err := tr.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		for _, b := range s.bufs.All() {
			if _, err := s.bufs.Unregister(context.Background(), b.ID); err != nil {
				t.Errorf("segtable unregister: %v", err)
			}
		}
		for _, free := range s.frees {
			if err := free(); err != nil {
				t.Errorf("free: %v", err)
			}
		}
	})
	return s
}

// alloc returns n guarded bytes filled with fill.
func (s *side) alloc(t testing.TB, n int, fill byte) []byte {
	t.Helper()
	b, free, err := mem.AllocGuarded(n)
	if err != nil {
		t.Fatal(err)
	}
	s.frees = append(s.frees, free)
	for i := range b {
		b[i] = fill
	}
	return b
}

func (s *side) register(t testing.TB, m []byte, remote bool) testBuf {
	t.Helper()
	b, err := s.bufs.Register(m, "", remote)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := s.tr.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	tb := testBuf{mem: m, id: uint32(b.ID), addr: uint64(b.Addr), reg: reg.Key, b: b, r: reg}
	if !remote {
		if reg.Key != "" {
			t.Fatalf("local-only buffer published key %q", reg.Key)
		}
		return tb
	}
	// PROTOCOL.md: "<BufferID hex>.<key hex>".
	id, key, ok := strings.Cut(reg.Key, ".")
	bid, err1 := strconv.ParseUint(id, 16, 32)
	k, err2 := strconv.ParseUint(key, 16, 64)
	if !ok || err1 != nil || err2 != nil || uint32(bid) != tb.id {
		t.Fatalf("registration key %q is not <BufferID hex>.<key hex> for buffer %d", reg.Key, tb.id)
	}
	tb.key = k
	return tb
}

// desc describes the side's buffers at the side's endpoint, with the
// host:port replaced by addr when addr is not empty.
func (s *side) desc(addr string, bufs ...testBuf) *segtable.SegmentDesc {
	ep := s.tr.Endpoint()
	if addr != "" {
		// host:port ends where the key ("/") or the pin ("?") starts.
		if i := strings.IndexAny(ep, "/?"); i >= 0 {
			ep = addr + ep[i:]
		} else {
			ep = addr
		}
	}
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "target", Epoch: 1, Endpoints: map[string]string{Name: ep}}
	for _, b := range bufs {
		d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: b.addr, Length: uint64(len(b.mem)), Keys: map[string]string{Name: b.reg}})
	}
	return d
}

// serverConns returns how many connections the target still serves. It
// takes the transport's lock, so once it reports a connection gone, what
// that connection's goroutine did happens before the caller goes on.
func (s *side) serverConns() int {
	s.tr.mu.Lock()
	defer s.tr.mu.Unlock()
	return len(s.tr.conns)
}

// waitServed waits until the target serves no connection.
func (s *side) waitServed(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(hang)
	for s.serverConns() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("hang: the target still serves %d connections", s.serverConns())
		}
		time.Sleep(time.Millisecond)
	}
}

// rawConn is a connection that speaks the protocol by hand.
type rawConn struct {
	t      testing.TB
	c      net.Conn
	maxLen uint32
}

// dialRaw connects to addr; every read and write on it fails after hang.
func dialRaw(t testing.TB, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, hang)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(hang))
	t.Cleanup(func() { c.Close() })
	return c
}

// helloRaw runs the hello over c with segment key k and checks every
// field the target sends.
func helloRaw(t testing.TB, c net.Conn, k []byte) *rawConn {
	t.Helper()
	return helloRawFeatures(t, c, k, 3)
}

// helloRawFeatures is helloRaw with the features word the challenge must
// carry.
func helloRawFeatures(t testing.TB, c net.Conn, k []byte, features uint32) *rawConn {
	t.Helper()
	cnonce := make([]byte, 16)
	rand.Read(cnonce)
	if _, err := c.Write(specHello(1, cnonce)); err != nil {
		t.Fatalf("hello: %v", err)
	}
	ch, err := readChallenge(c)
	if err != nil {
		t.Fatalf("challenge: %v", err)
	}
	if ch.version != 1 || ch.status != 0 || ch.features != features || ch.maxLen == 0 {
		t.Fatalf("challenge: version %d status %d maxlen %d features %#x, want 1, 0, >0, %#x", ch.version, ch.status, ch.maxLen, ch.features, features)
	}
	if _, err := c.Write(specMAC(k, "initiator", cnonce, ch.snonce)); err != nil {
		t.Fatalf("proof: %v", err)
	}
	var acc [specAcceptLen]byte
	if _, err := io.ReadFull(c, acc[:]); err != nil {
		t.Fatalf("accept: %v", err)
	}
	if st, z := binary.BigEndian.Uint16(acc[:]), binary.BigEndian.Uint16(acc[2:]); st != 0 || z != 0 {
		t.Fatalf("accept: status %d, reserved %d, want 0, 0", st, z)
	}
	if !hmac.Equal(acc[4:], specMAC(k, "target", cnonce, ch.snonce)) {
		t.Fatal("accept: the target's MAC is not HMAC(K, \"moonring/1 target\" | cnonce | snonce)")
	}
	return &rawConn{t: t, c: c, maxLen: ch.maxLen}
}

func (s *side) raw(t testing.TB) *rawConn {
	t.Helper()
	return helloRaw(t, dialRaw(t, s.tr.Addr()), s.k)
}

func (rc *rawConn) send(b []byte) {
	rc.t.Helper()
	if _, err := rc.c.Write(b); err != nil {
		rc.t.Fatalf("send: %v", err)
	}
}

// resp reads one response and checks its reserved bytes.
func (rc *rawConn) resp() (id uint32, status uint8) {
	rc.t.Helper()
	var b [specRespLen]byte
	if _, err := io.ReadFull(rc.c, b[:]); err != nil {
		rc.t.Fatalf("response: %v", err)
	}
	if b[5]|b[6]|b[7] != 0 {
		rc.t.Fatalf("response % x: reserved bytes set", b)
	}
	return binary.BigEndian.Uint32(b[:]), b[4]
}

func (rc *rawConn) payload(n int) []byte {
	rc.t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(rc.c, b); err != nil {
		rc.t.Fatalf("payload of %d bytes: %v", n, err)
	}
	return b
}

// do sends one request and returns its status, and a READ's payload.
func (rc *rawConn) do(r specReq, payload []byte) (uint8, []byte) {
	rc.t.Helper()
	rc.send(r.frame(payload))
	id, st := rc.resp()
	if id != r.id {
		rc.t.Fatalf("response id %#x, want %#x", id, r.id)
	}
	if st == 0 && r.op == specRead {
		return st, rc.payload(int(r.length))
	}
	return st, nil
}

// expectClosed checks that the target sends nothing more and closes.
func (rc *rawConn) expectClosed(what string) {
	rc.t.Helper()
	expectEOF(rc.t, rc.c, what)
}

func expectEOF(t testing.TB, c net.Conn, what string) {
	t.Helper()
	var b [1]byte
	n, err := io.ReadFull(c, b[:])
	switch {
	case n != 0:
		t.Fatalf("%s: the target answered (% x...), want the connection closed", what, b[:n])
	case errors.Is(err, io.EOF), errors.Is(err, syscall.ECONNRESET):
	default:
		t.Fatalf("%s: read %v, want EOF or a reset (the connection closed)", what, err)
	}
}

func allEqual(b []byte, v byte) int {
	for i, x := range b {
		if x != v {
			return i
		}
	}
	return -1
}

// checksTarget is a target with two adjacent remote buffers A (2 pages) and
// B (1 page, ending at a guard page) and a local-only buffer C, MaxLength
// two pages.
type checksTarget struct {
	*side
	a, b, c testBuf
	aWant   []byte
}

func newChecksTarget(t *testing.T) *checksTarget {
	s := newSide(t, Config{MaxLength: uint32(2 * page), SliceSize: uint64(page)})
	arena := s.alloc(t, 3*page, canaryByte)
	ct := &checksTarget{side: s}
	testpattern.Fill(arena[:2*page], 1)
	ct.aWant = bytes.Clone(arena[:2*page])
	ct.a = s.register(t, arena[:2*page], true)
	ct.b = s.register(t, arena[2*page:], true)
	ct.c = s.register(t, s.alloc(t, page, canaryByte), false)
	return ct
}

// intact checks that no request changed a byte: A holds its pattern, B and
// C their canaries. The caller has made the server's writes visible (a
// response read after them, or waitServed).
func (ct *checksTarget) intact(t *testing.T) {
	t.Helper()
	if i := testpattern.FirstDiff(ct.a.mem, ct.aWant); i >= 0 {
		t.Errorf("A changed at offset %d", i)
	}
	if i := allEqual(ct.b.mem, canaryByte); i >= 0 {
		t.Errorf("B changed at offset %d", i)
	}
	if i := allEqual(ct.c.mem, canaryByte); i >= 0 {
		t.Errorf("local-only C changed at offset %d", i)
	}
}

// probe checks the connection is still in step: a READ of A answers with
// its id and A's bytes.
func (ct *checksTarget) probe(rc *rawConn, id uint32) {
	rc.t.Helper()
	st, got := rc.do(specReq{op: specRead, id: id, buffer: ct.a.id, length: 64, key: ct.a.key, addr: ct.a.addr + 100}, nil)
	if st != 0 || !bytes.Equal(got, ct.aWant[100:164]) {
		rc.t.Fatalf("probe READ: status %d, bytes equal %v; want 0 and A's bytes", st, bytes.Equal(got, ct.aWant[100:164]))
	}
}

// TestServerRefusals sends requests that fail a check. Each gets its own
// status, moves no byte, and leaves the connection in step: a WRITE's
// payload is consumed (it is itself a request frame, which the target must
// not serve), and no READ payload follows a refusal.
func TestServerRefusals(t *testing.T) {
	ct := newChecksTarget(t)
	a, b, c := ct.a, ct.b, ct.c
	cases := []struct {
		name string
		r    specReq
		want []uint8 // the statuses PROTOCOL.md allows
	}{
		{"unregistered address", specReq{buffer: a.id, key: a.key, addr: 0x1000, length: 16}, []uint8{1}},
		{"address after the last buffer", specReq{buffer: b.id, key: b.key, addr: b.end(), length: 16}, []uint8{1}},
		{"address before the first buffer", specReq{buffer: a.id, key: a.key, addr: a.addr - 8, length: 16}, []uint8{1}},
		{"local-only buffer", specReq{buffer: c.id, key: a.key, addr: c.addr, length: 16}, []uint8{1}},
		{"wrong buffer key", specReq{buffer: a.id, key: a.key ^ 1, addr: a.addr, length: 16}, []uint8{1}},
		{"zero buffer key", specReq{buffer: a.id, key: 0, addr: a.addr, length: 16}, []uint8{1}},
		{"another buffer's key", specReq{buffer: a.id, key: b.key, addr: a.addr, length: 16}, []uint8{1}},
		{"another buffer's id and key", specReq{buffer: b.id, key: b.key, addr: a.addr, length: 16}, []uint8{1}},
		{"unknown buffer id", specReq{buffer: a.id + 1000, key: a.key, addr: a.addr, length: 16}, []uint8{1}},
		{"runs past the end into the next buffer", specReq{buffer: a.id, key: a.key, addr: a.end() - 100, length: 200}, []uint8{2}},
		{"runs past the end into a guard page", specReq{buffer: b.id, key: b.key, addr: b.end() - 1, length: 2}, []uint8{2}},
		{"whole buffer plus one", specReq{buffer: b.id, key: b.key, addr: b.addr, length: uint32(len(b.mem)) + 1}, []uint8{2}},
		{"wraps around the address space", specReq{buffer: a.id, key: a.key, addr: ^uint64(0) - 99, length: 200}, []uint8{1}},
	}
	rc := ct.raw(t)
	id := uint32(0x1000)
	for _, tc := range cases {
		for _, op := range []byte{specRead, specWrite} {
			id++
			r := tc.r
			r.op, r.id = op, id
			var payload []byte
			if op == specWrite {
				// The payload is a valid request of its own: a target that
				// does not consume it would answer 0xbad.
				evil := specReq{op: specRead, id: 0xbad, buffer: a.id, length: 8, key: a.key, addr: a.addr}.frame(nil)
				payload = bytes.Repeat(evil, int(r.length)/len(evil)+1)[:r.length]
			}
			st, _ := rc.do(r, payload)
			if !bytes.Contains(tc.want, []byte{st}) {
				t.Errorf("%s, op %d: status %d, want one of %v", tc.name, op, st, tc.want)
			}
			id++
			ct.probe(rc, id)
		}
	}
	ct.intact(t)
}

// TestServerCheckOrder: a request naming a buffer it does not hold the key
// of is denied (status 1) whatever its address: registered or not, inside
// a buffer or past one, wrapping around. The target used to check the range
// first, so a peer with the segment key but no buffer key learned from
// status 2 against status 1 which addresses were registered. With the
// buffer's key, an address outside the buffer is denied as well, and one
// inside it whose length runs past the end is out of range (status 2).
func TestServerCheckOrder(t *testing.T) {
	ct := newChecksTarget(t)
	a, b, c := ct.a, ct.b, ct.c
	addrs := []struct {
		name   string
		addr   uint64
		length uint32
	}{
		{"inside A", a.addr + 8, 16},
		{"inside B", b.addr, 16},
		{"unregistered", 0x1000, 16},
		{"before A", a.addr - 64, 16},
		{"past B", b.end() + 4096, 16},
		{"runs past A", a.end() - 8, 64},
		{"wraps around", ^uint64(0) - 7, 64},
	}
	keys := []struct {
		name   string
		buffer uint32
		key    uint64
	}{
		{"A with a wrong key", a.id, a.key ^ 0x10},
		{"A with B's key", a.id, b.key},
		{"an unknown buffer", a.id + 1000, a.key},
		{"the local-only buffer", c.id, 0},
	}
	rc := ct.raw(t)
	id := uint32(0)
	for _, k := range keys {
		for _, at := range addrs {
			for _, op := range []byte{specRead, specWrite} {
				id++
				r := specReq{op: op, id: id, buffer: k.buffer, length: at.length, key: k.key, addr: at.addr}
				var payload []byte
				if op == specWrite {
					payload = bytes.Repeat([]byte{0x5a}, int(at.length))
				}
				if st, _ := rc.do(r, payload); st != 1 {
					t.Errorf("%s at an address %s, op %d: status %d, want 1 (denied) whatever the address", k.name, at.name, op, st)
				}
			}
		}
	}
	// The buffer's own key: the address, then the range.
	for _, at := range addrs[1:] {
		want := uint8(1)
		if at.addr >= a.addr && at.addr < a.end() {
			want = 2 // starts in A, runs past its end
		}
		id++
		if st, _ := rc.do(specReq{op: specRead, id: id, buffer: a.id, length: at.length, key: a.key, addr: at.addr}, nil); st != want {
			t.Errorf("A's key at an address %s: status %d, want %d", at.name, st, want)
		}
	}
	id++
	ct.probe(rc, id)
	ct.intact(t)
}

// TestServerFramingErrors: a frame the target cannot trust closes the
// connection at once, with no response and no byte moved, even when the
// rest of the frame is a valid WRITE and a valid request follows.
func TestServerFramingErrors(t *testing.T) {
	ct := newChecksTarget(t)
	a := ct.a
	max := uint32(2 * page)
	valid := specReq{op: specWrite, id: 7, buffer: a.id, length: 64, key: a.key, addr: a.addr}
	cases := []struct {
		name string
		edit func(*specReq)
	}{
		{"op 0", func(r *specReq) { r.op = 0 }},
		{"op 4", func(r *specReq) { r.op = 4 }},
		{"NOTIFY naming a buffer", func(r *specReq) { r.op = 3 }},
		{"op 255", func(r *specReq) { r.op = 255 }},
		{"flags 1", func(r *specReq) { r.flags = 1 }},
		{"flags 0x80", func(r *specReq) { r.flags = 0x80 }},
		{"reserved byte 2", func(r *specReq) { r.reserved = 0x0100 }},
		{"reserved byte 3", func(r *specReq) { r.reserved = 0x0001 }},
		{"length 0", func(r *specReq) { r.length = 0 }},
		{"length maxlen+1", func(r *specReq) { r.length = max + 1 }},
		{"length 2^32-1", func(r *specReq) { r.length = ^uint32(0) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rc := ct.raw(t)
			if rc.maxLen != max {
				t.Fatalf("challenge maxlen %d, want Config.MaxLength %d", rc.maxLen, max)
			}
			ct.probe(rc, 1)
			r := valid
			tc.edit(&r)
			payload := bytes.Repeat([]byte{0x5a}, 64)
			next := specReq{op: specRead, id: 8, buffer: a.id, length: 8, key: a.key, addr: a.addr}.frame(nil)
			rc.send(append(r.frame(payload), next...))
			rc.expectClosed(tc.name)
			ct.waitServed(t)
			ct.intact(t)
		})
	}
	t.Run("length maxlen is accepted", func(t *testing.T) {
		rc := ct.raw(t)
		st, got := rc.do(specReq{op: specRead, id: 9, buffer: a.id, length: max, key: a.key, addr: a.addr}, nil)
		if st != 0 || !bytes.Equal(got, ct.aWant) {
			t.Fatalf("READ of maxlen bytes: status %d, bytes equal %v", st, bytes.Equal(got, ct.aWant))
		}
	})
}

// TestServerHello covers the hello's refusals, each with its own status.
func TestServerHello(t *testing.T) {
	s := newSide(t, Config{})
	t.Run("wrong segment key", func(t *testing.T) {
		c := dialRaw(t, s.tr.Addr())
		cnonce := make([]byte, 16)
		rand.Read(cnonce)
		c.Write(specHello(1, cnonce))
		ch, err := readChallenge(c)
		if err != nil || ch.status != 0 {
			t.Fatalf("challenge: %+v, %v", ch, err)
		}
		wrong := bytes.Clone(s.k)
		wrong[0] ^= 1
		c.Write(specMAC(wrong, "initiator", cnonce, ch.snonce))
		var acc [specAcceptLen]byte
		if _, err := io.ReadFull(c, acc[:]); err != nil {
			t.Fatalf("accept: %v", err)
		}
		if st := binary.BigEndian.Uint16(acc[:]); st != 3 {
			t.Errorf("accept status %d, want 3 (wrong key)", st)
		}
		if allEqual(acc[2:], 0) >= 0 {
			t.Errorf("accept after a wrong key carries % x, want zeros (no MAC)", acc[2:])
		}
		expectEOF(t, c, "after a wrong key")
	})
	t.Run("proof for another snonce", func(t *testing.T) {
		c := dialRaw(t, s.tr.Addr())
		cnonce := make([]byte, 16)
		c.Write(specHello(1, cnonce))
		ch, err := readChallenge(c)
		if err != nil {
			t.Fatal(err)
		}
		// A replayed proof: right key, but for a nonce the target did not draw.
		stale := bytes.Clone(ch.snonce)
		stale[0] ^= 1
		c.Write(specMAC(s.k, "initiator", cnonce, stale))
		var acc [specAcceptLen]byte
		if _, err := io.ReadFull(c, acc[:]); err != nil {
			t.Fatalf("accept: %v", err)
		}
		if st := binary.BigEndian.Uint16(acc[:]); st != 3 {
			t.Errorf("accept status %d for a proof over another snonce, want 3", st)
		}
	})
	t.Run("unknown flags", func(t *testing.T) {
		for _, flags := range []uint16{1, 0x8000} {
			c := dialRaw(t, s.tr.Addr())
			h := specHello(1, make([]byte, 16))
			binary.BigEndian.PutUint16(h[6:], flags)
			c.Write(h)
			expectEOF(t, c, fmt.Sprintf("a hello with flags %#x", flags))
		}
	})
	t.Run("wrong version", func(t *testing.T) {
		c := dialRaw(t, s.tr.Addr())
		c.Write(specHello(2, make([]byte, 16)))
		ch, err := readChallenge(c)
		if err != nil {
			t.Fatal(err)
		}
		if ch.status != 1 || ch.version != 1 {
			t.Errorf("challenge to version 2: status %d, version %d; want 1 (not supported), 1 (the target's own)", ch.status, ch.version)
		}
		expectEOF(t, c, "after a version refusal")
	})
	t.Run("Open with another Config.Key", func(t *testing.T) {
		targ := newSide(t, Config{Key: []byte("the target's key")})
		init := newSide(t, Config{Key: []byte("another key")})
		b := targ.register(t, targ.alloc(t, page, 0), true)
		_, err := init.tr.Open(context.Background(), targ.desc("", b))
		if !errors.Is(err, ErrAuth) {
			t.Fatalf("Open with another key: %v, want ErrAuth", err)
		}
		same := newSide(t, Config{Key: []byte("the target's key")})
		ep, err := same.tr.Open(context.Background(), targ.desc("", b))
		if err != nil {
			t.Fatalf("Open with the same key: %v", err)
		}
		ep.Close()
	})
	t.Run("Open against a version 2 target", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		var wg sync.WaitGroup
		defer wg.Wait()
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(hang))
			var h [specHelloLen]byte
			io.ReadFull(c, h[:])
			var ch [specChallengeLen]byte
			copy(ch[:], "MRNG")
			binary.BigEndian.PutUint16(ch[4:], 2)
			binary.BigEndian.PutUint16(ch[6:], 1)
			c.Write(ch[:])
		}()
		init := newSide(t, Config{})
		d := &segtable.SegmentDesc{Version: 1, Name: "v2", Endpoints: map[string]string{Name: ln.Addr().String() + "/" + strings.Repeat("00", 32)}}
		_, err = init.tr.Open(context.Background(), d)
		if !errors.Is(err, ErrVersion) {
			t.Fatalf("Open against version 2: %v, want ErrVersion", err)
		}
	})
}

// In a stream of WRITEs the next request is always already waiting. The
// target must still acknowledge a WRITE once ackAfter payload bytes have
// come in behind its ack, rather than hold every ack until the stream
// pauses: the initiator's window would fill with WRITEs that landed but
// were not acknowledged, and the connection idle a round trip each window.
// Here the second WRITE's payload stays incomplete, so the target waits on
// it: the first's ack must be out by then (before, it never came).
func TestServerAcksWriteStream(t *testing.T) {
	s := newSide(t, Config{})
	buf := s.register(t, s.alloc(t, 2*ackAfter, 0), true)
	rc := s.raw(t)
	p := make([]byte, ackAfter)
	testpattern.Fill(p, 5)
	first := specReq{op: specWrite, id: 1, buffer: buf.id, length: ackAfter, key: buf.key, addr: buf.addr}
	second := first
	second.id, second.addr = 2, buf.addr+ackAfter
	f2 := second.frame(p)
	rc.send(append(first.frame(p), f2[:specReqLen+100]...))
	if id, st := rc.resp(); id != 1 || st != 0 {
		t.Fatalf("response %d status %d; want the first WRITE's ack, OK", id, st)
	}
	if !bytes.Equal(buf.mem[:ackAfter], p) {
		t.Fatal("the first WRITE was acknowledged before its bytes landed")
	}
	rc.send(f2[specReqLen+100:])
	if id, st := rc.resp(); id != 2 || st != 0 {
		t.Fatalf("response %d status %d; want the second WRITE's ack, OK", id, st)
	}
	if !bytes.Equal(buf.mem[ackAfter:], p) {
		t.Fatal("the second WRITE's bytes did not land")
	}
}

// TestServerPipeline pipelines a long random mix of READs and WRITEs, good
// and refused, small and large, with random ids, and checks every response
// against a model of the buffer: the responses come in request order with
// the requests' ids, statuses and bytes. PROTOCOL.md orders responses, not
// the execution of requests in flight together (the engine spreads those
// over rails anyway), so READs read the lower half of the buffer and
// WRITEs write the upper half. The mix starts with READs that exactly fill
// the target's 64 KiB response buffer before one more request.
func TestServerPipeline(t *testing.T) {
	s := newSide(t, Config{})
	const size = 256 << 10
	buf := s.register(t, s.alloc(t, size, 0), true)
	testpattern.Fill(buf.mem, 2)
	model := bytes.Clone(buf.mem)
	rng := mrand.New(mrand.NewPCG(3, 4))

	var (
		stream []byte
		wants  []pipeWant
		ids    = map[uint32]bool{}
	)
	add := func(op byte, off, n int, good bool) {
		id := rng.Uint32()
		for ids[id] {
			id = rng.Uint32()
		}
		ids[id] = true
		r := specReq{op: op, id: id, buffer: buf.id, length: uint32(n), key: buf.key, addr: buf.addr + uint64(off)}
		w := pipeWant{id: id}
		// PROTOCOL.md: the key first, then the address, then the range.
		if !good {
			r.key ^= 0x8000
			w.status = append(w.status, 1)
		} else if off >= size {
			w.status = append(w.status, 1)
		} else if off+n > size {
			w.status = append(w.status, 2)
		}
		ok := len(w.status) == 0
		if ok {
			w.status = []uint8{0}
		}
		var payload []byte
		if op == specWrite {
			payload = make([]byte, n)
			testpattern.Fill(payload, rng.Uint64())
			if ok {
				copy(model[off:], payload)
			}
		} else if ok {
			w.payload = bytes.Clone(model[off : off+n])
		}
		stream = append(stream, r.frame(payload)...)
		wants = append(wants, w)
	}
	// 4 × (8 + 16376) bytes fill a 64 KiB response buffer to the byte.
	for i := range 4 {
		add(specRead, i*16376, 16376, true)
	}
	add(specRead, 0, 8, true)
	add(specRead, 0, 8, false)
	sizes := []int{1, 3, 7, 8, 100, 4096, 16375, 16376, 16377, 16383, 16384, 20000, 65535, 65536, 70000}
	for range 600 {
		n := sizes[rng.IntN(len(sizes))]
		op := byte(specRead)
		if rng.IntN(2) == 0 {
			op = specWrite
		}
		off := rng.IntN(size/2 - n + 1)
		if op == specWrite {
			off += size / 2
		}
		good := rng.IntN(8) != 0
		if rng.IntN(10) == 0 {
			off = size - n + 1 + rng.IntN(n) // runs past the end
		}
		add(op, off, n, good)
	}
	rc := s.raw(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // write while the responses are read, or both sides could block
		defer wg.Done()
		rc.c.Write(stream)
	}()
	defer wg.Wait()
	rc.expectPipeline(wants, buf.mem, model)
}

// pipeWant is a response a pipelined stream's model expects: its id, the
// statuses PROTOCOL.md allows, and a READ's payload.
type pipeWant struct {
	id      uint32
	status  []uint8
	payload []byte
}

// expectPipeline reads the responses wants describe, in order, and then
// checks that mem is as model says.
func (rc *rawConn) expectPipeline(wants []pipeWant, mem, model []byte) {
	rc.t.Helper()
	for i, w := range wants {
		id, st := rc.resp()
		if id != w.id || !bytes.Contains(w.status, []byte{st}) {
			rc.t.Fatalf("response %d: id %#x status %d, want id %#x status in %v", i, id, st, w.id, w.status)
		}
		if w.payload != nil {
			if got := rc.payload(len(w.payload)); !bytes.Equal(got, w.payload) {
				rc.t.Fatalf("response %d: READ payload differs at %d", i, testpattern.FirstDiff(got, w.payload))
			}
		}
	}
	if i := testpattern.FirstDiff(mem, model); i >= 0 {
		rc.t.Fatalf("buffer differs from the model at offset %d", i)
	}
}

// TestServerWriteVisibleOnResponse: a WRITE's response arrives only after
// its bytes are in memory. WRITEs are pipelined; right after each response
// is read, that WRITE's bytes must be in the buffer.
func TestServerWriteVisibleOnResponse(t *testing.T) {
	s := newSide(t, Config{})
	const n, chunk = 128, 3000
	buf := s.register(t, s.alloc(t, n*chunk, 0), true)
	var stream []byte
	payloads := make([][]byte, n)
	for i := range n {
		payloads[i] = make([]byte, chunk)
		testpattern.Fill(payloads[i], uint64(i)+10)
		stream = append(stream, specReq{op: specWrite, id: uint32(i), buffer: buf.id, length: chunk, key: buf.key, addr: buf.addr + uint64(i*chunk)}.frame(payloads[i])...)
	}
	rc := s.raw(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		rc.c.Write(stream)
	}()
	defer wg.Wait()
	for i := range n {
		id, st := rc.resp()
		if id != uint32(i) || st != 0 {
			t.Fatalf("response %d: id %d status %d", i, id, st)
		}
		if j := testpattern.FirstDiff(buf.mem[i*chunk:(i+1)*chunk], payloads[i]); j >= 0 {
			t.Fatalf("WRITE %d answered before its byte %d was in memory", i, j)
		}
	}
}

// chanCompleter sends every completion to a channel with room for all.
type chanCompleter chan completion

type completion struct {
	token uint64
	err   error
}

func (c chanCompleter) Complete(token uint64, err error) { c <- completion{token, err} }

// await waits for n completions and checks each token completes once.
func (c chanCompleter) await(t testing.TB, n int) map[uint64]error {
	t.Helper()
	got := map[uint64]error{}
	timer := time.NewTimer(hang)
	defer timer.Stop()
	for len(got) < n {
		select {
		case x := <-c:
			if _, dup := got[x.token]; dup {
				t.Fatalf("token %d completed twice", x.token)
			}
			got[x.token] = x.err
		case <-timer.C:
			t.Fatalf("hang: %d of %d slices completed", len(got), n)
		}
	}
	return got
}

// postAll posts every slice of sl to ep, waiting while the connection is
// full (Post's backpressure: a connection takes startDepth slices until
// it grows, and Config.Depth after).
func postAll(t testing.TB, ep transport.Endpoint, c transport.Completer, sl []transport.Slice) {
	t.Helper()
	deadline := time.Now().Add(hang)
	for posted := 0; posted < len(sl); {
		n, err := ep.Post(c, sl[posted:])
		if err != nil {
			t.Fatalf("Post: %d of %d, %v", posted+n, len(sl), err)
		}
		if posted += n; posted < len(sl) {
			if time.Now().After(deadline) {
				t.Fatalf("hang: Post took %d of %d slices in %v", posted, len(sl), hang)
			}
			time.Sleep(50 * time.Microsecond)
		}
	}
}

func localSlice(op transport.Op, local []byte, remote uint64, token uint64) transport.Slice {
	return transport.Slice{Op: op, Local: unsafe.Pointer(unsafe.SliceData(local)), Remote: remote, Length: uint64(len(local)), Token: token}
}

// TestServerStalledNotifyReleases: a peer that sends a large READ (whose
// region the target holds until it writes the payload) and then a NOTIFY
// header whose payload never comes is cut off after FrameTimeout, and the
// region goes back, so Unregister ends. The NOTIFY's payload used to be
// read with no deadline: the region stayed held while the peer lived, and
// Unregister gave up after a minute with the buffer still served.
func TestServerStalledNotifyReleases(t *testing.T) {
	s := newSide(t, Config{FrameTimeout: 300 * time.Millisecond})
	buf := s.register(t, s.alloc(t, 1<<20, 7), true)
	rc := s.raw(t)
	read := specReq{op: specRead, id: 1, buffer: buf.id, length: 64 << 10, key: buf.key, addr: buf.addr}
	note := specReq{op: 3, id: 2, length: 100} // a NOTIFY: its 100 bytes never follow
	rc.send(append(read.frame(nil), note.frame(nil)...))
	rc.expectClosed("a NOTIFY whose payload never comes, behind a held READ")
	done := make(chan error, 1)
	go func() { done <- s.tr.Unregister(buf.b, buf.r) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Unregister: %v", err)
		}
	case <-time.After(hang):
		t.Fatal("hang: Unregister with the READ's region still held")
	}
}

// TestIdleConnsHoldNoBuffers: the target's connections take a response
// buffer, a read buffer and a group state from shared pools while they
// have requests and give them back when they wait: eight initiators WRITE
// bytes of their own (small payloads, read through the read buffer; two
// WRITEs a Post, most of them a group frame) and READ them back at once,
// and each gets its own (the buffers pass from connection to
// connection); once they are idle the target holds no buffer.
func TestIdleConnsHoldNoBuffers(t *testing.T) {
	const peers, size, rounds = 8, 4096, 200
	targ := newSide(t, Config{})
	m := targ.alloc(t, peers*size, 0)
	for i := range m {
		m[i] = byte(i/size*31 + i%251)
	}
	remote := targ.register(t, m, true)
	var wg sync.WaitGroup
	errs := make(chan error, peers)
	for p := range peers {
		init := newSide(t, Config{Rails: 1})
		ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ep.Close() })
		local := init.alloc(t, 2*size, 0)
		wg.Add(1)
		go func() {
			defer wg.Done()
			comp := make(chanCompleter, 2)
			src, got := local[:size], local[size:]
			at := remote.addr + uint64(p*size)
			for r := range rounds {
				op := transport.Read
				if r%2 == 0 { // every other round writes new bytes first
					op = transport.Write
					for i := range src {
						src[i] = byte(p*37 + r*11 + i%253)
					}
				}
				buf := got
				if op == transport.Write {
					buf = src
				} else {
					clear(got)
				}
				s := []transport.Slice{localSlice(op, buf, at, uint64(r))}
				if op == transport.Write { // in two halves: a run of WRITEs
					h := size / 2
					s = []transport.Slice{localSlice(op, buf[:h], at, uint64(r)), localSlice(op, buf[h:], at+uint64(h), uint64(r))}
				}
				if n, err := ep.Post(comp, s); n != len(s) || err != nil {
					errs <- fmt.Errorf("peer %d: Post = %d, %v", p, n, err)
					return
				}
				for range s {
					if c := <-comp; c.err != nil {
						errs <- fmt.Errorf("peer %d: %v: %v", p, op, c.err)
						return
					}
				}
				if op == transport.Read && !bytes.Equal(got, src) {
					errs <- fmt.Errorf("peer %d, round %d: read other bytes than it wrote", p, r)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	held := func() (conns, holding int) {
		targ.tr.mu.Lock()
		defer targ.tr.mu.Unlock()
		for _, pc := range targ.tr.conns {
			if pc.holdsOut.Load() || pc.holdsIn.Load() || pc.holdsGroup.Load() {
				holding++
			}
		}
		return len(targ.tr.conns), holding
	}
	if targ.tr.groups.frames.Load() == 0 {
		t.Fatal("the target served no group frame: no connection took a group state")
	}
	targ.tr.mu.Lock()
	for _, pc := range targ.tr.conns {
		// Each of its requests came after the answer to the one
		// before: the connection waited for it holding no buffer.
		if w := pc.idleWaits.Load(); w < rounds {
			t.Errorf("a connection waited %d times without a read buffer; its peer made %d requests one at a time", w, rounds)
		}
	}
	targ.tr.mu.Unlock()
	deadline := time.Now().Add(10 * time.Second)
	for {
		conns, holding := held()
		if conns < peers {
			t.Fatalf("the target has %d connections, want %d", conns, peers)
		}
		if holding == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d idle connections hold a response or read buffer or a group state 10 s after the last request", holding, conns)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestIdleRearmHoldsNoBuffer: when the idle deadline fires on a connection
// whose requests came since it was armed, the connection waits again
// holding no read buffer, as it does after an answer (it waited in a read
// with one until the next request or IdleTimeout).
func TestIdleRearmHoldsNoBuffer(t *testing.T) {
	const idle = 300 * time.Millisecond
	targ := newSide(t, Config{IdleTimeout: idle})
	m := targ.alloc(t, 4096, 0)
	remote := targ.register(t, m, true)
	init := newSide(t, Config{Rails: 1})
	ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep.Close() })
	local := init.alloc(t, 64, 0)
	comp := make(chanCompleter, 1)
	for r := range 3 { // requests within the first IdleTimeout: it fires with requests since
		if n, err := ep.Post(comp, []transport.Slice{localSlice(transport.Read, local, remote.addr, uint64(r))}); n != 1 || err != nil {
			t.Fatalf("Post = %d, %v", n, err)
		}
		if c := <-comp; c.err != nil {
			t.Fatal(c.err)
		}
		time.Sleep(idle / 10)
	}
	conn := func() *peerConn {
		targ.tr.mu.Lock()
		defer targ.tr.mu.Unlock()
		for _, pc := range targ.tr.conns {
			return pc
		}
		return nil
	}
	pc := conn()
	if pc == nil {
		t.Fatal("the target has no connection")
	}
	open := func() bool { // pc is still one of the target's connections
		targ.tr.mu.Lock()
		defer targ.tr.mu.Unlock()
		for _, c := range targ.tr.conns {
			if c == pc {
				return true
			}
		}
		return false
	}
	w0 := pc.idleWaits.Load()
	deadline := time.Now().Add(20 * idle)
	for pc.idleWaits.Load() == w0 {
		if !open() {
			t.Fatal("the connection was closed idle without waiting again holding no buffer after the deadline re-armed")
		}
		if time.Now().After(deadline) {
			t.Fatalf("no wait without a buffer in %v after the last request (IdleTimeout %v)", 20*idle, idle)
		}
		time.Sleep(time.Millisecond)
	}
	// Nothing more came: the connection ends at the next deadline.
	for deadline = time.Now().Add(20 * idle); open(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("an idle connection still open %v after its deadline was re-armed", 20*idle)
		}
	}
}
