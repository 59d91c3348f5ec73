package rdma

import (
	"bytes"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
)

func TestHandshakeRoundTrip(t *testing.T) {
	in := qpAddr{Kind: kindHello, Device: 3, LID: 0x1234, MTU: 3, RdAtomic: 16, QPN: 0xabcdef, PSN: 0x123456}
	copy(in.GID[:], netip.MustParseAddr("::ffff:10.0.0.1").AsSlice())
	var b [msgLen]byte
	in.encode(&b)
	want := []byte{'M', 'R', 'Q', 'P', 1, kindHello, 0, 3,
		0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1,
		0x12, 0x34, 3, 16, 0, 0xab, 0xcd, 0xef, 0, 0x12, 0x34, 0x56}
	if !bytes.Equal(b[:], want) {
		t.Fatalf("encoded\n%x\nwant\n%x", b[:], want)
	}
	out, err := decodeQPAddr(b[:])
	if err != nil {
		t.Fatal(err)
	}
	if out != in {
		t.Fatalf("decoded %+v, want %+v", out, in)
	}
}

func TestHandshakeRejects(t *testing.T) {
	good := qpAddr{Kind: kindAccept, Device: 0, MTU: 5, RdAtomic: 1, QPN: 17, PSN: 0}
	cases := []struct {
		name string
		mut  func(b []byte)
	}{
		{"magic", func(b []byte) { b[0] = 'X' }},
		{"version", func(b []byte) { b[4] = 2 }},
		{"kind", func(b []byte) { b[5] = 9 }},
		{"zero QPN", func(b []byte) { copy(b[28:32], []byte{0, 0, 0, 0}) }},
		{"QPN past 24 bits", func(b []byte) { b[28] = 1 }},
		{"PSN past 24 bits", func(b []byte) { b[32] = 1 }},
		{"MTU 0", func(b []byte) { b[26] = 0 }},
		{"MTU 6", func(b []byte) { b[26] = 6 }},
		{"no RDMA READ", func(b []byte) { b[27] = 0 }},
	}
	for _, c := range cases {
		var b [msgLen]byte
		good.encode(&b)
		if _, err := decodeQPAddr(b[:]); err != nil {
			t.Fatalf("good message refused: %v", err)
		}
		c.mut(b[:])
		if _, err := decodeQPAddr(b[:]); !errors.Is(err, ErrHandshake) {
			t.Errorf("%s: err %v, want ErrHandshake", c.name, err)
		}
	}
	if _, err := decodeQPAddr(make([]byte, msgLen-1)); !errors.Is(err, ErrHandshake) {
		t.Errorf("short message: err %v", err)
	}
	// A refusal carries only its code.
	var b [msgLen]byte
	(&qpAddr{Kind: kindRefuse, Device: refuseLimit}).encode(&b)
	m, err := decodeQPAddr(b[:])
	if err != nil || m.Kind != kindRefuse || m.Device != refuseLimit {
		t.Errorf("refusal decoded as %+v, %v", m, err)
	}
}

func FuzzDecodeQPAddr(f *testing.F) {
	var b [msgLen]byte
	(&qpAddr{Kind: kindHello, MTU: 3, RdAtomic: 4, QPN: 9, PSN: 7}).encode(&b)
	f.Add(b[:])
	f.Add([]byte("MRQP"))
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := decodeQPAddr(in)
		if err != nil {
			return
		}
		var out [msgLen]byte
		m.encode(&out)
		if m.Kind == kindRefuse {
			return // the other fields of a refusal are not checked
		}
		m2, err := decodeQPAddr(out[:])
		if err != nil || m2 != m {
			t.Fatalf("re-decoding %+v gave %+v, %v", m, m2, err)
		}
		if !bytes.Equal(out[:], in) {
			t.Fatalf("accepted %x but encodes it as %x", in, out)
		}
	})
}

func TestEndpointString(t *testing.T) {
	s := formatEndpoint("10.0.0.1:4791", []string{"rxe0", "mlx5_1"}, nil)
	if s != "10.0.0.1:4791/rxe0,mlx5_1" {
		t.Fatalf("formatEndpoint = %q", s)
	}
	addr, devs, key, err := parseEndpoint(s)
	if err != nil || addr != "10.0.0.1:4791" || len(devs) != 2 || devs[1] != "mlx5_1" || key != nil {
		t.Fatalf("parseEndpoint(%q) = %q, %v, %x, %v", s, addr, devs, key, err)
	}
	k := bytes.Repeat([]byte{0xab}, keySize)
	s = formatEndpoint("[::1]:7", []string{"rxe0"}, k)
	if addr, devs, key, err = parseEndpoint(s); err != nil || addr != "[::1]:7" || len(devs) != 1 || !bytes.Equal(key, k) {
		t.Errorf("parseEndpoint(%q) = %q, %v, %x, %v", s, addr, devs, key, err)
	}
	for _, bad := range []string{"", "10.0.0.1:4791", "10.0.0.1:4791/", "10.0.0.1/rxe0", "h:1/a,,b",
		"h:1/rxe0/abcd", "h:1/rxe0/" + strings.Repeat("zz", keySize), "h:1/rxe0/" + strings.Repeat("ab", keySize) + "/x"} {
		if _, _, _, err := parseEndpoint(bad); err == nil {
			t.Errorf("parseEndpoint(%q) accepted", bad)
		}
	}
}

// The keyed handshake over a pipe: the same key connects; another key is
// refused on both sides before the target's answer function runs; a
// tampered hello is refused as a wrong key.
func TestKeyedHandshake(t *testing.T) {
	k1, k2 := deriveKey([]byte("one")), deriveKey([]byte("two"))
	hello := qpAddr{Kind: kindHello, Device: 1, MTU: 3, RdAtomic: 4, QPN: 0x11, PSN: 0x22}
	accept := qpAddr{Kind: kindAccept, Device: 1, MTU: 3, RdAtomic: 4, QPN: 0x33, PSN: 0x44}
	type result struct {
		hello, ans qpAddr
		err        error
		called     bool
	}
	run := func(ikey, tkey []byte, tamper bool) (qpAddr, error, result) {
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		done := make(chan result, 1)
		go func() {
			var r result
			r.hello, r.ans, r.err = serveHandshake(b, tkey, func(h *qpAddr) qpAddr { r.called = true; return accept })
			b.Close()
			done <- r
		}()
		var conn io.ReadWriter = a
		if tamper {
			conn = &flipper{ReadWriter: a, at: nonceLen + 30}
		}
		ans, err := dialHandshake(conn, ikey, &hello)
		a.Close()
		return ans, err, <-done
	}
	ans, err, r := run(k1, k1, false)
	if err != nil || ans != accept || r.err != nil || r.hello != hello || !r.called {
		t.Fatalf("same key: answer %+v, %v; target saw %+v, %v", ans, err, r.hello, r.err)
	}
	_, err, r = run(k1, k2, false)
	if !errors.Is(err, ErrAuth) || !errors.Is(r.err, ErrAuth) || r.called {
		t.Fatalf("another key: initiator %v, target %v, answer function called %v", err, r.err, r.called)
	}
	_, err, r = run(k1, k1, true)
	if !errors.Is(r.err, ErrAuth) || r.called || err == nil {
		t.Fatalf("tampered hello: initiator %v, target %v, answer function called %v", err, r.err, r.called)
	}
}

// flipper flips one bit of the byte written at offset at.
type flipper struct {
	io.ReadWriter
	n, at int
}

func (f *flipper) Write(p []byte) (int, error) {
	q := append([]byte(nil), p...)
	if f.at >= f.n && f.at < f.n+len(q) {
		q[f.at-f.n] ^= 1
	}
	f.n += len(q)
	return f.ReadWriter.Write(q)
}

func TestKeys(t *testing.T) {
	k := formatKey([]uint32{0x1234, 0xffffffff, 0})
	if k != "1234.ffffffff.0" {
		t.Fatalf("formatKey = %q", k)
	}
	got, err := parseKey(k, 3)
	if err != nil || got[0] != 0x1234 || got[1] != 0xffffffff || got[2] != 0 {
		t.Fatalf("parseKey = %v, %v", got, err)
	}
	for _, bad := range []struct {
		s string
		n int
	}{{"", 1}, {"1234", 2}, {"1234.5", 1}, {"xyz", 1}, {"100000000", 1}, {"-1", 1}, {"not-a-key-1234-x", 1}} {
		if _, err := parseKey(bad.s, bad.n); err == nil {
			t.Errorf("parseKey(%q, %d) accepted", bad.s, bad.n)
		}
	}
}

func gid(i int, addr string, typ GIDType) GID {
	return GID{Index: i, Raw: netip.MustParseAddr(addr).As16(), Type: typ}
}

func TestChooseGID(t *testing.T) {
	// What a RoCE port usually shows: a v1 and a v2 entry per address,
	// link-local first.
	roce := []GID{
		gid(0, "fe80::1", GIDTypeRoCEv1),
		gid(1, "fe80::1", GIDTypeRoCEv2),
		gid(2, "::ffff:10.0.0.1", GIDTypeRoCEv1),
		gid(3, "::ffff:10.0.0.1", GIDTypeRoCEv2),
		gid(4, "2001:db8::5", GIDTypeRoCEv1),
		gid(5, "2001:db8::5", GIDTypeRoCEv2),
	}
	ix := func(i int) *int { return &i }
	cases := []struct {
		name     string
		table    []GID
		ethernet bool
		override *int
		want     int // -1: error
	}{
		{"IPv4 RoCE v2 first", roce, true, nil, 3},
		{"global IPv6 v2 without IPv4", []GID{roce[0], roce[1], roce[4], roce[5]}, true, nil, 5},
		{"only link-local: refuse", roce[:2], true, nil, -1},
		{"only RoCE v1: refuse", []GID{roce[0], roce[2], roce[4]}, true, nil, -1},
		{"lowest index among equals", []GID{gid(7, "::ffff:10.0.0.2", GIDTypeRoCEv2), gid(6, "::ffff:10.0.0.3", GIDTypeRoCEv2)}, true, nil, 6},
		{"link-local IPv4 169.254", []GID{gid(1, "::ffff:169.254.3.4", GIDTypeRoCEv2)}, true, nil, -1},
		{"zero GID skipped", []GID{{Index: 0, Type: GIDTypeRoCEv2}, roce[3]}, true, nil, 3},
		{"override to link-local", roce, true, ix(1), 1},
		{"override missing", roce, true, ix(9), -1},
		{"override of a zero entry", []GID{{Index: 0}}, true, ix(0), -1},
		{"InfiniBand port GID", []GID{gid(0, "fe80::2:c903:1:2", GIDTypeIB)}, false, nil, 0},
		{"empty", nil, true, nil, -1},
	}
	for _, c := range cases {
		g, err := ChooseGID(c.table, c.ethernet, c.override)
		switch {
		case c.want < 0 && err == nil:
			t.Errorf("%s: chose %v, want an error", c.name, g)
		case c.want < 0 && !errors.Is(err, ErrNoGID):
			t.Errorf("%s: error %v does not wrap ErrNoGID", c.name, err)
		case c.want >= 0 && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.want >= 0 && g.Index != c.want:
			t.Errorf("%s: chose index %d (%v), want %d", c.name, g.Index, g, c.want)
		}
	}
}
