package metadata_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

var testKey = []byte("the deployment's segment key")

func signed(t *testing.T, s metadata.Store) *metadata.Signed {
	t.Helper()
	return signedBy(t, s, string(testKey))
}

func signedBy(t *testing.T, s metadata.Store, key string) *metadata.Signed {
	t.Helper()
	w, err := metadata.NewSigned(s, []byte(key), nil)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestSigned runs the store suite through Signed stores: what they publish
// is signed, and readers take it.
func TestSigned(t *testing.T) {
	t.Run("Memory", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) metadata.Store { return signed(t, metadata.NewMemory()) })
	})
	t.Run("P2P", func(t *testing.T) {
		storetest.RunOptions(t, func(t *testing.T) metadata.Store {
			return signed(t, newP2P(t, metadata.P2PConfig{}))
		}, storetest.Options{
			OwnName: func(s metadata.Store) string { return s.(*metadata.Signed).Name() },
			Peer: func(t *testing.T, _ metadata.Store) metadata.Store {
				return signed(t, newP2P(t, metadata.P2PConfig{}))
			},
		})
	})
	if _, err := metadata.NewSigned(metadata.NewMemory(), nil, nil); err == nil {
		t.Fatal("NewSigned accepted an empty key")
	}
}

// TestSignedPublishes: what a Signed store puts verifies under the key, and
// a buffer that stays keeps its MAC across republishes of one epoch (it is
// signed once).
func TestSignedPublishes(t *testing.T) {
	inner := metadata.NewMemory()
	s := signed(t, inner)
	d := testDesc("n", 5, "a")
	d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: 1 << 28, Length: 64, Location: "cpu:0", Keys: map[string]string{"tcp": "second"}})
	if err := s.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	if d.MAC != "" || d.Buffers[0].MAC != "" {
		t.Fatal("Put signed the caller's descriptor, not a copy")
	}
	raw, err := inner.Get(t.Context(), "n")
	if err != nil {
		t.Fatal(err)
	}
	v, _ := segtable.NewSigner(testKey)
	if err := v.Verify(raw); err != nil {
		t.Fatalf("published descriptor: %v", err)
	}
	d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: 1 << 30, Length: 64, Location: "cpu:0", Keys: map[string]string{"tcp": "new"}})
	d.Buffers[1].Keys["tcp"] = "changed"
	if err := s.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	again, _ := inner.Get(t.Context(), "n")
	if err := v.Verify(again); err != nil {
		t.Fatalf("republished descriptor: %v", err)
	}
	if again.AllBuffers()[0].MAC != raw.AllBuffers()[0].MAC || again.AllBuffers()[1].MAC == raw.AllBuffers()[1].MAC {
		t.Fatal("an unchanged buffer was re-signed or a changed one kept its MAC")
	}
}

// rawStore is a store's path for a party that writes exact bytes: an
// attacker, or the owner replaying nothing but what it signed.
type rawStore struct {
	reader metadata.Store              // what an engine reads through (wrapped by the test)
	put    func(*segtable.SegmentDesc) // publish d as it is, replacing any
	del    func(name string)
	name   func(n string) string // the name to use where the test picks n
}

// testRefuses checks that a Signed reader takes only descriptors signed
// with its key, and no older epoch than it has seen, from any store.
func testRefuses(t *testing.T, rs rawStore) {
	reader := signed(t, rs.reader)
	good, _ := segtable.NewSigner(testKey)
	bad, _ := segtable.NewSigner([]byte("not the key"))
	ctx := t.Context()

	name := rs.name("victim")
	mk := func(epoch uint64, tag string, s *segtable.Signer) *segtable.SegmentDesc {
		d := testDesc(name, epoch, tag)
		if s != nil {
			s.Sign(d)
		}
		return d
	}
	wantRefused := func(what string, target error) {
		t.Helper()
		d, err := reader.Get(ctx, name)
		if !errors.Is(err, metadata.ErrNotFound) || !errors.Is(err, target) {
			t.Fatalf("%s: Get = %+v, %v; want ErrNotFound and %v", what, d, err, target)
		}
	}
	rs.put(mk(10, "unsigned", nil))
	wantRefused("unsigned", metadata.ErrForged)
	rs.put(mk(10, "other key", bad))
	wantRefused("signed with another key", metadata.ErrForged)
	relay := mk(10, "relay", good)
	relay.Endpoints["tcp"] = "10.6.6.6:7001" // moved after signing
	rs.put(relay)
	wantRefused("endpoint moved to a relay", metadata.ErrForged)

	old := mk(10, "epoch 10", good)
	cur := mk(20, "epoch 20", good)
	rs.put(cur)
	if d, err := reader.Get(ctx, name); err != nil || d.Epoch != 20 {
		t.Fatalf("signed descriptor: Get = %+v, %v", d, err)
	}
	rs.put(old)
	wantRefused("replay of an older epoch", metadata.ErrStale)
	if st := reader.Refused(); st.Forged != 3 || st.Stale != 1 {
		t.Fatalf("Refused = %+v, want 3 forged and 1 stale", st)
	}

	// A watch hands on the signed descriptor and reports a forged one as
	// Deleted: the engine keeps what it had.
	rs.put(cur)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := reader.Watch(wctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 20 || ev.Desc.Endpoints["tcp"] != "epoch 20" {
		t.Fatalf("first event %+v", ev)
	}
	forged := mk(30, "forged", bad)
	rs.put(forged)
	// Every event until the watch has refused it is Deleted (a store may
	// report a withdrawal before the forged descriptor), and so is the one
	// that stands for it.
	var ev metadata.Event
	var events int
	take := func(wait time.Duration) bool {
		select {
		case ev = <-ch:
			events++
			if !ev.Deleted || ev.Desc.Endpoints["tcp"] != "epoch 20" {
				t.Fatalf("forged descriptor: event %+v, want Deleted of the last good one", ev)
			}
			return true
		case <-time.After(wait):
			return false
		}
	}
	for deadline := time.Now().Add(hang); reader.Refused().Forged < 4; take(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the watch never refused the forged descriptor")
		}
	}
	for take(100 * time.Millisecond) {
	}
	if events == 0 {
		t.Fatal("forged descriptor: no event")
	}
	rs.put(mk(40, "epoch 40", good))
	for ev = next(t, ch); ev.Deleted; ev = next(t, ch) {
	}
	if ev.Desc.Epoch != 40 {
		t.Fatalf("signed again: event %+v", ev)
	}
}

func TestSignedRefusesMemory(t *testing.T) {
	m := metadata.NewMemory()
	t.Cleanup(func() { m.Close() })
	testRefuses(t, rawStore{
		reader: m,
		put: func(d *segtable.SegmentDesc) {
			m.Delete(context.Background(), d.Name, 0)
			if err := m.Put(context.Background(), d); err != nil {
				t.Fatal(err)
			}
		},
		name: func(n string) string { return n },
	})
}

// TestSignedRefusesP2P: a peer (or whoever answers at its address) serving
// a forged or replayed descriptor.
func TestSignedRefusesP2P(t *testing.T) {
	var mu sync.Mutex
	var body []byte
	name := fakePeer(t, func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		b := bytes.Clone(body)
		mu.Unlock()
		if b == nil {
			http.NotFound(w, nil)
			return
		}
		w.Write(b)
	})
	testRefuses(t, rawStore{
		reader: newP2P(t, metadata.P2PConfig{}),
		put: func(d *segtable.SegmentDesc) {
			b, err := d.Marshal()
			if err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			body = b
			mu.Unlock()
		},
		name: func(string) string { return name },
	})
}

// TestSignedRefusesEtcd: whoever can write to etcd's keys.
func TestSignedRefusesEtcd(t *testing.T) {
	srv := etcdtest.Start(t)
	newEtcd := func() *etcd.Store {
		s, err := etcd.New(etcd.Config{Endpoints: []string{srv.Endpoint()}, Prefix: "/moonring-test/signed/"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	w := newEtcd()
	testRefuses(t, rawStore{
		reader: newEtcd(),
		put: func(d *segtable.SegmentDesc) {
			w.Delete(context.Background(), d.Name, 0)
			if err := w.Put(context.Background(), d); err != nil {
				t.Fatal(err)
			}
		},
		name: func(n string) string { return n },
	})
}

// TestSignedRefusesHTTP: whoever can write to a metadata server without
// the key (a name created without an owner token stays open to anyone).
func TestSignedRefusesHTTP(t *testing.T) {
	_, url := startServer(t, metadata.ServerConfig{})
	w := newHTTP(t, url, 0)
	testRefuses(t, rawStore{
		reader: newHTTP(t, url, 0),
		put: func(d *segtable.SegmentDesc) {
			w.Delete(context.Background(), d.Name, 0)
			if err := w.Put(context.Background(), d); err != nil {
				t.Fatal(err)
			}
		},
		name: func(n string) string { return n },
	})
}

// AllowUnsigned lets a descriptor with no signature through (a Mooncake
// engine's), cut down to the transports it names, so that it can never
// point an authenticated transport anywhere; a descriptor whose signature
// is there but wrong is still refused, as is an unsigned one left with no
// endpoint, and without AllowUnsigned every unsigned one.
func TestSignedAllowUnsigned(t *testing.T) {
	ctx := context.Background()
	inner := metadata.NewMemory()
	defer inner.Close()
	unsigned := func(name string, endpoints ...string) *segtable.SegmentDesc {
		d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: name, Endpoints: map[string]string{}}
		keys := map[string]string{}
		for _, e := range endpoints {
			d.Endpoints[e] = "127.0.0.1:9"
			keys[e] = "k"
		}
		d.Buffers = []segtable.BufferDesc{{Addr: 1 << 20, Length: 4096, Location: "cpu:0", Keys: keys}}
		if err := inner.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		return d
	}
	unsigned("mooncake", "mooncake-tcp", "mooncake-tcp.version", "mooncake-rpc", "tcp", "shm")
	unsigned("relay", "tcp", "shm")
	bad := unsigned("badmac", "mooncake-tcp")
	bad.MAC = "AAAAAAAAAAAAAAAAAAAAAA"
	if err := inner.Put(ctx, bad); err != nil {
		t.Fatal(err)
	}

	strict := signed(t, inner)
	if _, err := strict.Get(ctx, "mooncake"); !errors.Is(err, metadata.ErrForged) {
		t.Fatalf("without AllowUnsigned: %v, want ErrForged", err)
	}

	s := signed(t, inner)
	s.AllowUnsigned("mooncake-tcp", "mooncake-rpc")
	d, err := s.Get(ctx, "mooncake")
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Endpoints) != 3 || d.Endpoints["mooncake-tcp"] == "" || d.Endpoints["mooncake-tcp.version"] == "" || d.Endpoints["mooncake-rpc"] == "" {
		t.Errorf("endpoints %v: want the mooncake ones alone", d.Endpoints)
	}
	if k := d.Buffers[0].Keys; len(k) != 3 || k["tcp"] != "" || k["shm"] != "" {
		t.Errorf("buffer keys %v: want the mooncake ones alone", k)
	}
	if got := s.Refused(); got.Unsigned != 1 || got.Forged != 0 {
		t.Errorf("counts %+v: want one unsigned, none forged", got)
	}
	for _, name := range []string{"relay", "badmac"} {
		if _, err := s.Get(ctx, name); !errors.Is(err, metadata.ErrForged) {
			t.Errorf("%s: %v, want ErrForged", name, err)
		}
	}
	// A watch hands on the cut descriptor too.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.Watch(wctx, "mooncake")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-ch:
		if ev.Deleted || ev.Desc.Endpoints["tcp"] != "" || ev.Desc.Endpoints["mooncake-tcp"] == "" {
			t.Errorf("watch event %+v: want the cut descriptor", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no watch event")
	}
	cancel()
	for range ch {
	}
}

// An unsigned descriptor, which anyone who can write the store can make,
// moves nothing a reader remembers: one claiming the largest epoch does
// not make the name's later signed descriptors stale.
func TestUnsignedLocksNothingOut(t *testing.T) {
	ctx := context.Background()
	inner := metadata.NewMemory()
	defer inner.Close()
	pub := signed(t, inner)
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "peer", Epoch: 5, Endpoints: map[string]string{"tcp": "127.0.0.1:9", "mooncake-tcp": "127.0.0.1:10"},
		Buffers: []segtable.BufferDesc{{Addr: 1 << 20, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "k", "mooncake-tcp": "k"}}}}
	if err := pub.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	r := signed(t, inner)
	r.AllowUnsigned("mooncake-tcp")
	if _, err := r.Get(ctx, "peer"); err != nil {
		t.Fatal(err)
	}
	forged := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "peer", Epoch: 1<<64 - 1, Endpoints: map[string]string{"mooncake-tcp": "127.0.0.1:11"},
		Buffers: []segtable.BufferDesc{{Addr: 1 << 20, Length: 4096, Location: "cpu:0", Keys: map[string]string{"mooncake-tcp": "k"}}}}
	if err := inner.Delete(ctx, "peer", 5); err != nil { // a store writer may do both
		t.Fatal(err)
	}
	if err := inner.Put(ctx, forged); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Get(ctx, "peer"); err != nil {
		t.Fatalf("the unsigned descriptor (cut down): %v", err)
	}
	if err := inner.Delete(ctx, "peer", 1<<64-1); err != nil {
		t.Fatal(err)
	}
	d2 := *d
	d2.Epoch = 6
	if err := pub.Put(ctx, &d2); err != nil {
		t.Fatal(err)
	}
	got, err := r.Get(ctx, "peer")
	if err != nil || got.Epoch != 6 || got.Endpoints["tcp"] == "" {
		t.Fatalf("the next signed descriptor after an unsigned one of epoch 2^64-1: %v, %v", got, err)
	}
}
