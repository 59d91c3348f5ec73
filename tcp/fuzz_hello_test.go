package tcp

// FuzzServerHello: arbitrary bytes from the first byte of a connection,
// the hello included, against a plain target and a TLS one, checked
// against a model of the hello (PROTOCOL.md, Hello). FuzzServerFrames
// (fuzz_test.go) starts after a valid hello; this one starts before it.

import (
	"bytes"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// helloFuzzTimeout is the fuzz targets' HandshakeTimeout: a stream that
// stops inside the hello and holds the connection open is closed by it.
const helloFuzzTimeout = 100 * time.Millisecond

// helloTarget is a target the hello fuzzer talks to: its remote buffer
// sits at FuzzServerFrames' wire address and key, so that frames in a
// corpus entry name it, and nothing may ever change it.
type helloTarget struct {
	s       *side
	cfg     Config
	remote  testBuf
	local   testBuf
	initial []byte
	notes   sync.Mutex
	noted   int // notifications delivered; none may be
}

func newHelloTarget(f *testing.F, cfg Config) *helloTarget {
	cfg.HandshakeTimeout, cfg.MaxLength, cfg.SliceSize = helloFuzzTimeout, fuzzMax, 4096
	ht := &helloTarget{s: newSide(f, cfg), cfg: cfg}
	ht.s.tr.SetNotify("hello-target", func(*transport.Notification) error {
		ht.notes.Lock()
		defer ht.notes.Unlock()
		ht.noted++
		return nil
	})
	ht.remote = ht.s.register(f, ht.s.alloc(f, 2*page, 0), true)
	ht.local = ht.s.register(f, ht.s.alloc(f, page, canaryByte), false)
	ht.initial = make([]byte, len(ht.remote.mem))
	testpattern.Fill(ht.initial, 11)
	copy(ht.remote.mem, ht.initial)
	// No connection exists yet; every connection's first read orders this
	// write before the server's reads of the region.
	rs := ht.s.tr.regs.Values()
	rs[0].addr, rs[0].key = fuzzAddr, fuzzKey
	ht.remote.addr, ht.remote.key = fuzzAddr, fuzzKey
	return ht
}

// helloWant is what the model of the hello predicts for a stream.
type helloWant struct {
	// challenge is the status of the challenge the target sends, or -1
	// for none.
	challenge int
	// refused: the target sends an accept refusing the proof (status 3).
	refused bool
	// refusals is what Refusals must grow by; with tlsHello, any of
	// none, BadHello or (held) HandshakeTimeout, one at most.
	refusals Refusals
	tlsHello bool
}

// helloModel runs stream through PROTOCOL.md's hello: hold says the
// connection stays open after it (else the peer's side ends there), tls
// that the target requires TLS (AutoTLS).
func helloModel(stream []byte, hold, requireTLS bool) helloWant {
	w := helloWant{challenge: -1}
	stalled := func() helloWant { // the stream ends inside the hello
		if hold {
			w.refusals.HandshakeTimeout = 1
		}
		return w
	}
	if len(stream) == 0 {
		return stalled()
	}
	if requireTLS {
		if stream[0] == 0x16 {
			w.tlsHello = true
			return w
		}
		// A plain hello to a TLS target: refused with status 2 once its
		// 24 bytes came, or its end; a held one past HandshakeTimeout gets
		// no answer (the write meets the deadline).
		w.refusals.BadHello = 1
		if len(stream) >= specHelloLen || !hold {
			w.challenge = 2
		}
		return w
	}
	if len(stream) < specHelloLen {
		return stalled()
	}
	h := stream[:specHelloLen]
	switch {
	case string(h[:4]) != "MRNG":
		w.refusals.BadHello = 1
		return w
	case binary.BigEndian.Uint16(h[4:]) != 1:
		w.challenge = 1
		w.refusals.BadHello = 1
		return w
	case binary.BigEndian.Uint16(h[6:]) != 0:
		w.refusals.BadHello = 1
		return w
	}
	w.challenge = 0
	if len(stream) < specHelloLen+specProofLen {
		return stalled()
	}
	// The proof is over a nonce the target draws afterwards: a stream
	// fixed in advance cannot hold the right one.
	w.refused = true
	w.refusals.Auth = 1
	return w
}

// sub returns a's counts less b's.
func (a Refusals) sub(b Refusals) Refusals {
	return Refusals{
		HandshakeCap: a.HandshakeCap - b.HandshakeCap, SourceCap: a.SourceCap - b.SourceCap,
		Descriptors: a.Descriptors - b.Descriptors, AcceptErrors: a.AcceptErrors - b.AcceptErrors,
		HandshakeTimeout: a.HandshakeTimeout - b.HandshakeTimeout, BadHello: a.BadHello - b.BadHello,
		Auth: a.Auth - b.Auth, ConnCap: a.ConnCap - b.ConnCap, Idle: a.Idle - b.Idle, BadFrame: a.BadFrame - b.BadFrame,
	}
}

// run sends stream from the first byte of a fresh connection, then ends
// its side (or, with hold, keeps it open), reads all the target sends
// until it closes, and compares with the model.
func (ht *helloTarget) run(t *testing.T, stream []byte, hold bool) {
	want := helloModel(stream, hold, ht.cfg.AutoTLS)
	before := ht.s.tr.Refusals()
	c := dialRaw(t, ht.s.tr.Addr())
	// The target must end the connection within its HandshakeTimeout; the
	// margin is for a loaded machine, not a measure.
	start := time.Now()
	c.SetDeadline(start.Add(helloFuzzTimeout + 5*time.Second))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		c.Write(stream) // fails once the target closes early: fine
		if !hold {
			c.(*net.TCPConn).CloseWrite()
		}
	}()
	got, err := io.ReadAll(c)
	c.Close() // ends a Write still blocked on a target that stopped reading
	wg.Wait()
	reset := errors.Is(err, syscall.ECONNRESET)
	if err != nil && !reset {
		t.Fatalf("the target did not end the connection within its HandshakeTimeout (%v) and a margin: %v after %v", helloFuzzTimeout, err, time.Since(start))
	}
	ht.s.waitServed(t)

	if want.tlsHello {
		// TLS records, whatever the handshake got to: never the
		// protocol's plain challenge.
		if bytes.HasPrefix(got, []byte("MRNG")) {
			t.Fatalf("a TLS target answered a TLS record with a plain challenge: % x", got[:min(len(got), 32)])
		}
	} else {
		var exp []byte
		if want.challenge >= 0 {
			exp = append(exp, "MRNG"...)
			exp = binary.BigEndian.AppendUint16(exp, 1)
			exp = binary.BigEndian.AppendUint16(exp, uint16(want.challenge))
			exp = append(exp, make([]byte, 16)...) // the snonce: random when status 0
			exp = binary.BigEndian.AppendUint32(exp, ht.cfg.MaxLength)
			// The features word: group frames and wide ones (bits 0
			// and 1) on an accepted hello, nothing on a refusal.
			exp = binary.BigEndian.AppendUint32(exp, map[bool]uint32{true: 3}[want.challenge == 0])
		}
		if want.refused {
			exp = binary.BigEndian.AppendUint16(exp, 3)
			exp = append(exp, make([]byte, specAcceptLen-2)...)
		}
		// After a reset (the target closed with bytes of ours unread) the
		// last of what it sent may be lost, never more than it sent.
		if len(got) > len(exp) || (!reset && len(got) < len(exp)) {
			t.Fatalf("the target sent %d bytes (% x), the model says %d", len(got), got[:min(len(got), 80)], len(exp))
		}
		for i := range got {
			if i >= 8 && i < 24 && want.challenge == 0 {
				continue
			}
			if got[i] != exp[i] {
				t.Fatalf("byte %d of what the target sent is %#x, the model says %#x (got % x)", i, got[i], exp[i], got)
			}
		}
	}

	d := ht.s.tr.Refusals().sub(before)
	if want.tlsHello {
		ok := d == Refusals{} || d == Refusals{BadHello: 1} || (hold && d == Refusals{HandshakeTimeout: 1})
		if !ok {
			t.Fatalf("refusals grew by %+v for a TLS hello (hold %v); want none, one bad hello or (held) one handshake timeout", d, hold)
		}
	} else if d != want.refusals {
		t.Fatalf("refusals grew by %+v, the model says %+v", d, want.refusals)
	}
	// Nothing was served: no request without a valid hello.
	ht.s.tr.Served(func(s Served) { t.Fatalf("the target served %+v without a valid hello", s) })
	if i := testpattern.FirstDiff(ht.remote.mem, ht.initial); i >= 0 {
		t.Fatalf("remote buffer byte %d changed without a valid hello", i)
	}
	if i := allEqual(ht.local.mem, canaryByte); i >= 0 {
		t.Fatalf("local-only buffer byte %d changed", i)
	}
	ht.notes.Lock()
	defer ht.notes.Unlock()
	if ht.noted != 0 {
		t.Fatalf("%d notifications delivered without a valid hello", ht.noted)
	}
}

// tlsClientHello is the first flight of a TLS 1.3 client: a valid
// ClientHello record, for the corpus.
func tlsClientHello(f *testing.F) []byte {
	a, b := net.Pipe()
	defer b.Close()
	go func() {
		tls.Client(a, &tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS13}).Handshake()
		a.Close()
	}()
	var hdr [5]byte
	if _, err := io.ReadFull(b, hdr[:]); err != nil {
		f.Fatal(err)
	}
	rec := make([]byte, 5+int(binary.BigEndian.Uint16(hdr[3:])))
	copy(rec, hdr[:])
	if _, err := io.ReadFull(b, rec[5:]); err != nil {
		f.Fatal(err)
	}
	return rec
}

// FuzzServerHello feeds arbitrary bytes to a target from the first byte
// of a connection, the hello included: to a plain target, or (tls) to one
// with AutoTLS; then the stream ends, or with hold the connection stays
// open. The target must never panic, must answer exactly as the model of
// the hello says (a challenge, a refusal of the proof, nothing) and count
// the refusal it says, must never serve a request (no byte of its buffers
// changes, nothing is counted in Served, no notification delivered: a
// stream fixed in advance cannot prove the key), and must end the
// connection within its HandshakeTimeout; goleak checks that its
// goroutines end.
//
//	go test -run '^$' -fuzz FuzzServerHello ./tcp/
func FuzzServerHello(f *testing.F) {
	plain := newHelloTarget(f, Config{})
	withTLS := newHelloTarget(f, Config{AutoTLS: true})
	hello := specHello(1, bytes.Repeat([]byte{7}, 16))
	proof := bytes.Repeat([]byte{9}, specProofLen)
	read := specReq{op: specRead, id: 1, buffer: plain.remote.id, length: 64, key: fuzzKey, addr: fuzzAddr}.frame(nil)
	write := specReq{op: specWrite, id: 2, buffer: plain.remote.id, length: 8, key: fuzzKey, addr: fuzzAddr}.frame([]byte("overwrit"))
	note := notifyFrame(3, 4, "peer", []byte("hi"))
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	with := func(b []byte, off int, v ...byte) []byte { b = bytes.Clone(b); copy(b[off:], v); return b }
	ch := tlsClientHello(f)

	for _, s := range [][]byte{
		{},
		hello[:1],
		hello[:10],
		hello,                                  // no proof
		cat(hello, proof[:10]),                 // half a proof
		cat(hello, proof),                      // a wrong proof
		cat(hello, proof, read, write, note),   // frames behind a wrong proof
		cat(hello, read, write),                // frames in place of the proof
		with(hello, 0, 'm'),                    // bad magic
		with(hello, 5, 2),                      // version 2
		with(hello, 7, 1),                      // a flag
		cat(with(hello, 0, 0x16, 3, 1), proof), // a TLS record header's first bytes
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), // another protocol
		cat(read, write),            // frames with no hello
		ch,                          // a TLS ClientHello
		ch[:20],                     // part of one
		cat(ch, hello, proof, read), // more behind one
	} {
		f.Add(s, false, false)
		f.Add(s, false, true)
	}
	for _, s := range [][]byte{{}, hello[:10], hello, cat(hello, proof[:10]), ch[:20]} {
		f.Add(s, true, false)
		f.Add(s, true, true)
	}

	f.Fuzz(func(t *testing.T, stream []byte, hold, useTLS bool) {
		if useTLS {
			withTLS.run(t, stream, hold)
		} else {
			plain.run(t, stream, hold)
		}
	})
}
