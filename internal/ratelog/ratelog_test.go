package ratelog

import (
	"sync"
	"testing"
	"time"
)

// TestLimit: the first event passes, those within the interval are held
// back and counted, the next after it passes with their count; under
// concurrent callers exactly one passes per interval.
func TestLimit(t *testing.T) {
	l := Limit{Every: time.Hour}
	if ok, n := l.Allow(); !ok || n != 0 {
		t.Fatalf("first event: %v, %d", ok, n)
	}
	for range 5 {
		if ok, _ := l.Allow(); ok {
			t.Fatal("an event within the interval passed")
		}
	}
	l.last.Store(time.Now().Add(-2 * time.Hour).UnixNano()) // the interval has gone by
	if ok, n := l.Allow(); !ok || n != 5 {
		t.Fatalf("after the interval: %v, %d held back, want true, 5", ok, n)
	}
	var c Limit
	var wg sync.WaitGroup
	var passed sync.Map
	for i := range 64 {
		wg.Go(func() {
			if ok, _ := c.Allow(); ok {
				passed.Store(i, true)
			}
		})
	}
	wg.Wait()
	n := 0
	passed.Range(func(any, any) bool { n++; return true })
	if n != 1 {
		t.Fatalf("%d of 64 concurrent events passed, want 1", n)
	}
}
