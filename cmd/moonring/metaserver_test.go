package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// startMetaServer runs `moonring metadata-server` through run in a
// goroutine and returns its URL (loopback, whatever address it bound) and a
// function that stops it and returns run's error.
func startMetaServer(t *testing.T, args ...string) (string, func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	saved := metaServerCtx
	metaServerCtx = ctx
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		err := run(append([]string{"metadata-server"}, args...), pw)
		pw.Close()
		done <- err
	}()
	stop := func() error {
		cancel()
		select {
		case err := <-done:
			metaServerCtx = saved
			return err
		case <-time.After(30 * time.Second):
			t.Fatal("metadata-server did not stop within 30s of its context's end")
		}
		return nil
	}
	line, err := bufio.NewReader(pr).ReadString('\n')
	go io.Copy(io.Discard, pr) // anything more must not block the server
	if err != nil {
		t.Fatalf("metadata-server printed %q, then: %v (run: %v)", line, err, stop())
	}
	rest, ok := strings.CutPrefix(strings.TrimSpace(line), "metadata-server listening on ")
	scheme, addr, ok2 := strings.Cut(rest, "://")
	if !ok || !ok2 || (scheme != "http" && scheme != "https") {
		stop()
		t.Fatalf("metadata-server printed %q", line)
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		stop()
		t.Fatalf("address %q: %v", addr, err)
	}
	return scheme + "://127.0.0.1:" + port, stop
}

func TestMetadataServer(t *testing.T) {
	dir := t.TempDir()
	url, stop := startMetaServer(t, "--listen", ":0", "--dir", dir)
	h, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url})
	if err != nil {
		stop()
		t.Fatal(err)
	}
	ctx := t.Context()
	d := &segtable.SegmentDesc{
		Version:   segtable.DescVersion,
		Name:      "engine-a",
		Epoch:     42,
		Endpoints: map[string]string{"tcp": "10.0.0.1:7001"},
		Buffers:   []segtable.BufferDesc{{Addr: 0x1000, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "k"}}},
	}
	err = h.Put(ctx, d)
	var got *segtable.SegmentDesc
	if err == nil {
		got, err = h.Get(ctx, "engine-a")
	}
	h.Close()
	if serr := stop(); serr != nil {
		t.Fatalf("metadata-server: %v", serr)
	}
	if err != nil || got.Epoch != 42 || got.Endpoints["tcp"] != "10.0.0.1:7001" {
		t.Fatalf("Put and Get through metadata-server: %+v, %v", got, err)
	}
	if kept, _ := filepath.Glob(filepath.Join(dir, "seg-*.json")); len(kept) != 1 {
		t.Fatalf("files kept: %v, want one", kept)
	}

	// A restart on the same directory serves the descriptor.
	url, stop = startMetaServer(t, "--listen", "127.0.0.1:0", "--dir", dir)
	defer stop()
	h2, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	defer h2.Close()
	if got, err := h2.Get(ctx, "engine-a"); err != nil || got.Epoch != 42 {
		t.Fatalf("after a restart: %+v, %v", got, err)
	}
	if _, err := h2.Get(ctx, "engine-b"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("Get of a name never put: %v", err)
	}
}

func TestMetadataServerBadInput(t *testing.T) {
	metaNoKeyEnv(t)
	openKey := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(openKey, []byte("k\n"), 0o644); err != nil { // others may read it
		t.Fatal(err)
	}
	corrupt := t.TempDir()
	if err := os.WriteFile(filepath.Join(corrupt, "seg-0.json"), []byte("{"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"--bogus"},
		{"--listen"},
		{"--listen", "nowhere"},
		{"--listen", "127.0.0.1:0", "extra"},
		{"--listen", "127.0.0.1:0", "--max-ttl", "1ms"},
		{"--listen", "127.0.0.1:0", "--dir", corrupt},
		{"--listen", "127.0.0.1:0", "--tls-cert", "x.pem"},
		{"--listen", "127.0.0.1:0", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"},
		{"--listen", "127.0.0.1:0", "--max-descriptor", "big"},
		{"--listen", "127.0.0.1:0", "--max-bytes", "0"},
		{"--listen", "127.0.0.1:0", "--max-names", "0"},
		{"--listen", "127.0.0.1:0", "--max-conns", "-1"},
		{"--listen", "127.0.0.1:0", "--max-descriptor", "2M", "--max-bytes", "1M"},
		{"--listen", "127.0.0.1:0", "--key-file", "/nonexistent/key"},
		{"--listen", "127.0.0.1:0", "--key-file", openKey},
	} {
		var out bytes.Buffer
		err := run(append([]string{"metadata-server"}, args...), &out)
		if err == nil {
			t.Errorf("metadata-server %q: no error", args)
			continue
		}
		if strings.Contains(err.Error(), "\n") {
			t.Errorf("metadata-server %q: error of more than one line: %q", args, err)
		}
		if out.Len() != 0 {
			t.Errorf("metadata-server %q printed %q", args, out.String())
		}
	}
	var out bytes.Buffer
	if err := run([]string{"metadata-server", "-h"}, &out); err != nil || !strings.Contains(out.String(), "-listen") {
		t.Fatalf("metadata-server -h: %v, printed %q", err, out.String())
	}
}

// metaNoKeyEnv unsets MOONRING_KEY for the test.
func metaNoKeyEnv(t *testing.T) {
	t.Setenv("MOONRING_KEY", "") // restores it after the test
	os.Unsetenv("MOONRING_KEY")
}

// metaKeyFile writes key to a file of mode 0600 and returns its name.
func metaKeyFile(t *testing.T, key string) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(f, []byte(key+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return f
}

// A metadata-server given the key (a file or MOONRING_KEY) denies stores
// without it and serves those with it; its limits come from flags.
func TestMetadataServerKey(t *testing.T) {
	metaNoKeyEnv(t)
	ctx := t.Context()
	for _, how := range []string{"file", "env"} {
		args := []string{"--listen", "127.0.0.1:0", "--max-names", "1", "--max-descriptor", "2K"}
		if how == "file" {
			args = append(args, "--key-file", metaKeyFile(t, "secret"))
		} else {
			t.Setenv("MOONRING_KEY", "secret")
		}
		url, stop := startMetaServer(t, args...)
		var errs []error
		for _, key := range []string{"", "other", "secret"} {
			hs, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url, Key: []byte(key)})
			if err != nil {
				t.Fatal(err)
			}
			var h metadata.Store = hs
			if key != "" { // as an engine with the key: it signs (a server with the key keeps only signed descriptors)
				h, _ = metadata.NewSigned(hs, []byte(key), nil)
			}
			errs = append(errs, h.Put(ctx, metaDesc("a", 1)))
			if key == "secret" {
				big := metaDesc("b", 1)
				big.Endpoints["pad"] = strings.Repeat("p", 4<<10)
				errs = append(errs, h.Put(ctx, big), h.Put(ctx, metaDesc("c", 1)))
			}
			h.Close()
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
		os.Unsetenv("MOONRING_KEY")
		if !errors.Is(errs[0], metadata.ErrDenied) || !errors.Is(errs[1], metadata.ErrDenied) || errs[2] != nil {
			t.Fatalf("%s: Puts without the key, with another and with it: %v", how, errs[:3])
		}
		if !errors.Is(errs[3], segtable.ErrBadDesc) || !errors.Is(errs[4], metadata.ErrQuota) {
			t.Fatalf("%s: Puts past --max-descriptor and --max-names: %v", how, errs[3:])
		}
	}
}

// metaDesc returns a small valid descriptor.
func metaDesc(name string, epoch uint64) *segtable.SegmentDesc {
	return &segtable.SegmentDesc{
		Version:   segtable.DescVersion,
		Name:      name,
		Epoch:     epoch,
		Endpoints: map[string]string{"tcp": "10.0.0.1:7001"},
	}
}

// With --tls-cert and --tls-key the server speaks https, and a store that
// trusts its certificate publishes through it.
func TestMetadataServerTLS(t *testing.T) {
	metaNoKeyEnv(t)
	dir := t.TempDir()
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "metadata-server"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &priv.PublicKey, priv)
	if err != nil {
		t.Fatal(err)
	}
	pk, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pk}), 0o600)
	url, stop := startMetaServer(t, "--listen", "127.0.0.1:0", "--tls-cert", certFile, "--tls-key", keyFile, "--key-file", metaKeyFile(t, "secret"))
	defer stop()
	if !strings.HasPrefix(url, "https://") {
		t.Fatalf("URL %q", url)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	hs, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url, Key: []byte("secret"), TLS: &tls.Config{RootCAs: pool}})
	if err != nil {
		t.Fatal(err)
	}
	h, _ := metadata.NewSigned(hs, []byte("secret"), nil) // as an engine with the key
	defer h.Close()
	if err := h.Put(t.Context(), metaDesc("a", 1)); err != nil {
		t.Fatal(err)
	}
	if d, err := h.Get(t.Context(), "a"); err != nil || d.Epoch != 1 {
		t.Fatalf("Get over https: %+v, %v", d, err)
	}
	// A store that does not trust the certificate gets nowhere.
	u, err := metadata.NewHTTP(metadata.HTTPConfig{URL: url})
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	if _, err := u.Get(t.Context(), "a"); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Get without trusting the certificate: %v", err)
	}
}
