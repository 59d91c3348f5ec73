package uring

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestMain fails the run when a test leaks a goroutine or a file descriptor
// (a ring fd, a socket) past its end.
func TestMain(m *testing.M) {
	// The runtime opens its netpoller's epoll and eventfd at the first
	// timer; start it now so that they count as before.
	time.Sleep(time.Microsecond)
	before := openFDs()
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "uring: goroutine leak:", err)
			code = 1
		}
		if after := openFDs(); len(after) != len(before) {
			fmt.Fprintf(os.Stderr, "uring: fd leak: %d fds open before the tests, %d after:\n%s\n",
				len(before), len(after), strings.Join(after, "\n"))
			code = 1
		}
	}
	os.Exit(code)
}

// openFDs lists the process's open fds as "fd -> target", sorted. The fd of
// the directory being read shows up in every listing alike.
func openFDs() []string {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil // not Linux: nothing to compare
	}
	var fds []string
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name())
		fds = append(fds, e.Name()+" -> "+target)
	}
	sort.Strings(fds)
	return fds
}
