// Package leakcheck ends a package's tests with a check for goroutines
// that outlived them, as goleak.VerifyTestMain does, but gives goroutines
// that end on their own after a test's cleanup (a connection's reader
// seeing EOF, net/http's per-connection goroutines) up to Grace to go
// before it calls them leaked: goleak's own retries last about half a
// second, which a loaded machine running the race detector can exceed.
//
// It is for tests only; nothing in the library imports it.
package leakcheck

import (
	"fmt"
	"os"
	"sort"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Grace is how long VerifyTestMain waits for goroutines to end. Set it
// before VerifyTestMain, if at all.
var Grace = 10 * time.Second

// VerifyTestMain runs m's tests and, when they passed, fails the run if
// goroutines other than those that were running before are still there
// after Grace. It does not return: it exits with the run's code. Call it
// from TestMain; not safe for concurrent use (there is one TestMain).
func VerifyTestMain(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	if code == 0 {
		deadline := time.Now().Add(Grace)
		for {
			err := goleak.Find(opts...)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				fmt.Fprintf(os.Stderr, "leakcheck: goroutines outlived the tests by %v: %v\n", Grace, err)
				code = 1
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	os.Exit(code)
}

// FDs lists the process's open descriptors as "fd -> target", sorted,
// for tests that check none is left open: the count, and what to print
// when it grew. The descriptor of the directory being read is in every
// listing alike. It returns nil where /proc/self/fd cannot be read.
func FDs() []string {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil
	}
	fds := make([]string, 0, len(ents))
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name())
		fds = append(fds, e.Name()+" -> "+target)
	}
	sort.Strings(fds)
	return fds
}
