//go:build efa && cgo

// exited.go: whether a shm peer's process is gone. libfabric's shm
// provider posts into the peer's shared region under a lock that lives
// there; a peer killed while holding it leaves every later post to it
// spinning in the provider, a goroutine's thread lost for good (seen with
// libfabric 1.17 in TestTwoProcessesSHM). shm's address carries the
// peer's pid ("fi_shm://PID:..."), so Post and a retry ask the kernel
// whether that process is still there before they go into the provider:
// at once after operations to the peer failed or timed out, else every
// livenessEvery. A peer whose process cannot be seen when it is opened
// (another pid namespace) is not watched. A peer that dies between the
// question and the post can still catch a poster; the provider's own fix
// is the only whole one.

package efa

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/transport"
)

// errPeerExited: the shm peer's process is gone; nothing is posted to it
// until its segment is opened again.
var errPeerExited = fmt.Errorf("efa: the shm peer's process has exited: %w", transport.ErrPeer)

// livenessEvery is how often Post asks whether a shm peer's process is
// there while nothing failed: a peer that dies mid-stream is seen within
// it, at a cost of a kill(2) and a /proc read a peer that often.
const livenessEvery = 10 * time.Millisecond

// exitedPeer reports whether p, a shm peer, is known or found to be gone
// at now (UnixNano): asked at once when its operations failed or timed
// out since the last answer, else at most every livenessEvery. Once gone,
// always gone.
func (p *peer) exitedPeer(now int64) bool {
	if p.dead.Load() {
		return true
	}
	if !p.suspect.Load() && now-p.checked.Load() < int64(livenessEvery) {
		return false
	}
	p.checked.Store(now)
	if !exited(p.pid) {
		p.suspect.Store(false) // answered: the next failure asks again
		return false
	}
	p.dead.Store(true)
	return true
}

// shmPrefix starts the addresses of libfabric's shm provider.
const shmPrefix = "fi_shm://"

// shmPid returns the pid in a shm provider address ("fi_shm://PID:..."
// or "fi_shm://PID", NUL-terminated or not), or 0 for any other address.
func shmPid(addr []byte) int {
	rest, ok := bytes.CutPrefix(addr, []byte(shmPrefix))
	if !ok {
		return 0
	}
	end := bytes.IndexAny(rest, ":\x00")
	if end < 0 {
		end = len(rest)
	}
	pid, err := strconv.Atoi(string(rest[:end]))
	if err != nil || pid <= 0 {
		return 0
	}
	return pid
}

// exited reports whether process pid is gone (kill(2) finds none) or a
// zombie (its /proc state). A process kill finds but /proc does not show
// (hidepid, no /proc) reads as there.
func exited(pid int) bool {
	if err := unix.Kill(pid, 0); errors.Is(err, unix.ESRCH) {
		return true
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// The state follows the command's closing parenthesis and a space.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return false
	}
	return b[i+2] == 'Z' || b[i+2] == 'X'
}

// shmPeerPid is the pid to watch for a shm peer at addr, asked when the
// peer is first opened: 0 (not watched) for other providers, and for a
// process this one cannot see even then, when it has just published its
// descriptor: another pid namespace, whose pids mean nothing here.
func shmPeerPid(addr []byte) int {
	pid := shmPid(addr)
	if pid == 0 || exited(pid) {
		return 0
	}
	return pid
}
