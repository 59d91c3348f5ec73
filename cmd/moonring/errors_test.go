package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring"
)

// main prints one "moonring:" prefix, not one per error it wraps.
func TestErrTextOnePrefix(t *testing.T) {
	err := fmt.Errorf("bench: step 1 of 2 (write 4K) failed: %w", moonring.ErrTransport)
	if got, want := errText(err), "moonring: bench: step 1 of 2 (write 4K) failed: transport failed"; got != want {
		t.Errorf("errText = %q; want %q", got, want)
	}
	// As the process prints it: a bench whose target holds another key.
	noKey(t)
	lines, stop := startServe(t, 1, "--listen", "127.0.0.1:0", "--buffer-size", "4M", "--key-file", writeKey(t, "key A", 0o600))
	defer stop()
	self, _ := os.Executable()
	cmd := exec.Command(self, "bench", "--segment", segmentOf(t, lines[0]), "--block-size", "4K", "--buffer-size", "4M", "--key-file", writeKey(t, "key B", 0o600))
	msg, _ := cmd.CombinedOutput()
	t.Logf("bench: %s", msg)
	if n := strings.Count(string(msg), "moonring:"); n != 1 {
		t.Errorf("bench printed %q: %d moonring: prefixes; want one", msg, n)
	}
}

// A key that does not match says which side refused what, and what to
// check on both sides; no key at all says that this side has none.
func TestBenchWrongKey(t *testing.T) {
	noKey(t)
	lines, stop := startServe(t, 1, "--listen", "127.0.0.1:0", "--buffer-size", "4M", "--key-file", writeKey(t, "key A", 0o600))
	defer stop()
	name := segmentOf(t, lines[0])
	err := run([]string{"bench", "--segment", name, "--block-size", "4K", "--buffer-size", "4M", "--key-file", writeKey(t, "key B", 0o600)}, io.Discard)
	if err == nil {
		t.Fatal("another key: no error")
	}
	for _, want := range []string{"this process refused the descriptor of segment " + name, "another key", "--key-file", keyEnv, "both sides"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("err %q lacks %q", err, want)
		}
	}
	if !errors.Is(err, moonring.ErrDenied) {
		t.Errorf("err %v is not ErrDenied", err)
	}
	err = run([]string{"bench", "--segment", name, "--block-size", "4K", "--buffer-size", "4M"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "the target "+name+" needs the segment key and this process has none") || !strings.Contains(err.Error(), keyEnv) {
		t.Errorf("no key: err %v; want it to say this process has none and how to give it", err)
	}
}

// A target that dies mid-sweep: the error says the connection to it was
// lost and that its process exited (it said "transport failed").
func TestBenchTargetLost(t *testing.T) {
	started := make(chan *exec.Cmd, 1)
	targetStarted = func(cmd *exec.Cmd, key []byte) { started <- cmd }
	defer func() { targetStarted = nil }()
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run([]string{"bench", "--operation", "write", "--block-size", "4K,64K", "--buffer-size", "4M", "--duration", "3s"}, pw)
		pw.Close()
	}()
	cmd := <-started
	r := bufio.NewReader(pr)
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("bench ended before a row: %v", <-done)
		}
		if strings.HasPrefix(line, "tcp ") {
			break
		}
	}
	time.Sleep(300 * time.Millisecond)
	pid := cmd.Process.Pid
	cmd.Process.Kill()
	go io.Copy(io.Discard, r)
	err := <-done
	if err == nil {
		t.Fatal("no error after the target was killed")
	}
	for _, want := range []string{"step 2 of 2", fmt.Sprintf("the target process (pid %d) exited", pid), "the connection to it was lost"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("err %q lacks %q", err, want)
		}
	}
}

// serve logs the hellos it refuses (the TCP transport logs them at info,
// which serve's warning level hid).
func TestServeLogsRefusedHello(t *testing.T) {
	t.Setenv(keyEnv, "a key of the deployment")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tcpAddr := ln.Addr().String()
	ln.Close()
	var warn syncBuffer
	stderr = &warn
	defer func() { stderr = os.Stderr }()
	_, stop := startServe(t, 1, "--listen", "127.0.0.1:0", "--tcp-listen", tcpAddr, "--buffer-size", "1M", "--no-shm")
	defer stop()
	for range 3 {
		c, err := net.Dial("tcp", tcpAddr)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(strings.Repeat("not a hello ", 16)))
		c.(*net.TCPConn).CloseWrite()
		io.Copy(io.Discard, c)
		c.Close()
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(warn.String(), "connection refused") {
		if time.Now().After(deadline) {
			t.Fatalf("serve's stderr %q; want the refused hello logged", warn.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("serve logged:\n%s", warn.String())
	if n := strings.Count(warn.String(), "connection refused"); n > 1 {
		t.Errorf("%d lines for 3 refusals within a second; want them rate-limited:\n%s", n, warn.String())
	}
	if strings.Contains(warn.String(), "rail connected") {
		t.Errorf("connection events logged too:\n%s", warn.String())
	}
}
