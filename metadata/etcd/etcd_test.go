package etcd_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

var etcdPrefixes atomic.Int64

// etcdPrefix returns a key prefix no other store of this process uses, so
// that one etcd serves many tests.
func etcdPrefix() string {
	return fmt.Sprintf("/moonring-test/%d/", etcdPrefixes.Add(1))
}

// newEtcd returns a store of the etcd at endpoint under prefix, closed
// when the test ends.
func newEtcd(t *testing.T, endpoint, prefix string, ttl time.Duration) *etcd.Store {
	t.Helper()
	e, err := etcd.New(etcd.Config{Endpoints: []string{endpoint}, Prefix: prefix, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// rawEtcd returns a plain client of the etcd at endpoint, to look at and
// meddle with what the stores wrote; it is closed when the test ends.
func rawEtcd(t *testing.T, endpoint string) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestEtcd runs, against one etcd, the suite (with one store, and with
// writes through one store and reads through another) and the checks that
// need no restart of etcd.
func TestEtcd(t *testing.T) {
	srv := etcdtest.Start(t)
	ep := srv.Endpoint()
	t.Run("One", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) metadata.Store {
			return newEtcd(t, ep, etcdPrefix(), 0)
		})
	})
	t.Run("Peer", func(t *testing.T) {
		var prefix string
		storetest.RunOptions(t, func(t *testing.T) metadata.Store {
			prefix = etcdPrefix()
			return newEtcd(t, ep, prefix, 0)
		}, storetest.Options{
			Peer: func(t *testing.T, _ metadata.Store) metadata.Store { return newEtcd(t, ep, prefix, 0) },
		})
	})
	t.Run("PublishRace", func(t *testing.T) { testEtcdPublishRace(t, ep) })
	t.Run("Expiry", func(t *testing.T) { testEtcdExpiry(t, ep) })
	t.Run("Keys", func(t *testing.T) { testEtcdKeys(t, ep) })
}

// Two stores race to publish one name with different epochs: exactly one
// wins, the other gets ErrExists, and the loser keeps nothing alive.
func testEtcdPublishRace(t *testing.T, ep string) {
	prefix := etcdPrefix()
	a, b := newEtcd(t, ep, prefix, 0), newEtcd(t, ep, prefix, 0)
	ctx := t.Context()
	for round := range 20 {
		ea, eb := uint64(2*round+1), uint64(2*round+2)
		var errA, errB error
		var wg sync.WaitGroup
		start := make(chan struct{})
		wg.Go(func() { <-start; errA = a.Put(ctx, testDesc("contested", ea, "a")) })
		wg.Go(func() { <-start; errB = b.Put(ctx, testDesc("contested", eb, "b")) })
		close(start)
		wg.Wait()
		winner, want := a, ea
		switch {
		case errA == nil && errors.Is(errB, metadata.ErrExists):
		case errB == nil && errors.Is(errA, metadata.ErrExists):
			winner, want = b, eb
		default:
			t.Fatalf("round %d: Put errors %v and %v, want one nil and one ErrExists", round, errA, errB)
		}
		if err := errors.Join(errA, errB); !strings.Contains(err.Error(), "contested") || !strings.Contains(err.Error(), a.String()) {
			t.Errorf("error %q does not name the segment and the store", err)
		}
		for _, s := range []*etcd.Store{a, b} {
			d, err := s.Get(ctx, "contested")
			if err != nil || d.Epoch != want {
				t.Fatalf("round %d: Get = %+v, %v; want epoch %d", round, d, err, want)
			}
		}
		if err := winner.Delete(ctx, "contested", want); err != nil {
			t.Fatalf("round %d: winner's Delete: %v", round, err)
		}
	}
}

// A store whose owner stops keeping its lease alive (the store closed, as
// when the engine dies) loses its descriptor within a few TTLs, and a
// watcher in another store sees Deleted; the descriptor of an open store
// outlives its TTL, and goes at Delete.
func testEtcdExpiry(t *testing.T, ep string) {
	prefix := etcdPrefix()
	dead := newEtcd(t, ep, prefix, time.Second)
	live := newEtcd(t, ep, prefix, 2*time.Second)
	reader := newEtcd(t, ep, prefix, 0)
	ctx := t.Context()
	if err := dead.Put(ctx, testDesc("dead", 1, "d")); err != nil {
		t.Fatal(err)
	}
	if err := live.Put(ctx, testDesc("live", 2, "l")); err != nil {
		t.Fatal(err)
	}
	// Republishing keeps the name alive as well.
	if err := live.Put(ctx, testDesc("live", 2, "l2")); err != nil {
		t.Fatal(err)
	}
	deadCh, err := reader.Watch(ctx, "dead")
	if err != nil {
		t.Fatal(err)
	}
	liveCh, err := reader.Watch(ctx, "live")
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, deadCh); ev.Deleted || ev.Desc.Epoch != 1 {
		t.Fatalf("first event of dead: %+v", ev)
	}
	if ev := next(t, liveCh); ev.Deleted || ev.Desc.Epoch != 2 || ev.Desc.Endpoints["tcp"] != "l2" {
		t.Fatalf("first event of live: %+v", ev)
	}
	start := time.Now()
	dead.Close() // no Delete: the engine "died"
	if ev := next(t, deadCh); !ev.Deleted || ev.Desc.Epoch != 1 {
		t.Fatalf("event after the owner stopped its keepalive: %+v, want Deleted", ev)
	}
	t.Logf("a descriptor nobody kept alive went in %v (TTL 1s)", time.Since(start).Round(time.Millisecond))
	if _, err := reader.Get(ctx, "dead"); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("Get of an expired descriptor: %v, want ErrNotFound", err)
	}
	// The name is free for the engine's next instance.
	heir := newEtcd(t, ep, prefix, time.Second)
	if err := heir.Put(ctx, testDesc("dead", 3, "d3")); err != nil {
		t.Fatalf("Put by the next instance: %v", err)
	}

	// The live one outlives its TTL (keepalives change nothing a watcher
	// sees), then goes at Delete.
	if since := time.Since(start); since < 3*time.Second {
		time.Sleep(3*time.Second - since)
	}
	select {
	case ev := <-liveCh:
		t.Fatalf("event %+v on a descriptor kept alive", ev)
	default:
	}
	if d, err := reader.Get(ctx, "live"); err != nil || d.Epoch != 2 {
		t.Fatalf("Get(live) after 1.5 TTLs: %+v, %v", d, err)
	}
	if err := live.Delete(ctx, "live", 2); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, liveCh); !ev.Deleted || ev.Desc.Endpoints["tcp"] != "l2" {
		t.Fatalf("event after Delete: %+v", ev)
	}
}

// The keys are the prefix and the name, the values the descriptors' JSON,
// each under a lease; stores under other prefixes do not see them; a value
// that is not a descriptor holds the name but reads as ErrBadDesc.
func testEtcdKeys(t *testing.T, ep string) {
	raw := rawEtcd(t, ep)
	prefix, other := etcdPrefix(), etcdPrefix()
	s, o := newEtcd(t, ep, prefix, 0), newEtcd(t, ep, other, 0)
	ctx := t.Context()
	names := []string{"10.0.0.1:7000", "[::1]:7000", "a/b", "名前", "a b?c#d"}
	for _, name := range names {
		if err := s.Put(ctx, testDesc(name, 1, "v")); err != nil {
			t.Fatalf("Put(%q): %v", name, err)
		}
	}
	resp, err := raw.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != len(names) {
		t.Fatalf("%d keys under %s, want %d", len(resp.Kvs), prefix, len(names))
	}
	for _, kv := range resp.Kvs {
		name := strings.TrimPrefix(string(kv.Key), prefix)
		d, err := segtable.UnmarshalDesc(kv.Value)
		if err != nil || d.Name != name {
			t.Errorf("key %q holds %q (%v)", kv.Key, kv.Value, err)
		}
		if kv.Lease == 0 {
			t.Errorf("key %q has no lease", kv.Key)
		}
		if _, err := o.Get(ctx, name); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("Get(%q) under another prefix: %v, want ErrNotFound", name, err)
		}
	}
	for _, name := range names {
		if d, err := s.Get(ctx, name); err != nil || d.Name != name {
			t.Fatalf("Get(%q) = %+v, %v", name, d, err)
		}
		if err := s.Delete(ctx, name, 1); err != nil {
			t.Fatalf("Delete(%q): %v", name, err)
		}
	}

	// Descriptors larger than etcd takes (1.5 MiB by default), or than
	// the client sends (2 MiB).
	for _, size := range []int{1600 << 10, 3 << 20} {
		d := testDesc("huge", 1, strings.Repeat("x", size))
		if err := s.Put(ctx, d); !errors.Is(err, segtable.ErrBadDesc) || !strings.Contains(err.Error(), "huge") {
			t.Errorf("Put of %d bytes: %v, want ErrBadDesc", size, err)
		}
		if _, err := s.Get(ctx, "huge"); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("Get after a Put too large: %v, want ErrNotFound", err)
		}
	}

	// Someone else's value under the prefix.
	if _, err := raw.Put(ctx, prefix+"junk", "not json"); err != nil {
		t.Fatal(err)
	}
	if _, err := raw.Put(ctx, prefix+"misnamed", string(mustMarshal(t, testDesc("other", 1, "v")))); err != nil {
		t.Fatal(err)
	}
	ch, err := s.Watch(ctx, "misnamed")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"junk", "misnamed"} {
		if _, err := s.Get(ctx, name); !errors.Is(err, segtable.ErrBadDesc) || !strings.Contains(err.Error(), name) {
			t.Errorf("Get(%q) of a value that is not its descriptor: %v, want ErrBadDesc", name, err)
		}
	}
	if err := s.Put(ctx, testDesc("junk", 1, "v")); !errors.Is(err, metadata.ErrExists) {
		t.Errorf("Put over a value that is not a descriptor: %v, want ErrExists", err)
	}
	if err := s.Delete(ctx, "junk", 1); !errors.Is(err, metadata.ErrEpoch) {
		t.Errorf("Delete(1) of a value that is not a descriptor: %v, want ErrEpoch", err)
	}
	if err := s.Delete(ctx, "junk", 0); err != nil {
		t.Errorf("Delete(0) of a value that is not a descriptor: %v", err)
	}
	if _, err := s.Get(ctx, "junk"); !errors.Is(err, metadata.ErrNotFound) {
		t.Errorf("Get after Delete(0): %v, want ErrNotFound", err)
	}
	// A watch shows such a value as no descriptor, and the real one when
	// it comes.
	if _, err := raw.Delete(ctx, prefix+"misnamed"); err != nil {
		t.Fatal(err)
	}
	if err := s.Put(ctx, testDesc("misnamed", 4, "v")); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 4 {
		t.Fatalf("watch of a name that held junk: %+v, want epoch 4", ev)
	}
}

func mustMarshal(t *testing.T, d *segtable.SegmentDesc) []byte {
	t.Helper()
	b, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// etcd killed and restarted on its data: the stores' calls work again, an
// open watch delivers the changes made after the restart, and a descriptor
// whose lease etcd lost comes back from its owner.
func TestEtcdRestart(t *testing.T) {
	srv := etcdtest.Start(t)
	ep := srv.Endpoint()
	prefix := etcdPrefix()
	// 5 s: the owner's reconnection backs off up to 2 s after the restart,
	// and its lease must outlive that on a loaded machine.
	owner := newEtcd(t, ep, prefix, 5*time.Second)
	reader := newEtcd(t, ep, prefix, 0)
	ctx := t.Context()
	if err := owner.Put(ctx, testDesc("a", 1, "v1")); err != nil {
		t.Fatal(err)
	}
	ch, err := reader.Watch(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Endpoints["tcp"] != "v1" {
		t.Fatalf("first event %+v", ev)
	}

	start := time.Now()
	srv.Restart()
	t.Logf("etcd restarted in %v", time.Since(start).Round(time.Millisecond))
	// The clients reconnect with backoff: the first calls may find etcd
	// not reached yet.
	var d *segtable.SegmentDesc
	for deadline := time.Now().Add(hang); ; {
		if d, err = reader.Get(ctx, "a"); err == nil || time.Now().After(deadline) {
			break
		}
		if !errors.Is(err, metadata.ErrUnreachable) {
			t.Fatalf("Get after the restart: %v, want the descriptor or ErrUnreachable", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil || d.Epoch != 1 || d.Endpoints["tcp"] != "v1" {
		t.Fatalf("Get after the restart = %+v, %v", d, err)
	}
	t.Logf("etcd answered again %v after the restart began", time.Since(start).Round(time.Millisecond))
	if err := owner.Put(ctx, testDesc("a", 1, "v2")); err != nil {
		t.Fatalf("Put after the restart: %v", err)
	}
	for { // a restore of v1 (the owner lost its lease for a while) may come first
		ev := next(t, ch)
		if ev.Deleted || ev.Desc.Epoch != 1 {
			t.Fatalf("event after the restart %+v, want epoch 1", ev)
		}
		if ev.Desc.Endpoints["tcp"] == "v2" {
			break
		}
	}
	if err := owner.Put(ctx, testDesc("b", 5, "b")); err != nil {
		t.Fatalf("Put of a new name after the restart: %v", err)
	}
	if d, err := reader.Get(ctx, "b"); err != nil || d.Epoch != 5 {
		t.Fatalf("Get(b) = %+v, %v", d, err)
	}

	// etcd loses the lease (revoked here; expired in an outage longer
	// than the TTL): the descriptor goes, and the owner writes it again.
	raw := rawEtcd(t, ep)
	resp, err := raw.Get(ctx, prefix+"a")
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("raw Get of a: %+v, %v; want one key with a lease", resp, err)
	}
	if _, err := raw.Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); !ev.Deleted || ev.Desc.Endpoints["tcp"] != "v2" {
		t.Fatalf("event after the lease was revoked: %+v, want Deleted", ev)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.Epoch != 1 || ev.Desc.Endpoints["tcp"] != "v2" {
		t.Fatalf("event after the owner restored its descriptor: %+v, want v2", ev)
	}
	if err := owner.Delete(ctx, "a", 1); err != nil {
		t.Fatalf("Delete of the restored descriptor: %v", err)
	}
	if ev := next(t, ch); !ev.Deleted {
		t.Fatalf("event after Delete: %+v", ev)
	}
}

func TestEtcdConfig(t *testing.T) {
	for _, cfg := range []etcd.Config{
		{},
		{Endpoints: []string{""}},
		{Endpoints: []string{"127.0.0.1:2379"}, TTL: 500 * time.Millisecond},
		{Endpoints: []string{"127.0.0.1:2379"}, TTL: -time.Second},
		{Endpoints: []string{"127.0.0.1:2379"}, DialTimeout: -time.Second},
	} {
		if e, err := etcd.New(cfg); err == nil {
			e.Close()
			t.Errorf("New(%+v): no error", cfg)
		}
	}
	e, err := etcd.New(etcd.Config{Endpoints: []string{"http://10.0.0.1:2379", "http://10.0.0.2:2379"}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if got := e.String(); got != "etcd http://10.0.0.1:2379,http://10.0.0.2:2379" {
		t.Fatalf("String() = %q", got)
	}
}

// An etcd that does not answer: calls fail with ErrUnreachable naming the
// store and the segment, within the DialTimeout; a watch waits for it.
func TestEtcdUnreachable(t *testing.T) {
	e, err := etcd.New(etcd.Config{Endpoints: []string{"http://" + deadAddr(t)}, DialTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx := t.Context()
	start := time.Now()
	_, err = e.Get(ctx, "a")
	if !errors.Is(err, metadata.ErrUnreachable) || !strings.Contains(err.Error(), e.String()) || !strings.Contains(err.Error(), `"a"`) {
		t.Fatalf("Get from a dead etcd: %v, want ErrUnreachable naming the store and the segment", err)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Get from a dead etcd: %v matches context.DeadlineExceeded, which the caller's context did not reach", err)
	}
	if err := e.Put(ctx, testDesc("a", 1, "x")); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Put to a dead etcd: %v, want ErrUnreachable", err)
	}
	if err := e.Delete(ctx, "a", 1); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Delete in a dead etcd: %v, want ErrUnreachable", err)
	}
	t.Logf("three calls failed in %v", time.Since(start).Round(time.Millisecond))
	// The caller's own deadline is reported as such.
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if _, err := e.Get(short, "a"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Get with a short deadline: %v, want context.DeadlineExceeded", err)
	}
	wctx, wcancel := context.WithCancel(ctx)
	ch, err := e.Watch(wctx, "a")
	if err != nil {
		t.Fatalf("Watch of a dead etcd: %v, want a watch that waits", err)
	}
	select {
	case ev := <-ch:
		t.Fatalf("event %+v from a dead etcd", ev)
	case <-time.After(300 * time.Millisecond):
	}
	wcancel()
	for range ch {
	}
}
