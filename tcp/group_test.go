package tcp

import (
	"bytes"
	"fmt"
	mrand "math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// groupFrame is a group frame per PROTOCOL.md (Groups) of the WRITE
// frames ws: the group header, every WRITE's header, then every payload.
func groupFrame(ws ...[]byte) []byte {
	g := specReq{op: specGroup, length: uint32(len(ws))}.frame(nil)
	for _, w := range ws {
		g = append(g, w[:specReqLen]...)
	}
	for _, w := range ws {
		g = append(g, w[specReqLen:]...)
	}
	return g
}

// TestServerGroupPipeline: a long stream of group frames of 2 to 16
// WRITEs (refused ones, ones past the buffer's end, payloads from 1 byte
// to past the frames' 64 KiB buffer) between READs and lone WRITEs, sent
// at once and in pieces with pauses between, so that a group's payloads
// come from the frames' buffer, from the bytes its last readv read past
// it and straight from the socket, cut at every kind of place. Every
// response must come in order with the status PROTOCOL.md gives, every
// READ with the bytes before the WRITEs, and the buffer must end as the
// model says.
func TestServerGroupPipeline(t *testing.T) {
	for _, pieces := range []bool{false, true} {
		t.Run(fmt.Sprintf("pieces=%v", pieces), func(t *testing.T) {
			testServerGroupPipeline(t, pieces)
		})
	}
}

func testServerGroupPipeline(t *testing.T, pieces bool) {
	s := newSide(t, Config{})
	const size = 512 << 10
	buf := s.register(t, s.alloc(t, size, 0), true)
	testpattern.Fill(buf.mem, 2)
	model := bytes.Clone(buf.mem)
	rng := mrand.New(mrand.NewPCG(5, 6))

	var (
		stream []byte
		wants  []pipeWant
		id     uint32
	)
	// req makes one READ or WRITE: READs in the first half of the buffer
	// and WRITEs in the second, so that no READ's bytes depend on how the
	// target orders it against a WRITE. bad: a wrong key; past: running
	// past the buffer's end.
	req := func(op byte, n int, bad, past bool) []byte {
		id++
		off := rng.IntN(size/2 - n + 1)
		if op == specWrite {
			off += size / 2
		}
		if past {
			off = size - n + 1 + rng.IntN(n)
		}
		r := specReq{op: op, id: id, buffer: buf.id, length: uint32(n), key: buf.key, addr: buf.addr + uint64(off)}
		w := pipeWant{id: id, status: []uint8{0}}
		switch {
		case bad:
			r.key ^= 0x10
			w.status[0] = 1
		case off >= size:
			w.status[0] = 1
		case off+n > size:
			w.status[0] = 2
		}
		var payload []byte
		if op == specWrite {
			payload = make([]byte, n)
			testpattern.Fill(payload, rng.Uint64())
			if w.status[0] == 0 {
				copy(model[off:], payload)
			}
		} else if w.status[0] == 0 {
			w.payload = bytes.Clone(model[off : off+n])
		}
		wants = append(wants, w)
		return r.frame(payload)
	}
	sizes := []int{1, 7, 8, 100, 4096, 16384, 32768, 65535, 65536, 70000}
	odd := func() (bool, bool) { return rng.IntN(8) == 0, rng.IntN(12) == 0 }
	for range 200 {
		switch rng.IntN(4) {
		case 0:
			bad, past := odd()
			stream = append(stream, req(specRead, sizes[rng.IntN(len(sizes))], bad, past)...)
		case 1:
			bad, past := odd()
			stream = append(stream, req(specWrite, sizes[rng.IntN(len(sizes))], bad, past)...)
		default:
			k := 2 + rng.IntN(maxWide-1)
			n := sizes[rng.IntN(len(sizes))] // mostly one size, as a KV cache's blocks
			var ws [][]byte
			for total := 0; len(ws) < k; total += n {
				if rng.IntN(4) == 0 {
					n = sizes[rng.IntN(len(sizes))]
				}
				if total+n > 1<<20 { // a group's payloads: 1 MiB at most
					break
				}
				bad, past := odd()
				ws = append(ws, req(specWrite, n, bad, past))
			}
			if len(ws) < 2 {
				// Too few for a group: the WRITE made goes alone.
				for _, w := range ws {
					stream = append(stream, w...)
				}
				continue
			}
			stream = append(stream, groupFrame(ws...)...)
		}
	}
	before := s.tr.groups.frames.Load()
	readvs, tails := s.tr.groups.readvs.Load(), s.tr.groups.tails.Load()
	rc := s.raw(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // write while the responses are read, or both sides could block
		defer wg.Done()
		if !pieces {
			rc.c.Write(stream)
			return
		}
		prng := mrand.New(mrand.NewPCG(7, 8))
		for len(stream) > 0 {
			n := min(len(stream), 1+prng.IntN(40000))
			if prng.IntN(3) == 0 {
				n = min(len(stream), 1+prng.IntN(64))
			}
			if _, err := rc.c.Write(stream[:n]); err != nil {
				return
			}
			stream = stream[n:]
			if prng.IntN(4) == 0 {
				time.Sleep(50 * time.Microsecond)
			}
		}
	}()
	defer wg.Wait()
	rc.expectPipeline(wants, buf.mem, model)
	g, rv, tl := s.tr.groups.frames.Load()-before, s.tr.groups.readvs.Load()-readvs, s.tr.groups.tails.Load()-tails
	t.Logf("%d group frames, %d readvs of their payloads, %d into the tail", g, rv, tl)
	if g == 0 || rv == 0 {
		// Payloads past the frames' 64 KiB buffer cannot all come from it.
		t.Fatalf("the target served %d group frames with %d readvs; want some of each", g, rv)
	}
}

// TestServerGroupCutReleases: a group frame whose connection ends in its
// headers or in a payload holds no region after: Unregister ends at once.
// The bytes of the payloads that arrived may have landed; nothing is
// answered.
func TestServerGroupCutReleases(t *testing.T) {
	for _, cut := range []int{specReqLen + 40, specReqLen + 3*specReqLen + 100, specReqLen + 3*specReqLen + 3*4096 - 1} {
		t.Run(fmt.Sprint(cut), func(t *testing.T) {
			s := newSide(t, Config{})
			buf := s.register(t, s.alloc(t, 64<<10, 7), true)
			var ws [][]byte
			for i := range 3 {
				ws = append(ws, specReq{op: specWrite, id: uint32(i + 1), buffer: buf.id, length: 4096, key: buf.key, addr: buf.addr + uint64(i)*8192}.frame(bytes.Repeat([]byte{byte(i + 1)}, 4096)))
			}
			rc := s.raw(t)
			rc.send(groupFrame(ws...)[:cut])
			rc.c.Close()
			s.waitServed(t)
			unregisterSoon(t, s, buf, "a cut group's")
		})
	}
}

// TestServerGroupStalls: a group whose initiator stops sending in the
// middle of its payloads, the connection left open, is cut off after
// FrameTimeout (one for the whole group), and its regions go back:
// Unregister ends.
func TestServerGroupStalls(t *testing.T) {
	s := newSide(t, Config{FrameTimeout: 300 * time.Millisecond})
	buf := s.register(t, s.alloc(t, 1<<20, 7), true)
	var ws [][]byte
	for i := range 4 {
		ws = append(ws, specReq{op: specWrite, id: uint32(i + 1), buffer: buf.id, length: 64 << 10, key: buf.key, addr: buf.addr + uint64(i)<<16}.frame(make([]byte, 64<<10)))
	}
	rc := s.raw(t)
	g := groupFrame(ws...)
	rc.send(g[:len(g)-(64<<10)-100]) // the last payload never comes
	start := time.Now()
	rc.expectClosed("a group whose last payload never comes")
	if took := time.Since(start); took < 100*time.Millisecond {
		t.Fatalf("closed after %v: before its FrameTimeout", took)
	}
	unregisterSoon(t, s, buf, "a stalled group's")
}

// unregisterSoon unregisters buf, which must be held by no frame of whose:
// Unregister waits up to a minute for one, the test only until hang.
func unregisterSoon(t *testing.T, s *side, buf testBuf, whose string) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- s.tr.Unregister(buf.b, buf.r) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Unregister: %v", err)
		}
	case <-time.After(hang):
		t.Fatalf("hang: Unregister with %s regions still held", whose)
	}
}

// TestGroupsNegotiated: an initiator sends runs of WRITEs as group frames
// only to a target whose hello offers them, of more than 16 WRITEs only
// to one that offers wide groups (a target from before them closes the
// connection at such a frame), and either way every WRITE lands and
// completes.
func TestGroupsNegotiated(t *testing.T) {
	for _, tc := range []struct {
		name             string
		target, initiate Config
		groups           bool
		widest           int // the most WRITEs a group frame held: 1 MiB of 32 KiB, or maxGroup
	}{
		{"both", Config{}, Config{Rails: 1}, true, 32},
		{"initiator without", Config{}, Config{Rails: 1, noGroups: true}, false, 0},
		{"target without", Config{noGroups: true}, Config{Rails: 1}, false, 0},
		{"target without wide", Config{narrowGroups: true}, Config{Rails: 1}, true, 16},
		{"TLS", Config{AutoTLS: true}, Config{Rails: 1, AutoTLS: true}, true, 32}, // the payloads through the frames' buffer
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n, size = 64, 32 << 10
			targ := newSide(t, tc.target)
			remote := targ.register(t, targ.alloc(t, n*size, 0), true)
			init := newSide(t, tc.initiate)
			ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
			if err != nil {
				t.Fatal(err)
			}
			defer ep.Close()
			local := init.alloc(t, n*size, 0)
			testpattern.Fill(local, 9)
			comp := make(chanCompleter, n)
			var sl []transport.Slice
			// Every other block in reverse order: scattered, as a KV cache's.
			for i := range n {
				j := n - 1 - i
				sl = append(sl, localSlice(transport.Write, local[i*size:(i+1)*size], remote.addr+uint64(j*size), uint64(i+1)))
			}
			if got, err := ep.Post(comp, sl); got != n || err != nil {
				t.Fatalf("Post: %d, %v", got, err)
			}
			for tok, err := range comp.await(t, n) {
				if err != nil {
					t.Fatalf("slice %d: %v", tok, err)
				}
			}
			for i := range n {
				j := n - 1 - i
				if d := testpattern.FirstDiff(remote.mem[j*size:(j+1)*size], local[i*size:(i+1)*size]); d >= 0 {
					t.Fatalf("block %d differs at %d", j, d)
				}
			}
			if g := targ.tr.groups.frames.Load(); (g > 0) != tc.groups {
				t.Fatalf("the target served %d group frames; want some: %v", g, tc.groups)
			}
			if w := targ.tr.groups.widest.Load(); w != uint64(tc.widest) {
				t.Fatalf("the widest group frame held %d WRITEs; want %d", w, tc.widest)
			}
		})
	}
}

// TestGroupsPartialWrites: with send buffers of a few KiB on both ends,
// the initiator's writevs end anywhere in a group frame (its header, the
// headers after it, a payload) and are resumed from the frames' parts;
// with queues of 2 and 4 slots groups stop at the end of the header
// array and start again at its head. Every WRITE must land whole and
// complete once, through the poller's kick, the sender's writev and its
// io_uring alike.
func TestGroupsPartialWrites(t *testing.T) {
	for _, tc := range []struct {
		depth               int
		senderOnly, iouring bool
	}{{2, false, false}, {4, false, false}, {128, false, false}, {128, true, false}, {128, true, true}} {
		t.Run(fmt.Sprintf("depth=%d,senderOnly=%v,iouring=%v", tc.depth, tc.senderOnly, tc.iouring), func(t *testing.T) {
			const size = 1 << 20
			targ := newSide(t, Config{LoopbackSendBuffer: 4096})
			remote := targ.register(t, targ.alloc(t, size, 0), true)
			init := newSide(t, Config{Rails: 1, Depth: tc.depth, LoopbackSendBuffer: 4096, senderOnly: tc.senderOnly, IOUring: tc.iouring})
			ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
			if err != nil {
				t.Fatal(err)
			}
			defer ep.Close()
			local := init.alloc(t, size, 0)
			rng := mrand.New(mrand.NewPCG(uint64(tc.depth), 9))
			model := make([]byte, size)
			comp := make(chanCompleter, 64)
			for round := range 20 {
				testpattern.Fill(local, rng.Uint64())
				// Up to 24 WRITEs of 1 byte to 40 KiB to disjoint ranges.
				var sl []transport.Slice
				off := 0
				for i := range 1 + rng.IntN(24) {
					n := 1 + rng.IntN(40<<10)
					if rng.IntN(3) == 0 {
						n = 1 + rng.IntN(64)
					}
					if off+n > size {
						break
					}
					sl = append(sl, localSlice(transport.Write, local[off:off+n], remote.addr+uint64(off), uint64(round*100+i+1)))
					copy(model[off:], local[off:off+n])
					off += n + rng.IntN(100)
				}
				postAll(t, ep, comp, sl)
				for tok, err := range comp.await(t, len(sl)) {
					if err != nil {
						t.Fatalf("round %d: slice %d: %v", round, tok, err)
					}
				}
				if d := testpattern.FirstDiff(remote.mem[:off], model[:off]); d >= 0 {
					t.Fatalf("round %d: the target's buffer differs at %d", round, d)
				}
			}
			if targ.tr.groups.frames.Load() == 0 {
				t.Fatal("no group frame was sent")
			}
		})
	}
}

// TestServerGroupTooLarge: a group whose WRITEs ask for more than 1 MiB of
// payloads in all closes the connection before any of them lands, even
// though each alone is within MaxLength.
func TestServerGroupTooLarge(t *testing.T) {
	s := newSide(t, Config{MaxLength: 4 << 20})
	buf := s.register(t, s.alloc(t, 2<<20, 7), true)
	half := 512<<10 + 1
	ws := [][]byte{
		specReq{op: specWrite, id: 1, buffer: buf.id, length: uint32(half), key: buf.key, addr: buf.addr}.frame(make([]byte, half)),
		specReq{op: specWrite, id: 2, buffer: buf.id, length: uint32(half), key: buf.key, addr: buf.addr + 1<<20}.frame(make([]byte, half)),
	}
	rc := s.raw(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); rc.c.Write(groupFrame(ws...)) }() // fails once the target closes
	rc.expectClosed("a group of 1 MiB + 2 bytes")
	wg.Wait()
	if i := allEqual(buf.mem, 7); i >= 0 {
		t.Fatalf("byte %d of the buffer changed: a payload landed", i)
	}
}

// TestServerGroupWide: a target takes a group of 64 WRITEs (each lands,
// each is answered in order) and closes the connection at a group frame
// that announces 65; one that offers no wide groups (features bit 0
// alone, as a target from before them) closes it at 17, before any
// payload lands.
func TestServerGroupWide(t *testing.T) {
	const size = 64
	for _, tc := range []struct {
		name     string
		cfg      Config
		features uint32
		k        int
		ok       bool
	}{
		{"wide 64", Config{}, 3, maxWide, true},
		{"wide 65", Config{}, 3, maxWide + 1, false},
		{"narrow 16", Config{narrowGroups: true}, 1, maxGroup, true},
		{"narrow 17", Config{narrowGroups: true}, 1, maxGroup + 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSide(t, tc.cfg)
			buf := s.register(t, s.alloc(t, (maxWide+1)*size, 0xff), true)
			var ws [][]byte
			for i := range tc.k {
				ws = append(ws, specReq{op: specWrite, id: uint32(i + 1), buffer: buf.id, length: size, key: buf.key, addr: buf.addr + uint64(i*size)}.frame(bytes.Repeat([]byte{byte(i)}, size)))
			}
			rc := helloRawFeatures(t, dialRaw(t, s.tr.Addr()), s.k, tc.features)
			if !tc.ok {
				var wg sync.WaitGroup
				wg.Add(1)
				go func() { defer wg.Done(); rc.c.Write(groupFrame(ws...)) }() // fails once the target closes
				rc.expectClosed(fmt.Sprintf("a group of %d", tc.k))
				wg.Wait()
				if i := allEqual(buf.mem, 0xff); i >= 0 {
					t.Fatalf("byte %d of the buffer changed: a payload landed", i)
				}
				return
			}
			rc.send(groupFrame(ws...))
			for i := range tc.k {
				if id, st := rc.resp(); id != uint32(i+1) || st != 0 {
					t.Fatalf("response %d: id %d status %d, want %d, 0", i, id, st, i+1)
				}
				if j := allEqual(buf.mem[i*size:(i+1)*size], byte(i)); j >= 0 {
					t.Fatalf("WRITE %d: byte %d not its payload's", i, j)
				}
			}
		})
	}
}

// TestServerGroupStreamNoCopies: in a stream of alike group frames the
// target reads each frame's headers, and no byte more, after the last
// payload of the frame before (the readv's tail, then the header read
// take what the next frame needs), so beyond the first frame's bytes,
// which the frames' buffer may read ahead, no payload byte is copied out
// of the buffer or the tail: every one is read straight into its
// destination.
func TestServerGroupStreamNoCopies(t *testing.T) {
	const k, size, frames = 32, 32 << 10, 160
	s := newSide(t, Config{})
	buf := s.register(t, s.alloc(t, k*size, 0), true)
	var ws [][]byte
	for i := range k {
		ws = append(ws, specReq{op: specWrite, id: uint32(i), buffer: buf.id, length: size, key: buf.key, addr: buf.addr + uint64(i*size)}.frame(bytes.Repeat([]byte{byte(i)}, size)))
	}
	frame := groupFrame(ws...)
	copied := s.tr.groups.copied.Load()
	rc := s.raw(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // write while the responses are read, or both sides could block
		defer wg.Done()
		for range frames {
			if _, err := rc.c.Write(frame); err != nil {
				return
			}
		}
	}()
	for f := range frames {
		for i := range k {
			if id, st := rc.resp(); id != uint32(i) || st != 0 {
				t.Fatalf("frame %d, response %d: id %d status %d, want %d, 0", f, i, id, st, i)
			}
		}
	}
	wg.Wait()
	if i := allEqual(buf.mem[(k-1)*size:], byte(k-1)); i >= 0 {
		t.Fatalf("the last WRITE's byte %d is not its payload's", i)
	}
	// The frames' buffer is 64 KiB: the first frame's payload bytes it
	// read ahead are copied out of it once. A frame's headers split
	// between a readv's tail and the socket may bring less than a header
	// of the next payload with them.
	if c := s.tr.groups.copied.Load() - copied; c > 64<<10+frames*reqSize {
		t.Fatalf("%d payload bytes copied out of the buffer or the tail over %d frames; want at most the first frame's 64 KiB and a header a frame", c, frames)
	}
}
