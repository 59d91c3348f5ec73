package tcp

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"log/slog"
	"math/big"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// selfSigned makes a self-signed certificate for 127.0.0.1 and a pool that
// trusts it.
func selfSigned(t *testing.T, name string, usage x509.ExtKeyUsage) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{usage},
		BasicConstraintsValid: true,
		IsCA:                  true,
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: cert}, pool
}

// roundTrip writes n bytes to the target's buffer over ep and reads them
// back, checking the target's memory in between.
func roundTrip(t *testing.T, ep transport.Endpoint, init *side, remote testBuf, n int) {
	t.Helper()
	src := init.alloc(t, n, 0)
	dst := init.alloc(t, n, 0)
	testpattern.Fill(src, uint64(n))
	comp := make(chanCompleter, 2)
	if k, err := ep.Post(comp, []transport.Slice{localSlice(transport.Write, src, remote.addr, 1)}); k != 1 || err != nil {
		t.Fatalf("Post WRITE: %d, %v", k, err)
	}
	if err := comp.await(t, 1)[1]; err != nil {
		t.Fatalf("WRITE: %v", err)
	}
	if i := testpattern.FirstDiff(remote.mem[:n], src); i >= 0 {
		t.Fatalf("target memory differs at %d after the WRITE completed", i)
	}
	if k, err := ep.Post(comp, []transport.Slice{localSlice(transport.Read, dst, remote.addr, 2)}); k != 1 || err != nil {
		t.Fatalf("Post READ: %d, %v", k, err)
	}
	if err := comp.await(t, 1)[2]; err != nil {
		t.Fatalf("READ: %v", err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatalf("READ brought other bytes (first difference at %d)", testpattern.FirstDiff(dst, src))
	}
}

func open(t *testing.T, init *side, targ *side, bufs ...testBuf) transport.Endpoint {
	t.Helper()
	ep, err := init.tr.Open(context.Background(), targ.desc("", bufs...))
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { ep.Close() })
	return ep
}

// TestTLSSamePort: a target with TLS serves TLS and plain connections on
// one port; an initiator that trusts the target's self-signed certificate
// (and names no ServerName: it is the host it dials) moves data over TLS.
func TestTLSSamePort(t *testing.T) {
	cert, pool := selfSigned(t, "target", x509.ExtKeyUsageServerAuth)
	targ := newSide(t, Config{TLS: &tls.Config{Certificates: []tls.Certificate{cert}}})
	remote := targ.register(t, targ.alloc(t, 64<<10, 0), true)

	init := newSide(t, Config{ClientTLS: &tls.Config{RootCAs: pool}})
	roundTrip(t, open(t, init, targ, remote), init, remote, 64<<10)

	// A plain hello on the same port is served too.
	rc := targ.raw(t)
	testpattern.Fill(remote.mem[:16], 99)
	st, got := rc.do(specReq{op: specRead, id: 1, buffer: remote.id, length: 16, key: remote.key, addr: remote.addr}, nil)
	if st != 0 || !bytes.Equal(got, remote.mem[:16]) {
		t.Fatalf("plain READ on the TLS port: status %d", st)
	}

	// An initiator that does not trust the certificate is refused.
	_, other := selfSigned(t, "someone else", x509.ExtKeyUsageServerAuth)
	stranger := newSide(t, Config{ClientTLS: &tls.Config{RootCAs: other}})
	var unknown x509.UnknownAuthorityError
	if _, err := stranger.tr.Open(context.Background(), targ.desc("", remote)); !errors.As(err, &unknown) {
		t.Fatalf("Open trusting another CA: %v, want x509.UnknownAuthorityError", err)
	}
}

// TestTLSRequired: a target that requires TLS answers a plain hello with
// challenge status 2 and closes; Open without ClientTLS fails with
// ErrTLSRequired, with it succeeds.
func TestTLSRequired(t *testing.T) {
	cert, pool := selfSigned(t, "target", x509.ExtKeyUsageServerAuth)
	targ := newSide(t, Config{TLS: &tls.Config{Certificates: []tls.Certificate{cert}}, RequireTLS: true})
	remote := targ.register(t, targ.alloc(t, page, 0), true)

	c := dialRaw(t, targ.tr.Addr())
	c.Write(specHello(1, make([]byte, 16)))
	ch, err := readChallenge(c)
	if err != nil {
		t.Fatal(err)
	}
	if ch.status != 2 {
		t.Errorf("plain hello to a TLS-only target: challenge status %d, want 2", ch.status)
	}
	expectEOF(t, c, "after TLS required")

	plain := newSide(t, Config{})
	if _, err := plain.tr.Open(context.Background(), targ.desc("", remote)); !errors.Is(err, ErrTLSRequired) {
		t.Fatalf("Open without TLS: %v, want ErrTLSRequired", err)
	}
	init := newSide(t, Config{ClientTLS: &tls.Config{RootCAs: pool}})
	roundTrip(t, open(t, init, targ, remote), init, remote, page)
}

// logBuffer collects a Logger's output.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestMutualTLS: a target that requires and verifies client certificates
// refuses an initiator without one and serves one with a trusted one.
func TestMutualTLS(t *testing.T) {
	serverCert, serverPool := selfSigned(t, "target", x509.ExtKeyUsageServerAuth)
	clientCert, clientPool := selfSigned(t, "initiator", x509.ExtKeyUsageClientAuth)
	var log logBuffer
	targ := newSide(t, Config{
		TLS: &tls.Config{
			Certificates: []tls.Certificate{serverCert},
			ClientAuth:   tls.RequireAndVerifyClientCert,
			ClientCAs:    clientPool,
		},
		RequireTLS: true,
		Logger:     slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug})),
	})
	remote := targ.register(t, targ.alloc(t, page, 0), true)

	anon := newSide(t, Config{ClientTLS: &tls.Config{RootCAs: serverPool}})
	if ep, err := anon.tr.Open(context.Background(), targ.desc("", remote)); err == nil {
		ep.Close()
		t.Fatal("Open without a client certificate succeeded")
	} else {
		t.Logf("Open without a client certificate: %v", err)
	}
	// The target's side of the refusal: it says why (it logs after it has
	// closed the connection).
	waitFor(t, "the target to log a certificate refusal", func() bool { return strings.Contains(log.String(), "certificate") })

	init := newSide(t, Config{ClientTLS: &tls.Config{RootCAs: serverPool, Certificates: []tls.Certificate{clientCert}}})
	roundTrip(t, open(t, init, targ, remote), init, remote, page)
}
