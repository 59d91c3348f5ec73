package mcetcd_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/mooncake/mcetcd"
	"github.com/moonring/moonring/segtable"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

var clusters atomic.Int64

// cluster returns a cluster id no other store of this process uses, so
// that one etcd serves every test.
func cluster() string { return fmt.Sprintf("test-%d", clusters.Add(1)) }

func newStore(t *testing.T, ep, cluster string) *mooncake.Store {
	t.Helper()
	s, err := mcetcd.NewStore(etcd.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second},
		mooncake.StoreConfig{Keys: mooncake.Keys{ClusterID: cluster}, PollInterval: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func rawEtcd(t *testing.T, ep string) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestEtcd runs the Store suite over etcd, and reads and writes Mooncake's
// keys as a Mooncake engine does (plain Put/Get/Delete of the key, the
// JSON as it is).
func TestEtcd(t *testing.T) {
	srv := etcdtest.Start(t)
	ep := srv.Endpoint()
	t.Run("Suite", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) metadata.Store { return newStore(t, ep, cluster()) })
	})
	t.Run("Peer", func(t *testing.T) {
		var c string
		storetest.RunOptions(t, func(t *testing.T) metadata.Store {
			c = cluster()
			return newStore(t, ep, c)
		}, storetest.Options{Peer: func(t *testing.T, _ metadata.Store) metadata.Store { return newStore(t, ep, c) }})
	})
	t.Run("MooncakeKeys", func(t *testing.T) {
		raw := rawEtcd(t, ep)
		ctx := t.Context()
		doc, err := os.ReadFile("../testdata/tcp.json")
		if err != nil {
			t.Fatal(err)
		}
		rpc, _ := os.ReadFile("../testdata/rpc_meta.json")
		if _, err := raw.Put(ctx, "mooncake/prod/ram/10.1.0.7:15001", string(doc)); err != nil {
			t.Fatal(err)
		}
		raw.Put(ctx, "mooncake/prod/rpc_meta/10.1.0.7:15001", string(rpc))
		s := newStore(t, ep, "prod")
		d, err := s.Get(ctx, "10.1.0.7:15001")
		if err != nil {
			t.Fatal(err)
		}
		if d.Epoch != 0 || d.Endpoints[mooncake.TransportTCP] != "10.1.0.7:16734" || d.Endpoints[mooncake.EndpointRPC] != "10.1.0.7:15001" {
			t.Fatalf("read %+v", d)
		}
		// What we publish is under Mooncake's keys, readable by its decoder.
		mine := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "10.2.0.1:15100", Epoch: 3,
			Endpoints: map[string]string{mooncake.EndpointRPC: "10.2.0.1:15100", mooncake.TransportTCP: "10.2.0.1:16000"},
			Buffers:   []segtable.BufferDesc{{Addr: 1 << 20, Length: 4096, Keys: map[string]string{mooncake.TransportTCP: ""}}}}
		if err := s.Put(ctx, mine); err != nil {
			t.Fatal(err)
		}
		resp, err := raw.Get(ctx, "mooncake/prod/ram/10.2.0.1:15100")
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("raw get: %v", err)
		}
		if md, err := mooncake.Decode(resp.Kvs[0].Value); err != nil || md.TCPDataPort != 16000 {
			t.Fatalf("published %+v, %v", md, err)
		}
		resp, _ = raw.Get(ctx, "mooncake/prod/rpc_meta/10.2.0.1:15100")
		if len(resp.Kvs) != 1 || resp.Kvs[0].Lease != 0 {
			t.Fatalf("rpc_meta %+v", resp.Kvs)
		}
		if err := s.Delete(ctx, mine.Name, 3); err != nil {
			t.Fatal(err)
		}
		if resp, _ := raw.Get(ctx, "mooncake/prod/", clientv3.WithPrefix()); len(resp.Kvs) != 2 {
			t.Fatalf("left %d keys, want the Mooncake engine's 2", len(resp.Kvs))
		}
	})
	t.Run("Oversize", func(t *testing.T) {
		kv, err := mcetcd.NewKV(etcd.Config{Endpoints: []string{ep}})
		if err != nil {
			t.Fatal(err)
		}
		defer kv.Close()
		if err := kv.Put(t.Context(), "mooncake/x/big", make([]byte, 100)); err != nil {
			t.Fatal(err)
		}
		if _, _, err := kv.Get(t.Context(), "mooncake/x/big", 99); !errors.Is(err, mooncake.ErrBadDoc) {
			t.Fatalf("oversize: %v", err)
		}
		if v, ok, err := kv.Get(t.Context(), "mooncake/x/big", 100); err != nil || !ok || len(v) != 100 {
			t.Fatalf("get: %d, %v, %v", len(v), ok, err)
		}
		if ok, err := kv.Delete(t.Context(), "mooncake/x/big"); !ok || err != nil {
			t.Fatalf("delete: %v, %v", ok, err)
		}
		if ok, err := kv.Delete(t.Context(), "mooncake/x/big"); ok || err != nil {
			t.Fatalf("second delete: %v, %v", ok, err)
		}
	})
}

// TestUnreachable: an etcd that is not there fails calls with
// ErrUnreachable within the timeout.
func TestUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	kv, err := mcetcd.NewKV(etcd.Config{Endpoints: []string{addr}, DialTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer kv.Close()
	if _, _, err := kv.Get(t.Context(), "k", 10); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("get: %v", err)
	}
}

func TestEndpoints(t *testing.T) {
	for in, want := range map[string][]string{
		"etcd://10.0.0.1:2379;10.0.0.2:2379": {"10.0.0.1:2379", "10.0.0.2:2379"},
		"10.0.0.1:2379":                      {"10.0.0.1:2379"},
		"etcd://a:1;;":                       {"a:1"},
		"":                                   nil,
	} {
		if got := mcetcd.Endpoints(in); !slices.Equal(got, want) {
			t.Errorf("Endpoints(%q) = %q, want %q", in, got, want)
		}
	}
	if _, err := mcetcd.NewKV(etcd.Config{}); err == nil {
		t.Error("no endpoints accepted")
	}
}
