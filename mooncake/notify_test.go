package mooncake

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// TestNotifyBothWays: a moonring engine's notification reaches another's
// daemon (as it would a Mooncake engine's), refusals come back as
// ErrNotifyRefused, and what a Mooncake sender writes is what we send.
func TestNotifyBothWays(t *testing.T) {
	var mu sync.Mutex
	var got []transport.Notification
	refuse := false
	s := listenRPC(t, RPCConfig{Notify: func(n *transport.Notification) error {
		mu.Lock()
		defer mu.Unlock()
		if refuse {
			return transport.ErrNotifyFull
		}
		got = append(got, transport.Notification{From: n.From, Msg: bytes.Clone(n.Msg)})
		return nil
	}})
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: s.Name(), Endpoints: map[string]string{EndpointRPC: s.Name()}}
	ctx := t.Context()
	n := &transport.Notification{From: "10.0.0.9:15000", Tag: 77, Msg: []byte("block 7 done \u00e9")}
	if err := SendNotification(ctx, nil, d, n); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if len(got) != 1 || got[0].From != n.From || !bytes.Equal(got[0].Msg, n.Msg) || got[0].Tag != 0 {
		t.Fatalf("delivered %+v", got)
	}
	refuse = true
	mu.Unlock()
	if err := SendNotification(ctx, nil, d, n); !errors.Is(err, ErrNotifyRefused) {
		t.Fatalf("a full queue: %v", err)
	}
	s.SetNotify(nil)
	if err := SendNotification(ctx, nil, d, n); !errors.Is(err, ErrNotifyRefused) {
		t.Fatalf("no receiver: %v", err)
	}
	if err := SendNotification(ctx, nil, &segtable.SegmentDesc{Name: "x"}, n); !errors.Is(err, ErrNoRPC) {
		t.Fatalf("no endpoint: %v", err)
	}
	if err := SendNotification(ctx, nil, d, &transport.Notification{Msg: []byte{0xff, 0xfe}}); !errors.Is(err, ErrBadFrame) {
		t.Fatalf("not UTF-8: %v", err)
	}

	// Toward a Mooncake daemon: the frame is the one its sendNotify
	// writes, and its answer is taken.
	name, frames := fakeMooncakePeer(t, func(string) []byte { return []byte(`{"name":"","notify_msg":"success"}` + "\n") })
	md := &segtable.SegmentDesc{Name: name, Endpoints: map[string]string{EndpointRPC: name}}
	if err := SendNotification(ctx, &RPCClient{}, md, &transport.Notification{From: "10.1.0.8:15002", Msg: []byte("kv-block 42 ready")}); err != nil {
		t.Fatal(err)
	}
	f := <-frames
	if want := `{"name":"10.1.0.8:15002","notify_msg":"kv-block 42 ready"}` + "\n"; f.Type != FrameNotify || string(f.Body) != want {
		t.Fatalf("sent %v %q, want %q", f.Type, f.Body, want)
	}
	name, _ = fakeMooncakePeer(t, func(string) []byte { return []byte(`{"name":"","notify_msg":""}` + "\n") })
	md.Endpoints[EndpointRPC] = name
	if err := SendNotification(ctx, nil, md, n); !errors.Is(err, ErrNotifyRefused) {
		t.Fatalf("Mooncake's refusal: %v", err)
	}
}

// TestClientAgainstDaemon: probe and handshake through the client; the
// handshake function's answer and refusal.
func TestClientAgainstDaemon(t *testing.T) {
	s := listenRPC(t, RPCConfig{})
	c := &RPCClient{}
	ctx := t.Context()
	if err := c.Probe(ctx, s.Name()); err != nil {
		t.Fatal(err)
	}
	req := &HandshakeDesc{LocalNICPath: "a@mlx5_0", PeerNICPath: s.Name() + "@mlx5_1", QPNums: []uint32{5, 6}, ReadyAckSupported: true}
	if ans, err := c.Handshake(ctx, s.Name(), req); !errors.Is(err, ErrHandshakeRefused) || ans.ReplyMsg != NoHandshakeReply {
		t.Fatalf("no handshake function: %+v, %v", ans, err)
	}
	s.SetHandshake(func(h *HandshakeDesc) (*HandshakeDesc, error) {
		if len(h.QPNums) != 2 {
			return nil, fmt.Errorf("want 2 queue pairs, got %d", len(h.QPNums))
		}
		return &HandshakeDesc{LocalNICPath: h.PeerNICPath, PeerNICPath: h.LocalNICPath, QPNums: []uint32{90, 91}, ReadyAckSupported: true}, nil
	})
	ans, err := c.Handshake(ctx, s.Name(), req)
	if err != nil || ans.LocalNICPath != req.PeerNICPath || len(ans.QPNums) != 2 || ans.QPNums[0] != 90 {
		t.Fatalf("handshake: %+v, %v", ans, err)
	}
	req.QPNums = req.QPNums[:1]
	if _, err := c.Handshake(ctx, s.Name(), req); !errors.Is(err, ErrHandshakeRefused) {
		t.Fatalf("refused handshake: %v", err)
	}
	// A descriptor-less daemon answers null: FetchDesc gives nil.
	if d, err := c.FetchDesc(ctx, s.Name(), nil); err != nil || d != nil {
		t.Fatalf("FetchDesc: %+v, %v", d, err)
	}
	// A canceled context fails with its error.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := c.Probe(cctx, s.Name()); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled: %v", err)
	}
	addr := s.Name()
	s.Close()
	if err := c.Probe(ctx, addr); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("closed daemon: %v", err)
	}
}
