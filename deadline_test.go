package moonring

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"
)

// TestDeadlineCtx: a publish's context ends at its deadline or when
// cancelled, as context.WithTimeout's does, through Err, Done and the
// contexts derived from it; one whose Done is never called allocates
// itself only.
func TestDeadlineCtx(t *testing.T) {
	closed := func(c context.Context) bool {
		select {
		case <-c.Done():
			return true
		default:
			return false
		}
	}
	c := newDeadlineCtx(time.Hour)
	if d, ok := c.Deadline(); !ok || time.Until(d) < 59*time.Minute {
		t.Errorf("Deadline = %v, %v", d, ok)
	}
	child, stop := context.WithCancel(c)
	defer stop()
	if c.Err() != nil || closed(c) || closed(child) || c.Value("k") != nil {
		t.Fatalf("a fresh context: Err %v", c.Err())
	}
	c.cancel()
	<-child.Done()
	if !errors.Is(c.Err(), context.Canceled) || !closed(c) || !errors.Is(child.Err(), context.Canceled) {
		t.Fatalf("cancelled: Err %v, child's %v", c.Err(), child.Err())
	}
	c.cancel() // again: nothing changes
	if !errors.Is(c.Err(), context.Canceled) {
		t.Fatalf("cancelled twice: Err %v", c.Err())
	}

	past := newDeadlineCtx(-time.Second)
	if !errors.Is(past.Err(), context.DeadlineExceeded) || !closed(past) {
		t.Fatalf("past its deadline: Err %v", past.Err())
	}
	past.cancel()
	if !errors.Is(past.Err(), context.DeadlineExceeded) {
		t.Fatalf("past its deadline, then cancelled: Err %v", past.Err())
	}

	soon := newDeadlineCtx(time.Millisecond)
	<-soon.Done() // the timer Done started ends it
	if !errors.Is(soon.Err(), context.DeadlineExceeded) {
		t.Fatalf("at its deadline: Err %v", soon.Err())
	}

	allocs := testing.AllocsPerRun(100, func() {
		c := newDeadlineCtx(time.Hour)
		if c.Err() != nil {
			t.Fatal(c.Err())
		}
		c.cancel()
	})
	if allocs > 1 {
		t.Errorf("%.0f allocations a context whose Done is not called, want 1", allocs)
	}
}

// TestDeadlineCtxDerived: contexts derived from a publish's context (a
// networked store's calls) follow it through its AfterFunc, with no
// goroutine each, end when it ends, and a stopped AfterFunc is not
// called.
func TestDeadlineCtxDerived(t *testing.T) {
	c := newDeadlineCtx(time.Hour)
	before := runtime.NumGoroutine()
	var stops []context.CancelFunc
	var kids []context.Context
	for range 100 {
		k, stop := context.WithTimeout(c, time.Hour)
		kids, stops = append(kids, k), append(stops, stop)
	}
	if n := runtime.NumGoroutine() - before; n > 10 {
		t.Errorf("100 derived contexts started %d goroutines", n)
	}
	stops[0]()
	called := make(chan struct{}, 1)
	stop := c.AfterFunc(func() { called <- struct{}{} })
	if !stop() || stop() {
		t.Fatal("stop: want true once, then false")
	}
	ran := make(chan struct{})
	c.AfterFunc(func() { close(ran) })
	c.cancel()
	for i, k := range kids {
		<-k.Done()
		if want := context.Canceled; !errors.Is(k.Err(), want) {
			t.Fatalf("derived context %d: Err %v, want %v", i, k.Err(), want)
		}
	}
	<-ran
	select {
	case <-called:
		t.Fatal("a stopped AfterFunc was called")
	case <-time.After(10 * time.Millisecond):
	}
	late := make(chan struct{})
	c.AfterFunc(func() { close(late) }) // after the end: at once
	<-late
	for _, s := range stops {
		s()
	}
}
