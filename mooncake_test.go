package moonring_test

import (
	"bytes"
	"context"
	"net"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
)

// mooncakeEngine is an engine in Mooncake mode with P2PHANDSHAKE metadata:
// its segment is named by its RPC port. With key, it also runs moonring's
// TCP transport and signs its descriptor.
func mooncakeEngine(t *testing.T, key []byte, transports ...string) *moonring.Engine {
	t.Helper()
	cfg := moonring.Config{Mooncake: &moonring.MooncakeConfig{}, Key: key, Transports: transports}
	if key != nil {
		cfg.TCP = &tcp.Config{}
	}
	e, err := moonring.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// Two engines in Mooncake mode reach each other as Mooncake engines do:
// the segment is the RPC port's ip:port, the descriptor comes from the
// peer's RPC port in Mooncake's schema, and the bytes go over Mooncake's
// TCP data protocol (version 2), both ways, checked.
func TestMooncakeModeP2P(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a := mooncakeEngine(t, nil, mctcp.Name)
	b := mooncakeEngine(t, nil, mctcp.Name)
	if _, _, err := net.SplitHostPort(b.Name()); err != nil {
		t.Fatalf("segment name %q: want the RPC port's ip:port (%v)", b.Name(), err)
	}
	src := make([]byte, 3<<20)
	fill(src, 7)
	if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	dst, err := b.Alloc(len(src), "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	if name, err := a.SegmentTransport(seg); err != nil || name != mctcp.Name {
		t.Fatalf("segment transport %q, %v; want %s", name, err, mctcp.Name)
	}
	req := moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg, TargetOffset: uint64(moonring.AddressOf(dst)), Length: uint64(len(src))}
	if err := a.Transfer(ctx, req); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("WRITE over Mooncake's TCP: data differs")
	}
	clear(src)
	req.Opcode = moonring.Read
	if err := a.Transfer(ctx, req); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("READ over Mooncake's TCP: data differs")
	}
	// Outside the registered buffer: refused by the target, nothing moved.
	req.TargetOffset += uint64(len(dst))
	req.Length = 4096
	if err := a.Transfer(ctx, req); err == nil {
		t.Fatal("a READ past the target's buffer succeeded")
	}
	// A WRITE with a notification: the bytes, then Mooncake's notify
	// frame on b's RPC port, delivered as a Notification (no tag:
	// Mooncake's notifications have none).
	req = moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg, TargetOffset: uint64(moonring.AddressOf(dst)), Length: 4096,
		Notify: &moonring.Notify{Tag: 9, Msg: []byte("kv ready")}}
	if err := a.Transfer(ctx, req); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-b.Notifications():
		if n.From != a.Name() || string(n.Msg) != "kv ready" {
			t.Fatalf("notification %+v: want from %s, \"kv ready\"", n, a.Name())
		}
	case <-ctx.Done():
		t.Fatal("no notification")
	}
	// What b publishes is what a Mooncake requester reads off its RPC
	// port: Mooncake's schema, with the TCP data port and version.
	d, err := new(mooncake.RPCClient).FetchDesc(ctx, b.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if d == nil || d.Name != b.Name() || len(d.Buffers) != 1 || d.TCPDataPort == 0 {
		t.Fatalf("b's descriptor as Mooncake reads it: %+v", d)
	}
}

// With a segment key, an engine in Mooncake mode signs what it publishes
// (a keyed peer then uses moonring's own TCP to it), and takes a peer's
// unsigned descriptor (a Mooncake engine's) only cut down to Mooncake's
// transport.
func TestMooncakeModeSigned(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	key := []byte("mooncake mode key")
	a := mooncakeEngine(t, key, "tcp", mctcp.Name) // not "local": the peers are in this process
	signedPeer := mooncakeEngine(t, key)
	unsignedPeer := mooncakeEngine(t, nil) // as a Mooncake engine: no MACs
	for _, tc := range []struct {
		peer *moonring.Engine
		want string
	}{{signedPeer, "tcp"}, {unsignedPeer, mctcp.Name}} {
		dst, err := tc.peer.Alloc(1<<20, "cpu:0")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tc.peer.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
			t.Fatal(err)
		}
		seg, err := a.OpenSegment(ctx, tc.peer.Name())
		if err != nil {
			t.Fatal(err)
		}
		if name, _ := a.SegmentTransport(seg); name != tc.want {
			t.Errorf("%s: transport %q; want %q", tc.peer.Name(), name, tc.want)
		}
		src := make([]byte, len(dst))
		fill(src, 3)
		if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
			t.Fatal(err)
		}
		if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg, TargetOffset: uint64(moonring.AddressOf(dst)), Length: uint64(len(src))}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(dst, src) {
			t.Fatalf("%s: data differs", tc.want)
		}
	}
}

// An unsigned descriptor, which a keyed engine in Mooncake mode takes cut
// down to Mooncake's transports, does not withdraw the others: a forger
// who can write the store cannot take the segment's tcp path down and
// move it onto Mooncake's unauthenticated one.
func TestMooncakeUnsignedWithdrawsNothing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	key := []byte("mooncake mode key")
	store := metadata.NewMemory()
	mk := func() *moonring.Engine {
		e, err := moonring.New(moonring.Config{Mooncake: &moonring.MooncakeConfig{}, Key: key, TCP: &tcp.Config{}, Metadata: store,
			Transports: []string{"tcp", mctcp.Name}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	a, b := mk(), mk()
	dst, err := b.Alloc(1<<20, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both paths open", func() bool {
		info, err := a.Segment(seg)
		return err == nil && len(info.Paths) == 2 && info.Paths[0].Up && info.Paths[1].Up
	})
	info, err := a.Segment(seg)
	if err != nil || info.Transport != "tcp" {
		t.Fatalf("segment %+v (%v): want on tcp", info, err)
	}
	forged := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: b.Name(), Epoch: info.Epoch,
		Endpoints: map[string]string{mctcp.Name: "127.0.0.1:9", mooncake.EndpointRPC: "127.0.0.1:9"}}
	if err := store.Put(ctx, forged); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the forged descriptor taken", func() bool {
		info, err := a.Segment(seg)
		return err == nil && len(info.Buffers) == 0
	})
	if name, err := a.SegmentTransport(seg); err != nil || name != "tcp" {
		t.Fatalf("after an unsigned descriptor the segment is on %q (%v); want tcp", name, err)
	}
}
