package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// stalledPeer runs bench against segment in a child process, waits until
// bytes flow, then stops the child (SIGSTOP) in the middle of its
// requests: a peer that holds the buffer and answers nothing, reads
// nothing. The returned function kills it.
func stalledPeer(t *testing.T, segment string, args ...string) func() {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, append([]string{"bench", "--segment", segment, "--duration", "2m", "--buffer-size", "128M"}, args...)...)
	var progress syncBuffer
	cmd.Stderr = &progress
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	kill := func() { cmd.Process.Kill(); cmd.Wait() }
	for deadline := time.Now().Add(time.Minute); ; {
		// The progress line: "... N MiB, X GB/s so far", every half
		// second: some hundreds of MiB moved is a steady state.
		if p := progress.String(); strings.Contains(p, " MiB, ") {
			f := strings.Fields(p[:strings.LastIndex(p, " MiB, ")])
			if n, _ := strconv.Atoi(f[len(f)-1]); n >= 256 {
				break
			}
		}
		if time.Now().After(deadline) {
			kill()
			t.Fatalf("the peer moved no bytes in a minute: %q", progress.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		kill()
		t.Fatal(err)
	}
	time.Sleep(time.Second) // its sockets fill, or its revoke waits
	return kill
}

// syncBuffer is a bytes.Buffer for a writer and a reader on two goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestServeGraceCutsPeers: a peer stalled in the middle of its requests
// (over TCP: its socket full, the target's write of a READ's bytes
// blocked; over shm: its revoke never answered) does not hold serve's
// shutdown past --grace: serve cuts it and exits within a few seconds of
// the grace, with the status and message that say so. (It waited out
// TCP's one-minute drain, or FrameTimeout, and shm's 10-second revoke.)
func TestServeGraceCutsPeers(t *testing.T) {
	t.Setenv(keyEnv, "a key of the deployment")
	const grace = time.Second
	for _, proto := range []string{"tcp", "shm"} {
		t.Run(proto, func(t *testing.T) {
			lines, stop := startServe(t, 1, "--listen", "127.0.0.1:0", "--buffer-size", "128M", "--grace", grace.String())
			defer stop()
			kill := stalledPeer(t, segmentOf(t, lines[0]), "--protocol", proto, "--operation", "read", "--block-size", "16M", "--batch-size", "8", "--ring")
			defer kill()
			start := time.Now()
			err := stop()
			took := time.Since(start)
			t.Logf("serve stopped in %v: %v", took, err)
			if took > grace+4*time.Second {
				t.Errorf("serve took %v to stop with a grace of %v", took, grace)
			}
			if !errors.Is(err, errGraceOut) || exitCode(err) != exitGraceOut || !strings.Contains(err.Error(), "cut") {
				t.Errorf("serve: %v (exit %d); want the grace ran out, peers cut, exit %d", err, exitCode(err), exitGraceOut)
			}
		})
	}
}
