// Package storetest is the conformance suite for [metadata.Store]
// implementations: every store (memory, p2p, HTTP, etcd) runs the same
// [Run] so that engines can rely on the same semantics whichever store a
// deployment picks. A store whose documented semantics are narrower (a p2p
// store publishes only its own name) runs [RunOptions] and says so in
// [Options], which relaxes only that store's suite.
//
// The suite makes no timed assertions: a store that loses an event or never
// closes a watch makes the suite hang until the hang guard of a minute
// fails it, or until go test's -timeout.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// hangGuard bounds every wait for an event, so that a store that loses one
// fails with a message instead of hanging. It is not a speed requirement.
const hangGuard = time.Minute

// Options adapts [RunOptions] to a store whose documented semantics are
// narrower than [metadata.Memory]'s, or adds a second path to check. The
// zero Options runs the full suite, as [Run] does; each field relaxes or
// reroutes only what its doc says, so a store that needs none of them gets
// every check.
type Options struct {
	// OwnName, when not nil, says that s publishes under one name only,
	// the one OwnName returns, and refuses Put and Delete under any
	// other: a peer-to-peer store serves only its own engine's segment,
	// and the name is the address it serves it at. The suite then writes
	// under that name wherever it would write a name of its own choosing,
	// and leaves out the checks that need two names published in one
	// store (that a Put under one name leaves another alone, that a watch
	// sees only its own name's changes); everything else, epochs, copies,
	// coalescing, watch and close semantics included, is checked as for
	// any store.
	OwnName func(s metadata.Store) string
	// Peer, when not nil, returns a second store that reads what s
	// publishes, e.g. another engine's p2p store, which fetches over the
	// network. The suite then reads (Get and Watch) through the peer and
	// writes through s, so the checks cover the path a remote engine
	// takes; Close semantics are checked on both. Peer is called at most
	// once per subtest, after newStore; the suite closes the peer (and may
	// close it twice) before the cleanups registered on t run.
	Peer func(t *testing.T, s metadata.Store) metadata.Store
}

// Run checks the documented semantics of [metadata.Store] against stores made
// by newStore. Each subtest calls newStore once; it must return a fresh,
// empty, open store, which the suite closes (and may close twice) before the
// cleanups that newStore registered on t run. Run is not safe for concurrent
// use with the same newStore unless newStore is; its subtests run one after
// another.
func Run(t *testing.T, newStore func(t *testing.T) metadata.Store) {
	RunOptions(t, newStore, Options{})
}

// RunOptions is [Run] adapted by opts; see [Options].
func RunOptions(t *testing.T, newStore func(t *testing.T) metadata.Store, opts Options) {
	tests := []struct {
		name string
		fn   func(t *testing.T, e *env)
	}{
		{"GetMissing", testGetMissing},
		{"PutGetCopies", testPutGetCopies},
		{"PutInvalid", testPutInvalid},
		{"EpochConflict", testEpochConflict},
		{"Republish", testRepublish},
		{"Delete", testDelete},
		{"WatchInitialUpdateDelete", testWatchInitialUpdateDelete},
		{"WatchBeforePut", testWatchBeforePut},
		{"WatchCoalesces", testWatchCoalesces},
		{"WatchEventIsCopy", testWatchEventIsCopy},
		{"WatchEndsWithContext", testWatchEndsWithContext},
		{"WatchEndsWithClose", testWatchEndsWithClose},
		{"ContextDone", testContextDone},
		{"Concurrent", testConcurrent},
		{"Close", testClose},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newStore(t)
			if s == nil {
				t.Fatal("newStore returned nil")
			}
			e := &env{s: s, r: s}
			t.Cleanup(func() {
				for _, st := range e.stores() {
					if err := st.Close(); err != nil {
						t.Errorf("Close %s: %v", st, err)
					}
				}
			})
			if opts.OwnName != nil {
				if e.own = opts.OwnName(s); e.own == "" {
					t.Fatal("OwnName returned an empty name")
				}
			}
			if opts.Peer != nil {
				if e.r = opts.Peer(t, s); e.r == nil {
					t.Fatal("Peer returned nil")
				}
			}
			tt.fn(t, e)
		})
	}
}

// env is what one subtest works on.
type env struct {
	s   metadata.Store // takes the writes
	r   metadata.Store // takes the reads: s, or the peer of Options.Peer
	own string         // the one name s publishes under; "" when any
}

// name returns the name to write under where the suite would pick n.
func (e *env) name(n string) string {
	if e.own != "" {
		return e.own
	}
	return n
}

// multi reports whether s publishes under any number of names.
func (e *env) multi() bool { return e.own == "" }

// stores returns s and, when it is another store, the peer.
func (e *env) stores() []metadata.Store {
	if e.r == e.s {
		return []metadata.Store{e.s}
	}
	return []metadata.Store{e.s, e.r}
}

// desc returns a valid descriptor whose tag (its tcp endpoint) tells
// revisions apart.
func desc(name string, epoch uint64, tag string) *segtable.SegmentDesc {
	return &segtable.SegmentDesc{
		Version:   segtable.DescVersion,
		Name:      name,
		Epoch:     epoch,
		Endpoints: map[string]string{"tcp": tag},
		Buffers: []segtable.BufferDesc{
			{Addr: 0x1000, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "key-" + tag}},
			{Addr: 0x10000, Length: 1 << 20, Location: "cpu:1", Keys: map[string]string{"tcp": "key2-" + tag}},
		},
		Devices: []segtable.DeviceDesc{{Name: "eth0", Kind: "nic", Node: 0}},
	}
}

func tag(d *segtable.SegmentDesc) string { return d.Endpoints["tcp"] }

// diff describes how two descriptors differ, "" when they are the same. A
// nil map or slice equals an empty one, since stores that encode descriptors
// need not keep the difference; a Chunked descriptor equals a flat one
// with its buffers.
func diff(got, want *segtable.SegmentDesc) string {
	gotBufs, wantBufs := []segtable.BufferDesc(nil), []segtable.BufferDesc(nil)
	if got != nil && want != nil {
		gotBufs, wantBufs = got.AllBuffers(), want.AllBuffers()
	}
	switch {
	case got == nil || want == nil:
		if got != want {
			return fmt.Sprintf("got %v, want %v", got, want)
		}
		return ""
	case got.Version != want.Version || got.Name != want.Name || got.Epoch != want.Epoch:
		return fmt.Sprintf("got version/name/epoch %d/%q/%d, want %d/%q/%d",
			got.Version, got.Name, got.Epoch, want.Version, want.Name, want.Epoch)
	case !maps.Equal(got.Endpoints, want.Endpoints):
		return fmt.Sprintf("got endpoints %v, want %v", got.Endpoints, want.Endpoints)
	case len(gotBufs) != len(wantBufs):
		return fmt.Sprintf("got %d buffers, want %d", len(gotBufs), len(wantBufs))
	case len(got.Devices) != len(want.Devices):
		return fmt.Sprintf("got devices %v, want %v", got.Devices, want.Devices)
	}
	for i, g := range gotBufs {
		w := wantBufs[i]
		if g.Addr != w.Addr || g.Length != w.Length || g.Location != w.Location || !maps.Equal(g.Keys, w.Keys) {
			return fmt.Sprintf("got buffer %d %+v, want %+v", i, g, w)
		}
	}
	for i, g := range got.Devices {
		if g != want.Devices[i] {
			return fmt.Sprintf("got devices %v, want %v", got.Devices, want.Devices)
		}
	}
	return ""
}

func mustPut(t *testing.T, s metadata.Store, d *segtable.SegmentDesc) {
	t.Helper()
	if err := s.Put(t.Context(), d); err != nil {
		t.Fatalf("Put(%q, epoch %d): %v", d.Name, d.Epoch, err)
	}
}

func mustGet(t *testing.T, s metadata.Store, name string) *segtable.SegmentDesc {
	t.Helper()
	d, err := s.Get(t.Context(), name)
	if err != nil {
		t.Fatalf("Get(%q): %v", name, err)
	}
	if d == nil {
		t.Fatalf("Get(%q) returned nil and no error", name)
	}
	return d
}

// wantErr fails t unless err matches target and names the segment.
func wantErr(t *testing.T, op string, err, target error, name string) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: got error %v, want %v", op, err, target)
	}
	if name != "" && !strings.Contains(err.Error(), name) {
		t.Errorf("%s: error %q does not name the segment %q", op, err, name)
	}
}

// recv waits for the next event of a watch on name; ok is false when the
// channel is closed.
func recv(t *testing.T, ch <-chan metadata.Event, name string) (ev metadata.Event, ok bool) {
	t.Helper()
	select {
	case ev, ok = <-ch:
	case <-time.After(hangGuard):
		t.Fatalf("watch %q: no event and no close within %v", name, hangGuard)
	}
	if ok && (ev.Desc == nil || ev.Desc.Name != name) {
		t.Fatalf("watch %q: event %+v does not carry a descriptor of that name", name, ev)
	}
	return ev, ok
}

func mustRecv(t *testing.T, ch <-chan metadata.Event, name string) metadata.Event {
	t.Helper()
	ev, ok := recv(t, ch, name)
	if !ok {
		t.Fatalf("watch %q: channel closed early", name)
	}
	return ev
}

// waitClosed drains a watch until its channel closes.
func waitClosed(t *testing.T, ch <-chan metadata.Event, name string) {
	t.Helper()
	for {
		if _, ok := recv(t, ch, name); !ok {
			return
		}
	}
}

func testGetMissing(t *testing.T, e *env) {
	for _, st := range e.stores() {
		if st.String() == "" {
			t.Errorf("String is empty")
		}
	}
	missing := e.name("missing-segment")
	d, err := e.r.Get(t.Context(), missing)
	wantErr(t, "Get(missing)", err, metadata.ErrNotFound, missing)
	if d != nil {
		t.Errorf("Get(missing) returned %+v with the error", d)
	}
	if !strings.Contains(err.Error(), e.r.String()) {
		t.Errorf("error %q does not name the store %q", err, e.r.String())
	}
}

func testPutGetCopies(t *testing.T, e *env) {
	s, a := e.s, e.name("a")
	d := desc(a, 7, "v1")
	want := d.Clone()
	mustPut(t, s, d)
	// The caller's descriptor is the caller's: the store kept a copy.
	d.Endpoints["tcp"] = "changed"
	d.Buffers[0].Keys["tcp"] = "changed"
	d.Buffers[1].Length = 1
	d.Devices[0].Node = 9
	got := mustGet(t, e.r, a)
	if e := diff(got, want); e != "" {
		t.Fatalf("Get after changing the Put argument: %s", e)
	}
	// So is the one Get returned.
	got.Endpoints["tcp"] = "changed"
	if got.Chunked == nil {
		// A Chunked one's buffers are shared, and no reader changes
		// them (see metadata.Store); its header is its own.
		got.Buffers[0].Keys["tcp"] = "changed"
	}
	got.Epoch = 8
	if got.Devices != nil {
		got.Devices[0].Node = 9
	}
	if e := diff(mustGet(t, e.r, a), want); e != "" {
		t.Fatalf("Get after changing an earlier Get's result: %s", e)
	}
	if !e.multi() {
		return
	}
	// Names are distinct keys.
	mustPut(t, s, desc("b", 1, "b1"))
	if e := diff(mustGet(t, e.r, "a"), want); e != "" {
		t.Fatalf("Get(a) after Put(b): %s", e)
	}
	if tag(mustGet(t, e.r, "b")) != "b1" {
		t.Fatalf("Get(b) does not return b")
	}
}

func testPutInvalid(t *testing.T, e *env) {
	s := e.s
	err := s.Put(t.Context(), nil)
	wantErr(t, "Put(nil)", err, segtable.ErrBadDesc, "")
	bad := map[string]*segtable.SegmentDesc{
		"version": func() *segtable.SegmentDesc {
			d := desc(e.name("bad-version"), 1, "x")
			d.Version = 0
			return d
		}(),
		"future": func() *segtable.SegmentDesc {
			d := desc(e.name("bad-future"), 1, "x")
			d.Version = segtable.DescVersion + 1
			return d
		}(),
		"name": desc("", 1, "x"),
		"overlap": func() *segtable.SegmentDesc {
			d := desc(e.name("bad-overlap"), 1, "x")
			d.Buffers[1].Addr = d.Buffers[0].Addr + 1
			return d
		}(),
		"empty buffer": func() *segtable.SegmentDesc {
			d := desc(e.name("bad-empty"), 1, "x")
			d.Buffers[0].Length = 0
			return d
		}(),
	}
	for what, d := range bad {
		err := s.Put(t.Context(), d)
		wantErr(t, "Put(bad "+what+")", err, segtable.ErrBadDesc, d.Name)
		if d.Name != "" {
			_, err := e.r.Get(t.Context(), d.Name)
			wantErr(t, "Get after refused Put("+what+")", err, metadata.ErrNotFound, d.Name)
		}
	}
}

func testEpochConflict(t *testing.T, e *env) {
	s, a := e.s, e.name("a")
	mustPut(t, s, desc(a, 1, "first"))
	err := s.Put(t.Context(), desc(a, 2, "second"))
	wantErr(t, "Put with another epoch", err, metadata.ErrExists, a)
	got := mustGet(t, e.r, a)
	if got.Epoch != 1 || tag(got) != "first" {
		t.Fatalf("refused Put changed the store: epoch %d tag %q", got.Epoch, tag(got))
	}
	// The owner gives the name up; the new instance takes it.
	if err := s.Delete(t.Context(), a, 1); err != nil {
		t.Fatalf("Delete by owner: %v", err)
	}
	mustPut(t, s, desc(a, 2, "second"))
	if got := mustGet(t, e.r, a); got.Epoch != 2 || tag(got) != "second" {
		t.Fatalf("after handover got epoch %d tag %q", got.Epoch, tag(got))
	}
}

func testRepublish(t *testing.T, e *env) {
	a := e.name("a")
	mustPut(t, e.s, desc(a, 5, "v1"))
	d := desc(a, 5, "v2")
	d.Buffers = d.Buffers[:1]
	mustPut(t, e.s, d)
	if e := diff(mustGet(t, e.r, a), d); e != "" {
		t.Fatalf("after republish: %s", e)
	}
}

func testDelete(t *testing.T, e *env) {
	ctx, s, a, b := t.Context(), e.s, e.name("a"), e.name("b")
	wantErr(t, "Delete(missing)", s.Delete(ctx, a, 0), metadata.ErrNotFound, a)
	mustPut(t, s, desc(a, 3, "v1"))
	wantErr(t, "Delete with a stale epoch", s.Delete(ctx, a, 2), metadata.ErrEpoch, a)
	wantErr(t, "Delete with a newer epoch", s.Delete(ctx, a, 4), metadata.ErrEpoch, a)
	if got := mustGet(t, e.r, a); got.Epoch != 3 {
		t.Fatalf("refused Delete changed the store: epoch %d", got.Epoch)
	}
	if err := s.Delete(ctx, a, 3); err != nil {
		t.Fatalf("Delete with the right epoch: %v", err)
	}
	_, err := e.r.Get(ctx, a)
	wantErr(t, "Get after Delete", err, metadata.ErrNotFound, a)
	wantErr(t, "second Delete", s.Delete(ctx, a, 3), metadata.ErrNotFound, a)

	mustPut(t, s, desc(b, 9, "v1"))
	if err := s.Delete(ctx, b, 0); err != nil {
		t.Fatalf("Delete with epoch 0: %v", err)
	}
	_, err = e.r.Get(ctx, b)
	wantErr(t, "Get after Delete(0)", err, metadata.ErrNotFound, b)
}

func testWatchInitialUpdateDelete(t *testing.T, e *env) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s, a := e.s, e.name("a")
	mustPut(t, s, desc(a, 1, "v1"))
	ch, err := e.r.Watch(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	if ev := mustRecv(t, ch, a); ev.Deleted || tag(ev.Desc) != "v1" || ev.Desc.Epoch != 1 {
		t.Fatalf("first event %+v, want the current value v1", ev)
	}
	mustPut(t, s, desc(a, 1, "v2"))
	if ev := mustRecv(t, ch, a); ev.Deleted || tag(ev.Desc) != "v2" {
		t.Fatalf("event after republish %+v, want v2", ev)
	}
	if err := s.Delete(ctx, a, 1); err != nil {
		t.Fatal(err)
	}
	if ev := mustRecv(t, ch, a); !ev.Deleted || ev.Desc.Epoch != 1 {
		t.Fatalf("event after Delete %+v, want Deleted with epoch 1", ev)
	}
	// A new owner shows up on the same watch.
	mustPut(t, s, desc(a, 2, "w1"))
	if ev := mustRecv(t, ch, a); ev.Deleted || ev.Desc.Epoch != 2 || tag(ev.Desc) != "w1" {
		t.Fatalf("event after the new owner's Put %+v, want epoch 2 w1", ev)
	}
	cancel()
	waitClosed(t, ch, a)
}

func testWatchBeforePut(t *testing.T, e *env) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s, a := e.s, e.name("a")
	ch, err := e.r.Watch(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	ch2, err := e.r.Watch(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	var other <-chan metadata.Event
	if e.multi() {
		if other, err = e.r.Watch(ctx, "b"); err != nil {
			t.Fatal(err)
		}
		mustPut(t, s, desc("b", 1, "b1")) // must reach only the watch of b
	}
	mustPut(t, s, desc(a, 4, "a1"))
	for _, c := range []<-chan metadata.Event{ch, ch2} {
		if ev := mustRecv(t, c, a); ev.Deleted || ev.Desc.Epoch != 4 || tag(ev.Desc) != "a1" {
			t.Fatalf("first event of a watch made before Put: %+v", ev)
		}
	}
	if other != nil {
		if ev := mustRecv(t, other, "b"); tag(ev.Desc) != "b1" {
			t.Fatalf("watch of b got %+v", ev)
		}
	}
	cancel()
	waitClosed(t, ch, a)
	waitClosed(t, ch2, a)
	if other != nil {
		waitClosed(t, other, "b")
	}
}

// testWatchCoalesces puts many revisions to a watch that nobody reads: Put
// must not block, and the reader must then see revisions in order, ending
// with the last.
func testWatchCoalesces(t *testing.T, e *env) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s, a := e.s, e.name("a")
	ch, err := e.r.Watch(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	const n = 100
	for i := range n {
		mustPut(t, s, desc(a, 1, fmt.Sprintf("rev-%03d", i)))
	}
	last := ""
	for last != fmt.Sprintf("rev-%03d", n-1) {
		ev := mustRecv(t, ch, a)
		if ev.Deleted || tag(ev.Desc) <= last {
			t.Fatalf("event %q (deleted %v) after %q: events must follow the order of changes", tag(ev.Desc), ev.Deleted, last)
		}
		last = tag(ev.Desc)
	}
	if err := s.Delete(ctx, a, 1); err != nil {
		t.Fatal(err)
	}
	mustPut(t, s, desc(a, 2, "after"))
	for {
		ev := mustRecv(t, ch, a)
		if !ev.Deleted && ev.Desc.Epoch == 2 {
			break
		}
		if !ev.Deleted {
			t.Fatalf("unexpected event %+v between the delete and the new owner", ev)
		}
	}
}

func testWatchEventIsCopy(t *testing.T, e *env) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s, a := e.s, e.name("a")
	mustPut(t, s, desc(a, 1, "v1"))
	ch1, err := e.r.Watch(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	ch2, err := e.r.Watch(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	// Both the first event (the current value) and an event of a change
	// belong to the receiver alone.
	for _, v := range []string{"v1", "v2"} {
		if v != "v1" {
			mustPut(t, s, desc(a, 1, v))
		}
		ev1, ev2 := mustRecv(t, ch1, a), mustRecv(t, ch2, a)
		if tag(ev1.Desc) != v || tag(ev2.Desc) != v {
			t.Fatalf("events %q and %q, want %q", tag(ev1.Desc), tag(ev2.Desc), v)
		}
		ev1.Desc.Endpoints["tcp"] = "changed"
		if ev1.Desc.Chunked == nil { // shared, and changed by nobody: see metadata.Store
			ev1.Desc.Buffers[0].Keys["tcp"] = "changed"
		}
		if tag(ev2.Desc) != v || ev2.Desc.AllBuffers()[0].Keys["tcp"] != "key-"+v {
			t.Fatalf("two watchers share one descriptor")
		}
		if e := diff(mustGet(t, e.r, a), desc(a, 1, v)); e != "" {
			t.Fatalf("changing a watch event changed the store: %s", e)
		}
	}
}

func testWatchEndsWithContext(t *testing.T, e *env) {
	ctx, cancel := context.WithCancel(t.Context())
	s, a := e.s, e.name("a")
	mustPut(t, s, desc(a, 1, "v1"))
	ch, err := e.r.Watch(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	waitClosed(t, ch, a)
	// The store goes on without the watcher.
	mustPut(t, s, desc(a, 1, "v2"))
	if tag(mustGet(t, e.r, a)) != "v2" {
		t.Fatalf("Put after the watch ended was lost")
	}
}

// testWatchEndsWithClose closes each store with a watch open on it: that
// store's watches end, whatever the other store does.
func testWatchEndsWithClose(t *testing.T, e *env) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	a := e.name("a")
	var chans []<-chan metadata.Event
	for _, st := range e.stores() {
		ch, err := st.Watch(ctx, a)
		if err != nil {
			t.Fatal(err)
		}
		chans = append(chans, ch)
	}
	for i, st := range e.stores() {
		if err := st.Close(); err != nil {
			t.Fatal(err)
		}
		waitClosed(t, chans[i], a)
	}
}

func testContextDone(t *testing.T, e *env) {
	s, a, b := e.s, e.name("a"), e.name("b")
	mustPut(t, s, desc(a, 1, "v1"))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	for _, st := range e.stores() {
		_, err := st.Get(ctx, a)
		wantErr(t, "Get with a done context", err, context.Canceled, "")
		ch, err := st.Watch(ctx, a)
		wantErr(t, "Watch with a done context", err, context.Canceled, "")
		if ch != nil {
			t.Errorf("Watch returned a channel with its error")
		}
	}
	wantErr(t, "Put with a done context", s.Put(ctx, desc(b, 1, "b")), context.Canceled, "")
	wantErr(t, "Delete with a done context", s.Delete(ctx, a, 1), context.Canceled, "")
	// Nothing happened.
	if tag(mustGet(t, e.r, a)) != "v1" {
		t.Fatalf("a canceled call changed the store")
	}
	if e.multi() {
		_, err := e.r.Get(t.Context(), "b")
		wantErr(t, "Get of a canceled Put", err, metadata.ErrNotFound, "b")
	}
}

// testConcurrent runs writers of disjoint names and watchers together; its
// value is under -race. A store with one name gets one writer.
func testConcurrent(t *testing.T, e *env) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s := e.s
	writers, watchers, names := 4, 4, 16
	if !e.multi() {
		writers = 1
	}
	nameOf := func(w, i int) string { return e.name(fmt.Sprintf("w%d-n%d", w, i)) }
	var wg sync.WaitGroup
	errs := make(chan error, watchers+writers*names)
	for w := range watchers {
		watched := nameOf(w%writers, 0)
		ch, err := e.r.Watch(ctx, watched)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() { // a watcher that reads everything, until cancel
			for ev := range ch {
				if ev.Desc == nil || ev.Desc.Name != watched {
					errs <- fmt.Errorf("watch %q got %+v", watched, ev)
					return
				}
			}
		})
	}
	var writersWG sync.WaitGroup
	for w := range writers {
		writersWG.Go(func() {
			for i := range names {
				name := nameOf(w, i)
				for rev := range 3 {
					if err := s.Put(ctx, desc(name, uint64(w+1), fmt.Sprint(rev))); err != nil {
						errs <- err
						return
					}
				}
				d, err := e.r.Get(ctx, name)
				if err != nil || tag(d) != "2" {
					errs <- fmt.Errorf("Get(%q) = %v, %v; want revision 2", name, d, err)
					return
				}
				if i%2 == 1 {
					if err := s.Delete(ctx, name, uint64(w+1)); err != nil {
						errs <- err
						return
					}
				}
			}
		})
	}
	writersWG.Wait()
	cancel()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for w := range writers {
		for i := range names {
			if !e.multi() && i != names-1 {
				continue // one name: only the last round's outcome stands
			}
			name := nameOf(w, i)
			d, err := e.r.Get(t.Context(), name)
			if i%2 == 1 {
				wantErr(t, "Get of a deleted name", err, metadata.ErrNotFound, name)
			} else if err != nil || d.Epoch != uint64(w+1) || tag(d) != "2" {
				t.Errorf("Get(%q) = %+v, %v", name, d, err)
			}
		}
	}
}

func testClose(t *testing.T, e *env) {
	a, b := e.name("a"), e.name("b")
	mustPut(t, e.s, desc(a, 1, "v1"))
	for _, s := range e.stores() {
		if err := s.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		if err := s.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
		ctx := t.Context()
		_, err := s.Get(ctx, a)
		wantErr(t, "Get after Close", err, metadata.ErrClosed, a)
		wantErr(t, "Put after Close", s.Put(ctx, desc(b, 1, "b")), metadata.ErrClosed, b)
		wantErr(t, "Delete after Close", s.Delete(ctx, a, 1), metadata.ErrClosed, a)
		_, err = s.Watch(ctx, a)
		wantErr(t, "Watch after Close", err, metadata.ErrClosed, a)
	}
}
