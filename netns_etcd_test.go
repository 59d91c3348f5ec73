package moonring_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	etcdstore "github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/tcp"
)

// TestNetnsEtcdDiscovery: two "hosts" (the root namespace and a network
// namespace joined by a veth pair) that find each other through etcd: the
// target publishes its segment under a lease, the initiator opens it by
// name, moves bytes over the veth, and once the target is killed its
// segment disappears from etcd when the lease runs out.
func TestNetnsEtcdDiscovery(t *testing.T) {
	e2eLeaks(t)
	n := netnsSetup(t)
	etcd := etcdtest.StartOn(t, n.hostIP)
	const size = 4 << 20
	const name = "netns-etcd-target"
	c := startChildVia(t, []string{"ip", "netns", "exec", n.name}, "target",
		"MOONRING_SIZE="+strconv.Itoa(size), "MOONRING_LISTEN="+net.JoinHostPort(n.nsIP, "0"),
		"MOONRING_ETCD="+etcd.Endpoint(), "MOONRING_NAME="+name, "MOONRING_ETCD_TTL=2s")
	store, err := etcdstore.New(etcdstore.Config{Endpoints: []string{etcd.Endpoint()}})
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	e, err := moonring.New(moonring.Config{Metadata: store, Transports: []string{"tcp"}, TCP: &tcp.Config{Key: childKey}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	seg, err := e.OpenSegment(ctx, name)
	if err != nil {
		t.Fatalf("open %s through etcd: %v", name, err)
	}
	d, err := store.Get(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if ep := d.Endpoints["tcp"]; len(ep) < len(n.nsIP) || ep[:len(n.nsIP)] != n.nsIP {
		t.Fatalf("the target's tcp endpoint is %q, want one on %s", ep, n.nsIP)
	}
	remote := d.AllBuffers()[0].Addr
	src := make([]byte, 1<<20)
	back := make([]byte, len(src))
	fill(src, 17)
	e.RegisterLocalMemory(src, "cpu:0", false)
	e.RegisterLocalMemory(back, "cpu:0", false)
	defer e.UnregisterLocalMemory(ctx, src)
	defer e.UnregisterLocalMemory(ctx, back)
	if err := e.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg, TargetOffset: remote + 4096, Length: uint64(len(src))}); err != nil {
		t.Fatal(err)
	}
	if err := e.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(back), TargetID: seg, TargetOffset: remote + 4096, Length: uint64(len(back))}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, back) {
		t.Fatal("data differs after a round trip over the veth")
	}
	// The target dies without withdrawing its segment: its lease does.
	c.Kill()
	deadline := time.Now().Add(30 * time.Second) // a hang detector; the lease is 2 s
	for {
		_, err := store.Get(ctx, name)
		if errors.Is(err, metadata.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the killed target's segment is still in etcd: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err := e.CloseSegment(ctx, seg); err != nil {
		t.Fatal(err)
	}
}
