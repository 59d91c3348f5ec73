package tcp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// TestAutoTLS: two transports with AutoTLS move bytes over TLS 1.3, the
// target's certificate the one its endpoint pins; an initiator without
// AutoTLS (and one whose ClientTLS trusts no one) follows the pin too, and
// so does a deployment with a shared key, whose endpoint has no key.
func TestAutoTLS(t *testing.T) {
	targ := newSide(t, Config{AutoTLS: true})
	remote := targ.register(t, targ.alloc(t, 1<<20, 0), true)
	ep := targ.tr.Endpoint()
	if !regexp.MustCompile(`^127\.0\.0\.1:[0-9]+/[0-9a-f]{64}\?tls=[0-9a-f]{64}$`).MatchString(ep) {
		t.Fatalf("endpoint %q: want host:port/<key hex>?tls=<64 lowercase hex>", ep)
	}
	if fp := targ.tr.Fingerprint(); !strings.HasSuffix(ep, "?tls="+fp) {
		t.Fatalf("endpoint %q does not end in the fingerprint %q", ep, fp)
	}
	// What the port serves is the certificate pinned, over TLS 1.3.
	c, err := tls.Dial("tcp", targ.tr.Addr(), &tls.Config{InsecureSkipVerify: true})
	if err != nil {
		t.Fatal(err)
	}
	st := c.ConnectionState()
	c.Close()
	if sum := sha256.Sum256(st.PeerCertificates[0].Raw); hex.EncodeToString(sum[:]) != targ.tr.Fingerprint() {
		t.Fatal("the certificate served is not the one Fingerprint names")
	}
	if st.Version != tls.VersionTLS13 {
		t.Fatalf("TLS version %#x, want 1.3", st.Version)
	}

	for name, cfg := range map[string]Config{
		"AutoTLS":                 {AutoTLS: true},
		"plain":                   {},
		"ClientTLS trusts no one": {ClientTLS: &tls.Config{RootCAs: x509.NewCertPool()}},
	} {
		t.Run(name, func(t *testing.T) {
			init := newSide(t, cfg)
			roundTrip(t, open(t, init, targ, remote), init, remote, 1<<20)
		})
	}
	t.Run("shared key", func(t *testing.T) {
		key := []byte("a deployment's key")
		targ := newSide(t, Config{AutoTLS: true, Key: key})
		remote := targ.register(t, targ.alloc(t, 64<<10, 0), true)
		if ep := targ.tr.Endpoint(); ep != targ.tr.Addr()+"?tls="+targ.tr.Fingerprint() {
			t.Fatalf("endpoint %q: want host:port?tls=<fingerprint>", ep)
		}
		init := newSide(t, Config{Key: key})
		ep, err := init.tr.Open(context.Background(), targ.desc(targ.tr.Addr(), remote))
		if err != nil {
			t.Fatal(err)
		}
		defer ep.Close()
		roundTrip(t, ep, init, remote, 64<<10)
	})
	if _, err := New(Config{AutoTLS: true, TLS: &tls.Config{}}); err == nil {
		t.Fatal("New with AutoTLS and TLS both set succeeded")
	}
}

// TestParseEndpoint: the endpoint forms of PROTOCOL.md, old and new.
func TestParseEndpoint(t *testing.T) {
	tr := newSide(t, Config{}).tr
	key := strings.Repeat("ab", 32)
	pin := strings.Repeat("0f", 32)
	for _, ep := range []string{"127.0.0.1:1/" + key, "127.0.0.1:1/" + key + "?tls=" + pin, "[::1]:7000/" + key + "?tls=" + pin} {
		addr, k, p, err := tr.parseEndpoint(ep)
		if err != nil || hex.EncodeToString(k) != key || (strings.Contains(ep, "?") != (p != nil)) || (p != nil && hex.EncodeToString(p) != pin) || strings.ContainsAny(addr, "/?") {
			t.Errorf("parseEndpoint(%q) = %q, %x, %x, %v", ep, addr, k, p, err)
		}
	}
	for _, ep := range []string{
		"127.0.0.1:1/" + key + "?tls=" + strings.ToUpper(pin), // not lowercase
		"127.0.0.1:1/" + key + "?tls=" + pin[:62],             // short
		"127.0.0.1:1/" + key + "?tls=" + pin + "00",           // long
		"127.0.0.1:1/" + key + "?tls=" + pin[:62] + "zz",      // not hex
		"127.0.0.1:1/" + key + "?tls=",                        // empty
		"127.0.0.1:1/" + key + "?pin=" + pin,                  // another field
		"127.0.0.1:1/" + key + "?tls=" + pin + "&x=1",         // more fields
		"127.0.0.1/" + key + "?tls=" + pin,                    // no port
		"127.0.0.1:1?tls=" + pin,                              // no key, and none configured
	} {
		if _, _, _, err := tr.parseEndpoint(ep); err == nil {
			t.Errorf("parseEndpoint(%q) succeeded", ep)
		}
	}
}

// TestAutoTLSPinMismatch: an endpoint whose pin is not the certificate that
// answers at its address is refused with ErrPinMismatch (wrapping ErrAuth):
// a wrong pin, or a relay on the address that terminates TLS with a
// certificate of its own.
func TestAutoTLSPinMismatch(t *testing.T) {
	targ := newSide(t, Config{AutoTLS: true})
	remote := targ.register(t, targ.alloc(t, page, 0), true)
	init := newSide(t, Config{AutoTLS: true})

	d := targ.desc("", remote)
	wrong := []byte(strings.Repeat("0", 64))
	copy(wrong, targ.tr.Fingerprint()[:10])
	d.Endpoints[Name] = strings.Replace(d.Endpoints[Name], targ.tr.Fingerprint(), string(wrong), 1)
	if _, err := init.tr.Open(context.Background(), d); !errors.Is(err, ErrPinMismatch) || !errors.Is(err, ErrAuth) {
		t.Fatalf("Open with a wrong pin: %v, want ErrPinMismatch and ErrAuth", err)
	}

	// Another AutoTLS transport at the address the descriptor names (it has
	// the same key even): its certificate is not the pinned one.
	relay := newSide(t, Config{AutoTLS: true, Key: []byte("k")})
	d = targ.desc(relay.tr.Addr(), remote)
	if _, err := init.tr.Open(context.Background(), d); !errors.Is(err, ErrPinMismatch) {
		t.Fatalf("Open of a pinned endpoint answered by another certificate: %v, want ErrPinMismatch", err)
	}
}

// TestAutoTLSNoPlain: a target with AutoTLS cannot be spoken to in plain: a
// plain hello is answered "TLS required" and closed, and an initiator
// given the endpoint without its pin fails with ErrTLSRequired.
func TestAutoTLSNoPlain(t *testing.T) {
	targ := newSide(t, Config{AutoTLS: true})
	remote := targ.register(t, targ.alloc(t, page, 0), true)
	c := dialRaw(t, targ.tr.Addr())
	c.Write(specHello(1, make([]byte, 16)))
	ch, err := readChallenge(c)
	if err != nil {
		t.Fatal(err)
	}
	if ch.status != 2 {
		t.Fatalf("plain hello to an AutoTLS target: challenge status %d, want 2", ch.status)
	}
	expectEOF(t, c, "after TLS required")

	init := newSide(t, Config{})
	d := targ.desc("", remote)
	d.Endpoints[Name], _, _ = strings.Cut(d.Endpoints[Name], "?")
	if _, err := init.tr.Open(context.Background(), d); !errors.Is(err, ErrTLSRequired) {
		t.Fatalf("Open of the endpoint less its pin: %v, want ErrTLSRequired", err)
	}
}

// tamperProxy relays connections to a target and edits what the initiator
// sends on the way, as an attacker on the path can. Each connection gets
// its own editor from edit; flipped counts the bytes changed.
type tamperProxy struct {
	ln      net.Listener
	target  string
	edit    func() func(b []byte) int // returns how many bytes of b it changed
	flipped atomic.Int64
	// cut, when set, is asked for each connection: true makes the proxy
	// pass the hello and the challenge, take the proof, and close both
	// sides before the target's accept reaches the initiator.
	cut   func() bool
	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

func newTamperProxy(t *testing.T, target string, edit func() func([]byte) int, cut func() bool) *tamperProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tamperProxy{ln: ln, target: target, edit: edit, cut: cut}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *tamperProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		if p.cut != nil && p.cut() {
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				defer c.Close()
				defer s.Close()
				var hello [24 + 32]byte
				var ch [32]byte
				if _, err := io.ReadFull(c, hello[:24]); err != nil {
					return
				}
				s.Write(hello[:24])
				if _, err := io.ReadFull(s, ch[:]); err != nil {
					return
				}
				c.Write(ch[:])
				io.ReadFull(c, hello[24:]) // the proof: kept from the target
			}()
			continue
		}
		p.wg.Add(2)
		go func() { // target -> initiator, as it is
			defer p.wg.Done()
			io.Copy(c, s)
			c.Close()
		}()
		go func() { // initiator -> target, edited
			defer p.wg.Done()
			defer s.Close()
			edit := func([]byte) int { return 0 }
			if p.edit != nil {
				edit = p.edit()
			}
			buf := make([]byte, 32<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					p.flipped.Add(int64(edit(buf[:n])))
					if _, err := s.Write(buf[:n]); err != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}
}

func (p *tamperProxy) addr() string { return p.ln.Addr().String() }

// flipWritePayloads edits a plain connection's stream as PROTOCOL.md lays
// it out: past the hello (24 bytes) and the proof (32), it follows the
// request frames and inverts byte flipAt of every WRITE payload.
func flipWritePayloads() func([]byte) int {
	var (
		skip    = 24 + 32 // the hello and the proof
		hdr     [32]byte
		got     int // bytes of the header so far
		payload int // WRITE or NOTIFY payload bytes still to come
		off     int // position in the current payload
		write   bool
	)
	return func(b []byte) int {
		flips := 0
		for len(b) > 0 {
			switch {
			case skip > 0:
				n := min(skip, len(b))
				skip -= n
				b = b[n:]
			case payload > 0:
				n := min(payload, len(b))
				if write && flipAt >= off && flipAt < off+n {
					b[flipAt-off] ^= 0xff
					flips++
				}
				payload -= n
				off += n
				b = b[n:]
			default:
				n := copy(hdr[got:], b)
				got += n
				b = b[n:]
				if got == len(hdr) {
					got, off = 0, 0
					if op := hdr[0]; op == 2 || op == 3 {
						payload = int(binary.BigEndian.Uint32(hdr[12:]))
						write = op == 2
					}
				}
			}
		}
		return flips
	}
}

// flipAt is the byte of each WRITE payload that the relay inverts.
const flipAt = 1000

// flipOnce edits an opaque (TLS) stream: it inverts the byte at offset
// 4096, well after the TLS handshake and the hello, inside the first
// WRITE's payload.
func flipOnce() func([]byte) int {
	pos := 0
	return func(b []byte) int {
		defer func() { pos += len(b) }()
		if i := 4096 - pos; i >= 0 && i < len(b) {
			b[i] ^= 0xff
			return 1
		}
		return 0
	}
}

// TestRelayTampering: a relay on the path inverts a byte of each WRITE
// payload the initiator sends. Over the plain transport the WRITE
// completes and the target's memory holds the changed byte: the hello
// authenticates the peers, not the frames after it (PROTOCOL.md,
// Security). With AutoTLS the changed record fails TLS's authentication:
// the WRITE fails and the changed byte reaches no memory.
func TestRelayTampering(t *testing.T) {
	const n = 64 << 10
	t.Run("plain: undetected", func(t *testing.T) {
		targ := newSide(t, Config{})
		remote := targ.register(t, targ.alloc(t, n, 0), true)
		px := newTamperProxy(t, targ.tr.Addr(), flipWritePayloads, nil)
		init := newSide(t, Config{Rails: 1})
		ep, err := init.tr.Open(context.Background(), targ.desc(px.addr(), remote))
		if err != nil {
			t.Fatal(err)
		}
		defer ep.Close()
		src := init.alloc(t, n, 0)
		testpattern.Fill(src, 12)
		comp := make(chanCompleter, 1)
		if k, err := ep.Post(comp, []transport.Slice{localSlice(transport.Write, src, remote.addr, 1)}); k != 1 || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		if err := comp.await(t, 1)[1]; err != nil {
			t.Fatalf("WRITE through the tampering relay: %v; the plain transport was expected to let it through", err)
		}
		if px.flipped.Load() != 1 {
			t.Fatalf("the relay changed %d bytes, want 1", px.flipped.Load())
		}
		want := bytes.Clone(src)
		want[flipAt] ^= 0xff
		if i := testpattern.FirstDiff(remote.mem, want); i >= 0 {
			t.Fatalf("the target's memory differs from the tampered payload at %d", i)
		}
		t.Logf("plain: the WRITE completed OK and the target holds %#x at %d where %#x was sent", remote.mem[flipAt], flipAt, src[flipAt])
	})
	t.Run("AutoTLS: refused", func(t *testing.T) {
		targ := newSide(t, Config{AutoTLS: true})
		remote := targ.register(t, targ.alloc(t, n, 0), true)
		old := bytes.Clone(remote.mem)
		px := newTamperProxy(t, targ.tr.Addr(), flipOnce, nil)
		init := newSide(t, Config{AutoTLS: true, Rails: 1})
		ep, err := init.tr.Open(context.Background(), targ.desc(px.addr(), remote))
		if err != nil {
			t.Fatal(err)
		}
		defer ep.Close()
		src := init.alloc(t, n, 0)
		testpattern.Fill(src, 12)
		comp := make(chanCompleter, 1)
		if k, err := ep.Post(comp, []transport.Slice{localSlice(transport.Write, src, remote.addr, 1)}); k != 1 || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		err = comp.await(t, 1)[1]
		if err == nil {
			t.Fatal("WRITE through a relay that changed a TLS record completed")
		}
		if !errors.Is(err, transport.ErrPeer) {
			t.Errorf("WRITE through the tampering relay: %v, want ErrPeer", err)
		}
		if px.flipped.Load() == 0 {
			t.Fatal("the relay changed nothing: the test proves nothing")
		}
		// Once the target's goroutines have ended (their writes are then
		// visible), each byte is the old one or the one sent, never a
		// changed one.
		ep.Close()
		targ.waitServed(t)
		for i := range remote.mem {
			if remote.mem[i] != old[i] && remote.mem[i] != src[i] {
				t.Fatalf("the target's byte %d is %#x: neither the old %#x nor the %#x sent", i, remote.mem[i], old[i], src[i])
			}
		}
		t.Logf("AutoTLS: the WRITE failed: %v", err)
	})
}

// TestAutoTLSRefusesPinless: an AutoTLS initiator does not talk plain to a
// peer whose endpoint pins nothing, so a replayed older descriptor of a
// target (from before it ran AutoTLS) cannot strip TLS; and a republished
// descriptor without the pin does not move an open endpoint to it.
func TestAutoTLSRefusesPinless(t *testing.T) {
	plain := newSide(t, Config{})
	remote := plain.register(t, plain.alloc(t, 4096, 1), true)
	init := newSide(t, Config{AutoTLS: true, Key: plain.k})
	_, err := init.tr.Open(context.Background(), plain.desc(plain.tr.Addr(), remote))
	if !errors.Is(err, ErrNoPin) || !errors.Is(err, ErrPinMismatch) {
		t.Fatalf("Open of a pinless endpoint from an AutoTLS transport: %v, want ErrNoPin", err)
	}
}
