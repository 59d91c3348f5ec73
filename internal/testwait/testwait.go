// Package testwait waits in tests for a condition that other goroutines
// bring about. Its limit is a hang detector, far above any wait a test
// expects, never a timing assertion. It is for tests only; nothing in the
// library imports it.
package testwait

import (
	"testing"
	"time"
)

// For polls cond every millisecond until it holds, and fails t with
// "hang: waiting for what" when it has not held within limit. Call it from
// the test's goroutine.
func For(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("hang: waiting for %s (%v)", what, limit)
			return
		}
		time.Sleep(time.Millisecond)
	}
}
