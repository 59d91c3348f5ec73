package main

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// noKey clears MOONRING_KEY for the test (restored after it).
func noKey(t *testing.T) {
	t.Helper()
	t.Setenv(keyEnv, "")
	os.Unsetenv(keyEnv)
}

// writeKey writes a key file of the given mode and returns its name.
func writeKey(t *testing.T, content string, mode os.FileMode) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(f, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(f, mode); err != nil { // past the umask
		t.Fatal(err)
	}
	return f
}

func TestLoadKey(t *testing.T) {
	noKey(t)
	if k, err := loadKey(""); k != nil || err != nil {
		t.Errorf("no file, no %s: %q, %v; want no key and no error", keyEnv, k, err)
	}
	if k, err := loadKey(writeKey(t, "s3cret\n", 0o600)); err != nil || string(k) != "s3cret" {
		t.Errorf("a file of mode 0600: %q, %v; want the key without its newline", k, err)
	}
	if k, err := loadKey(writeKey(t, "s3cret\r\n", 0o400)); err != nil || string(k) != "s3cret" {
		t.Errorf("a file of mode 0400 ending in CRLF: %q, %v", k, err)
	}
	if k, err := loadKey(writeKey(t, "s3cret \n\n", 0o600)); err != nil || string(k) != "s3cret \n" {
		t.Errorf("only one newline is trimmed: %q, %v", k, err)
	}
	for _, c := range []struct {
		what    string
		content string
		mode    os.FileMode
	}{
		{"readable by others", "s3cret\n", 0o644},
		{"readable by the group", "s3cret\n", 0o640},
		{"writable by others", "s3cret\n", 0o602},
		{"empty", "", 0o600},
		{"a newline only", "\n", 0o600},
		{"too long", strings.Repeat("k", maxKeyFile+1), 0o600},
	} {
		if k, err := loadKey(writeKey(t, c.content, c.mode)); !errors.Is(err, errBadKey) {
			t.Errorf("a key file %s: %q, %v; want errBadKey", c.what, k, err)
		}
	}
	if _, err := loadKey(t.TempDir()); !errors.Is(err, errBadKey) {
		t.Errorf("a directory as the key file: %v; want errBadKey", err)
	}
	if _, err := loadKey(filepath.Join(t.TempDir(), "none")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a missing key file: %v; want ErrNotExist", err)
	}
	t.Setenv(keyEnv, "from the environment")
	if k, err := loadKey(""); err != nil || string(k) != "from the environment" {
		t.Errorf("%s: %q, %v", keyEnv, k, err)
	}
	if _, err := loadKey(writeKey(t, "s3cret\n", 0o600)); !errors.Is(err, errBadKey) {
		t.Errorf("both a key file and %s: %v; want errBadKey", keyEnv, err)
	}
	t.Setenv(keyEnv, "")
	if _, err := loadKey(""); !errors.Is(err, errBadKey) {
		t.Errorf("%s set but empty: %v; want errBadKey", keyEnv, err)
	}
}

// Serving beyond loopback with no key is refused; --insecure serves, with
// a warning.
func TestServeOpenListenNeedsKey(t *testing.T) {
	noKey(t)
	for _, args := range [][]string{
		{"--listen", "0.0.0.0:0"},
		{"--listen", "[::]:0"},
		{"--listen", ":0"},
		{"--listen", "127.0.0.1:0", "--tcp-listen", "0.0.0.0:0"},
		{"--listen", "example.com:0"},
	} {
		err := serve(append(args, "--buffer-size", "64K"), io.Discard, nil)
		if !errors.Is(err, errNeedKey) {
			t.Errorf("serve %q without a key: %v; want errNeedKey", args, err)
		}
	}
	var warn bytes.Buffer
	stderr = &warn
	defer func() { stderr = os.Stderr }()
	stop := make(chan struct{})
	close(stop)
	var out bytes.Buffer
	if err := serve([]string{"--listen", "0.0.0.0:0", "--buffer-size", "64K", "--insecure"}, &out, stop); err != nil {
		t.Fatalf("serve --insecure: %v", err)
	}
	if !strings.HasPrefix(out.String(), "serving segment ") || !strings.Contains(warn.String(), "WARNING") {
		t.Errorf("serve --insecure: printed %q, warned %q; want it served with a warning", out.String(), warn.String())
	}
	// A key given: beyond loopback is fine.
	t.Setenv(keyEnv, "a key of the deployment")
	if err := serve([]string{"--listen", "0.0.0.0:0", "--buffer-size", "64K"}, io.Discard, stop); err != nil {
		t.Errorf("serve on 0.0.0.0 with a key: %v", err)
	}
}

// startServe runs serve in this process until the returned function is
// called, and returns the lines it printed first (n of them).
func startServe(t *testing.T, n int, args ...string) ([]string, func() error) {
	t.Helper()
	stop := make(chan struct{})
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- serve(args, pw, stop)
		pw.Close()
	}()
	r := bufio.NewReader(pr)
	var lines []string
	for range n {
		line, err := r.ReadString('\n')
		if err != nil {
			close(stop)
			t.Fatalf("serve printed %q, then %v (%v)", lines, err, <-done)
		}
		lines = append(lines, strings.TrimSuffix(line, "\n"))
	}
	go io.Copy(io.Discard, r)
	var once sync.Once
	var err error
	return lines, func() error {
		once.Do(func() { close(stop); err = <-done })
		return err
	}
}

// segmentOf returns the segment name in serve's first line.
func segmentOf(t *testing.T, line string) string {
	t.Helper()
	f := strings.Fields(line)
	if len(f) < 3 || f[0] != "serving" || f[1] != "segment" {
		t.Fatalf("serve printed %q", line)
	}
	return strings.TrimSuffix(f[2], ":")
}

// serve on loopback with no key makes one, in a file of mode 0600 that it
// names and removes at exit; a peer with that file gets in, one without a
// key or with another does not.
func TestServeGeneratedKey(t *testing.T) {
	noKey(t)
	lines, stop := startServe(t, 2, "--listen", "127.0.0.1:0", "--buffer-size", "4M")
	defer stop()
	name := segmentOf(t, lines[0])
	f := strings.Fields(lines[1])
	if len(f) < 2 || f[0] != "key:" || !strings.Contains(lines[1], "--key-file "+f[1]) {
		t.Fatalf("second line %q: want the generated key's file and how to use it", lines[1])
	}
	file := f[1]
	st, err := os.Stat(file)
	if err != nil {
		t.Fatalf("key file %s: %v", file, err)
	}
	if st.Mode().Perm() != 0o600 {
		t.Errorf("key file mode %04o; want 0600", st.Mode().Perm())
	}
	key, err := loadKey(file)
	if err != nil || len(key) != 64 {
		t.Fatalf("key %q, %v: want 32 random bytes in hex", key, err)
	}
	benchJSON(t, "--segment", name, "--key-file", file)
	// The same key through the environment.
	t.Setenv(keyEnv, string(key))
	benchJSON(t, "--segment", name)
	for _, k := range []string{"moonring bench", "another key"} { // the old built-in key among them
		t.Setenv(keyEnv, k)
		if err := run([]string{"bench", "--segment", name, "--duration", "10ms", "--block-size", "4K", "--buffer-size", "4M"}, io.Discard); err == nil {
			t.Errorf("bench with key %q reached a segment of another key", k)
		}
	}
	noKey(t)
	err = run([]string{"bench", "--segment", name, "--duration", "10ms", "--block-size", "4K", "--buffer-size", "4M"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "--key-file") {
		t.Errorf("bench with no key: %v; want a failure that names --key-file", err)
	}
	if err := stop(); err != nil {
		t.Fatalf("serve: %v", err)
	}
	if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("key file after serve stopped: %v; want it removed", err)
	}
}

// The bench's own target process gets a fresh key each run, through its
// environment, never its command line; none is built into the program.
func TestBenchPrivateKey(t *testing.T) {
	t.Setenv(keyEnv, "the user's key")
	var mu sync.Mutex
	var keys [][]byte
	targetStarted = func(cmd *exec.Cmd, key []byte) {
		mu.Lock()
		defer mu.Unlock()
		keys = append(keys, key)
		if slices.ContainsFunc(cmd.Args, func(a string) bool { return strings.Contains(a, string(key)) }) {
			t.Errorf("the key is on the target's command line %q", cmd.Args)
		}
		var env []string
		for _, v := range cmd.Env {
			if strings.HasPrefix(v, keyEnv+"=") {
				env = append(env, v)
			}
		}
		if !slices.Equal(env, []string{keyEnv + "=" + string(key)}) {
			t.Errorf("the target's environment has %q; want the run's key alone", env)
		}
	}
	defer func() { targetStarted = nil }()
	benchJSON(t)
	benchJSON(t, "--protocol", "shm")
	if len(keys) != 2 {
		t.Fatalf("%d target processes reported; want 2", len(keys))
	}
	for i, k := range keys {
		if len(k) != 64 || string(k) == "the user's key" {
			t.Errorf("run %d: key %q; want 32 fresh random bytes in hex", i, k)
		}
	}
	if bytes.Equal(keys[0], keys[1]) {
		t.Errorf("two runs used the same key %q: a built-in one", keys[0])
	}
}

// Every subcommand's -h names the key's two sources and exits cleanly.
func TestHelpNamesKey(t *testing.T) {
	for _, cmd := range []string{"serve", "bench", "info"} {
		var out bytes.Buffer
		err := run([]string{cmd, "-h"}, &out)
		if !errors.Is(err, flag.ErrHelp) {
			t.Errorf("%s -h: %v; want flag.ErrHelp (exit 0)", cmd, err)
		}
		for _, want := range []string{keyEnv, "--key-file"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("%s -h does not name %s:\n%s", cmd, want, out.String())
			}
		}
	}
	var out bytes.Buffer
	run([]string{"-h"}, &out)
	if !strings.Contains(out.String(), keyEnv) {
		t.Errorf("moonring -h does not name %s:\n%s", keyEnv, out.String())
	}
}

// capListener: connections past its cap are closed at once and counted;
// one closed gives its place back.
func TestCapListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cl := &capListener{Listener: ln, max: 2, log: slog.New(slog.DiscardHandler)}
	defer cl.Close()
	accepted := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := cl.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	var clients []net.Conn
	for range 4 {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	a := <-accepted
	<-accepted
	for deadline := time.Now().Add(30 * time.Second); cl.refused.Load() < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("refused %d of 4 connections with a cap of 2", cl.refused.Load())
		}
	}
	a.Close()
	a.Close() // a second Close gives nothing back twice
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	select {
	case <-accepted:
	case <-time.After(30 * time.Second):
		t.Fatal("no connection accepted after one closed")
	}
	if n := cl.open.Load(); n != 2 {
		t.Errorf("%d open; want 2", n)
	}
}
