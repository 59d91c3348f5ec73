package testwait

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fatalRecorder is a testing.TB whose Fatalf records instead of ending
// the test.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Fatalf(format string, args ...any) { f.msg = fmt.Sprintf(format, args...) }

// For returns once the condition holds, and fails naming what it waited
// for when the condition never does.
func TestFor(t *testing.T) {
	var n atomic.Int32
	go func() {
		time.Sleep(5 * time.Millisecond)
		n.Store(1)
	}()
	rec := &fatalRecorder{TB: t}
	For(rec, time.Minute, "the flag", func() bool { return n.Load() == 1 })
	if rec.msg != "" {
		t.Fatalf("failed although the condition came to hold: %s", rec.msg)
	}
	For(rec, 20*time.Millisecond, "the impossible", func() bool { return false })
	if !strings.Contains(rec.msg, "hang: waiting for the impossible") {
		t.Fatalf("a condition that never holds: %q; want a failure naming it", rec.msg)
	}
}
