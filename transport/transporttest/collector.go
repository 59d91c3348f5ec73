// collector.go holds the suite's Completer (collector), which records each
// slice's completion and fails a second one, and the posting helpers that
// hand slices to an endpoint and wait for all of them within hang.

package transporttest

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// collector is the suite's Completer: it records every completion and
// reports a token completed twice or never posted.
type collector struct {
	mu     sync.Mutex
	got    map[uint64]error
	dups   []uint64
	signal chan struct{}
}

func newCollector() *collector {
	return &collector{got: map[uint64]error{}, signal: make(chan struct{}, 1)}
}

func (c *collector) Complete(token uint64, err error) {
	c.mu.Lock()
	if _, ok := c.got[token]; ok {
		c.dups = append(c.dups, token)
	}
	c.got[token] = err
	c.mu.Unlock()
	select {
	case c.signal <- struct{}{}:
	default:
	}
}

func (c *collector) completed(token uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.got[token]
	return ok
}

func (c *collector) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.got)
}

// await waits until every token of s has completed and returns their
// errors in order, or an error wrapping errHang.
func (c *collector) await(s []transport.Slice) ([]error, error) {
	deadline := time.Now().Add(hang)
	for {
		c.mu.Lock()
		done := 0
		for i := range s {
			if _, ok := c.got[s[i].Token]; ok {
				done++
			}
		}
		c.mu.Unlock()
		if done == len(s) {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w: %d of %d slices completed after %v", errHang, done, len(s), hang)
		}
		select {
		case <-c.signal:
		case <-time.After(10 * time.Millisecond):
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	errs := make([]error, len(s))
	for i := range s {
		errs[i] = c.got[s[i].Token]
	}
	return errs, nil
}

// wait is await on the test goroutine.
func (c *collector) wait(t *testing.T, s []transport.Slice) []error {
	t.Helper()
	errs, err := c.await(s)
	if err != nil {
		t.Fatal(err)
	}
	return errs
}

var errHang = errors.New("transporttest: hang")

// check reports tokens completed twice or completed without being accepted.
func (c *collector) check(t *testing.T, accepted map[uint64]bool) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.dups) > 0 {
		t.Errorf("%d slices completed more than once (tokens %v)", len(c.dups), c.dups[:min(len(c.dups), 8)])
	}
	if accepted == nil {
		return
	}
	for tok := range c.got {
		if !accepted[tok] {
			t.Errorf("token %d completed but Post never accepted it", tok)
		}
	}
	for tok := range accepted {
		if _, ok := c.got[tok]; !ok {
			t.Errorf("token %d accepted but never completed", tok)
		}
	}
}

// post posts every slice of s, retrying the rest when the endpoint is full
// (Post's backpressure contract). It returns how many were accepted and
// Post's error, if any stopped it, or an error wrapping errHang when the
// endpoint never took them.
func post(ep transport.Endpoint, c transport.Completer, s []transport.Slice) (int, error) {
	done := 0
	deadline := time.Now().Add(hang)
	for done < len(s) {
		n, err := ep.Post(c, s[done:])
		if n < 0 || n > len(s)-done {
			return done, fmt.Errorf("%w: Post of %d slices returned %d", errHang, len(s)-done, n)
		}
		done += n
		if err != nil {
			return done, err
		}
		if done < len(s) {
			if time.Now().After(deadline) {
				return done, fmt.Errorf("%w: endpoint took %d of %d slices in %v", errHang, done, len(s), hang)
			}
			if n == 0 {
				time.Sleep(10 * time.Microsecond)
			}
			runtime.Gosched()
		}
	}
	return done, nil
}

// mustPost is post on the test goroutine: a hang is fatal.
func mustPost(t *testing.T, ep transport.Endpoint, c transport.Completer, s []transport.Slice) (int, error) {
	t.Helper()
	n, err := post(ep, c, s)
	if errors.Is(err, errHang) {
		t.Fatal(err)
	}
	return n, err
}
