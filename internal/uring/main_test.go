package uring

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/moonring/moonring/internal/leakcheck"
)

// TestMain fails the run when a test leaks a goroutine or a file descriptor
// (a ring fd, a socket) past its end.
func TestMain(m *testing.M) {
	// The runtime opens its netpoller's epoll and eventfd at the first
	// timer; start it now so that they count as before.
	time.Sleep(time.Microsecond)
	before := leakcheck.FDs()
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "uring: goroutine leak:", err)
			code = 1
		}
		if after := leakcheck.FDs(); len(after) != len(before) {
			fmt.Fprintf(os.Stderr, "uring: fd leak: %d fds open before the tests, %d after:\n%s\n",
				len(before), len(after), strings.Join(after, "\n"))
			code = 1
		}
	}
	os.Exit(code)
}
