package tcp

import (
	"bytes"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/testpattern"
)

// TestServerLowatReset: a payload that arrives in two parts, with a pause
// between, has the target wait for its rest with a low-water mark set
// (lowat.go); once the payload is in, the mark is back to one byte, so a
// lone 32-byte READ sent after a pause is answered. A mark left standing
// would keep the target asleep until the READ's bytes reached it, that
// is for ever: the client's deadline fails the test instead. Both ways
// a payload is read straight from the socket are tried: a group's, and a
// lone WRITE's (fillOne).
func TestServerLowatReset(t *testing.T) {
	s := newSide(t, Config{})
	const size = 1 << 20
	buf := s.register(t, s.alloc(t, size, 0), true)
	model := bytes.Clone(buf.mem)
	rc := s.raw(t)
	id := uint32(0)
	write := func(off, n int) ([]byte, uint32) {
		id++
		p := make([]byte, n)
		testpattern.Fill(p, uint64(id))
		copy(model[off:], p)
		return specReq{op: specWrite, id: id, buffer: buf.id, length: uint32(n), key: buf.key, addr: buf.addr + uint64(off)}.frame(p), id
	}
	for _, group := range []bool{true, false} {
		var frame []byte
		var ids []uint32
		if group {
			a, ia := write(0, 128<<10)
			b, ib := write(256<<10, 128<<10)
			frame, ids = groupFrame(a, b), []uint32{ia, ib}
		} else {
			w, iw := write(512<<10, 256<<10)
			frame, ids = w, []uint32{iw}
		}
		before := s.tr.groups.marks.Load()
		cut := len(frame) / 5
		rc.send(frame[:cut])
		time.Sleep(50 * time.Millisecond) // the target reads the part, then waits for the rest
		rc.send(frame[cut:])
		rc.c.SetReadDeadline(time.Now().Add(10 * time.Second))
		for _, want := range ids {
			if got, st := rc.resp(); got != want || st != 0 {
				t.Fatalf("group %v: response id %d status %d, want %d, 0", group, got, st, want)
			}
		}
		if m := s.tr.groups.marks.Load() - before; m == 0 {
			t.Errorf("group %v: the target waited for the rest of a payload with no low-water mark", group)
		}
		time.Sleep(50 * time.Millisecond) // the target waits for the next request
		id++
		rc.send(specReq{op: specRead, id: id, buffer: buf.id, length: 8, key: buf.key, addr: buf.addr}.frame(nil))
		if got, st := rc.resp(); got != id || st != 0 {
			t.Fatalf("group %v: READ after the payload: id %d status %d, want %d, 0", group, got, st, id)
		}
		if got := rc.payload(8); !bytes.Equal(got, model[:8]) {
			t.Fatalf("group %v: READ after the payload: % x, want % x", group, got, model[:8])
		}
	}
	if i := testpattern.FirstDiff(buf.mem, model); i >= 0 {
		t.Fatalf("buffer differs from the model at offset %d", i)
	}
}

// TestServerPayloadsSkipBuffer: a stream of bulk frames (groups of 32 KiB
// WRITEs, lone WRITEs of 64 KiB to 1 MiB), sent at once or a frame at a
// time with pauses between, lands with next to none of its payload bytes
// copied out of the frames' buffer or a tail: after a bulk frame the
// target reads the next frame's headers and not the payload behind them
// (nbReader.limit, groupTail). Without that, each header read while the
// target waited took up to 64 KiB of the payload behind it into the
// frames' buffer, to be copied out again.
func TestServerPayloadsSkipBuffer(t *testing.T) {
	for _, paced := range []bool{false, true} {
		t.Run(fmt.Sprintf("paced=%v", paced), func(t *testing.T) { testPayloadsSkipBuffer(t, paced) })
	}
}

func testPayloadsSkipBuffer(t *testing.T, paced bool) {
	s := newSide(t, Config{})
	const size = 4 << 20
	buf := s.register(t, s.alloc(t, size, 0), true)
	model := bytes.Clone(buf.mem)
	var (
		frames [][]byte
		wants  []pipeWant
		id     uint32
		total  int
	)
	write := func(off, n int) []byte {
		id++
		p := make([]byte, n)
		testpattern.Fill(p, uint64(id)*7)
		copy(model[off:], p)
		wants = append(wants, pipeWant{id: id, status: []uint8{0}})
		total += n
		return specReq{op: specWrite, id: id, buffer: buf.id, length: uint32(n), key: buf.key, addr: buf.addr + uint64(off)}.frame(p)
	}
	lone := []int{64 << 10, 100 << 10, 1 << 20, 300 << 10}
	for i := range 24 {
		if i%2 == 0 {
			var ws [][]byte
			for j := range 16 {
				ws = append(ws, write((i*16+j)%128*(32<<10), 32<<10))
			}
			frames = append(frames, groupFrame(ws...))
			continue
		}
		n := lone[i/2%len(lone)]
		frames = append(frames, write(size-n-(i%3)*4096, n))
	}
	before := s.tr.groups.copied.Load()
	rc := s.raw(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // write while the responses are read, or both sides could block
		defer wg.Done()
		if !paced {
			rc.c.Write(bytes.Join(frames, nil))
			return
		}
		for _, f := range frames {
			if _, err := rc.c.Write(f); err != nil {
				return
			}
			time.Sleep(2 * time.Millisecond) // the target waits for the next header
		}
	}()
	defer wg.Wait()
	rc.c.SetReadDeadline(time.Now().Add(time.Minute))
	rc.expectPipeline(wants, buf.mem, model)
	copied := int(s.tr.groups.copied.Load() - before)
	// The first frame's header may come with a whole buffer of payload;
	// after it, each frame's headers may bring no more than a frame's
	// headers' room of payload.
	bound := 64<<10 + len(frames)*nextHeads(maxGroup)
	t.Logf("%d frames, %d payload bytes, %d copied out of the buffers (at most %d)", len(frames), total, copied, bound)
	if copied > bound {
		t.Fatalf("%d of %d payload bytes were copied out of the frames' buffer or a tail; want at most %d", copied, total, bound)
	}
}
