// progress.go holds bench's progress line on stderr while a step runs: a
// line redrawn in place on a terminal, plain lines a second apart
// elsewhere, and the count of bytes moved it reads.

package main

import (
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// moved counts the bytes of the step under way, for the progress line.
var moved atomic.Int64

// progressLine prints, every half second on stderr, the step's bytes and
// GB/s so far and the time left, then clears the line. When stderr is not
// a terminal it prints plain lines, one a second, without escape codes.
func progressLine(res result, d time.Duration) func() {
	if !stderrIsTerminal() {
		return progressPlain(res, d)
	}
	moved.Store(0)
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t0 := time.Now()
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				fmt.Fprint(os.Stderr, "\r\033[K")
				return
			case <-tick.C:
				el := time.Since(t0)
				b := moved.Load()
				fmt.Fprintf(os.Stderr, "\r\033[K%s", progressText(res, d, el, b))
			}
		}
	}()
	return func() { close(done); <-exited }
}

// progressText is the progress of a step d long (after its warm-up of d/5)
// that has moved b bytes in el.
func progressText(res result, d, el time.Duration, b int64) string {
	return fmt.Sprintf("%s %s %s: %d MiB, %.2f GB/s so far, %.1f s left",
		res.Transport, res.Op, res.Block, b>>20, float64(b)/el.Seconds()/1e9, max(0, (d+d/5-el).Seconds()))
}

// progressPlain is progressLine for a stderr that is a file or a pipe: a
// line a second.
func progressPlain(res result, d time.Duration) func() {
	moved.Store(0)
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t0 := time.Now()
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				fmt.Fprintln(progressOut, progressText(res, d, time.Since(t0), moved.Load()))
			}
		}
	}()
	return func() { close(done); <-exited }
}

// progressOut takes the progress lines when stderr is no terminal; tests
// replace it.
var progressOut io.Writer = os.Stderr

// stderrIsTerminal reports whether stderr is a terminal, where escape
// codes may redraw the progress line. Tests replace it.
var stderrIsTerminal = func() bool {
	_, err := unix.IoctlGetTermios(int(os.Stderr.Fd()), unix.TCGETS)
	return err == nil
}
