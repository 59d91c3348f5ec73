package mctcp

// notify.go: notifications to a Mooncake segment. Mooncake carries them on
// its RPC port, not on the data port: a Notify slice becomes a notify frame
// to the segment's Endpoints["mooncake-rpc"] (mooncake.SendNotification),
// sent on a goroutine of its own so that Post does not block. Notifications
// from Mooncake peers arrive on this engine's RPC port, which the engine
// runs (mooncake.RPCServer), not here.

import (
	"context"
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

var _ transport.Notifier = (*Transport)(nil)

// notifyTimeout bounds the sending of one notification.
const notifyTimeout = 5 * time.Second

// SetNotify records the engine's segment name, sent as the notifications'
// sender (Mooncake's notify frame names it). deliver is not used: Mooncake
// peers' notifications come in on the engine's RPC port. Safe for
// concurrent use.
func (t *Transport) SetNotify(self string, _ func(*transport.Notification) error) {
	t.self.Store(&self)
}

// notify sends a Notify slice's message to the segment's RPC port and
// completes the slice: nil when the peer took it, transport.ErrNotifyFull
// when it refused it (retried, as a full queue), transport.ErrPeer when it
// could not be reached, transport.ErrDenied when the segment has no RPC
// port or the message is not text Mooncake's frame can carry. Mooncake's
// notifications have no tag: the slice's is not sent.
func (e *Endpoint) notify(c transport.Completer, sl *transport.Slice) {
	d := e.dest.Load()
	if d.rpc == "" {
		c.Complete(sl.Token, fmt.Errorf("mctcp: notify %s: the segment publishes no %s: %w", e.name, mooncake.EndpointRPC, transport.ErrDenied))
		return
	}
	from := ""
	if p := e.t.self.Load(); p != nil {
		from = *p
	}
	var msg []byte
	if sl.Length > 0 && sl.Local != nil {
		msg = unsafe.Slice((*byte)(sl.Local), sl.Length) // valid until the slice completes
	}
	token := sl.Token // s is the caller's again once Post returns
	desc := &segtable.SegmentDesc{Name: e.name, Endpoints: map[string]string{mooncake.EndpointRPC: d.rpc}}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), notifyTimeout)
		defer cancel()
		go func() { // Close cuts the wait short
			select {
			case <-e.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		err := mooncake.SendNotification(ctx, &e.t.rpc, desc, &transport.Notification{From: from, Msg: msg})
		switch {
		case err == nil:
		case errors.Is(err, mooncake.ErrNotifyRefused):
			err = fmt.Errorf("mctcp: notify %s: %w: %w", e.name, transport.ErrNotifyFull, err)
		case errors.Is(err, mooncake.ErrBadFrame), errors.Is(err, mooncake.ErrNoRPC):
			err = fmt.Errorf("mctcp: notify %s: %w: %w", e.name, transport.ErrDenied, err)
		default:
			err = fmt.Errorf("mctcp: notify %s: %w: %w", e.name, transport.ErrPeer, err)
		}
		c.Complete(token, err)
	}()
}
