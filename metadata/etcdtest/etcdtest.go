// Package etcdtest runs a single-member etcd server for the tests of the
// etcd metadata store ([github.com/moonring/moonring/metadata/etcd.Store]): a
// real etcd process on loopback, in a test's temporary directory, that a
// test can kill and restart.
//
// It uses the etcd binary on PATH or /usr/bin/etcd (Debian's etcd-server).
// When there is none it runs scripts/ensure-deps.sh once, which installs
// etcd-server when it runs as root with apt-get; when etcd is still
// missing, the test is skipped, loudly ("SKIP etcd: ..." on stderr as well
// as in the test's log), unless MOONRING_CI=1, where it fails: CI must run
// the etcd tests.
//
// Each [Start] costs an etcd startup (about a second); tests share one
// server where they can, e.g. by giving each store its own key prefix.
package etcdtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"
)

// readyTimeout bounds how long Start and Restart wait for etcd to answer.
const readyTimeout = 30 * time.Second

// Server is one etcd process serving on loopback for a test. Its methods
// are safe for concurrent use, but Start and Restart must be called from
// the test's goroutine (they fail the test). It runs from Start until Kill
// or the end of the test, whose cleanup kills it; its data directory is
// the test's and goes with it.
type Server struct {
	t      testing.TB
	bin    string
	dir    string // the test's temporary directory: data, etcd.log
	data   string
	host   string // where etcd listens
	client string // "http://host:port"
	peer   string

	mu     sync.Mutex
	proc   *os.Process   // nil when none runs
	exited chan struct{} // closed when proc has exited
}

// Start starts etcd on free loopback ports in a temporary directory of t,
// waits until it answers, and kills it when t ends. It skips t (or fails
// it, with MOONRING_CI=1) when there is no etcd binary; see the package
// doc.
func Start(t testing.TB) *Server {
	t.Helper()
	return StartOn(t, "127.0.0.1")
}

// StartOn is Start with etcd's client and peer ports on host (an address
// of this machine, e.g. the root side of a test's veth pair, so that
// processes in a network namespace can reach it).
func StartOn(t testing.TB, host string) *Server {
	t.Helper()
	s := &Server{t: t, bin: Binary(t), dir: t.TempDir(), host: host}
	t.Cleanup(s.Kill)
	var err error
	// A port found free may be taken before etcd binds it: try again on
	// others, in a fresh data directory (it records the peer URL).
	for attempt := range 3 {
		s.data = filepath.Join(s.dir, fmt.Sprint("data", attempt))
		s.client, s.peer = "http://"+freeAddr(t, s.host), "http://"+freeAddr(t, s.host)
		if err = s.start(); err == nil {
			return s
		}
		t.Logf("etcdtest: %v", err)
	}
	t.Fatalf("etcdtest: etcd did not start: %v", err)
	return nil
}

// Endpoint returns etcd's client URL, "http://127.0.0.1:port". It stays
// the same across Restart.
func (s *Server) Endpoint() string { return s.client }

// Kill kills etcd (SIGKILL: no clean shutdown) and waits for it to exit.
// It does nothing when etcd is not running.
func (s *Server) Kill() {
	s.mu.Lock()
	p, exited := s.proc, s.exited
	s.proc = nil
	s.mu.Unlock()
	if p == nil {
		return
	}
	p.Kill() //nolint:errcheck // it may have exited already
	<-exited
}

// Restart kills etcd if it runs and starts it again on the same data
// directory and ports, and waits until it answers: what it had written
// survives, as after a crash.
func (s *Server) Restart() {
	s.t.Helper()
	s.Kill()
	if err := s.start(); err != nil {
		s.t.Fatalf("etcdtest: etcd did not restart: %v", err)
	}
}

// start runs etcd and waits until it answers.
func (s *Server) start() error {
	logPath := filepath.Join(s.dir, "etcd.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(s.bin,
		"--name", "etcdtest",
		"--data-dir", s.data,
		"--listen-client-urls", s.client,
		"--advertise-client-urls", s.client,
		"--listen-peer-urls", s.peer,
		"--initial-advertise-peer-urls", s.peer,
		"--initial-cluster", "etcdtest="+s.peer,
		// Short raft timings lower etcd's minimum lease TTL, 3 heartbeats
		// of an election timeout rounded up to a second, to one second,
		// and make it elect itself at once after a restart.
		"--heartbeat-interval", "25",
		"--election-timeout", "250",
	)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = sysProcAttr()
	started := make(chan error, 1)
	exited := make(chan struct{})
	go func() {
		// The parent-death signal follows the thread that started
		// etcd: hold it while etcd runs. Returning locked ends the
		// thread, after etcd has exited.
		runtime.LockOSThread()
		defer close(exited)
		defer logf.Close()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		cmd.Wait() //nolint:errcheck // a killed etcd exits with an error
	}()
	if err := <-started; err != nil {
		<-exited
		return err
	}
	s.mu.Lock()
	s.proc, s.exited = cmd.Process, exited
	s.mu.Unlock()
	if err := s.waitReady(exited); err != nil {
		s.Kill()
		return fmt.Errorf("%v; %s ends:\n%s", err, logPath, tail(logPath))
	}
	return nil
}

// waitReady polls etcd's /health until it answers healthy (it has a
// leader), etcd exits, or readyTimeout passes.
func (s *Server) waitReady(exited <-chan struct{}) error {
	hc := &http.Client{
		Timeout:   time.Second,
		Transport: &http.Transport{DisableKeepAlives: true, Proxy: nil},
	}
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	var last error
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.client+"/health", nil)
		resp, err := hc.Do(req)
		if err == nil {
			var body bytes.Buffer
			body.ReadFrom(resp.Body) //nolint:errcheck // judged by its content
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && bytes.Contains(body.Bytes(), []byte(`"health":"true"`)) {
				return nil
			}
			err = fmt.Errorf("/health answered %s: %s", resp.Status, bytes.TrimSpace(body.Bytes()))
		}
		last = err
		select {
		case <-exited:
			return errors.New("etcd exited")
		case <-ctx.Done():
			return fmt.Errorf("etcd did not answer healthy within %v: %v", readyTimeout, last)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// tail returns the end of the file at path.
func tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > 4<<10 {
		b = b[len(b)-4<<10:]
	}
	return string(b)
}

// freeAddr returns an address on host whose port was free a moment ago.
func freeAddr(t testing.TB, host string) string {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatalf("etcdtest: %v", err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

var (
	findOnce sync.Once
	findBin  string
	findLog  string // what running ensure-deps.sh said, if it ran
	findErr  error
)

// Binary returns the path of the etcd binary, running
// scripts/ensure-deps.sh once per process when there is none. When etcd
// is still missing it skips t, loudly, or fails it with MOONRING_CI=1.
// It is safe for concurrent use.
func Binary(t testing.TB) string {
	t.Helper()
	findOnce.Do(func() { findBin, findLog, findErr = find() })
	if findLog != "" {
		t.Log(findLog)
	}
	if findErr != nil {
		unavailable(t, "%v", findErr)
	}
	return findBin
}

// unavailable skips t, loudly, because etcd cannot be had here; with
// MOONRING_CI=1 it fails t instead.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("MOONRING_CI") == "1" {
		t.Fatalf("etcd: %s (MOONRING_CI=1: the etcd tests must run)", msg)
	}
	fmt.Fprintf(os.Stderr, "\n*** %s: SKIP etcd: %s ***\n\n", t.Name(), msg)
	t.Skipf("SKIP etcd: %s", msg)
}

// lookup returns the etcd binary on PATH or at /usr/bin/etcd, or "".
func lookup() string {
	if p, err := exec.LookPath("etcd"); err == nil {
		return p
	}
	if fi, err := os.Stat("/usr/bin/etcd"); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
		return "/usr/bin/etcd"
	}
	return ""
}

func find() (bin, log string, err error) {
	if bin := lookup(); bin != "" {
		return bin, "", nil
	}
	const missing = "no etcd binary (etcd on PATH or /usr/bin/etcd, from Debian's etcd-server)"
	script, err := ensureDepsScript()
	if err != nil {
		return "", "", fmt.Errorf("%s, and %v", missing, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, script).CombinedOutput()
	log = fmt.Sprintf("etcd missing: %s: %v\n%s", script, err, out)
	if bin := lookup(); bin != "" {
		return bin, log, nil
	}
	if err == nil {
		return "", log, fmt.Errorf("%s, and %s ran but did not install it", missing, script)
	}
	return "", log, fmt.Errorf("%s, and %s could not install it: %v: %s", missing, script, err, lastLine(out))
}

// ensureDepsScript finds scripts/ensure-deps.sh in the working directory
// or one above it (go test runs in the package's directory).
func ensureDepsScript() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		p := filepath.Join(dir, "scripts", "ensure-deps.sh")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			break // the module's root, without the script
		}
		up := filepath.Dir(dir)
		if up == dir {
			break
		}
		dir = up
	}
	return "", errors.New("no scripts/ensure-deps.sh to install it with")
}

func lastLine(b []byte) []byte {
	b = bytes.TrimSpace(b)
	if i := bytes.LastIndexByte(b, '\n'); i >= 0 {
		b = b[i+1:]
	}
	return b
}
