//go:build rdma && cgo

package rdma

import (
	"errors"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testwait"
	"github.com/moonring/moonring/transport"
)

// The port goes down under an open endpoint (the VM's rxe0 link, veth0,
// is taken down): the asynchronous event marks the device down and fails
// its queue pairs, slices fail with a retryable error instead of waiting
// for timeouts, and once the link is up again the endpoint reconnects.
func TestPortDown(t *testing.T) {
	if os.Getenv("RDMA_VM_DEV") == "" {
		t.Skip("SKIP: takes the RDMA device's link down: runs only inside the rdma VM (make test-rdma)")
	}
	link := func(state string) {
		t.Helper()
		if out, err := exec.Command("/usr/sbin/ip", "link", "set", "veth0", state).CombinedOutput(); err != nil {
			t.Fatalf("ip link set veth0 %s: %v: %s", state, err, out)
		}
	}
	w := newWorld(t, Config{QPsPerDevice: 1}, 1<<16)
	ep := w.open(t)
	c := newWaiter()
	postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 4096, 1)})
	if err := c.wait(t, 1); err != nil {
		t.Fatal(err)
	}
	d := w.init.devs[0]
	link("down")
	defer link("up")
	waitFor(t, "the port-down event", func() bool { return d.down.Load() })
	tok := uint64(2)
	n, err := ep.Post(c, []transport.Slice{w.slice(transport.Write, 0, 4096, tok)})
	switch {
	case err != nil:
		t.Logf("Post with the port down: %v", err)
	case n == 1:
		if err := c.wait(t, tok); err == nil {
			t.Fatal("WRITE with the port down succeeded")
		} else if !isRetryable(err) {
			t.Fatalf("WRITE with the port down: %v; want a retryable error", err)
		} else {
			t.Logf("WRITE with the port down: %v", err)
		}
	}
	link("up")
	waitFor(t, "the port-active event", func() bool { return !d.down.Load() })
	w.lmem[9] = 0x99
	deadline := time.Now().Add(30 * time.Second)
	for {
		tok++
		n, err := ep.Post(c, []transport.Slice{w.slice(transport.Write, 0, 4096, tok)})
		if err == nil && n == 1 {
			if err = c.wait(t, tok); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no WRITE succeeded within 30 s of the link coming back: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if w.rmem[9] != 0x99 {
		t.Fatal("WRITE after the link came back did not land")
	}
	t.Logf("asynchronous events seen: %d; GID now %v", d.events.Load(), w.init.GIDs()[0])
}

func isRetryable(err error) bool {
	return !isFinal(err)
}

func isFinal(err error) bool {
	for _, e := range []error{transport.ErrDenied, transport.ErrRange, transport.ErrClosed} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.For(t, 20*time.Second, what, cond)
}
