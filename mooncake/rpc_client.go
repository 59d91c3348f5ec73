// rpc_client.go holds the client of a Mooncake engine's RPC port: one TCP
// connection per exchange, as Mooncake's own requester makes them.

package mooncake

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// Errors of the RPC client, beside [ErrBadFrame] (an answer that is not a
// frame of the request's type, or not its document) and
// [metadata.ErrUnreachable] (no connection, or it broke or timed out
// before the answer came; the error wraps the cause).
var (
	// ErrNotifyRefused reports a notification the peer answered with
	// Mooncake's refusal (an empty notify_msg). A retry may help: the
	// peer's queue may have room later.
	ErrNotifyRefused = errors.New("mooncake rpc: the peer refused the notification")
	// ErrHandshakeRefused reports a handshake answer with a reply_msg; the
	// error carries it.
	ErrHandshakeRefused = errors.New("mooncake rpc: the peer refused the handshake")
)

// DefaultRPCClientTimeout bounds one exchange of an [RPCClient] when the
// context has no earlier deadline.
const DefaultRPCClientTimeout = 10 * time.Second

// RPCClient asks Mooncake engines' RPC ports: metadata (a P2PHANDSHAKE
// peer's descriptor), notify, probe and the transport handshake. Each call
// is one TCP connection: it sends one frame, reads the answer of the same
// type and closes. Its zero value is ready: it dials with a 2s connect
// timeout, bounds each exchange by the context and DefaultRPCClientTimeout,
// and accepts answers up to DefaultMaxFrame. It holds no resource between
// calls and is safe for concurrent use; its fields must not change while
// it is in use.
type RPCClient struct {
	// Dialer makes the connections; nil: a net.Dialer with a 2s timeout.
	Dialer *net.Dialer
	// Timeout bounds one exchange, connection included; default
	// DefaultRPCClientTimeout.
	Timeout time.Duration
	// MaxFrame bounds an answer's length; default DefaultMaxFrame, never
	// over MaxFrameLimit. A Mooncake engine whose descriptor is larger
	// answers with more (its own requesters then need
	// MC_HANDSHAKE_MAX_LENGTH raised too).
	MaxFrame int
}

var defaultDialer = &net.Dialer{Timeout: 2 * time.Second}

// Exchange sends a frame of type t with body to the RPC port at addr
// ("host:port") and returns the body of the answer, which must be a frame
// of type t. It is the primitive of the other methods.
func (c *RPCClient) Exchange(ctx context.Context, addr string, t FrameType, body []byte) ([]byte, error) {
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = DefaultRPCClientTimeout
	}
	xctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	d := c.Dialer
	if d == nil {
		d = defaultDialer
	}
	conn, err := d.DialContext(xctx, "tcp", addr)
	if err != nil {
		return nil, fail(ctx, addr, err)
	}
	defer conn.Close()
	dl, _ := xctx.Deadline()
	conn.SetDeadline(dl)
	// The caller's cancellation interrupts the exchange at once.
	stop := context.AfterFunc(xctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := WriteFrame(conn, t, body); err != nil {
		return nil, fail(ctx, addr, err)
	}
	ans, err := readAnswer(conn, t, frameMax(c.MaxFrame))
	switch {
	case errors.Is(err, ErrBadFrame):
		return nil, fmt.Errorf("mooncake rpc %s: %w", addr, err)
	case err != nil:
		return nil, fail(ctx, addr, err)
	}
	return ans, nil
}

// fail wraps an I/O failure of an exchange under ctx, the caller's
// context: its error when it is done, else metadata.ErrUnreachable (the
// exchange's own timeout included).
func fail(ctx context.Context, addr string, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("mooncake rpc %s: %w (%v)", addr, cerr, err)
	}
	return fmt.Errorf("mooncake rpc %s: %w: %w", addr, metadata.ErrUnreachable, err)
}

// readAnswer reads the answer to a request of type want: a frame of that
// type. A peer that closes before a whole frame is io.ErrUnexpectedEOF (or
// io.EOF when it sent nothing: Mooncake's way of refusing a malformed
// request).
func readAnswer(r io.Reader, want FrameType, max int) ([]byte, error) {
	f, err := readRequest(r, max)
	if err != nil {
		return nil, err
	}
	if f.Type != want {
		return nil, fmt.Errorf("%w: a %v answer to a %v request", ErrBadFrame, f.Type, want)
	}
	return f.Body, nil
}

// isNull reports whether a document is JSON null.
func isNull(b []byte) bool { return string(bytes.TrimSpace(b)) == "null" }

// FetchDesc asks the engine at addr for its descriptor, as a Mooncake
// engine in P2PHANDSHAKE mode does, sending own (this engine's descriptor
// in Mooncake's schema, which the peer ignores; nil sends null). It
// returns nil, nil when the peer has no descriptor (it answered null), and
// [ErrBadDoc] when the answer is not a descriptor.
func (c *RPCClient) FetchDesc(ctx context.Context, addr string, own []byte) (*SegmentDesc, error) {
	if own == nil {
		own = nullBody
	}
	ans, err := c.Exchange(ctx, addr, FrameMetadata, own)
	if err != nil {
		return nil, err
	}
	if isNull(ans) {
		return nil, nil
	}
	d, err := Decode(ans)
	if err != nil {
		return nil, fmt.Errorf("mooncake rpc %s: metadata answer: %w", addr, err)
	}
	return d, nil
}

// Notify sends n to the engine at addr: nil when it answered success,
// [ErrNotifyRefused] when it refused.
func (c *RPCClient) Notify(ctx context.Context, addr string, n NotifyDesc) error {
	body, err := n.Encode()
	if err != nil {
		return fmt.Errorf("mooncake rpc %s: %w: %v", addr, ErrBadFrame, err)
	}
	ans, err := c.Exchange(ctx, addr, FrameNotify, append(body, '\n'))
	if err != nil {
		return err
	}
	r, err := DecodeNotify(ans)
	if err != nil {
		return fmt.Errorf("mooncake rpc %s: notify answer: %w", addr, err)
	}
	if r.NotifyMsg == "" {
		return fmt.Errorf("mooncake rpc %s: %w", addr, ErrNotifyRefused)
	}
	return nil
}

// Probe asks whether the engine at addr is alive: nil when it answers
// {"status":"success"}.
func (c *RPCClient) Probe(ctx context.Context, addr string) error {
	ans, err := c.Exchange(ctx, addr, FrameProbe, []byte("{}\n"))
	if err != nil {
		return err
	}
	p, err := DecodeProbeReply(ans)
	if err != nil {
		return fmt.Errorf("mooncake rpc %s: probe answer: %w", addr, err)
	}
	if *p != ProbeOK {
		return fmt.Errorf("mooncake rpc %s: %w: probe status %q", addr, ErrBadFrame, p.Status)
	}
	return nil
}

// Handshake sends a Connection frame with h and returns the peer's
// answer; an answer with a reply_msg is returned with
// [ErrHandshakeRefused].
func (c *RPCClient) Handshake(ctx context.Context, addr string, h *HandshakeDesc) (*HandshakeDesc, error) {
	body, err := h.Encode()
	if err != nil {
		return nil, fmt.Errorf("mooncake rpc %s: %w: %v", addr, ErrBadFrame, err)
	}
	ans, err := c.Exchange(ctx, addr, FrameConnection, append(body, '\n'))
	if err != nil {
		return nil, err
	}
	r, err := DecodeHandshake(ans)
	if err != nil {
		return nil, fmt.Errorf("mooncake rpc %s: handshake answer: %w", addr, err)
	}
	if r.ReplyMsg != "" {
		return r, fmt.Errorf("mooncake rpc %s: %w: %.200q", addr, ErrHandshakeRefused, r.ReplyMsg)
	}
	return r, nil
}

// fetchSegtable fetches the descriptor of the P2PHANDSHAKE segment name
// (its RPC address) in moonring's form; nil, nil when the peer has none.
func (c *RPCClient) fetchSegtable(ctx context.Context, name string, own []byte) (*segtable.SegmentDesc, error) {
	d, err := c.FetchDesc(ctx, name, own)
	if err != nil || d == nil {
		return nil, err
	}
	sd, err := ToSegtable(d, nil)
	if err != nil {
		return nil, fmt.Errorf("mooncake rpc %s: %w", name, err)
	}
	if sd.Name != name {
		return nil, fmt.Errorf("mooncake rpc %s: %w: the peer serves segment %q", name, ErrBadDoc, sd.Name)
	}
	return sd, nil
}
