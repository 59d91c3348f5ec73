// notify.go sends moonring notifications to Mooncake segments: a Notify
// frame to the RPC port that the segment's descriptor names.

package mooncake

import (
	"context"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// ErrNoRPC reports a segment whose descriptor names no Mooncake RPC
// endpoint ([EndpointRPC]): nothing to send a notification to. A retry
// does not help until the segment is published with one.
var ErrNoRPC = errors.New("mooncake: the segment has no Mooncake RPC endpoint")

// SendNotification sends n to the Mooncake segment d through the RPC port
// of d.Endpoints[EndpointRPC], as Mooncake's notify does: the message
// {"name": n.From, "notify_msg": n.Msg}. Mooncake's notifications carry
// no tag: n.Tag is not sent, and those this package receives have Tag 0.
// The message must be valid UTF-8 (Mooncake's JSON carries text), else
// [ErrBadFrame]. It returns nil when the peer took it, [ErrNotifyRefused]
// when it refused, [ErrNoRPC] when d names no RPC endpoint, and the
// client's errors otherwise ([RPCClient.Notify]). c nil uses the zero
// RPCClient. Safe for concurrent use.
func SendNotification(ctx context.Context, c *RPCClient, d *segtable.SegmentDesc, n *transport.Notification) error {
	if c == nil {
		c = &RPCClient{}
	}
	addr := d.Endpoints[EndpointRPC]
	if addr == "" {
		return fmt.Errorf("segment %q: %w", d.Name, ErrNoRPC)
	}
	if !utf8.Valid(n.Msg) || !utf8.ValidString(n.From) {
		return fmt.Errorf("segment %q: %w: a notification that is not UTF-8 text", d.Name, ErrBadFrame)
	}
	if len(n.From) > MaxString || len(n.Msg) > MaxNotifyMsg-len(n.From)-64 {
		return fmt.Errorf("segment %q: %w: a notification of %d bytes", d.Name, ErrBadFrame, len(n.Msg))
	}
	if err := c.Notify(ctx, addr, NotifyDesc{Name: n.From, NotifyMsg: string(n.Msg)}); err != nil {
		return fmt.Errorf("segment %q: %w", d.Name, err)
	}
	return nil
}
