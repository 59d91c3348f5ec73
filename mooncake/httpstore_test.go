package mooncake

import (
	"errors"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

func newStore(t testing.TB, f *fakeServer, keys Keys) *Store {
	s, err := NewHTTPStore(HTTPConfig{URL: f.url(), Keys: keys, PollInterval: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestStoreConformance runs the Store suite against both flavours of
// the fake server. What differs from the contract (no atomic epoch checks,
// polling watches) is not exercised by the suite, which has one writer
// per name.
func TestStoreConformance(t *testing.T) {
	for _, strict := range []bool{true, false} {
		name := "example"
		if strict {
			name = "master"
		}
		t.Run(name, func(t *testing.T) {
			storetest.Run(t, func(t *testing.T) metadata.Store {
				return newStore(t, newFakeServer(t, strict), Keys{})
			})
		})
	}
}

// TestStoreReadsMooncake: documents a Mooncake engine wrote are read
// and converted, its rpc_meta entry giving the host.
func TestStoreReadsMooncake(t *testing.T) {
	f := newFakeServer(t, true)
	k := Keys{ClusterID: "prod"}
	doc, _ := os.ReadFile("testdata/tcp.json")
	rpc, _ := os.ReadFile("testdata/rpc_meta.json")
	f.set("mooncake/prod/ram/10.1.0.7:15001", doc)
	f.set("mooncake/prod/rpc_meta/10.1.0.7:15001", rpc)
	s := newStore(t, f, k)
	d, err := s.Get(t.Context(), "10.1.0.7:15001")
	if err != nil {
		t.Fatal(err)
	}
	if d.Epoch != 0 || d.Endpoints[TransportTCP] != "10.1.0.7:16734" || d.Endpoints[EndpointTCPVersion] != "2" ||
		d.Endpoints[EndpointRPC] != "10.1.0.7:15001" || len(d.Buffers) != 2 || d.Buffers[0].Addr != 140397692583936 {
		t.Fatalf("got %+v", d)
	}
	// Another cluster sees nothing.
	if _, err := newStore(t, f, Keys{}).Get(t.Context(), "10.1.0.7:15001"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("default cluster: %v", err)
	}
	// A moonring engine may not take a Mooncake engine's name.
	mine := &segtable.SegmentDesc{Version: 1, Name: "10.1.0.7:15001", Epoch: 9, Endpoints: map[string]string{}}
	if err := s.Put(t.Context(), mine); !errors.Is(err, metadata.ErrExists) {
		t.Fatalf("Put over a Mooncake descriptor: %v", err)
	}
	if err := s.Delete(t.Context(), "10.1.0.7:15001", 9); !errors.Is(err, metadata.ErrEpoch) {
		t.Fatalf("Delete of a Mooncake descriptor with an epoch: %v", err)
	}
	// A watch sees it, and sees it go.
	ch, err := s.Watch(t.Context(), "10.1.0.7:15001")
	if err != nil {
		t.Fatal(err)
	}
	if ev := <-ch; ev.Deleted || ev.Desc.Endpoints[TransportTCP] != "10.1.0.7:16734" {
		t.Fatalf("first event %+v", ev)
	}
	if err := s.Delete(t.Context(), "10.1.0.7:15001", 0); err != nil {
		t.Fatal(err)
	}
	if ev := <-ch; !ev.Deleted {
		t.Fatalf("event after Delete %+v", ev)
	}
	if ks := f.keys(); len(ks) != 0 {
		t.Fatalf("left behind: %v", ks)
	}
}

// TestStorePublishesMooncake: what Put writes is a descriptor and an
// rpc_meta entry a Mooncake engine reads.
func TestStorePublishesMooncake(t *testing.T) {
	f := newFakeServer(t, true)
	s := newStore(t, f, Keys{})
	d := publishable()
	if err := s.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	raw, ok := f.get("mooncake/ram/10.2.0.1:15100")
	if !ok {
		t.Fatalf("nothing under the ram key; keys %v", f.keys())
	}
	md, err := Decode(raw)
	if err != nil {
		t.Fatal(err)
	}
	if md.Protocol != "rdma" || md.TCPDataPort != 16000 || len(md.Devices) != 2 || md.Timestamp == "" {
		t.Fatalf("published %+v", md)
	}
	rb, ok := f.get("mooncake/rpc_meta/10.2.0.1:15100")
	if !ok {
		t.Fatal("no rpc_meta entry")
	}
	if r, err := DecodeRPCMeta(rb); err != nil || *r != (RPCMeta{"10.2.0.1", 15100}) {
		t.Fatalf("rpc_meta %q: %v", rb, err)
	}
	// Republishing with another RPC port replaces the rpc_meta entry,
	// which the server would refuse to overwrite.
	d.Endpoints[EndpointRPC] = "10.2.0.1:15101"
	if err := s.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	rb, _ = f.get("mooncake/rpc_meta/10.2.0.1:15100")
	if r, err := DecodeRPCMeta(rb); err != nil || r.RPCPort != 15101 {
		t.Fatalf("rpc_meta after republish %q: %v", rb, err)
	}
	got, err := s.Get(t.Context(), d.Name)
	if err != nil || got.Endpoints[EndpointRPC] != "10.2.0.1:15101" || got.Epoch != d.Epoch {
		t.Fatalf("Get: %+v, %v", got, err)
	}
	if err := s.Delete(t.Context(), d.Name, d.Epoch); err != nil {
		t.Fatal(err)
	}
	if ks := f.keys(); len(ks) != 0 {
		t.Fatalf("left behind: %v", ks)
	}
}

// TestStoreBadServer: garbage from the server is an error, never a
// descriptor, and an oversized answer is refused.
func TestStoreBadServer(t *testing.T) {
	f := newFakeServer(t, false)
	s := newStore(t, f, Keys{})
	for _, body := range []string{"", "null", "[]", `{"name":"x"}`, `{"name":"x","protocol":"tcp","buffers":[{"name":"x","addr":0,"length":1}]}`,
		string(make([]byte, MaxDocBytes+1))} {
		f.set("mooncake/ram/x", []byte(body))
		if d, err := s.Get(t.Context(), "x"); err == nil || !errors.Is(err, segtable.ErrBadDesc) {
			t.Errorf("Get of %.40q: %+v, %v", body, d, err)
		}
	}
	// A document that names another segment.
	doc, _ := os.ReadFile("testdata/tcp-v1.json")
	f.set("mooncake/ram/x", doc)
	if _, err := s.Get(t.Context(), "x"); !errors.Is(err, segtable.ErrBadDesc) {
		t.Errorf("Get of another segment's document: %v", err)
	}
	if _, err := NewHTTPStore(HTTPConfig{URL: "ftp://x/metadata"}); err == nil {
		t.Error("ftp URL accepted")
	}
	if _, err := NewHTTPStore(HTTPConfig{URL: "http://x/metadata?a=b"}); err == nil {
		t.Error("URL with a query accepted")
	}
	if !slices.Contains([]string{s.String()}, "mooncake-http "+f.url()) {
		t.Error(s.String())
	}
}

// TestStoreNoRPCMeta: without an rpc_meta entry a segment name's port
// is not taken for the RPC port (outside P2PHANDSHAKE it is not one).
func TestStoreNoRPCMeta(t *testing.T) {
	f := newFakeServer(t, true)
	f.set("mooncake/ram/10.1.0.7:15001", readGolden(t, "tcp.json"))
	d, err := newStore(t, f, Keys{}).Get(t.Context(), "10.1.0.7:15001")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := d.Endpoints[EndpointRPC]; ok || d.Endpoints[TransportTCP] != "10.1.0.7:16734" {
		t.Fatalf("endpoints %v", d.Endpoints)
	}
}

// TestStoreSlashNames: a name with a slash, which Mooncake takes for a
// key path, is neither published nor deleted.
func TestStoreSlashNames(t *testing.T) {
	f := newFakeServer(t, true)
	s := newStore(t, f, Keys{})
	d := &segtable.SegmentDesc{Version: 1, Name: "rpc_meta/victim", Endpoints: map[string]string{}}
	if err := s.Put(t.Context(), d); !errors.Is(err, segtable.ErrBadDesc) {
		t.Fatalf("Put: %v", err)
	}
	f.set("mooncake/rpc_meta/victim", readGolden(t, "rpc_meta.json"))
	if err := s.Delete(t.Context(), "rpc_meta/victim", 0); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("Delete: %v", err)
	}
	if _, ok := f.get("mooncake/rpc_meta/victim"); !ok {
		t.Fatal("deleted through a slash name")
	}
}
