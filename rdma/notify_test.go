//go:build rdma && cgo

package rdma

import (
	"bytes"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/moonring/moonring/transport"
)

// sink is a target engine's notification queue.
type sink struct {
	mu   sync.Mutex
	got  []transport.Notification
	full bool
}

func (k *sink) deliver(n *transport.Notification) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.full {
		return transport.ErrNotifyFull
	}
	k.got = append(k.got, transport.Notification{From: n.From, Tag: n.Tag, Msg: bytes.Clone(n.Msg)})
	return nil
}

// A WRITE then its notification: the target's poller hands the
// notification to its engine after the bytes landed, and the Notify slice
// completes on the target's answer.
func TestNotify(t *testing.T) {
	w := newWorld(t, Config{QPsPerDevice: 2}, 1<<16)
	var k sink
	w.init.SetNotify("initiator-seg", nil)
	ep0 := w.open(t) // opened before the target takes notifications
	c := newWaiter()
	msg := []byte("kv ready")
	notify := func(tok uint64, tag uint64, m []byte, rail int) transport.Slice {
		s := transport.Slice{Op: transport.Notify, Rail: uint16(rail), Remote: tag, Length: uint64(len(m)), Token: tok}
		if len(m) > 0 {
			s.Local = unsafePointer(m)
		}
		return s
	}
	postAll(t, ep0, c, []transport.Slice{notify(1, 7, msg, 0)})
	if err := c.wait(t, 1); !errors.Is(err, transport.ErrDenied) {
		t.Fatalf("notification to a target without SetNotify: %v, want ErrDenied", err)
	}
	w.targ.SetNotify("target-seg", k.deliver)
	ep := w.open(t)
	for i := range w.lmem[:4096] {
		w.lmem[i] = byte(i*3 + 1)
	}
	postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 4096, 2)})
	if err := c.wait(t, 2); err != nil {
		t.Fatal(err)
	}
	postAll(t, ep, c, []transport.Slice{notify(3, 42, msg, 1)})
	if err := c.wait(t, 3); err != nil {
		t.Fatalf("notification: %v", err)
	}
	k.mu.Lock()
	if len(k.got) != 1 || k.got[0].From != "initiator-seg" || k.got[0].Tag != 42 || string(k.got[0].Msg) != "kv ready" {
		t.Fatalf("delivered %+v", k.got)
	}
	k.mu.Unlock()
	if !bytes.Equal(w.rmem[:4096], w.lmem[:4096]) {
		t.Fatal("the WRITE before the notification did not land")
	}
	// Many at once, more than the credit, an empty and a maximal message:
	// Post pushes back, every one arrives once, in order per rail.
	big := bytes.Repeat([]byte{0xab}, transport.MaxNotifyMessage)
	var s []transport.Slice
	for i := 0; i < 40; i++ {
		m := []byte(fmt.Sprintf("note %d", i))
		switch i {
		case 5:
			m = nil
		case 6:
			m = big
		}
		s = append(s, notify(uint64(100+i), uint64(1000+i), m, 0))
	}
	postAll(t, ep, c, s)
	for i := range s {
		if err := c.wait(t, s[i].Token); err != nil {
			t.Fatalf("notification %d: %v", i, err)
		}
	}
	k.mu.Lock()
	if len(k.got) != 41 {
		t.Fatalf("%d notifications delivered, want 41", len(k.got))
	}
	for i, n := range k.got[1:] {
		want := fmt.Sprintf("note %d", i)
		switch i {
		case 5:
			want = ""
		case 6:
			want = string(big)
		}
		if n.Tag != uint64(1000+i) || string(n.Msg) != want {
			t.Fatalf("notification %d: tag %d, %d bytes; want tag %d, %d bytes", i, n.Tag, len(n.Msg), 1000+i, len(want))
		}
	}
	k.full = true
	k.mu.Unlock()
	// A full queue at the target: a retryable failure.
	postAll(t, ep, c, []transport.Slice{notify(200, 1, msg, 0)})
	if err := c.wait(t, 200); !errors.Is(err, transport.ErrNotifyFull) {
		t.Fatalf("notification to a full queue: %v, want ErrNotifyFull", err)
	}
	// Too long: refused before it is sent.
	long := make([]byte, transport.MaxNotifyMessage+1)
	postAll(t, ep, c, []transport.Slice{notify(201, 1, long, 0)})
	if err := c.wait(t, 201); !errors.Is(err, transport.ErrRange) {
		t.Fatalf("notification of %d bytes: %v, want ErrRange", len(long), err)
	}
	if c.dup.Load() != 0 {
		t.Errorf("%d duplicate completions", c.dup.Load())
	}
}

// A target whose answer to a notification cannot be posted ends the
// connection: the notification fails with a retryable ErrPeer when the
// initiator's queue pair fails with it, and the next one, on a fresh
// queue pair, goes through. It used to wait for an answer that never came.
func TestNotifyAnswerFails(t *testing.T) {
	w := newWorld(t, Config{QPsPerDevice: 1}, 1<<16)
	var k sink
	w.init.SetNotify("initiator-seg", nil)
	w.targ.SetNotify("target-seg", k.deliver)
	ep := w.open(t)
	c := newWaiter()
	msg := []byte("kv ready")
	s := transport.Slice{Op: transport.Notify, Remote: 7, Length: uint64(len(msg)), Local: unsafePointer(msg), Token: 1}
	w.targ.setFailAnswers(true)
	postAll(t, ep, c, []transport.Slice{s})
	if err := c.wait(t, 1); !errors.Is(err, transport.ErrPeer) {
		t.Fatalf("a notification whose answer failed: %v, want ErrPeer", err)
	}
	w.targ.setFailAnswers(false)
	s.Token = 2
	postAll(t, ep, c, []transport.Slice{s})
	if err := c.wait(t, 2); err != nil {
		t.Fatalf("the next notification: %v", err)
	}
	if c.dup.Load() != 0 {
		t.Errorf("%d duplicate completions", c.dup.Load())
	}
}
