//go:build linux

package etcd_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/metadata/etcdtest"
)

// startTLSEtcd runs etcd serving clients over TLS with the certificates of
// pki, requiring client certificates, until the test ends, and returns its
// host:port.
func startTLSEtcd(t *testing.T, pki *testPKI) string {
	t.Helper()
	bin := etcdtest.Binary(t)
	free := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().String()
	}
	client, peer := free(), free()
	dir := t.TempDir()
	logf, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin,
		"--name", "tls", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", "https://"+client, "--advertise-client-urls", "https://"+client,
		"--listen-peer-urls", "http://"+peer, "--initial-advertise-peer-urls", "http://"+peer,
		"--initial-cluster", "tls=http://"+peer,
		"--cert-file", pki.file("server.pem"), "--key-file", pki.file("server-key.pem"),
		"--trusted-ca-file", pki.file("ca.pem"), "--client-cert-auth",
		"--heartbeat-interval", "25", "--election-timeout", "250",
	)
	cmd.Stdout, cmd.Stderr = logf, logf
	// As etcdtest does: the kernel kills etcd when the thread that started
	// it exits, so a test binary that dies leaves none behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started, exited := make(chan error, 1), make(chan struct{})
	go func() {
		runtime.LockOSThread()
		defer close(exited)
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		cmd.Wait() //nolint:errcheck // killed
	}()
	if err := <-started; err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
		logf.Close()
	})
	return client
}

// rootClient returns a plain client of the TLS etcd at addr with the
// client certificate, once etcd answers.
func rootClient(t *testing.T, pki *testPKI, addr string) *clientv3.Client {
	t.Helper()
	pair, err := tls.LoadX509KeyPair(pki.file("client.pem"), pki.file("client-key.pem"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(pki.caCert)
	c, err := clientv3.New(clientv3.Config{
		Endpoints: []string{"https://" + addr}, DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
		TLS: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{pair}},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	waitFor(t, "etcd answers over TLS", func() bool {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		_, err := c.Get(ctx, "x")
		return err == nil
	})
	return c
}

// An Etcd store from ParseURL reaches an etcd that requires TLS client
// certificates, and then one that also requires a password; without the
// certificate, or with a wrong password, it does not.
func TestEtcdTLS(t *testing.T) {
	pki := newPKI(t)
	addr := startTLSEtcd(t, pki)
	root := rootClient(t, pki, addr)
	tlsURL := fmt.Sprintf("etcd://%s?cacert=%s&cert=%s&key=%s", addr, pki.file("ca.pem"), pki.file("client.pem"), pki.file("client-key.pem"))
	timeout := 5 * time.Second
	open := func(u string) (*etcd.Store, error) {
		cfg, err := etcd.ParseURL(u)
		if err != nil {
			t.Fatal(err)
		}
		cfg.Prefix, cfg.DialTimeout = etcdPrefix(), timeout
		return etcd.New(cfg)
	}
	e, err := open(tlsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx := t.Context()
	if err := e.Put(ctx, testDesc("a", 1, "tls")); err != nil {
		t.Fatalf("Put over TLS: %v", err)
	}
	if d, err := e.Get(ctx, "a"); err != nil || d.Endpoints["tcp"] != "tls" {
		t.Fatalf("Get over TLS: %+v, %v", d, err)
	}
	timeout = 300 * time.Millisecond // they fail
	for what, u := range map[string]string{
		"no client certificate": fmt.Sprintf("etcd://%s?cacert=%s", addr, pki.file("ca.pem")),
		"no TLS":                "etcd://" + addr,
		"system roots":          "etcd://" + addr + "?tls=1",
	} {
		o, err := open(u)
		if err != nil {
			t.Fatalf("%s: New: %v", what, err)
		}
		_, err = o.Get(ctx, "a")
		o.Close()
		if !errors.Is(err, metadata.ErrUnreachable) {
			t.Fatalf("%s: Get: %v, want ErrUnreachable", what, err)
		}
	}

	timeout = 5 * time.Second

	// etcd's auth on top: a user with a password.
	if _, err := root.UserAdd(ctx, "root", "rootpw"); err != nil {
		t.Fatal(err)
	}
	if _, err := root.UserGrantRole(ctx, "root", "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := root.AuthEnable(ctx); err != nil {
		t.Fatal(err)
	}
	good := metaPasswordFile(t, "rootpw")
	bad := metaPasswordFile(t, "wrong")
	if o, err := open(tlsURL + "&user=root&password-file=" + bad); !errors.Is(err, metadata.ErrDenied) {
		if o != nil {
			o.Close()
		}
		t.Fatalf("New with a wrong password: %v, want ErrDenied", err)
	}
	o, err := open(tlsURL + "&user=root&password-file=" + good)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if err := o.Put(ctx, testDesc("b", 1, "auth")); err != nil {
		t.Fatalf("Put with a password: %v", err)
	}
	if d, err := o.Get(ctx, "b"); err != nil || d.Endpoints["tcp"] != "auth" {
		t.Fatalf("Get with a password: %+v, %v", d, err)
	}
}

func metaPasswordFile(t *testing.T, pw string) string {
	t.Helper()
	return writeFile(t, pw+"\n", 0o600)
}
