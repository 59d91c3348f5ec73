package mooncake

import (
	"context"
	"errors"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

func newP2P(t testing.TB) *P2PStore {
	t.Helper()
	p, err := NewP2PStore(P2PConfig{PollInterval: 5 * time.Millisecond, RPC: RPCConfig{Timeout: 2 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// TestP2PConformance runs the Store suite: locally, and with every read
// made by another engine's store through the RPC port.
func TestP2PConformance(t *testing.T) {
	own := func(s metadata.Store) string { return s.(*P2PStore).Name() }
	t.Run("local", func(t *testing.T) {
		storetest.RunOptions(t, func(t *testing.T) metadata.Store { return newP2P(t) }, storetest.Options{OwnName: own})
	})
	t.Run("peer", func(t *testing.T) {
		storetest.RunOptions(t, func(t *testing.T) metadata.Store { return newP2P(t) }, storetest.Options{
			OwnName: own,
			Peer:    func(t *testing.T, _ metadata.Store) metadata.Store { return newP2P(t) },
		})
	})
}

func p2pDesc(name string, epoch uint64, tag string) *segtable.SegmentDesc {
	return &segtable.SegmentDesc{
		Version: segtable.DescVersion, Name: name, Epoch: epoch,
		Endpoints: map[string]string{EndpointRPC: name, "tcp": tag},
		Buffers:   []segtable.BufferDesc{{Addr: 0x10000, Length: 1 << 20, Keys: map[string]string{"tcp": "k"}}},
	}
}

// TestP2PTwoEngines: two daemons read each other's descriptors; a watch
// sees a change, and sees the peer go when it closes.
func TestP2PTwoEngines(t *testing.T) {
	a, b := newP2P(t), newP2P(t)
	ctx := t.Context()
	if err := a.Put(ctx, p2pDesc(a.Name(), 1, "a1")); err != nil {
		t.Fatal(err)
	}
	if err := b.Put(ctx, p2pDesc(b.Name(), 2, "b1")); err != nil {
		t.Fatal(err)
	}
	ga, err := b.Get(ctx, a.Name())
	if err != nil || ga.Epoch != 1 || ga.Endpoints["tcp"] != "a1" {
		t.Fatalf("b reads a: %+v, %v", ga, err)
	}
	gb, err := a.Get(ctx, b.Name())
	if err != nil || gb.Epoch != 2 || gb.Endpoints["tcp"] != "b1" {
		t.Fatalf("a reads b: %+v, %v", gb, err)
	}
	ch, err := a.Watch(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	if ev := recvEvent(t, ch); ev.Deleted || ev.Desc.Endpoints["tcp"] != "b1" {
		t.Fatalf("first event %+v", ev)
	}
	if err := b.Put(ctx, p2pDesc(b.Name(), 2, "b2")); err != nil {
		t.Fatal(err)
	}
	if ev := recvEvent(t, ch); ev.Deleted || ev.Desc.Endpoints["tcp"] != "b2" {
		t.Fatalf("after a change %+v", ev)
	}
	b.Close()
	if ev := recvEvent(t, ch); !ev.Deleted || ev.Desc.Endpoints["tcp"] != "b2" {
		t.Fatalf("after the peer closed %+v", ev)
	}
	if _, err := a.Get(ctx, b.Name()); !errors.Is(err, metadata.ErrUnreachable) {
		t.Fatalf("Get of a closed peer: %v", err)
	}
	// Names that are no address hold nothing; others' names are not ours.
	for _, n := range []string{"", "host-without-port", "[::1]"} {
		if _, err := a.Get(ctx, n); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("Get(%q): %v", n, err)
		}
	}
	if err := a.Put(ctx, p2pDesc("10.9.9.9:1", 1, "x")); !errors.Is(err, metadata.ErrNotOwner) {
		t.Errorf("Put of another name: %v", err)
	}
}

func recvEvent(t *testing.T, ch <-chan metadata.Event) metadata.Event {
	t.Helper()
	select {
	case ev, ok := <-ch:
		if !ok {
			t.Fatal("watch closed")
		}
		return ev
	case <-time.After(20 * time.Second):
		t.Fatal("no event in 20s")
	}
	return metadata.Event{}
}

// fakeMooncakePeer is a Mooncake engine's RPC daemon as its source
// describes it, over a plain listener: it answers a metadata frame with
// doc (a Mooncake-written descriptor) and records what it was sent.
func fakeMooncakePeer(t *testing.T, doc func(name string) []byte) (name string, got chan Frame) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	name = "127.0.0.1:" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	got = make(chan Frame, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.SetDeadline(time.Now().Add(5 * time.Second))
			f, err := ReadFrame(c, 0)
			if err == nil {
				select {
				case got <- Frame{Type: f.Type, Body: append([]byte(nil), f.Body...)}:
				default: // nobody looks at this many
				}
				WriteFrame(c, f.Type, doc(name))
				c.(*net.TCPConn).CloseWrite()
				c.Read(make([]byte, 1))
			}
			c.Close()
		}
	}()
	return name, got
}

// TestP2PReadsMooncake: a Mooncake engine's descriptor, fetched through
// its RPC port, converts with the RPC and TCP endpoints taken from the
// name; the request carried our own descriptor as Mooncake's does.
func TestP2PReadsMooncake(t *testing.T) {
	name, got := fakeMooncakePeer(t, func(name string) []byte {
		d, err := Decode(readGolden(t, "tcp.json"))
		if err != nil {
			t.Error(err)
			return nil
		}
		d.Name = name
		for i := range d.Buffers {
			d.Buffers[i].Name = name
		}
		b, _ := d.Encode()
		return append(b, '\n')
	})
	p := newP2P(t)
	if err := p.Put(t.Context(), p2pDesc(p.Name(), 7, "x")); err != nil {
		t.Fatal(err)
	}
	d, err := p.Get(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	if d.Epoch != 0 || d.Endpoints[EndpointRPC] != name || d.Endpoints[TransportTCP] != "127.0.0.1:16734" || len(d.Buffers) != 2 {
		t.Fatalf("got %+v", d)
	}
	f := <-got
	if f.Type != FrameMetadata {
		t.Fatalf("request type %v", f.Type)
	}
	if own, err := Decode(f.Body); err != nil || own.Name != p.Name() {
		t.Fatalf("the request carried %q: %v", f.Body, err)
	}
	// A peer serving another name's descriptor is refused.
	other, _ := fakeMooncakePeer(t, func(string) []byte { return readGolden(t, "tcp.json") })
	if _, err := p.Get(t.Context(), other); !errors.Is(err, segtable.ErrBadDesc) {
		t.Fatalf("another name's descriptor: %v", err)
	}
	// One answering null holds nothing.
	null, _ := fakeMooncakePeer(t, func(string) []byte { return []byte("null\n") })
	if _, err := p.Get(t.Context(), null); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("a null answer: %v", err)
	}
}

// TestP2PWatchTimestamps: a Mooncake peer's descriptor whose timestamp
// changes with each answer is delivered once.
func TestP2PWatchTimestamps(t *testing.T) {
	n := 0
	name, _ := fakeMooncakePeer(t, func(name string) []byte {
		d, _ := Decode(readGolden(t, "tcp.json"))
		d.Name = name
		n++
		d.Timestamp = "2026-12-01 18:00:00." + strconv.Itoa(100000+n)
		b, _ := d.Encode()
		return b
	})
	p := newP2P(t)
	ctx, cancel := context.WithCancel(t.Context())
	ch, err := p.Watch(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if ev := recvEvent(t, ch); ev.Deleted {
		t.Fatalf("first event %+v", ev)
	}
	select {
	case ev := <-ch:
		t.Fatalf("an event for a new timestamp: %+v", ev)
	case <-time.After(100 * time.Millisecond):
	}
	cancel()
	for range ch {
	}
}

// TestP2PCloseLeavesNothing: two stores that fetched, watched and served
// each other leave no descriptor open after Close (goroutines: TestMain).
func TestP2PCloseLeavesNothing(t *testing.T) {
	before := len(leakcheck.FDs())
	if before == 0 {
		t.Skip("no /proc/self/fd")
	}
	func() {
		a, err := NewP2PStore(P2PConfig{PollInterval: 2 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		b, err := NewP2PStore(P2PConfig{PollInterval: 2 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		if err := b.Put(t.Context(), p2pDesc(b.Name(), 1, "b")); err != nil {
			t.Fatal(err)
		}
		ch, err := a.Watch(t.Context(), b.Name())
		if err != nil {
			t.Fatal(err)
		}
		recvEvent(t, ch)
		for range 20 {
			if _, err := a.Get(t.Context(), b.Name()); err != nil {
				t.Fatal(err)
			}
		}
	}()
	waitStat(t, func() bool { return len(leakcheck.FDs()) <= before })
}
