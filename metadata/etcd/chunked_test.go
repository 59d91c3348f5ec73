package etcd_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/segtable"
)

// chunkSubtree is where the stores under prefix keep chunk keys.
func chunkSubtree(prefix string) string { return prefix + "\x00chunks/" }

// testBuffer returns the i-th buffer of the tests' lists: 4 KiB apart,
// each with a key of its own.
func testBuffer(i int) segtable.BufferDesc {
	return segtable.BufferDesc{Addr: 0x100000 + uint64(i)*0x1000, Length: 4096, Location: "cpu:0",
		Keys: map[string]string{"tcp": fmt.Sprintf("key-%d", i)}}
}

// testList returns a ChunkList of n buffers, inserted in address order as
// an engine registers them.
func testList(t testing.TB, n int) *segtable.ChunkList {
	t.Helper()
	l := new(segtable.ChunkList)
	for i := range n {
		if err := l.Insert(testBuffer(i)); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

// chunkedDesc returns the descriptor an engine publishes with l.
func chunkedDesc(name string, epoch uint64, l *segtable.ChunkList) *segtable.SegmentDesc {
	return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: name, Epoch: epoch,
		Endpoints: map[string]string{"tcp": "10.0.0.1:7000"}, Rev: l.Seq(), Chunked: l.Chunks()}
}

// sameDesc fails the test unless got is the descriptor want holds: the
// same JSON, byte for byte (a Chunked one, read from a header, encodes
// as the flat one).
func sameDesc(t testing.TB, what string, got, want *segtable.SegmentDesc) {
	t.Helper()
	if got == nil {
		t.Fatalf("%s: no descriptor", what)
	}
	g, err := got.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	w, err := want.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(g, w) {
		t.Fatalf("%s: descriptor of %d buffers (%d bytes) differs from the one of %d published (%d bytes)",
			what, got.NumBuffers(), len(g), want.NumBuffers(), len(w))
	}
}

// wire counts the requests of a store and their bytes, and the bytes of
// their answers (unary calls: a watch's stream is not counted).
type wire struct {
	reqs, sent, recvd atomic.Int64
}

func (c *wire) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	err := invoker(ctx, method, req, reply, cc, opts...)
	c.reqs.Add(1)
	if m, ok := req.(proto.Message); ok {
		c.sent.Add(int64(proto.Size(m)))
	}
	if m, ok := reply.(proto.Message); ok && err == nil {
		c.recvd.Add(int64(proto.Size(m)))
	}
	return err
}

func (c *wire) reset() { c.reqs.Store(0); c.sent.Store(0); c.recvd.Store(0) }

// newCounted returns a store whose requests c counts, closed when the
// test ends.
func newCounted(t testing.TB, ep, prefix string, c *wire, flat bool) *etcd.Store {
	t.Helper()
	s, err := etcd.NewIntercepted(etcd.Config{Endpoints: []string{ep}, Prefix: prefix, FlatLayout: flat}, c.intercept)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// countKeys returns how many keys start with prefix, and how many of them
// were written after revision rev.
func countKeys(t testing.TB, raw *clientv3.Client, prefix string, rev int64) (all, after int64) {
	t.Helper()
	ctx := context.Background()
	resp, err := raw.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	all = resp.Count
	// Not WithCountOnly: etcd counts the keys before it filters them by
	// revision.
	resp, err = raw.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithMinModRev(rev+1))
	if err != nil {
		t.Fatal(err)
	}
	return all, int64(len(resp.Kvs))
}

// chunkSum is the sum a header gives each chunk (chunkwire.Sum).
func chunkSum(b []byte) uint64 { return chunkwire.Sum(b) }

func currentRev(t testing.TB, raw *clientv3.Client) int64 {
	t.Helper()
	resp, err := raw.Get(context.Background(), "\x00")
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

// TestEtcdChunked runs the checks of the per-chunk layout against one
// etcd.
func TestEtcdChunked(t *testing.T) {
	srv := etcdtest.Start(t)
	ep := srv.Endpoint()
	t.Run("Large", func(t *testing.T) { testChunkedLarge(t, ep) })
	t.Run("Signed", func(t *testing.T) { testChunkedSigned(t, ep) })
	t.Run("Layouts", func(t *testing.T) { testChunkedLayouts(t, ep) })
	t.Run("Held", func(t *testing.T) { testChunkedHeld(t, ep) })
	t.Run("LeaseLost", func(t *testing.T) { testChunkedLeaseLost(t, ep) })
	t.Run("LostAnswer", func(t *testing.T) { testChunkedLostAnswer(t, ep) })
	t.Run("Bad", func(t *testing.T) { testChunkedBad(t, ep) })
}

// Headers that are not what a store writes, written straight into etcd:
// a chunk listed that etcd does not hold, a chunk of too many buffers, a
// chunk whose buffers do not match its count, another name's header.
// Get refuses each with ErrBadDesc; a watch shows each as no descriptor,
// and the real one when it comes.
func testChunkedBad(t *testing.T, ep string) {
	prefix := etcdPrefix()
	s := newEtcd(t, ep, prefix, 0)
	raw := rawEtcd(t, ep)
	ctx := t.Context()
	header := func(name, chunks string) string {
		return `{"layout":"moonring-chunks/1","desc":{"version":1,"name":"` + name + `","epoch":1,"endpoints":{"tcp":"x"},"buffers":null},"chunks":[` + chunks + `]}`
	}
	one := `[{"addr":4096,"length":4096,"location":"cpu:0","keys":null}]`
	if _, err := raw.Put(ctx, fmt.Sprintf("%s1/b/1/7", chunkSubtree(prefix)), one); err != nil {
		t.Fatal(err)
	}
	ch, err := s.Watch(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	good := header("b", fmt.Sprintf(`{"s":7,"n":1,"h":%d}`, chunkSum([]byte(one))))
	for i, v := range []string{
		good,
		header("b", `{"s":8,"n":1,"h":0}`),
		header("b", fmt.Sprintf(`{"s":7,"n":2,"h":%d}`, chunkSum([]byte(one)))),
		header("b", fmt.Sprintf(`{"s":7,"n":5000,"h":%d}`, chunkSum([]byte(one)))),
		header("c", fmt.Sprintf(`{"s":7,"n":1,"h":%d}`, chunkSum([]byte(one)))),
		`{"layout":"moonring-chunks/1","desc":`,
	} {
		if _, err := raw.Put(ctx, prefix+"b", v); err != nil {
			t.Fatal(err)
		}
		d, err := s.Get(ctx, "b")
		if i == 0 {
			if err != nil || d.NumBuffers() != 1 || d.AllBuffers()[0].Addr != 4096 {
				t.Fatalf("Get of a header written by hand: %+v, %v", d, err)
			}
			if ev := next(t, ch); ev.Deleted || ev.Desc.NumBuffers() != 1 {
				t.Fatalf("watch of a header written by hand: %+v", ev)
			}
			continue
		}
		if !errors.Is(err, segtable.ErrBadDesc) {
			t.Errorf("Get of bad header %d: %+v, %v; want ErrBadDesc", i, d, err)
		}
		if i == 1 {
			if ev := next(t, ch); !ev.Deleted {
				t.Fatalf("watch of a bad header: %+v, want Deleted", ev)
			}
		}
	}
	if _, err := raw.Put(ctx, prefix+"b", good); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); ev.Deleted || ev.Desc.NumBuffers() != 1 {
		t.Fatalf("watch of a good header after bad ones: %+v", ev)
	}
}

// A republish whose transaction committed but whose answer was lost: the
// retry finds its own header and stops there, writing no chunk again; a
// republish refused by etcd leaves what readers see unchanged, and the
// next one writes what it must. An empty list publishes and reads back.
func testChunkedLostAnswer(t *testing.T, ep string) {
	f := newFaults()
	prefix := etcdPrefix()
	s := newFaulty(t, ep, prefix, f, 0)
	raw := rawEtcd(t, ep)
	ctx := t.Context()
	l := testList(t, 5000)
	d := chunkedDesc("l", 1, l)
	if err := s.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	if err := l.Insert(testBuffer(9000)); err != nil {
		t.Fatal(err)
	}
	d = chunkedDesc("l", 1, l)
	f.count("")
	f.add(mTxn, fault{err: rpctypes.ErrGRPCTimeout, lost: true})
	rev := currentRev(t, raw)
	if err := s.Put(ctx, d); err != nil {
		t.Fatalf("Put whose answer was lost: %v", err)
	}
	if n := f.count(mTxn); n != 2 {
		t.Errorf("%d transactions for a republish whose answer was lost; want 2 (the write, the retry that finds it)", n)
	}
	if _, written := countKeys(t, raw, chunkSubtree(prefix), rev); written != 1 {
		t.Errorf("%d chunk keys written; want 1", written)
	}
	got, err := s.Get(ctx, "l")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "Get after a lost answer", got, d)

	// Refused (too large, say): nothing changes, and the next republish
	// writes the chunks the refused one made.
	if err := l.Insert(testBuffer(9001)); err != nil {
		t.Fatal(err)
	}
	f.add(mTxn, fault{err: rpctypes.ErrGRPCRequestTooLarge})
	if err := s.Put(ctx, chunkedDesc("l", 1, l)); !errors.Is(err, segtable.ErrBadDesc) {
		t.Fatalf("Put refused as too large: %v, want ErrBadDesc", err)
	}
	if got, err := s.Get(ctx, "l"); err != nil {
		t.Fatal(err)
	} else {
		sameDesc(t, "Get after a refused Put", got, d)
	}
	if err := l.Insert(testBuffer(9002)); err != nil {
		t.Fatal(err)
	}
	d = chunkedDesc("l", 1, l)
	if err := s.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	got, err = s.Get(ctx, "l")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "Get after the next republish", got, d)
	if all, _ := countKeys(t, raw, chunkSubtree(prefix), 0); all != int64(l.Chunks().Count()) {
		t.Errorf("%d chunk keys, want %d", all, l.Chunks().Count())
	}

	var empty segtable.ChunkList
	e := chunkedDesc("empty", 1, &empty)
	if err := s.Put(ctx, e); err != nil {
		t.Fatal(err)
	}
	got, err = s.Get(ctx, "empty")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "Get of an empty list", got, e)
}

// A descriptor of 100k buffers (some 9 MB of JSON, over etcd's 1.5 MiB
// request limit) publishes and reads back; a republish after one
// registration writes one or two chunk keys and the header, a watcher
// reads only those chunks, and both readers see the change; Delete
// leaves no chunk key.
func testChunkedLarge(t *testing.T, ep string) {
	const n = 100_000
	prefix := etcdPrefix()
	var pw, rw wire
	pub := newCounted(t, ep, prefix, &pw, false)
	reader := newCounted(t, ep, prefix, &rw, false)
	raw := rawEtcd(t, ep)
	ctx := t.Context()

	l := testList(t, n)
	d := chunkedDesc("big", 1, l)
	start := time.Now()
	if err := pub.Put(ctx, d); err != nil {
		t.Fatalf("Put of %d buffers: %v", n, err)
	}
	flat, _ := d.Marshal()
	t.Logf("first publish of %d buffers (%d chunks, %d bytes flat): %v, %d requests, %d bytes sent",
		n, l.Chunks().Count(), len(flat), time.Since(start).Round(time.Millisecond), pw.reqs.Load(), pw.sent.Load())
	if len(flat) <= 3<<19 {
		t.Fatalf("the flat descriptor is %d bytes: not over etcd's limit", len(flat))
	}
	if all, _ := countKeys(t, raw, chunkSubtree(prefix), 0); all != int64(l.Chunks().Count()) {
		t.Fatalf("%d chunk keys, want %d", all, l.Chunks().Count())
	}
	got, err := reader.Get(ctx, "big")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "Get", got, d)
	ch, err := reader.Watch(ctx, "big")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "the watch's first event", next(t, ch).Desc, d)

	// One registration, one republish.
	for i, b := range []segtable.BufferDesc{testBuffer(n + 10), testBuffer(n / 2)} {
		if i == 1 {
			// In the middle: a full chunk splits (two new chunks, one gone).
			if !l.Delete(b.Addr) {
				t.Fatal("no buffer to delete")
			}
			b.Length = 2048
		}
		if err := l.Insert(b); err != nil {
			t.Fatal(err)
		}
		d = chunkedDesc("big", 1, l)
		pw.reset()
		rw.reset()
		rev := currentRev(t, raw)
		start = time.Now()
		if err := pub.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		all, written := countKeys(t, raw, chunkSubtree(prefix), rev)
		t.Logf("republish %d: %v, %d requests, %d bytes sent; %d chunk keys written, %d in all", i, took.Round(time.Microsecond), pw.reqs.Load(), pw.sent.Load(), written, all)
		if written < 1 || written > 2 || all != int64(l.Chunks().Count()) {
			t.Errorf("republish %d: %d chunk keys written, %d in all; want 1 or 2, and %d", i, written, all, l.Chunks().Count())
		}
		if sent := pw.sent.Load(); sent > int64(len(flat))/20 {
			t.Errorf("republish %d sent %d bytes: more than a twentieth of the flat descriptor's %d", i, sent, len(flat))
		}
		ev := next(t, ch)
		sameDesc(t, "the watch's event", ev.Desc, d)
		if got := rw.recvd.Load(); got > 64<<10 {
			t.Errorf("the watch read %d bytes of chunks for a republish of one or two", got)
		}
		got, err := reader.Get(ctx, "big")
		if err != nil {
			t.Fatal(err)
		}
		sameDesc(t, "Get after the republish", got, d)
	}

	if err := pub.Delete(ctx, "big", 1); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); !ev.Deleted {
		t.Fatalf("event after Delete: %+v", ev)
	}
	if all, _ := countKeys(t, raw, prefix, 0); all != 0 {
		t.Fatalf("%d keys under the prefix after Delete", all)
	}
	if all, _ := countKeys(t, raw, chunkSubtree(prefix), 0); all != 0 {
		t.Fatalf("%d chunk keys after Delete", all)
	}
}

// A signed descriptor round-trips through metadata.Signed over etcd, in
// both layouts; a chunk forged in etcd is refused: by the store when only
// the chunk changed (its hash in the header; a reader that holds the
// chunk listed keeps it and reads nothing), by the signed reader when the
// header's hash was made to match.
func testChunkedSigned(t *testing.T, ep string) {
	key := []byte("segment key")
	for _, flat := range []bool{false, true} {
		t.Run(fmt.Sprintf("flat=%v", flat), func(t *testing.T) {
			prefix := etcdPrefix()
			var w wire
			ws, err := metadata.NewSigned(newCounted(t, ep, prefix, &w, flat), key, nil)
			if err != nil {
				t.Fatal(err)
			}
			rs, err := metadata.NewSigned(newEtcd(t, ep, prefix, 0), key, nil)
			if err != nil {
				t.Fatal(err)
			}
			raw := rawEtcd(t, ep)
			ctx := t.Context()
			l := testList(t, 1000)
			for round := range 3 {
				if round > 0 {
					if err := l.Insert(testBuffer(2000 + round)); err != nil {
						t.Fatal(err)
					}
				}
				if err := ws.Put(ctx, chunkedDesc("s", 7, l)); err != nil {
					t.Fatal(err)
				}
				got, err := rs.Get(ctx, "s")
				if err != nil {
					t.Fatalf("round %d: signed Get: %v", round, err)
				}
				chunks := len(got.Chunks)
				if got.Chunked != nil {
					chunks = got.Chunked.Count()
				}
				if got.MAC == "" || got.NumBuffers() != l.Chunks().Len() || chunks != l.Chunks().Count() {
					t.Fatalf("round %d: got %d buffers, %d chunks, MAC %q", round, got.NumBuffers(), chunks, got.MAC)
				}
				for i, b := range got.AllBuffers() {
					if b.MAC == "" || b.Addr != l.Chunks().Buffers()[i].Addr {
						t.Fatalf("round %d: buffer %d: %+v", round, i, b)
					}
				}
			}
			// Flat descriptors through Signed: their chunks are numbered
			// from 1 on every Put, so a seq is not a chunk's. The writer
			// and a watcher tell them apart.
			wch, err := rs.Watch(ctx, "flat")
			if err != nil {
				t.Fatal(err)
			}
			for round := range 3 {
				fd := testDesc("flat", 9, fmt.Sprint(round))
				fd.Buffers = nil
				for i := range 100 {
					b := testBuffer(i)
					b.Keys["tcp"] = fmt.Sprintf("round-%d-%d", round, i)
					fd.Buffers = append(fd.Buffers, b)
				}
				if err := ws.Put(ctx, fd); err != nil {
					t.Fatal(err)
				}
				got, err := rs.Get(ctx, "flat")
				if err != nil {
					t.Fatalf("round %d: signed Get of a flat descriptor: %v", round, err)
				}
				var ev metadata.Event
				for ev = next(t, wch); !ev.Deleted && ev.Desc.Endpoints["tcp"] != fmt.Sprint(round); ev = next(t, wch) {
				}
				for _, d := range []*segtable.SegmentDesc{got, ev.Desc} {
					if ev.Deleted || d.NumBuffers() != 100 || d.AllBuffers()[99].Keys["tcp"] != fmt.Sprintf("round-%d-99", round) {
						t.Fatalf("round %d: Get or watch of a flat descriptor: %d buffers (deleted %v)", round, d.NumBuffers(), ev.Deleted)
					}
				}
			}
			if err := ws.Delete(ctx, "flat", 9); err != nil {
				t.Fatal(err)
			}

			all, _ := countKeys(t, raw, chunkSubtree(prefix), 0)
			if flat {
				if all != 0 {
					t.Fatalf("FlatLayout wrote %d chunk keys", all)
				}
				return
			}
			if all != int64(l.Chunks().Count()) {
				t.Fatalf("%d chunk keys, want %d", all, l.Chunks().Count())
			}
			// Forge a chunk: a buffer's key changed.
			hresp, err := raw.Get(ctx, prefix+"s")
			if err != nil || len(hresp.Kvs) != 1 {
				t.Fatalf("raw Get of the header: %v", err)
			}
			var h struct {
				Chunks []struct {
					Seq uint64 `json:"s"`
				} `json:"chunks"`
			}
			if err := json.Unmarshal(hresp.Kvs[0].Value, &h); err != nil || len(h.Chunks) == 0 {
				t.Fatalf("header %q: %v", hresp.Kvs[0].Value, err)
			}
			ck := fmt.Sprintf("%s%d/s/7/%d", chunkSubtree(prefix), len("s"), h.Chunks[0].Seq)
			cresp, err := raw.Get(ctx, ck)
			if err != nil || len(cresp.Kvs) != 1 {
				t.Fatalf("raw Get of chunk %q: %+v, %v", ck, cresp, err)
			}
			old := cresp.Kvs[0].Value
			forged := bytes.Replace(old, []byte(`"key-0"`), []byte(`"evil!"`), 1)
			if bytes.Equal(forged, old) {
				t.Fatalf("chunk %q holds no key-0: %s", ck, old)
			}
			if _, err := raw.Put(ctx, ck, string(forged)); err != nil {
				t.Fatal(err)
			}
			// A reader that holds the chunk keeps it (the header names it
			// by its sum, unchanged): it reads the chunk listed, not the
			// one changed. A reader that reads it refuses it.
			if got, err := rs.Get(ctx, "s"); err != nil || got.NumBuffers() != l.Chunks().Len() {
				t.Fatalf("Get with a chunk held changed in etcd: %v", err)
			}
			fresh := newEtcd(t, ep, prefix, 0)
			if _, err := fresh.Get(ctx, "s"); !errors.Is(err, segtable.ErrBadDesc) {
				t.Fatalf("Get with a chunk changed in etcd: %v, want ErrBadDesc", err)
			}
			// The forger fixes the header's hash too: the MACs refuse it.
			var hv map[string]any
			d := json.NewDecoder(bytes.NewReader(hresp.Kvs[0].Value))
			d.UseNumber()
			if err := d.Decode(&hv); err != nil {
				t.Fatal(err)
			}
			first := hv["chunks"].([]any)[0].(map[string]any)
			first["h"] = json.Number(fmt.Sprint(chunkSum(forged)))
			hb, err := json.Marshal(hv)
			if err != nil {
				t.Fatal(err)
			}
			// Layout first, as a store writes it (json.Marshal of a map sorts
			// the keys, and "layout" is not the first).
			hb = append([]byte(`{"layout":"moonring-chunks/1",`), hb[1:]...)
			if _, err := raw.Put(ctx, prefix+"s", string(hb)); err != nil {
				t.Fatal(err)
			}
			if _, err := rs.Get(ctx, "s"); !errors.Is(err, metadata.ErrForged) {
				t.Fatalf("signed Get of a forged chunk: %v, want ErrForged", err)
			}
			if rs.Refused().Forged == 0 {
				t.Fatal("the signed reader counted no forgery")
			}
		})
	}
}

// Both layouts: FlatLayout writes one key; a flat value written by an old
// writer is read, watched and republished over in the per-chunk layout;
// a flat descriptor is written flat; names that share a prefix ("a",
// "a/1") keep their chunks apart; a name that starts with NUL is refused.
func testChunkedLayouts(t *testing.T, ep string) {
	prefix := etcdPrefix()
	s := newEtcd(t, ep, prefix, 0)
	raw := rawEtcd(t, ep)
	ctx := t.Context()

	// FlatLayout: one key, the whole descriptor.
	fprefix := etcdPrefix()
	var w wire
	fs := newCounted(t, ep, fprefix, &w, true)
	l := testList(t, 100)
	d := chunkedDesc("f", 1, l)
	if err := fs.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	resp, err := raw.Get(ctx, fprefix, clientv3.WithPrefix())
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Key) != fprefix+"f" {
		t.Fatalf("FlatLayout wrote %+v (%v); want the one key", resp, err)
	}
	old, err := segtable.UnmarshalDesc(resp.Kvs[0].Value)
	if err != nil {
		t.Fatalf("FlatLayout's value is no descriptor: %v", err)
	}
	sameDesc(t, "FlatLayout's value", old, d)

	// An old writer's flat value: read and watched, then a republish of
	// the same epoch takes the per-chunk layout over it.
	flat, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := raw.Put(ctx, prefix+"old", strings.Replace(string(flat), `"name":"f"`, `"name":"old"`, 1)); err != nil {
		t.Fatal(err)
	}
	want := chunkedDesc("old", 1, l)
	got, err := s.Get(ctx, "old")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "Get of an old writer's value", got, want)
	ch, err := s.Watch(ctx, "old")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "watch of an old writer's value", next(t, ch).Desc, want)
	if err := s.Put(ctx, chunkedDesc("old", 2, l)); !errors.Is(err, metadata.ErrExists) {
		t.Fatalf("Put of another epoch over an old writer's value: %v, want ErrExists", err)
	}
	if err := l.Insert(testBuffer(500)); err != nil {
		t.Fatal(err)
	}
	want = chunkedDesc("old", 1, l)
	if err := s.Put(ctx, want); err != nil {
		t.Fatalf("republish over an old writer's value: %v", err)
	}
	sameDesc(t, "watch of the republish", next(t, ch).Desc, want)
	got, err = s.Get(ctx, "old")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "Get of the republish", got, want)
	// And back: a flat descriptor is written flat, and the watch follows.
	fd := testDesc("old", 1, "flat again")
	if err := s.Put(ctx, fd); err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "watch of a flat republish", next(t, ch).Desc, fd)
	if v, err := raw.Get(ctx, prefix+"old"); err != nil || !bytes.Equal(v.Kvs[0].Value, mustMarshal(t, fd)) {
		t.Fatalf("a flat descriptor is not written flat: %v", err)
	}
	if all, _ := countKeys(t, raw, chunkSubtree(prefix), 0); all != 0 {
		t.Fatalf("%d chunk keys left when the name holds a flat descriptor", all)
	}

	// Names sharing a prefix.
	la, lb := testList(t, 40), testList(t, 70)
	a, b := chunkedDesc("a", 1, la), chunkedDesc("a/1", 1, lb)
	for _, d := range []*segtable.SegmentDesc{a, b} {
		if err := s.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Delete(ctx, "a", 1); err != nil {
		t.Fatal(err)
	}
	got, err = s.Get(ctx, "a/1")
	if err != nil {
		t.Fatalf("Get(a/1) after Delete(a): %v", err)
	}
	sameDesc(t, "a/1 after Delete(a)", got, b)
	if err := s.Delete(ctx, "a/1", 0); err != nil {
		t.Fatal(err)
	}
	if all, _ := countKeys(t, raw, chunkSubtree(prefix), 0); all != 0 {
		t.Fatalf("%d chunk keys after the Deletes", all)
	}

	if err := s.Put(ctx, chunkedDesc("\x00chunks/1/a/1/1", 1, la)); !errors.Is(err, segtable.ErrBadDesc) {
		t.Fatalf("Put of a name that starts with NUL: %v, want ErrBadDesc", err)
	}
}

// A name held by another epoch: a Chunked Put fails with ErrExists and
// leaves no chunk key of its own behind.
func testChunkedHeld(t *testing.T, ep string) {
	prefix := etcdPrefix()
	a, b := newEtcd(t, ep, prefix, 0), newEtcd(t, ep, prefix, 0)
	raw := rawEtcd(t, ep)
	ctx := t.Context()
	la := testList(t, 300)
	if err := a.Put(ctx, chunkedDesc("x", 1, la)); err != nil {
		t.Fatal(err)
	}
	before, _ := countKeys(t, raw, chunkSubtree(prefix), 0)
	if err := b.Put(ctx, chunkedDesc("x", 2, testList(t, 500))); !errors.Is(err, metadata.ErrExists) {
		t.Fatalf("Put of another epoch: %v, want ErrExists", err)
	}
	if all, _ := countKeys(t, raw, chunkSubtree(prefix), 0); all != before {
		t.Fatalf("%d chunk keys after a Put that lost, %d before", all, before)
	}
	if err := b.Delete(ctx, "x", 2); !errors.Is(err, metadata.ErrEpoch) {
		t.Fatalf("Delete of another epoch: %v, want ErrEpoch", err)
	}
	got, err := b.Get(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "the holder's descriptor", got, chunkedDesc("x", 1, la))
}

// etcd loses the lease (revoked here; expired in an outage): the header
// and every chunk go, and the owner writes them all again under a new
// lease.
func testChunkedLeaseLost(t *testing.T, ep string) {
	prefix := etcdPrefix()
	owner := newEtcd(t, ep, prefix, 5*time.Second)
	reader := newEtcd(t, ep, prefix, 0)
	raw := rawEtcd(t, ep)
	ctx := t.Context()
	l := testList(t, 2000)
	d := chunkedDesc("r", 3, l)
	if err := owner.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	ch, err := reader.Watch(ctx, "r")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "first event", next(t, ch).Desc, d)
	resp, err := raw.Get(ctx, prefix+"r")
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("raw Get of r: %+v, %v", resp, err)
	}
	lease := clientv3.LeaseID(resp.Kvs[0].Lease)
	if _, err := raw.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	if ev := next(t, ch); !ev.Deleted {
		t.Fatalf("event after the lease was revoked: %+v, want Deleted", ev)
	}
	sameDesc(t, "event after the restore", next(t, ch).Desc, d)
	got, err := reader.Get(ctx, "r")
	if err != nil {
		t.Fatal(err)
	}
	sameDesc(t, "Get after the restore", got, d)
	cresp, err := raw.Get(ctx, chunkSubtree(prefix), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	hresp, err := raw.Get(ctx, prefix+"r")
	if err != nil || len(hresp.Kvs) != 1 {
		t.Fatalf("raw Get of r after the restore: %v", err)
	}
	newLease := hresp.Kvs[0].Lease
	if newLease == 0 || newLease == int64(lease) || len(cresp.Kvs) != l.Chunks().Count() {
		t.Fatalf("after the restore: header lease %x (was %x), %d chunk keys (want %d)", newLease, lease, len(cresp.Kvs), l.Chunks().Count())
	}
	for _, kv := range cresp.Kvs {
		if kv.Lease != newLease {
			t.Fatalf("chunk key %q under lease %x, the header under %x", kv.Key, kv.Lease, newLease)
		}
	}
	// A republish after the restore writes only what changed.
	if err := l.Insert(testBuffer(5000)); err != nil {
		t.Fatal(err)
	}
	rev := currentRev(t, raw)
	d = chunkedDesc("r", 3, l)
	if err := owner.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	if _, written := countKeys(t, raw, chunkSubtree(prefix), rev); written > 2 {
		t.Errorf("republish after the restore wrote %d chunk keys", written)
	}
	sameDesc(t, "event after the republish", next(t, ch).Desc, d)
	if err := owner.Delete(ctx, "r", 3); err != nil {
		t.Fatal(err)
	}
	if all, _ := countKeys(t, raw, chunkSubtree(prefix), 0); all != 0 {
		t.Fatalf("%d chunk keys after Delete", all)
	}
}
