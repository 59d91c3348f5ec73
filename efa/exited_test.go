//go:build efa && cgo

package efa

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"
)

func TestShmPid(t *testing.T) {
	for _, c := range []struct {
		addr string
		pid  int
	}{
		{"fi_shm://4644:0:0\x00", 4644},
		{"fi_shm://12\x00", 12},
		{"fi_shm://77", 77},
		{"fi_shm://:0:0\x00", 0},
		{"fi_shm://-3:0\x00", 0},
		{"fi_shm://x1:0\x00", 0},
		{"fi_shm://99999999999999999999999:0", 0},
		{"fi_sockets://1:2", 0},
		{"\x02\x00\x1f\x90\x7f\x00\x00\x01", 0}, // a sockaddr_in: tcp's kind of address
		{"", 0},
	} {
		if got := shmPid([]byte(c.addr)); got != c.pid {
			t.Errorf("shmPid(%q) = %d, want %d", c.addr, got, c.pid)
		}
	}
}

// TestExited: this process is there; a child that exited and was waited
// for is gone, and so is one that exited and was not (a zombie: kill(0)
// still finds it).
func TestExited(t *testing.T) {
	if exited(os.Getpid()) {
		t.Fatal("this process reads as exited")
	}
	zombie := exec.Command("true")
	if err := zombie.Start(); err != nil {
		t.Fatal(err)
	}
	pid := zombie.Process.Pid
	deadline := time.Now().Add(30 * time.Second)
	for !exited(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("child %d, exited and not waited for, still reads as running after 30 s", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := zombie.Wait(); err != nil {
		t.Fatal(err)
	}
	if !exited(pid) {
		t.Errorf("child %d reads as running after it was waited for", pid)
	}
	if got := shmPeerPid([]byte(fmt.Sprintf("fi_shm://%d:0:0\x00", pid))); got != 0 {
		t.Errorf("a shm peer whose process is gone when it is opened is watched as pid %d, want 0 (not watched)", got)
	}
	if got := shmPeerPid([]byte(fmt.Sprintf("fi_shm://%d:0:0\x00", os.Getpid()))); got != os.Getpid() {
		t.Errorf("a shm peer whose process is there when it is opened: pid %d watched, want %d", got, os.Getpid())
	}
	if exited(sleeper(t).Process.Pid) {
		t.Errorf("a running child reads as exited")
	}
}

// sleeper starts a child that sleeps; the test's cleanup kills it and
// waits for it (once more is harmless).
func sleeper(t *testing.T) *exec.Cmd {
	c := exec.Command("sleep", "60")
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Process.Kill()
		c.Wait()
	})
	return c
}

// TestExitedPeer: a shm peer's process is asked at once while the peer is
// suspect (an answer that it is there clears that), else once
// livenessEvery passed since the last question; gone stays gone. The
// clock is the caller's: no sleeping.
func TestExitedPeer(t *testing.T) {
	now := time.Now().UnixNano()
	c := sleeper(t)
	p := &peer{pid: c.Process.Pid}
	if p.exitedPeer(now) {
		t.Fatal("a running peer reads as exited")
	}
	p.suspect.Store(true)
	if p.exitedPeer(now) || p.suspect.Load() {
		t.Fatalf("a suspect running peer: exited or still suspect (%v) once asked", p.suspect.Load())
	}
	c.Process.Kill()
	c.Wait()
	if p.exitedPeer(now + int64(livenessEvery)/2) {
		t.Fatal("asked again within livenessEvery of the last question, with nothing failed")
	}
	if !p.exitedPeer(now + 2*int64(livenessEvery)) {
		t.Fatalf("a peer killed, asked %v after the last question, reads as running", 2*livenessEvery)
	}
	if !p.exitedPeer(now + 2*int64(livenessEvery)) {
		t.Fatal("a peer found gone reads as running again")
	}

	q := &peer{pid: sleeper(t).Process.Pid}
	if q.exitedPeer(now) {
		t.Fatal("a running peer reads as exited")
	}
	k := exec.Command("true")
	if err := k.Run(); err != nil {
		t.Fatal(err)
	}
	q.pid = k.Process.Pid // a process that ended: as if q's had
	q.suspect.Store(true)
	if !q.exitedPeer(now) {
		t.Fatal("a suspect peer whose process ended reads as running when asked at once")
	}
}
