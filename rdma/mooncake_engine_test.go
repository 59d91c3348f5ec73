//go:build rdma && cgo

package rdma_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/rdma"
	"github.com/moonring/moonring/segtable"
)

// mcRDMAEngine starts an engine in Mooncake mode with Mooncake's RDMA
// transport (P2PHANDSHAKE unless store is given, then named name), or
// skips where there is no RDMA device (fails inside the VM).
func mcRDMAEngine(t *testing.T, store metadata.Store, name string, rc rdma.Config) *moonring.Engine {
	return mcRDMAEngineTimeout(t, store, name, rc, 0)
}

// mcRDMAEngineTimeout is mcRDMAEngine with the engine's request timeout
// (0: the default).
func mcRDMAEngineTimeout(t *testing.T, store metadata.Store, name string, rc rdma.Config, timeout time.Duration) *moonring.Engine {
	t.Helper()
	cfg := moonring.Config{Name: name, Metadata: store, Transports: []string{rdma.MooncakeName},
		Mooncake: &moonring.MooncakeConfig{RDMA: &rc}, Timeout: timeout}
	e, err := moonring.New(cfg)
	if err != nil {
		if errors.Is(err, rdma.ErrNoDevice) && os.Getenv("MOONRING_RDMA_REQUIRE") != "1" {
			t.Skipf("SKIP: no RDMA device here (%v); this test runs against Soft-RoCE in a VM: make test-rdma", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("Engine.Close: %v", err)
		}
	})
	return e
}

// mooncakeOnlyStore reads a P2PHANDSHAKE segment's descriptor as a
// Mooncake engine serves it: the moonring extension dropped, so that the
// initiator works from Mooncake's members alone (NICs, decimal rkeys, RPC
// port). It publishes nothing anywhere (the peer never looks this engine
// up) and watches nothing.
type mooncakeOnlyStore struct{ metadata.Store }

func (s mooncakeOnlyStore) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	var c mooncake.RPCClient
	d, err := c.FetchDesc(ctx, name, nil)
	if err != nil {
		return nil, err
	}
	if d == nil {
		return nil, metadata.ErrNotFound
	}
	d.Moonring = nil
	return mooncake.ToSegtable(d, nil)
}

// Two moonring engines through Mooncake's RDMA wire alone: the initiator
// reads the target's descriptor in Mooncake's schema, connects its queue
// pairs through the target's RPC port (the handshake and the ready
// acknowledgement), and WRITEs and READs with the rkeys the descriptor
// publishes; a local-only buffer and one unregistered since are not
// reachable; a notification goes over the RPC port.
func TestMooncakeRDMAEngines(t *testing.T) {
	a := mcRDMAEngine(t, nil, "", rdma.Config{})
	b := mcRDMAEngine(t, mooncakeOnlyStore{metadata.NewMemory()}, "mc-rdma-initiator", rdma.Config{})
	const size = 128 << 10
	src, back, dst, hidden := make([]byte, size), make([]byte, size), make([]byte, size), make([]byte, 4096)
	r := rand.New(rand.NewPCG(18, 1))
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	for _, m := range [][]byte{src, back} {
		if _, err := b.RegisterLocalMemory(m, "cpu:0", false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := a.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	if _, err := a.RegisterLocalMemory(hidden, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The target answers only handshakes it can use.
	var c mooncake.RPCClient
	nics := a.Transport(rdma.MooncakeName).(interface{ ExtraEndpoints() map[string]string }).ExtraEndpoints()[mooncake.EndpointRDMANICs]
	dev, _, _ := strings.Cut(nics, "/")
	good := mooncake.HandshakeDesc{LocalNICPath: "peer:1@dev9", PeerNICPath: mooncake.NICPath(a.Name(), dev),
		LocalGID: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01", QPNums: []uint32{100, 101}, ReadyAckSupported: true}
	for what, mod := range map[string]func(h *mooncake.HandshakeDesc){
		"another server":            func(h *mooncake.HandshakeDesc) { h.PeerNICPath = mooncake.NICPath("10.9.9.9:1", dev) },
		"no such device":            func(h *mooncake.HandshakeDesc) { h.PeerNICPath = mooncake.NICPath(a.Name(), "nodev") },
		"a bad GID":                 func(h *mooncake.HandshakeDesc) { h.LocalGID = "fe80::1" },
		"no queue pairs":            func(h *mooncake.HandshakeDesc) { h.QPNums = nil },
		"a ready ack for nothing":   func(h *mooncake.HandshakeDesc) { h.ReadyAck = true },
		"too many queue pairs":      func(h *mooncake.HandshakeDesc) { h.QPNums = make([]uint32, mooncake.MaxRDMAQPs+1) },
		"a NIC path without @":      func(h *mooncake.HandshakeDesc) { h.LocalNICPath = "peer" },
		"queue pair number 1 (GSI)": func(h *mooncake.HandshakeDesc) { h.QPNums = []uint32{1} },
	} {
		h := good
		mod(&h)
		if ans, err := c.Handshake(ctx, a.MooncakeRPC(), &h); !errors.Is(err, mooncake.ErrHandshakeRefused) || ans.ReplyMsg == "" {
			t.Errorf("a handshake with %s: %+v, %v", what, ans, err)
		}
	}
	// One it can: as many queue pairs as asked, the NIC paths crossed,
	// the same answer to the same request, the acknowledgement checked
	// against the queue pairs it names, and a new set for new ones.
	ans, err := c.Handshake(ctx, a.MooncakeRPC(), &good)
	if err != nil {
		t.Fatal(err)
	}
	ra, err := ans.RDMA()
	if err != nil || len(ra.QPNums) != 2 || ans.LocalNICPath != good.PeerNICPath || ans.PeerNICPath != good.LocalNICPath || !ra.ReadyAckSupported {
		t.Fatalf("answer %+v, %v", ans, err)
	}
	if again, err := c.Handshake(ctx, a.MooncakeRPC(), &good); err != nil || !slices.Equal(again.QPNums, ans.QPNums) {
		t.Errorf("the same request answered %v, %v; first %v", again.QPNums, err, ans.QPNums)
	}
	ack := good
	ack.ReadyAck = true
	if _, err := c.Handshake(ctx, a.MooncakeRPC(), &ack); err != nil {
		t.Errorf("ready ack: %v", err)
	}
	ack.QPNums = []uint32{100, 102}
	if _, err := c.Handshake(ctx, a.MooncakeRPC(), &ack); !errors.Is(err, mooncake.ErrHandshakeRefused) {
		t.Errorf("a stale ready ack: %v", err)
	}
	renew := good
	renew.QPNums = []uint32{200, 201}
	if again, err := c.Handshake(ctx, a.MooncakeRPC(), &renew); err != nil || slices.Equal(again.QPNums, ans.QPNums) {
		t.Errorf("new queue pairs answered %v, %v; first %v", again.QPNums, err, ans.QPNums)
	}

	seg, err := b.OpenSegment(ctx, a.Name())
	if err != nil {
		t.Fatal(err)
	}
	base := uint64(moonring.AddressOf(dst))
	off := 0
	for _, n := range []int{1, 7, 4096, 4096 + 3, 32 << 10, 64<<10 + 5} {
		if err := b.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src[off:]),
			TargetID: seg, TargetOffset: base + uint64(off), Length: uint64(n)}); err != nil {
			t.Fatalf("WRITE of %d bytes: %v", n, err)
		}
		if !bytes.Equal(dst[off:off+n], src[off:off+n]) {
			t.Fatalf("WRITE of %d bytes: data differs", n)
		}
		if err := b.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(back[off:]),
			TargetID: seg, TargetOffset: base + uint64(off), Length: uint64(n)}); err != nil {
			t.Fatalf("READ of %d bytes: %v", n, err)
		}
		if !bytes.Equal(back[off:off+n], src[off:off+n]) {
			t.Fatalf("READ of %d bytes: data differs", n)
		}
		off += n
	}
	if st := b.Transport(rdma.MooncakeName).(*rdma.Transport).Stats(); st.Slices == 0 || st.QPs == 0 {
		t.Fatalf("the initiator's Mooncake RDMA transport moved nothing: %+v", st)
	}
	// The target holds the test's set (2, replaced once) and the
	// initiator's (QPsPerDevice per device).
	ndev := len(strings.Split(nics, ","))
	if st := a.Transport(rdma.MooncakeName).(*rdma.Transport).Stats(); st.PeerQPs != 2+ndev*rdma.DefaultQPsPerDevice || st.PeerEvictions != 0 {
		t.Errorf("the target holds %d peer queue pairs (%d evictions); want %d", st.PeerQPs, st.PeerEvictions, 2+ndev*rdma.DefaultQPsPerDevice)
	}
	// Outside the target's remote memory: refused before anything is
	// posted.
	for what, at := range map[string]uint64{"past the end": base + size - 10, "a local-only buffer": uint64(moonring.AddressOf(hidden))} {
		if err := b.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(back),
			TargetID: seg, TargetOffset: at, Length: 20}); err == nil {
			t.Fatalf("a READ of %s succeeded", what)
		}
	}
	// A notification travels Mooncake's RPC port.
	if err := b.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src),
		TargetID: seg, TargetOffset: base, Length: 4096, Notify: &moonring.Notify{Msg: []byte("kv ready")}}); err != nil {
		t.Fatalf("WRITE with notify: %v", err)
	}
	select {
	case n := <-a.Notifications():
		if n.From != b.Name() || string(n.Msg) != "kv ready" {
			t.Fatalf("notification %+v; want from %s, \"kv ready\"", n, b.Name())
		}
	case <-ctx.Done():
		t.Fatal("no notification arrived")
	}
	// The target unregisters the buffer: its region goes, and the
	// initiator, which does not hear of it (its store watches nothing),
	// fails with the rkey it still holds, without hanging; the engine
	// stays usable.
	if err := a.UnregisterLocalMemory(ctx, dst); err != nil {
		t.Fatal(err)
	}
	err = b.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(back),
		TargetID: seg, TargetOffset: base, Length: 4096})
	if err == nil {
		t.Fatal("a READ of an unregistered buffer succeeded")
	}
	t.Logf("READ after the target unregistered: %v", err)
}

// The target's bound on peers' queue pairs: past MaxPeerQPs the set
// connected longest ago goes (its ready acknowledgement is then refused),
// and a set larger than the bound is refused.
func TestMooncakeRDMAPeerBound(t *testing.T) {
	a := mcRDMAEngine(t, nil, "", rdma.Config{MaxPeerQPs: 4})
	tr := a.Transport(rdma.MooncakeName).(*rdma.Transport)
	nics := tr.ExtraEndpoints()[mooncake.EndpointRDMANICs]
	dev, _, _ := strings.Cut(nics, "/")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var c mooncake.RPCClient
	req := func(peer string, qps ...uint32) *mooncake.HandshakeDesc {
		return &mooncake.HandshakeDesc{LocalNICPath: peer + "@dev0", PeerNICPath: mooncake.NICPath(a.Name(), dev),
			LocalGID: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01", QPNums: qps, ReadyAckSupported: true}
	}
	for i, p := range []string{"p1:1", "p2:1", "p3:1"} {
		if _, err := c.Handshake(ctx, a.MooncakeRPC(), req(p, uint32(100+2*i), uint32(101+2*i))); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
	}
	if st := tr.Stats(); st.PeerQPs != 4 || st.PeerEvictions != 1 {
		t.Fatalf("%d peer queue pairs, %d evictions; want 4 and 1", st.PeerQPs, st.PeerEvictions)
	}
	ack := req("p1:1", 100, 101)
	ack.ReadyAck = true
	if _, err := c.Handshake(ctx, a.MooncakeRPC(), ack); !errors.Is(err, mooncake.ErrHandshakeRefused) {
		t.Errorf("the evicted set's ready ack: %v", err)
	}
	ack = req("p3:1", 104, 105)
	ack.ReadyAck = true
	if _, err := c.Handshake(ctx, a.MooncakeRPC(), ack); err != nil {
		t.Errorf("a live set's ready ack: %v", err)
	}
	if _, err := c.Handshake(ctx, a.MooncakeRPC(), req("p4:1", 1000, 1001, 1002, 1003, 1004)); !errors.Is(err, mooncake.ErrHandshakeRefused) {
		t.Errorf("a set over the bound: %v", err)
	}
}

// A target that goes away mid-use: the initiator's request ends with an
// error (its queue pairs' retries run out, the reconnect finds no RPC port,
// or the engine's request timeout), never hangs, and the initiator closes
// cleanly.
func TestMooncakeRDMATargetGone(t *testing.T) {
	a := mcRDMAEngine(t, nil, "", rdma.Config{})
	// A short request timeout: the request either fails (ErrPeer) or times
	// out, and the test need not wait the default 30 s to see which.
	b := mcRDMAEngineTimeout(t, mooncakeOnlyStore{metadata.NewMemory()}, "mc-rdma-initiator-2", rdma.Config{}, 3*time.Second)
	src, dst := make([]byte, 64<<10), make([]byte, 64<<10)
	for i := range src {
		src[i] = byte(i * 7)
	}
	if _, err := b.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := a.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	seg, err := b.OpenSegment(ctx, a.Name())
	if err != nil {
		t.Fatal(err)
	}
	req := moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
		TargetOffset: uint64(moonring.AddressOf(dst)), Length: uint64(len(src))}
	if err := b.Transfer(ctx, req); err != nil || !bytes.Equal(dst, src) {
		t.Fatalf("WRITE before the target went: %v (equal %v)", err, bytes.Equal(dst, src))
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	// dst is a's no more once a is closed: the bytes are not looked at.
	if err := b.Transfer(ctx, req); err == nil {
		t.Fatal("a WRITE to a closed target succeeded")
	} else if ctx.Err() != nil {
		t.Fatalf("the WRITE ran out the test's context: %v", err)
	} else {
		t.Logf("WRITE after the target closed: %v", err)
	}
}

// Mooncake mode refuses a configuration it cannot publish, before it
// opens any device.
func TestMooncakeConfigRefused(t *testing.T) {
	for _, m := range []rdma.MooncakeMode{{Server: "a:1", RPC: "no-port"}, {Server: "", RPC: "127.0.0.1:1"}, {Server: "a@b", RPC: "127.0.0.1:1"}} {
		if tr, err := rdma.New(rdma.Config{Mooncake: &m}); !errors.Is(err, rdma.ErrMooncakeConfig) {
			if tr != nil {
				tr.Close()
			}
			t.Errorf("%+v: %v", m, err)
		}
	}
}

// A target that replaces the initiator's queue pairs (as when it takes a
// new handshake from the same NIC: here a forged one): the initiator's
// queue pairs fail, it connects its set again through a new handshake, and
// the engine's retry of the request succeeds with the bytes in place.
func TestMooncakeRDMAReconnect(t *testing.T) {
	a := mcRDMAEngine(t, nil, "", rdma.Config{})
	const name = "mc-rdma-initiator-3"
	b := mcRDMAEngine(t, mooncakeOnlyStore{metadata.NewMemory()}, name, rdma.Config{})
	src, dst := make([]byte, 64<<10), make([]byte, 64<<10)
	if _, err := b.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := a.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	seg, err := b.OpenSegment(ctx, a.Name())
	if err != nil {
		t.Fatal(err)
	}
	write := func(fill byte) error {
		for i := range src {
			src[i] = fill + byte(i)
		}
		err := b.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
			TargetOffset: uint64(moonring.AddressOf(dst)), Length: uint64(len(src))})
		if err == nil && !bytes.Equal(dst, src) {
			err = errors.New("data differs")
		}
		return err
	}
	if err := write(1); err != nil {
		t.Fatalf("first WRITE: %v", err)
	}
	bt := b.Transport(rdma.MooncakeName).(*rdma.Transport)
	before := bt.Stats().Reconnects
	// The forged handshake names b's NIC (its server name and first
	// device) with other queue pairs: a replaces b's set.
	bdev, _, _ := strings.Cut(bt.ExtraEndpoints()[mooncake.EndpointRDMANICs], "/")
	adev, _, _ := strings.Cut(a.Transport(rdma.MooncakeName).(*rdma.Transport).ExtraEndpoints()[mooncake.EndpointRDMANICs], "/")
	var c mooncake.RPCClient
	forged := &mooncake.HandshakeDesc{LocalNICPath: mooncake.NICPath(name, bdev), PeerNICPath: mooncake.NICPath(a.Name(), adev),
		LocalGID: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01", QPNums: []uint32{300, 301}, ReadyAckSupported: true}
	if _, err := c.Handshake(ctx, a.MooncakeRPC(), forged); err != nil {
		t.Fatal(err)
	}
	if err := write(2); err != nil {
		t.Fatalf("WRITE after the target replaced the queue pairs: %v", err)
	}
	if st := bt.Stats(); st.Reconnects <= before {
		t.Errorf("no reconnect counted: %+v", st)
	}
}
