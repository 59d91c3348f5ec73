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
	live := exec.Command("sleep", "60")
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	defer live.Wait()
	defer live.Process.Kill()
	if exited(live.Process.Pid) {
		t.Errorf("a running child reads as exited")
	}
}

// TestExitedPeer: a shm peer's process is asked after at most
// livenessEvery, and at once once the peer is suspect; gone stays gone.
func TestExitedPeer(t *testing.T) {
	child := exec.Command("sleep", "60")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	p := &peer{pid: child.Process.Pid}
	if p.exitedPeer() {
		t.Fatal("a running peer reads as exited")
	}
	child.Process.Kill()
	child.Wait()
	p.suspect.Store(true)
	if !p.exitedPeer() {
		t.Fatal("a suspect peer whose process was killed and waited for reads as running")
	}
	p.suspect.Store(false)
	if !p.exitedPeer() {
		t.Fatal("a peer found gone reads as running again")
	}

	quiet := exec.Command("sleep", "60")
	if err := quiet.Start(); err != nil {
		t.Fatal(err)
	}
	q := &peer{pid: quiet.Process.Pid}
	if q.exitedPeer() {
		t.Fatal("a running peer reads as exited")
	}
	quiet.Process.Kill()
	quiet.Wait()
	time.Sleep(2 * livenessEvery)
	if !q.exitedPeer() {
		t.Fatalf("a peer killed %v ago, nothing failed to it, reads as running", 2*livenessEvery)
	}
}
