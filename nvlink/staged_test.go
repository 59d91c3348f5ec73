package nvlink

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// stagedTCP checks the staging endpoint over TCP on loopback: size bytes
// of GPU 0's memory (filled and read back with put and get) are written to
// a target's host buffer in slices of chunk bytes, then read back into the
// GPU. tr's arena must hold fewer chunks than there are slices.
func stagedTCP(t *testing.T, tr *Transport, chunk, size int, put, get func(dev unsafe.Pointer, data []byte)) {
	t.Helper()
	arenaMem, err := tr.StagingArena()
	if err != nil {
		t.Fatal(err)
	}
	if n := len(arenaMem) / chunk; n >= size/chunk {
		t.Fatalf("an arena of %d chunks for %d slices: chunks would not be reused", n, size/chunk)
	}
	ti, err := tcp.New(tcp.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer ti.Close()
	tt, err := tcp.New(tcp.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer tt.Close()
	var ibufs, tbufs segtable.Buffers
	defer func() {
		for _, bs := range []*segtable.Buffers{&ibufs, &tbufs} {
			for _, b := range bs.All() {
				bs.Unregister(context.Background(), b.ID)
			}
		}
	}()
	arena, err := ibufs.Register(arenaMem, segtable.CPU(0), false)
	if err != nil {
		t.Fatal(err)
	}
	areg, err := ti.Register(arena)
	if err != nil {
		t.Fatal(err)
	}
	defer ti.Unregister(arena, areg)
	mem, err := tr.Alloc(size, 0)
	if err != nil {
		t.Fatal(err)
	}
	gb, err := ibufs.Register(mem, "cuda:0", false)
	if err != nil {
		t.Fatal(err)
	}
	greg, err := tr.Register(gb)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Unregister(gb, greg)
	dst := make([]byte, size)
	db, err := tbufs.Register(dst, segtable.CPU(0), true)
	if err != nil {
		t.Fatal(err)
	}
	dreg, err := tt.Register(db)
	if err != nil {
		t.Fatal(err)
	}
	defer tt.Unregister(db, dreg)
	desc := &segtable.SegmentDesc{Version: 1, Name: "tcp-target", Epoch: 1, Endpoints: map[string]string{tcp.Name: tt.Endpoint()},
		Buffers: []segtable.BufferDesc{{Addr: uint64(db.Addr), Length: db.Length, Keys: map[string]string{tcp.Name: dreg.Key}}}}
	inner, err := ti.Open(context.Background(), desc)
	if err != nil {
		t.Fatal(err)
	}
	defer inner.Close()
	ep, err := tr.Stage(inner, areg.Handle, uint64(chunk))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	move := func(op transport.Op, tok0 uint64) {
		t.Helper()
		var sl []transport.Slice
		for off := 0; off < size; off += chunk {
			sl = append(sl, transport.Slice{Op: op, LocalHandle: greg.Handle, Local: unsafe.Add(unsafe.Pointer(unsafe.SliceData(mem)), off),
				Remote: uint64(db.Addr) + uint64(off), Length: uint64(min(chunk, size-off)), Token: tok0 + uint64(off/chunk)})
		}
		r := newRecorder()
		deadline := time.Now().Add(time.Minute)
		for done := 0; done < len(sl); {
			n, err := ep.Post(r, sl[done:])
			if err != nil {
				t.Fatalf("Post: %v", err)
			}
			done += n
			tr.Poll()
			if time.Now().After(deadline) {
				t.Fatalf("%d of %d slices taken in a minute", done, len(sl))
			}
		}
		pollUntil(t, tr, r, int64(len(sl)))
		for _, x := range sl {
			if err := r.result(t, x.Token); err != nil {
				t.Fatalf("%v slice %d: %v", op, x.Token, err)
			}
		}
	}
	put(unsafe.Pointer(unsafe.SliceData(mem)), testpattern.Bytes(3, size))
	move(transport.Write, 100)
	if i := testpattern.FirstDiff(dst, testpattern.Bytes(3, size)); i >= 0 {
		t.Fatalf("GPU -> staging -> TCP: byte %d differs", i)
	}
	copy(dst, testpattern.Bytes(5, size))
	move(transport.Read, 200)
	got := make([]byte, size)
	get(unsafe.Pointer(unsafe.SliceData(mem)), got)
	if i := testpattern.FirstDiff(got, testpattern.Bytes(5, size)); i >= 0 {
		t.Fatalf("TCP -> staging -> GPU: byte %d differs", i)
	}
}

// TestStagedTCP runs stagedTCP on the fake driver, whose "device memory"
// is Go memory and whose copies run only when their event is queried.
func TestStagedTCP(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{StagingUnit: 16 << 10, StagingUnits: 12})
	dev := func(p unsafe.Pointer, n int) []byte { return unsafe.Slice((*byte)(p), n) }
	stagedTCP(t, p.init, 64<<10, 1<<20+1000,
		func(p unsafe.Pointer, data []byte) { copy(dev(p, len(data)), data) },
		func(p unsafe.Pointer, data []byte) { copy(data, dev(p, len(data))) })
}

// stagedFixture is a staging endpoint over a fake inner endpoint, on the
// fake driver.
type stagedFixture struct {
	fake  *fakeDriver
	tr    *Transport
	inner *innerEP
	ep    transport.Endpoint
	mem   []byte // GPU 0's memory, registered
	h     uint64 // its handle
	host  []byte // host memory, registered with tr
	hh    uint64
}

func newStagedFixture(t *testing.T, units int) *stagedFixture {
	t.Helper()
	f := &stagedFixture{fake: newFake(1), inner: &innerEP{}}
	p := newPair(t, f.fake, Config{StagingUnit: 4096, StagingUnits: units})
	f.tr = p.init
	arena, err := f.tr.StagingArena()
	if err != nil {
		t.Fatal(err)
	}
	f.inner.remote = make([]byte, 1<<16)
	f.inner.arena = arena
	if f.mem, err = f.tr.Alloc(1<<16, 0); err != nil {
		t.Fatal(err)
	}
	_, reg := p.register(f.tr, &p.ibufs, f.mem, "cuda:0", false)
	f.h = reg.Handle
	f.host = make([]byte, 4096)
	_, hreg := p.register(f.tr, &p.ibufs, f.host, segtable.CPU(0), false)
	f.hh = hreg.Handle
	if f.ep, err = f.tr.Stage(f.inner, 99, 4096); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *stagedFixture) slice(op transport.Op, off, n int, tok uint64) transport.Slice {
	return transport.Slice{Op: op, LocalHandle: f.h, Local: unsafe.Pointer(&f.mem[off]), Remote: uint64(off), Length: uint64(n), Token: tok}
}

// innerEP is an inner endpoint that holds the slices posted to it until
// the test releases them, moving bytes between the arena and remote.
type innerEP struct {
	remote, arena []byte
	capacity      int // most slices held; 0: no limit
	held          []heldSlice
	posts         int
	err           error // Post refuses with it
}

type heldSlice struct {
	c transport.Completer
	s transport.Slice
}

func (e *innerEP) Rails() int                   { return 1 }
func (e *innerEP) Update(*segtable.SegmentDesc) {}
func (e *innerEP) Close() error                 { return nil }
func (e *innerEP) Post(c transport.Completer, sl []transport.Slice) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	n := 0
	for _, s := range sl {
		if e.capacity > 0 && len(e.held) >= e.capacity {
			break
		}
		e.held = append(e.held, heldSlice{c, s})
		e.posts++
		n++
	}
	return n, nil
}

// release moves and completes the held slices, failing them with err when
// it is not nil.
func (e *innerEP) release(err error) {
	held := e.held
	e.held = nil
	for _, h := range held {
		if err == nil && h.s.Op != transport.Notify {
			local := unsafe.Slice((*byte)(h.s.Local), h.s.Length)
			if h.s.Op == transport.Write {
				copy(e.remote[h.s.Remote:], local)
			} else {
				copy(local, e.remote[h.s.Remote:h.s.Remote+h.s.Length])
			}
		}
		h.c.Complete(h.s.Token, err)
	}
}

// TestStagedSteps follows staged slices step by step: a WRITE reaches the
// inner endpoint only once its copy off the GPU is done, from the arena
// and with the arena's handle; a READ's bytes reach the GPU only after the
// inner endpoint completed; with every chunk in use Post takes fewer; a
// Notify passes through; failures of either step end the slice with the
// error, and the chunk is reused.
func TestStagedSteps(t *testing.T) {
	f := newStagedFixture(t, 2)
	for i := range f.mem {
		f.mem[i] = byte(i*7 + 3)
	}
	r := newRecorder()
	sl := []transport.Slice{f.slice(transport.Write, 0, 4096, 1), f.slice(transport.Write, 4096, 100, 2), f.slice(transport.Write, 8192, 10, 3)}
	n, err := f.ep.Post(r, sl)
	if n != 2 || err != nil {
		t.Fatalf("Post of 3 slices with 2 chunks: %d, %v; want 2, nil", n, err)
	}
	if f.inner.posts != 0 {
		t.Fatal("a WRITE reached the inner endpoint before its copy off the GPU was done")
	}
	for i := 0; i < 10 && len(f.inner.held) < 2; i++ {
		f.tr.Poll()
	}
	if len(f.inner.held) != 2 {
		t.Fatalf("%d WRITEs at the inner endpoint after their copies, want 2", len(f.inner.held))
	}
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(f.inner.arena)))
	for _, h := range f.inner.held {
		p := uintptr(h.s.Local)
		if h.s.LocalHandle != 99 || p < lo || p+uintptr(h.s.Length) > lo+uintptr(len(f.inner.arena)) {
			t.Errorf("inner slice: handle %d at %#x; want the arena's handle 99 inside the arena", h.s.LocalHandle, p)
		}
	}
	if r.n.Load() != 0 {
		t.Fatal("a WRITE completed before the inner endpoint completed it")
	}
	f.inner.release(nil)
	if r.n.Load() != 2 || r.result(t, 1) != nil || r.result(t, 2) != nil {
		t.Fatalf("after the inner endpoint completed: %d completions", r.n.Load())
	}
	if i := testpattern.FirstDiff(f.inner.remote[:4096], f.mem[:4096]); i >= 0 {
		t.Fatalf("WRITE: remote byte %d differs", i)
	}
	if i := testpattern.FirstDiff(f.inner.remote[4096:4196], f.mem[4096:4196]); i >= 0 {
		t.Fatalf("WRITE: remote byte %d differs", 4096+i)
	}
	// The chunks are free again: the third slice goes now.
	if n, err := f.ep.Post(r, sl[2:]); n != 1 || err != nil {
		t.Fatalf("Post after chunks came back: %d, %v", n, err)
	}
	for i := 0; i < 10 && len(f.inner.held) < 1; i++ {
		f.tr.Poll()
	}
	f.inner.release(nil)
	if r.n.Load() != 3 || r.result(t, 3) != nil {
		t.Fatalf("the third WRITE: %d completions", r.n.Load())
	}

	// READ: the bytes reach the GPU only after the inner endpoint is done
	// and the copy's event fired.
	for i := range f.inner.remote[:4096] {
		f.inner.remote[20000+i] = byte(255 - i)
	}
	rd := f.slice(transport.Read, 20000, 4096, 4)
	if n, err := f.ep.Post(r, []transport.Slice{rd}); n != 1 || err != nil {
		t.Fatalf("Post READ: %d, %v", n, err)
	}
	if len(f.inner.held) != 1 {
		t.Fatal("a READ did not go to the inner endpoint at once")
	}
	f.inner.release(nil)
	if r.n.Load() != 3 {
		t.Fatal("a READ completed before its bytes were copied to the GPU")
	}
	pollUntil(t, f.tr, r, 4)
	if err := r.result(t, 4); err != nil {
		t.Fatal(err)
	}
	if i := testpattern.FirstDiff(f.mem[20000:24096], f.inner.remote[20000:24096]); i >= 0 {
		t.Fatalf("READ: GPU byte %d differs", i)
	}

	// A Notify passes through to the inner endpoint with the caller's
	// completer and token.
	msg := []byte("hi")
	if n, err := f.ep.Post(r, []transport.Slice{{Op: transport.Notify, Local: unsafe.Pointer(&msg[0]), Length: 2, Remote: 7, Token: 5}}); n != 1 || err != nil {
		t.Fatalf("Post Notify: %d, %v", n, err)
	}
	if len(f.inner.held) != 1 || f.inner.held[0].s.Token != 5 || f.inner.held[0].c != r {
		t.Fatal("the Notify did not pass through unchanged")
	}
	f.inner.release(nil)

	// Failures: the inner endpoint's error; a copy that fails when it runs.
	if n, _ := f.ep.Post(r, []transport.Slice{f.slice(transport.Read, 0, 64, 6)}); n != 1 {
		t.Fatal("Post READ refused")
	}
	f.inner.release(transport.ErrPeer)
	if err := r.result(t, 6); !errors.Is(err, transport.ErrPeer) {
		t.Errorf("READ the inner endpoint failed: %v, want ErrPeer", err)
	}
	f.fake.mu.Lock()
	f.fake.asyncLen = 77
	f.fake.mu.Unlock()
	if n, _ := f.ep.Post(r, []transport.Slice{f.slice(transport.Write, 0, 77, 7)}); n != 1 {
		t.Fatal("Post WRITE refused")
	}
	pollUntil(t, f.tr, r, 7)
	var ce *cudaError
	if err := r.result(t, 7); !errors.As(err, &ce) || f.inner.posts != 6 {
		t.Errorf("WRITE whose copy failed: %v, %d inner posts; want the driver's error, and nothing more sent (6 posts)", err, f.inner.posts)
	}
	// The inner endpoint refusing with an error: the slice ends with it.
	f.inner.err = transport.ErrUnreachable
	if n, err := f.ep.Post(r, []transport.Slice{f.slice(transport.Read, 0, 64, 8)}); n != 1 || err != nil {
		t.Fatalf("Post READ to a refusing inner endpoint: %d, %v", n, err)
	}
	if err := r.result(t, 8); !errors.Is(err, transport.ErrUnreachable) {
		t.Errorf("READ the inner endpoint refused: %v, want ErrUnreachable", err)
	}
	f.inner.err = nil
	// Both chunks are free after all that.
	if n, _ := f.ep.Post(r, []transport.Slice{f.slice(transport.Read, 0, 8, 9), f.slice(transport.Read, 8, 8, 10)}); n != 2 {
		t.Fatalf("Post took %d of 2 slices: a chunk was lost", n)
	}
	f.inner.release(nil)
	pollUntil(t, f.tr, r, 10)
}

// TestStagedChecks: slices the staging endpoint refuses, and Stage's own
// refusals.
func TestStagedChecks(t *testing.T) {
	f := newStagedFixture(t, 2)
	r := newRecorder()
	cases := []struct {
		name string
		s    transport.Slice
		want error
	}{
		{"longer than the arena", f.slice(transport.Write, 0, 2*4096+1, 1), transport.ErrNotSupported},
		{"host memory", transport.Slice{Op: transport.Write, LocalHandle: f.hh, Local: unsafe.Pointer(&f.host[0]), Length: 8, Token: 2}, transport.ErrDenied},
		{"unknown handle", transport.Slice{Op: transport.Write, LocalHandle: 12345, Local: unsafe.Pointer(&f.mem[0]), Length: 8, Token: 3}, transport.ErrDenied},
		{"past the buffer", f.slice(transport.Read, len(f.mem)-4, 4, 4), nil},
		{"op 9", transport.Slice{Op: 9, LocalHandle: f.h, Local: unsafe.Pointer(&f.mem[0]), Length: 8, Token: 5}, transport.ErrNotSupported},
		{"no bytes", f.slice(transport.Write, 0, 0, 6), transport.ErrRange},
	}
	cases[3].s.Length = 8
	cases[3].want = transport.ErrRange
	for _, c := range cases {
		if n, err := f.ep.Post(r, []transport.Slice{c.s}); n != 1 || err != nil {
			t.Fatalf("%s: Post %d, %v", c.name, n, err)
		}
		if err := r.result(t, c.s.Token); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if f.inner.posts != 0 {
		t.Errorf("%d refused slices reached the inner endpoint", f.inner.posts)
	}
	if _, err := f.tr.Stage(f.inner, 99, 2*4096+1); err == nil {
		t.Error("Stage for slices longer than the arena: no error")
	}
	bare, err := newTransport(Config{}, f.fake)
	if err != nil {
		t.Fatal(err)
	}
	defer bare.Close()
	if _, err := bare.Stage(f.inner, 99, 4096); err == nil {
		t.Error("Stage before StagingArena: no error")
	}
}

// TestStagedClose: Close completes with ErrClosed the slices whose copy is
// in flight and those waiting for room, refuses new ones, and leaves those
// the inner endpoint holds to it; the transport's Close frees the arena
// (the fake's leak check at cleanup).
func TestStagedClose(t *testing.T) {
	f := newStagedFixture(t, 3)
	f.inner.capacity = 1
	r := newRecorder()
	// Slice 1 at the inner endpoint; slice 2 copied and waiting for room
	// there; slice 3's copy queued.
	if n, _ := f.ep.Post(r, []transport.Slice{f.slice(transport.Read, 0, 8, 1), f.slice(transport.Write, 8, 8, 2)}); n != 2 {
		t.Fatal("Post refused")
	}
	for i := 0; i < 4; i++ {
		f.tr.Poll()
	}
	// Slice 2 waits for room at the inner endpoint: a Poll that finds it
	// still waiting reports no progress (else a poller would take it for
	// work and never rest).
	if n := f.tr.Poll(); n != 0 {
		t.Errorf("Poll with only a slice waiting for room: %d, want 0", n)
	}
	if n, _ := f.ep.Post(r, []transport.Slice{f.slice(transport.Write, 16, 8, 3)}); n != 1 {
		t.Fatal("Post refused")
	}
	if len(f.inner.held) != 1 || r.n.Load() != 0 {
		t.Fatalf("%d slices at the inner endpoint, %d complete; want 1 and 0", len(f.inner.held), r.n.Load())
	}
	if err := f.ep.Close(); err != nil {
		t.Fatal(err)
	}
	for _, tok := range []uint64{2, 3} {
		if err := r.result(t, tok); !errors.Is(err, transport.ErrClosed) {
			t.Errorf("slice %d after Close: %v, want ErrClosed", tok, err)
		}
	}
	if n, _ := f.ep.Post(r, []transport.Slice{f.slice(transport.Write, 0, 8, 4)}); n != 1 {
		t.Fatal("Post after Close did not take the slice")
	}
	if err := r.result(t, 4); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("Post after Close: %v, want ErrClosed", err)
	}
	// The inner endpoint completes its slice (as its Close would).
	f.inner.release(transport.ErrClosed)
	if err := r.result(t, 1); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("slice at the inner endpoint: %v, want ErrClosed", err)
	}
	if r.n.Load() != 4 {
		t.Errorf("%d completions, want 4 (each slice once)", r.n.Load())
	}
}

// TestStagingUnits checks the arena's first-fit allocation against a
// model of one bool per unit, over random takes and frees, across word
// boundaries.
func TestStagingUnits(t *testing.T) {
	const n = 150
	s := &stager{used: make([]uint64, (n+63)/64), ops: make([]stagedOp, n)}
	model := make([]bool, n)
	taken := map[int32]int{}
	rng := rand.New(rand.NewPCG(1, 2))
	for step := 0; step < 20000; step++ {
		if len(taken) > 0 && rng.IntN(3) == 0 {
			for i, k := range taken { // any one
				s.mark(int(i), k, false)
				for u := int(i); u < int(i)+k; u++ {
					model[u] = false
				}
				delete(taken, i)
				break
			}
			continue
		}
		k := 1 + rng.IntN(70)
		want := int32(-1)
		for i := 0; i+k <= n && want < 0; i++ {
			free := true
			for u := i; u < i+k && free; u++ {
				free = !model[u]
			}
			if free {
				want = int32(i)
			}
		}
		if got := s.take(k); got != want {
			t.Fatalf("step %d: take(%d) = %d, the model's first fit %d", step, k, got, want)
		}
		if want >= 0 {
			for u := int(want); u < int(want)+k; u++ {
				model[u] = true
			}
			taken[want] = k
		}
	}
}

// TestStagedReadWakes: a READ's copy to the GPU, queued from the inner
// endpoint's completion (another transport's goroutine), wakes the
// engine's pollers (transport.Waker): only a Poll sees the copy finish,
// and a parked poller would otherwise look only at its next timed round.
func TestStagedReadWakes(t *testing.T) {
	f := newStagedFixture(t, 2)
	var wakes atomic.Int32
	f.tr.SetWake(func() { wakes.Add(1) })
	r := newRecorder()
	if n, _ := f.ep.Post(r, []transport.Slice{f.slice(transport.Read, 0, 64, 1)}); n != 1 {
		t.Fatal("Post refused")
	}
	if wakes.Load() != 0 {
		t.Fatal("woken before there was a copy to see")
	}
	f.inner.release(nil)
	if wakes.Load() != 1 {
		t.Fatalf("%d wakes after the copy to the GPU was queued, want 1", wakes.Load())
	}
	if !f.tr.InFlight() {
		t.Error("InFlight false with a copy queued")
	}
	pollUntil(t, f.tr, r, 1)
	if f.tr.InFlight() {
		t.Error("InFlight true with nothing queued")
	}
	// A WRITE's copy off the GPU, queued in Post (which may run on a
	// goroutine a parked poller lent its rings), wakes them too.
	if n, _ := f.ep.Post(r, []transport.Slice{f.slice(transport.Write, 0, 64, 2)}); n != 1 {
		t.Fatal("Post refused")
	}
	if wakes.Load() != 2 {
		t.Fatalf("%d wakes after a WRITE's copy was queued, want 2", wakes.Load())
	}
}
