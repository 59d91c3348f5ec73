package mctcp_test

// initiator_test.go: a raw socket plays a Mooncake target against the
// initiator, checking each request's bytes as Mooncake's server reads
// them and answering as it answers, or as a broken or hostile one would.

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// fakeAddr is where the fake target's one buffer lies, fakeLen its length.
const (
	fakeAddr = 0x7f00_0000_1000
	fakeLen  = 1 << 20
)

// fakeTarget accepts connections and hands each to serve.
type fakeTarget struct {
	ln    net.Listener
	wg    sync.WaitGroup
	conns atomic.Int32
}

func newFakeTarget(t *testing.T, serve func(c net.Conn)) *fakeTarget {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ft := &fakeTarget{ln: ln}
	ft.wg.Add(1)
	go func() {
		defer ft.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			ft.conns.Add(1)
			ft.wg.Add(1)
			go func() {
				defer ft.wg.Done()
				defer c.Close()
				c.SetDeadline(time.Now().Add(10 * time.Second))
				serve(c)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); ft.wg.Wait() })
	return ft
}

// desc describes the fake target to the initiator: version "" leaves the
// version out (Mooncake's "absent": 1).
func (ft *fakeTarget) desc(version string) *segtable.SegmentDesc {
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "mooncake-fake", Endpoints: map[string]string{mctcp.Name: ft.ln.Addr().String()},
		Buffers: []segtable.BufferDesc{{Addr: fakeAddr, Length: fakeLen, Keys: map[string]string{mctcp.Name: ""}}}}
	if version != "" {
		d.Endpoints[mctcp.VersionEndpoint] = version
	}
	return d
}

// readHeader reads a request as Mooncake's server does and checks it.
func readHeader(c net.Conn) (length, addr uint64, op byte, err error) {
	var h [24]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return 0, 0, 0, err
	}
	return binary.LittleEndian.Uint64(h[0:]), binary.LittleEndian.Uint64(h[8:]), h[16], nil
}

// result is what a Completer heard.
type result struct {
	token uint64
	err   error
}

type completer chan result

func (c completer) Complete(token uint64, err error) { c <- result{token, err} }

func (c completer) wait(t *testing.T) result {
	t.Helper()
	select {
	case r := <-c:
		return r
	case <-time.After(20 * time.Second):
		t.Fatal("no completion within 20 s")
		return result{}
	}
}

// initiator opens an endpoint to ft with cfg.
func initiator(t *testing.T, cfg mctcp.Config, ft *fakeTarget, version string) transport.Endpoint {
	t.Helper()
	tr := newT(t, cfg)
	t.Cleanup(func() { tr.Close() })
	ep, err := tr.Open(context.Background(), ft.desc(version))
	if err != nil {
		t.Fatal(err)
	}
	return ep
}

func post(t *testing.T, ep transport.Endpoint, c completer, op transport.Op, local []byte, remote uint64) {
	t.Helper()
	n, err := ep.Post(c, []transport.Slice{{Op: op, Local: unsafe.Pointer(unsafe.SliceData(local)), Remote: remote, Length: uint64(len(local)), Token: 7}})
	if n != 1 || err != nil {
		t.Fatalf("Post = %d, %v", n, err)
	}
}

// The four exchanges a Mooncake target serves, as its server code reads
// and answers them.
func TestInitiatorGolden(t *testing.T) {
	for _, tc := range []struct {
		version string
		opcode  byte // what the target must see
		write   bool
	}{
		{"", 0x01, true}, {"1", 0x00, false}, {"2", 0x81, true}, {"2", 0x80, false},
	} {
		t.Run(fmt.Sprintf("v%s/opcode%#x", tc.version, tc.opcode), func(t *testing.T) {
			payload := bytes.Repeat([]byte("mooncake"), 512)
			got := make(chan []byte, 1)
			ft := newFakeTarget(t, func(c net.Conn) {
				var h [24]byte
				if _, err := io.ReadFull(c, h[:]); err != nil {
					return
				}
				want := make([]byte, 24)
				binary.LittleEndian.PutUint64(want[0:], uint64(len(payload)))
				binary.LittleEndian.PutUint64(want[8:], fakeAddr+64)
				want[16] = tc.opcode
				if !bytes.Equal(h[:17], want[:17]) {
					got <- []byte(fmt.Sprintf("header % x, want % x", h[:17], want[:17]))
					return
				}
				v2 := tc.opcode&0x80 != 0
				if tc.write {
					b := make([]byte, len(payload))
					io.ReadFull(c, b)
					got <- b
					if v2 {
						c.Write(goldenOK)
					}
				} else {
					if v2 {
						c.Write(goldenOK)
					}
					c.Write(payload)
					got <- payload
				}
				io.Copy(io.Discard, c)
			})
			ep := initiator(t, mctcp.Config{Rails: 1}, ft, tc.version)
			c := make(completer, 4)
			local := make([]byte, len(payload))
			op := transport.Read
			if tc.write {
				copy(local, payload)
				op = transport.Write
			}
			post(t, ep, c, op, local, fakeAddr+64)
			if r := c.wait(t); r.err != nil || r.token != 7 {
				t.Fatalf("completion %+v", r)
			}
			if g := <-got; !bytes.Equal(g, payload) {
				t.Fatalf("target: %s", g)
			}
			if !bytes.Equal(local, payload) {
				t.Fatal("READ: local data differs")
			}
			ep.Close()
		})
	}
}

// The answers of a broken or hostile version 2 target fail the slice with
// the error the engine needs: a refusal is final (ErrDenied), the rest are
// path failures (ErrPeer) that a retry may get past.
func TestInitiatorFailures(t *testing.T) {
	for _, tc := range []struct {
		name  string
		write bool
		serve func(c net.Conn)
		want  []error
	}{
		{"READ refused", false, func(c net.Conn) { readHeader(c); c.Write(goldenRefused) }, []error{transport.ErrDenied, mctcp.ErrRefused}},
		{"WRITE refused before its payload", true, func(c net.Conn) { readHeader(c); c.Write(goldenRefused) }, []error{transport.ErrDenied, mctcp.ErrRefused}},
		{"bad magic (a version 1 target: the data first)", false, func(c net.Conn) { readHeader(c); c.Write(bytes.Repeat([]byte{1}, 4096)) }, []error{transport.ErrPeer, mctcp.ErrBadStatus}},
		{"unknown status code", true, func(c net.Conn) {
			readHeader(c)
			io.CopyN(io.Discard, c, 4096)
			c.Write(mustHex("0700000056544" + "34d"))
		}, []error{transport.ErrPeer, mctcp.ErrBadStatus}},
		{"no status within StatusTimeout", true, func(c net.Conn) { io.Copy(io.Discard, c) }, []error{transport.ErrPeer, mctcp.ErrTimeout}},
		{"READ data cut short", false, func(c net.Conn) { readHeader(c); c.Write(goldenOK); c.Write(make([]byte, 100)) }, []error{transport.ErrPeer}},
		{"READ data stalls", false, func(c net.Conn) { readHeader(c); c.Write(goldenOK); c.Write(make([]byte, 100)); io.Copy(io.Discard, c) }, []error{transport.ErrPeer, mctcp.ErrTimeout}},
		{"closed mid-payload", true, func(c net.Conn) { readHeader(c); io.CopyN(io.Discard, c, 100) }, []error{transport.ErrPeer}},
		{"closed at once", false, func(c net.Conn) {}, []error{transport.ErrPeer}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ft := newFakeTarget(t, tc.serve)
			ep := initiator(t, mctcp.Config{Rails: 1, StatusTimeout: 300 * time.Millisecond}, ft, "2")
			c := make(completer, 4)
			op := transport.Read
			if tc.write {
				op = transport.Write
			}
			start := time.Now()
			local := make([]byte, 4096)
			var r result
			n, err := ep.Post(c, []transport.Slice{{Op: op, Local: unsafe.Pointer(&local[0]), Remote: fakeAddr, Length: 4096, Token: 7}})
			switch {
			case err != nil && n == 0:
				// The rail died before the Post (a target that closes
				// at once, seen by the idle watch): the same path
				// failure, from Post.
				r.err = err
			case err != nil || n != 1:
				t.Fatalf("Post = %d, %v", n, err)
			default:
				r = c.wait(t)
			}
			for _, w := range tc.want {
				if !errors.Is(r.err, w) {
					t.Fatalf("error %v: want one wrapping %v", r.err, w)
				}
			}
			if errors.Is(r.err, transport.ErrPeer) == errors.Is(r.err, transport.ErrDenied) {
				t.Fatalf("error %v: want exactly one of ErrPeer and ErrDenied", r.err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("the failure took %v", d)
			}
			// The connection was dropped and is redialed: a later slice
			// goes over a new one.
			deadline := time.Now().Add(5 * time.Second)
			for ft.conns.Load() < 2 && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if ft.conns.Load() < 2 {
				t.Fatal("the rail was not redialed")
			}
			ep.Close()
		})
	}
}

// A version 1 peer is warned about once per address, however many
// endpoints reach it; a version 2 peer not at all.
func TestInitiatorV1WarnsOnce(t *testing.T) {
	ft := newFakeTarget(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	var logs strings.Builder
	var mu sync.Mutex
	lg := slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	tr := newT(t, mctcp.Config{Rails: 1, Logger: lg})
	defer tr.Close()
	for _, v := range []string{"", "1", "2", "1"} {
		ep, err := tr.Open(context.Background(), ft.desc(v))
		if err != nil {
			t.Fatal(err)
		}
		ep.Close()
	}
	mu.Lock()
	defer mu.Unlock()
	if n := strings.Count(logs.String(), "version 1"); n != 1 {
		t.Fatalf("%d warnings about version 1, want 1:\n%s", n, logs.String())
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// Slices outside every buffer of the descriptor are refused without a
// round trip; Notify slices are not this transport's.
func TestInitiatorLocalChecks(t *testing.T) {
	ft := newFakeTarget(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	ep := initiator(t, mctcp.Config{Rails: 1}, ft, "2")
	defer ep.Close()
	c := make(completer, 8)
	buf := make([]byte, 16)
	for _, s := range []transport.Slice{
		{Op: transport.Read, Remote: fakeAddr - 1, Length: 16},
		{Op: transport.Write, Remote: fakeAddr + fakeLen - 8, Length: 16},
		{Op: transport.Read, Remote: ^uint64(0) - 3, Length: 16},
	} {
		s.Local = unsafe.Pointer(&buf[0])
		ep.Post(c, []transport.Slice{s})
		if r := c.wait(t); !errors.Is(r.err, transport.ErrRange) {
			t.Fatalf("slice %+v: %v, want ErrRange", s, r.err)
		}
	}
	ep.Post(c, []transport.Slice{{Op: transport.Notify, Local: unsafe.Pointer(&buf[0])}})
	if r := c.wait(t); !errors.Is(r.err, transport.ErrDenied) {
		t.Fatalf("Notify: %v, want ErrDenied", r.err)
	}
}

// TestInitiatorUpdateSpans: after each republish, Post's check passes the
// ranges inside the descriptor's buffers then and no others (a buffer
// removed, a range across a buffer's end or start, a gap), over hundreds
// of chunks of buffers, with descriptors flat and chunked (a DescList's,
// whose republishes share the chunks a change did not touch).
func TestInitiatorUpdateSpans(t *testing.T) {
	ft := newFakeTarget(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	ep := initiator(t, mctcp.Config{Rails: 1}, ft, "2")
	defer ep.Close()
	const n = 5000
	const base = uint64(0x10_0000_0000)
	at := func(i int) (addr, length uint64) { return base + uint64(i)*0x2000, 0x1000 + uint64(i%7) }
	rng := mrand.New(mrand.NewPCG(1, 2))
	live := make([]bool, n)
	var l segtable.DescList
	// sweep checks every buffer's ranges against the endpoint's spans now.
	sweep := func(round int) {
		t.Helper()
		for i := range n {
			a, ln := at(i)
			for _, c := range []struct {
				addr, n uint64
				want    bool
			}{
				{a, ln, live[i]}, {a, 1, live[i]}, {a + ln - 1, 1, live[i]}, {a + 8, ln - 8, live[i]},
				{a, ln + 1, false}, {a + ln, 1, false}, {a - 1, 2, false}, {a + ln - 4, 0x1000, false},
			} {
				if got := mctcp.Inside(ep, c.addr, c.n); got != c.want {
					t.Fatalf("round %d, buffer %d (live %v): [%#x, +%#x) inside: %v, want %v", round, i, live[i], c.addr, c.n, got, c.want)
				}
			}
		}
	}
	for round := range 6 {
		for i := range live {
			if rng.IntN(3) == 0 || round == 0 {
				live[i] = !live[i]
				a, ln := at(i)
				if live[i] {
					l.Put(segtable.BufferID(i+1), segtable.BufferDesc{Addr: a, Length: ln, Keys: map[string]string{mctcp.Name: ""}}, true)
				} else {
					l.Delete(segtable.BufferID(i+1), a)
				}
			}
		}
		// Flat, then chunked twice (the second Mirror made from the
		// first's shared tables), and so on; the first round's flat
		// descriptor out of address order.
		d := ft.desc("2")
		d.Buffers = l.Buffers(true)
		if round == 0 {
			rng.Shuffle(len(d.Buffers), func(i, j int) { d.Buffers[i], d.Buffers[j] = d.Buffers[j], d.Buffers[i] })
		}
		if round%3 != 0 {
			d.Buffers, d.Chunked = nil, l.Remote()
		}
		ep.Update(d)
		sweep(round)
	}
	// A republish after one change (a chunked descriptor) makes the spans
	// of the chunk it changed, not of every chunk (n/ChunkSize of them,
	// each a table of its own when built anew).
	d := ft.desc("2")
	d.Buffers = nil
	a, ln := at(n / 2)
	flip := live[n/2]
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	allocs := testing.AllocsPerRun(20, func() {
		flip = !flip
		if flip {
			l.Put(segtable.BufferID(n/2+1), segtable.BufferDesc{Addr: a, Length: ln, Keys: map[string]string{mctcp.Name: ""}}, true)
		} else {
			l.Delete(segtable.BufferID(n/2+1), a)
		}
		d.Chunked = l.Remote()
		ep.Update(d)
	})
	runtime.ReadMemStats(&after)
	bytes := (after.TotalAlloc - before.TotalAlloc) / 21 // AllocsPerRun runs it once more
	live[n/2] = flip
	sweep(6) // the Mirrors made from shared tables answer as they should
	t.Logf("%v allocations, %d bytes a republish of %d buffers after one change", allocs, bytes, l.Len())
	// Spans built anew take 16 bytes a buffer (flat) or an allocation a
	// chunk (each chunk's table); the one change itself costs the
	// DescList and the Mirror a chunk's copy and their page arrays.
	if chunks := l.Len() / segtable.ChunkSize; allocs > float64(chunks)/2 || bytes > uint64(l.Len())*16 {
		t.Errorf("%v allocations and %d bytes a republish after one change, with %d buffers in %d chunks: the spans are built anew", allocs, bytes, l.Len(), chunks)
	}
}

// An unreachable peer fails Open with ErrPeer, a descriptor without the
// endpoint with ErrUnreachable.
func TestInitiatorOpenErrors(t *testing.T) {
	tr := newT(t, mctcp.Config{DialTimeout: time.Second})
	defer tr.Close()
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	_, err := tr.Open(context.Background(), &segtable.SegmentDesc{Name: "x", Endpoints: map[string]string{mctcp.Name: addr}})
	if !errors.Is(err, transport.ErrPeer) {
		t.Fatalf("Open of a closed port: %v, want ErrPeer", err)
	}
	_, err = tr.Open(context.Background(), &segtable.SegmentDesc{Name: "x", Endpoints: map[string]string{"tcp": addr}})
	if !errors.Is(err, transport.ErrUnreachable) {
		t.Fatalf("Open without the endpoint: %v, want ErrUnreachable", err)
	}
}

// Mooncake's target refuses a WRITE before its payload and closes without
// reading it: the initiator's write fails, and the refusal, already
// received, still decides the slice (final, not a path failure).
func TestInitiatorRefusedWriteClosedUnread(t *testing.T) {
	ft := newFakeTarget(t, func(c net.Conn) { readHeader(c); c.Write(goldenRefused); time.Sleep(10 * time.Millisecond) })
	ep := initiator(t, mctcp.Config{Rails: 1}, ft, "2")
	defer ep.Close()
	c := make(completer, 4)
	local := make([]byte, fakeLen)
	for i := range 5 {
		// Each refusal closes the connection; wait for the redial.
		deadline := time.Now().Add(5 * time.Second)
		for {
			n, err := ep.Post(c, []transport.Slice{{Op: transport.Write, Local: unsafe.Pointer(&local[0]), Remote: fakeAddr, Length: fakeLen, Token: uint64(i)}})
			if n == 1 {
				break
			}
			if !errors.Is(err, transport.ErrPeer) || time.Now().After(deadline) {
				t.Fatalf("Post = %d, %v", n, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if r := c.wait(t); !errors.Is(r.err, transport.ErrDenied) || !errors.Is(r.err, mctcp.ErrRefused) {
			t.Fatalf("%v: want the refusal (ErrDenied)", r.err)
		}
	}
}
