package etcd_test

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
)

// testPKI is a CA and the certificates it signed, as PEM files in a
// directory: ca.pem, server.pem and server-key.pem (for 127.0.0.1),
// client.pem and client-key.pem.
type testPKI struct {
	dir    string
	caCert *x509.Certificate
}

func (p *testPKI) file(name string) string { return filepath.Join(p.dir, name) }

func newPKI(t *testing.T) *testPKI {
	t.Helper()
	p := &testPKI{dir: t.TempDir()}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ca := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "moonring test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	if p.caCert, err = x509.ParseCertificate(der); err != nil {
		t.Fatal(err)
	}
	p.write(t, "ca.pem", "CERTIFICATE", der, 0o644)
	for i, name := range []string{"server", "client"} {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(int64(i + 2)),
			Subject:      pkix.Name{CommonName: name},
			NotBefore:    time.Now().Add(-time.Hour),
			NotAfter:     time.Now().Add(24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
			IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kb, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		p.write(t, name+".pem", "CERTIFICATE", der, 0o644)
		p.write(t, name+"-key.pem", "PRIVATE KEY", kb, 0o600)
	}
	return p
}

func (p *testPKI) write(t *testing.T, name, typ string, der []byte, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(p.file(name), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), mode); err != nil {
		t.Fatal(err)
	}
}

// writeFile writes content to a new file of mode in a temporary directory
// and returns its name.
func writeFile(t *testing.T, content string, mode os.FileMode) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(f, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(f, mode); err != nil { // past the umask
		t.Fatal(err)
	}
	return f
}

func TestParseEtcdURL(t *testing.T) {
	pki := newPKI(t)
	pw := writeFile(t, "s3cret\n", 0o600)
	for _, tc := range []struct {
		url       string
		endpoints []string
		tls, cert bool
		user, pw  string
		flat      bool
	}{
		{url: "etcd://10.0.0.1:2379", endpoints: []string{"http://10.0.0.1:2379"}},
		{url: "etcd://a:1,b:2,[::1]:3", endpoints: []string{"http://a:1", "http://b:2", "http://[::1]:3"}},
		{url: "etcd://a:1?tls=1", endpoints: []string{"https://a:1"}, tls: true},
		{url: "etcd://a:1?tls=false", endpoints: []string{"http://a:1"}},
		{url: "etcd://a:1,b:2?cacert=" + pki.file("ca.pem"), endpoints: []string{"https://a:1", "https://b:2"}, tls: true},
		{url: "etcd://a:1?cacert=" + pki.file("ca.pem") + "&cert=" + pki.file("client.pem") + "&key=" + pki.file("client-key.pem"), endpoints: []string{"https://a:1"}, tls: true, cert: true},
		{url: "etcd://a:1?user=moon&password-file=" + pw, endpoints: []string{"http://a:1"}, user: "moon", pw: "s3cret"},
		{url: "etcd://a:1?layout=flat", endpoints: []string{"http://a:1"}, flat: true},
		{url: "etcd://a:1?layout=chunks&tls=1", endpoints: []string{"https://a:1"}, tls: true},
	} {
		cfg, err := etcd.ParseURL(tc.url)
		if err != nil {
			t.Errorf("ParseURL(%q): %v", tc.url, err)
			continue
		}
		if !slices.Equal(cfg.Endpoints, tc.endpoints) || (cfg.TLS != nil) != tc.tls || cfg.Username != tc.user || cfg.Password != tc.pw || cfg.FlatLayout != tc.flat {
			t.Errorf("ParseURL(%q) = %+v", tc.url, cfg)
			continue
		}
		if tc.cert && (cfg.TLS.RootCAs == nil || len(cfg.TLS.Certificates) != 1) {
			t.Errorf("ParseURL(%q): TLS without the CA or the client certificate", tc.url)
		}
	}
	open := writeFile(t, "s3cret", 0o644)
	empty := writeFile(t, "\n", 0o600)
	huge := writeFile(t, strings.Repeat("x", 5<<10), 0o600)
	for _, u := range []string{
		"",
		"http://a:1",
		"etcd://",
		"etcd://a",
		"etcd://a:0",
		"etcd://a:65536",
		"etcd://:1",
		"etcd://a:1,",
		"etcd://a:1/path",
		"etcd://u@a:1",
		"etcd://a:1?bogus=1",
		"etcd://a:1?tls=maybe",
		"etcd://a:1?layout=tree",
		"etcd://a:1?layout=flat&layout=flat",
		"etcd://a:1?tls=1&tls=1",
		"etcd://a:1?cacert=",
		"etcd://a:1?tls=0&cacert=" + pki.file("ca.pem"),
		"etcd://a:1?cacert=/nonexistent/ca.pem",
		"etcd://a:1?cacert=" + pw, // not PEM
		"etcd://a:1?cacert=" + filepath.Dir(pw),
		"etcd://a:1?cert=" + pki.file("client.pem"),
		"etcd://a:1?key=" + pki.file("client-key.pem"),
		"etcd://a:1?cert=" + pki.file("client.pem") + "&key=" + pki.file("server-key.pem"),
		"etcd://a:1?user=moon",
		"etcd://a:1?password-file=" + pw,
		"etcd://a:1?user=moon&password-file=" + open,
		"etcd://a:1?user=moon&password-file=" + empty,
		"etcd://a:1?user=moon&password-file=" + huge,
		"etcd://a:1?user=moon&password-file=/nonexistent",
		"etcd://a:1?password=s3cret&user=moon",
		"etcd://a:1?%zz",
	} {
		if cfg, err := etcd.ParseURL(u); err == nil {
			t.Errorf("ParseURL(%q) = %+v, no error", u, cfg)
		} else if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("ParseURL(%q): error %q shows the password", u, err)
		}
	}
	// The parsed configuration is one New takes; TLS with an http
	// endpoint, or half a credential, it refuses.
	cfg, err := etcd.ParseURL("etcd://127.0.0.1:1?cacert=" + pki.file("ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	e, err := etcd.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.Close()
	for _, bad := range []etcd.Config{
		{Endpoints: []string{"http://127.0.0.1:1"}, TLS: cfg.TLS},
		{Endpoints: []string{"127.0.0.1:1"}, Username: "moon"},
		{Endpoints: []string{"127.0.0.1:1"}, Password: "s3cret"},
	} {
		if e, err := etcd.New(bad); err == nil {
			e.Close()
			t.Errorf("New(%+v): no error", bad)
		}
	}
	// Credentials are checked at once: an etcd that does not answer.
	if e, err := etcd.New(etcd.Config{Endpoints: []string{"127.0.0.1:1"}, Username: "moon", Password: "s3cret", DialTimeout: 200 * time.Millisecond}); !errors.Is(err, metadata.ErrUnreachable) {
		if e != nil {
			e.Close()
		}
		t.Fatalf("New with credentials of an etcd that is down: %v, want ErrUnreachable", err)
	}
}
