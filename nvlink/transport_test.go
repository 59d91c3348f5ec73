package nvlink

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

// The tests here drive the transport's logic with fakeDriver: what they
// prove is the transport's bookkeeping (keys, grants, mappings, events,
// completion, close), not that libcuda behaves as the fake does. The real
// driver runs only in gpu_test.go, on a machine with a GPU.

func TestLoadMissingLibrary(t *testing.T) {
	_, err := New(Config{Library: "/nonexistent/libcuda.so.1"})
	if !errors.Is(err, transport.ErrNotSupported) {
		t.Fatalf("New without the library: %v; want an error wrapping transport.ErrNotSupported", err)
	}
	if !strings.Contains(err.Error(), "no /nonexistent/libcuda.so.1") {
		t.Errorf("error %q does not say which library is missing", err)
	}
}

func TestLoadLibraryWithoutCUDA(t *testing.T) {
	if runtime.GOOS != "linux" || (runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64") {
		t.Skipf("CUDA is loaded only on linux/amd64 and linux/arm64, not %s/%s", runtime.GOOS, runtime.GOARCH)
	}
	// libc loads but has no cuInit: the driver is too old or not CUDA.
	_, err := New(Config{Library: "libc.so.6"})
	if !errors.Is(err, transport.ErrNotSupported) || !strings.Contains(err.Error(), "cuInit") {
		t.Fatalf("New with libc as the driver: %v; want ErrNotSupported naming cuInit", err)
	}
}

func TestBadConfig(t *testing.T) {
	for _, c := range []Config{{Depth: 3}, {Depth: -1}, {MaxBuffers: -2}, {MaxBuffers: maxSlots + 1}} {
		if _, err := newTransport(c, newFake(1)); err == nil {
			t.Errorf("config %+v accepted", c)
		}
	}
}

// pair is an initiator and a target sharing one fake driver, as two
// processes share the GPUs, each with a segtable to register memory in.
type pair struct {
	t          *testing.T
	fake       *fakeDriver
	init, targ *Transport
	ibufs      segtable.Buffers
	tbufs      segtable.Buffers
}

func newPair(t *testing.T, fake *fakeDriver, cfg Config) *pair {
	t.Helper()
	p := &pair{t: t, fake: fake}
	var err error
	if p.init, err = newTransport(cfg, fake); err != nil {
		t.Fatal(err)
	}
	if p.targ, err = newTransport(cfg, fake); err != nil {
		p.init.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.init.Close()
		p.targ.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for _, bs := range []*segtable.Buffers{&p.ibufs, &p.tbufs} {
			for _, b := range bs.All() {
				bs.Unregister(ctx, b.ID)
			}
		}
		if err := fake.leaks(); err != nil {
			t.Errorf("after Close: %v", err)
		}
	})
	return p
}

// register registers mem with tr through bs.
func (p *pair) register(tr *Transport, bs *segtable.Buffers, mem []byte, loc segtable.Location, remote bool) (*segtable.Buffer, segtable.Registration) {
	p.t.Helper()
	b, err := bs.Register(mem, loc, remote)
	if err != nil {
		p.t.Fatal(err)
	}
	reg, err := tr.Register(b)
	if err != nil {
		p.t.Fatalf("Register: %v", err)
	}
	return b, reg
}

func (p *pair) desc(bufs map[*segtable.Buffer]segtable.Registration) *segtable.SegmentDesc {
	d := &segtable.SegmentDesc{Version: 1, Name: "target", Epoch: 1, Endpoints: map[string]string{Name: p.targ.Endpoint()}}
	for b, r := range bufs {
		d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length, Location: string(b.Location), Keys: map[string]string{Name: r.Key}})
	}
	return d
}

func (p *pair) open(d *segtable.SegmentDesc) *Endpoint {
	p.t.Helper()
	ep, err := p.init.Open(context.Background(), d)
	if err != nil {
		p.t.Fatalf("Open: %v", err)
	}
	return ep.(*Endpoint)
}

// recorder is a Completer that counts and keeps every completion.
type recorder struct {
	mu  sync.Mutex
	got map[uint64][]error
	n   atomic.Int64
}

func newRecorder() *recorder { return &recorder{got: map[uint64][]error{}} }

// postWait posts every slice of s to ep in one Post, polls tr until each
// has completed, and fails the test on a slice that did not move.
func postWait(t *testing.T, tr *Transport, ep *Endpoint, s []transport.Slice) {
	t.Helper()
	r := newRecorder()
	if k, err := ep.Post(r, s); k != len(s) || err != nil {
		t.Fatalf("Post = %d of %d, %v", k, len(s), err)
	}
	pollUntil(t, tr, r, int64(len(s)))
	for i := range s {
		if err := r.result(t, s[i].Token); err != nil {
			t.Fatalf("%v slice %d: %v", s[i].Op, i, err)
		}
	}
}

func (r *recorder) Complete(tok uint64, err error) {
	r.mu.Lock()
	r.got[tok] = append(r.got[tok], err)
	r.mu.Unlock()
	r.n.Add(1)
}

// result returns the one completion of tok; it fails the test if there
// were none or several.
func (r *recorder) result(t *testing.T, tok uint64) error {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.got[tok]) != 1 {
		t.Fatalf("token %d completed %d times, want once", tok, len(r.got[tok]))
	}
	return r.got[tok][0]
}

// pollUntil polls tr until want completions arrived in r.
func pollUntil(t *testing.T, tr *Transport, r *recorder, want int64) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for r.n.Load() < want {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d completions after a minute of polling", r.n.Load(), want)
		}
		tr.Poll()
	}
}

func TestConformance(t *testing.T) {
	want := []transporttest.Interface{transporttest.Poller, transporttest.InFlight, transporttest.Waker,
		transporttest.DeviceMemory, transporttest.Stager}
	transporttest.RunWith(t, transporttest.Options{Want: want}, func(t *testing.T) (transport.Transport, transport.Transport) {
		fake := newFake(1)
		fake.allDevice = true // the suite registers Go memory: call it GPU 0's
		it, err := newTransport(Config{}, fake)
		if err != nil {
			t.Fatal(err)
		}
		tt, err := newTransport(Config{}, fake)
		if err != nil {
			t.Fatal(err)
		}
		// The engine's pollers call Poll; the suite does not know of
		// transport.Poller, so a goroutine stands in for them.
		stop := make(chan struct{})
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				select {
				case <-stop:
					return
				default:
				}
				if it.Poll() == 0 {
					time.Sleep(20 * time.Microsecond)
				}
			}
		}()
		t.Cleanup(func() { close(stop); <-done })
		return it, tt
	})
}

func TestWriteReadDeviceAndHost(t *testing.T) {
	fake := newFake(2)
	p := newPair(t, fake, Config{})
	// Two target buffers in one allocation of GPU 1, a local GPU buffer on
	// GPU 0 and a local host buffer.
	tmem, err := p.targ.Alloc(1<<20, 1)
	if err != nil {
		t.Fatal(err)
	}
	a, ra := p.register(p.targ, &p.tbufs, tmem[:512<<10], segtable.CUDA(1), true)
	b, rb := p.register(p.targ, &p.tbufs, tmem[512<<10:], segtable.CUDA(1), true)
	if ra.Key == "" || rb.Key == "" || ra.Key == rb.Key {
		t.Fatalf("keys %q and %q: want two distinct keys", ra.Key, rb.Key)
	}
	gmem, err := p.init.Alloc(256<<10, 0)
	if err != nil {
		t.Fatal(err)
	}
	g, rg := p.register(p.init, &p.ibufs, gmem, segtable.CUDA(0), false)
	if rg.Key != "" {
		t.Errorf("local-only GPU buffer got key %q", rg.Key)
	}
	hmem := make([]byte, 256<<10)
	h, rh := p.register(p.init, &p.ibufs, hmem, segtable.CPU(0), true)
	if rh.Key != "" {
		t.Errorf("host buffer got key %q: host memory is never exported", rh.Key)
	}
	ep := p.open(p.desc(map[*segtable.Buffer]segtable.Registration{a: ra, b: rb}))
	defer ep.Close()
	if fake.opens != 1 {
		t.Errorf("%d IPC opens for two buffers of one allocation, want 1", fake.opens)
	}
	for i := range gmem {
		gmem[i] = byte(i * 7)
	}
	for i := range hmem {
		hmem[i] = byte(i*13 + 1)
	}
	r := newRecorder()
	s := []transport.Slice{
		{Op: transport.Write, LocalHandle: rg.Handle, Local: g.Pointer(0), Remote: uint64(a.Addr) + 100, Length: 1000, Token: 1},
		{Op: transport.Write, LocalHandle: rh.Handle, Local: h.Pointer(5), Remote: uint64(b.Addr) + 7, Length: 4096, Token: 2},
	}
	if n, err := ep.Post(r, s); n != 2 || err != nil {
		t.Fatalf("Post = %d, %v", n, err)
	}
	if r.n.Load() != 0 {
		t.Fatalf("%d slices completed before any Poll: the copies are asynchronous", r.n.Load())
	}
	pollUntil(t, p.init, r, 2)
	for tok := uint64(1); tok <= 2; tok++ {
		if err := r.result(t, tok); err != nil {
			t.Fatalf("slice %d: %v", tok, err)
		}
	}
	if !bytes.Equal(tmem[100:1100], gmem[:1000]) {
		t.Errorf("DtoD WRITE: target bytes differ")
	}
	if !bytes.Equal(tmem[512<<10+7:512<<10+7+4096], hmem[5:5+4096]) {
		t.Errorf("HtoD WRITE: target bytes differ")
	}
	if tmem[99] != 0 || tmem[1100] != 0 {
		t.Errorf("bytes next to the WRITE changed")
	}
	// READ back into other places.
	s = []transport.Slice{
		{Op: transport.Read, LocalHandle: rg.Handle, Local: g.Pointer(10000), Remote: uint64(b.Addr) + 7, Length: 4096, Token: 3},
		{Op: transport.Read, LocalHandle: rh.Handle, Local: h.Pointer(20000), Remote: uint64(a.Addr) + 100, Length: 1000, Token: 4},
	}
	if n, err := ep.Post(r, s); n != 2 || err != nil {
		t.Fatalf("Post = %d, %v", n, err)
	}
	pollUntil(t, p.init, r, 4)
	for tok := uint64(3); tok <= 4; tok++ {
		if err := r.result(t, tok); err != nil {
			t.Fatalf("slice %d: %v", tok, err)
		}
	}
	if !bytes.Equal(gmem[10000:10000+4096], hmem[5:5+4096]) {
		t.Errorf("DtoD READ: bytes differ")
	}
	if !bytes.Equal(hmem[20000:21000], gmem[:1000]) {
		t.Errorf("DtoH READ: bytes differ")
	}
	// The local side is checked too: a range past the local buffer.
	bad := transport.Slice{Op: transport.Write, LocalHandle: rh.Handle, Local: h.Pointer(h.Length - 10), Remote: uint64(a.Addr), Length: 20, Token: 5}
	ep.Post(r, []transport.Slice{bad})
	if err := r.result(t, 5); !errors.Is(err, transport.ErrRange) {
		t.Errorf("local range past its buffer: %v, want ErrRange", err)
	}
	bad = transport.Slice{Op: transport.Write, LocalHandle: 999, Local: h.Pointer(0), Remote: uint64(a.Addr), Length: 20, Token: 6}
	ep.Post(r, []transport.Slice{bad})
	if err := r.result(t, 6); !errors.Is(err, transport.ErrDenied) {
		t.Errorf("unknown local handle: %v, want ErrDenied", err)
	}
	bad = transport.Slice{Op: transport.Notify, Remote: 1, Token: 7}
	ep.Post(r, []transport.Slice{bad})
	if err := r.result(t, 7); !errors.Is(err, transport.ErrNotSupported) {
		t.Errorf("notify: %v, want ErrNotSupported", err)
	}
	if err := ep.Close(); err != nil {
		t.Fatal(err)
	}
	if fake.closes != 1 {
		t.Errorf("%d IPC closes after the endpoint closed, want 1", fake.closes)
	}
	if err := p.targ.Free(tmem); err != nil {
		t.Errorf("Free: %v", err)
	}
	if err := p.targ.Free(tmem); err == nil {
		t.Errorf("second Free of the same memory succeeded")
	}
}

func TestLocationChecked(t *testing.T) {
	p := newPair(t, newFake(2), Config{})
	mem := make([]byte, 4096)
	b, err := p.tbufs.Register(mem, segtable.CUDA(0), true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.targ.Register(b); !errors.Is(err, ErrLocation) {
		t.Errorf("host memory registered as cuda:0: %v, want ErrLocation", err)
	}
	g, err := p.targ.Alloc(4096, 1)
	if err != nil {
		t.Fatal(err)
	}
	b, err = p.tbufs.Register(g, segtable.CUDA(0), true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.targ.Register(b); !errors.Is(err, ErrLocation) {
		t.Errorf("GPU 1 memory registered as cuda:0: %v, want ErrLocation", err)
	}
	if _, err := p.targ.Alloc(4096, 2); !errors.Is(err, ErrNoDevice) {
		t.Errorf("Alloc on GPU 2 of 2: %v, want ErrNoDevice", err)
	}
}

// target makes an exported GPU buffer of n bytes on the target and an
// endpoint to it, and a local GPU buffer of n bytes.
func (p *pair) target(n int) (tmem []byte, tb *segtable.Buffer, treg segtable.Registration, lmem []byte, lreg segtable.Registration, ep *Endpoint) {
	p.t.Helper()
	tmem, err := p.targ.Alloc(n, 0)
	if err != nil {
		p.t.Fatal(err)
	}
	tb, treg = p.register(p.targ, &p.tbufs, tmem, segtable.CUDA(0), true)
	lmem, err = p.init.Alloc(n, 0)
	if err != nil {
		p.t.Fatal(err)
	}
	_, lreg = p.register(p.init, &p.ibufs, lmem, segtable.CUDA(0), false)
	ep = p.open(p.desc(map[*segtable.Buffer]segtable.Registration{tb: treg}))
	p.t.Cleanup(func() { ep.Close() })
	return
}

// TestGroupedCopies: the slices of one Post are one group: one event for
// up to groupMax copies, their device-to-device copies in one launch of
// the gather kernel (the default), or in one batch call where the lane has
// no kernel and the driver batches, or a call each; a failed launch falls back to a
// call each. Scattered WRITEs and READs land byte for byte every way.
func TestGroupedCopies(t *testing.T) {
	for _, c := range []struct {
		name              string
		cfg               Config
		noBatch, noKernel bool
		launchErr         error
		launches, batches int // for each 600-slice Post
	}{
		{name: "kernel", launches: 3},
		{name: "batch", cfg: Config{NoCopyKernel: true}, batches: 3},
		{name: "driver-without-kernel", noKernel: true, batches: 3},
		{name: "launch-fails", launchErr: fakeErr("cuLaunchKernel", cuErrInvalidValue)},
		{name: "driver-without-batch", cfg: Config{NoCopyKernel: true}, noBatch: true},
		{name: "NoBatchCopies", cfg: Config{NoBatchCopies: true, NoCopyKernel: true}},
	} {
		t.Run(c.name, func(t *testing.T) {
			fake := newFake(1)
			fake.noBatch, fake.noKernel, fake.launchErr = c.noBatch, c.noKernel, c.launchErr
			c.cfg.Depth = 1024
			p := newPair(t, fake, c.cfg)
			const blk, n = 1 << 10, 600 // 3 groups: 256, 256, 88
			tmem, tb, _, lmem, lreg, ep := p.target(n * blk)
			testpattern.Fill(lmem, 5)
			perm := rand.New(rand.NewPCG(1, 2)).Perm(n)
			s := make([]transport.Slice, n)
			for i := range s {
				s[i] = transport.Slice{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[i*blk]), Remote: uint64(tb.Addr) + uint64(perm[i]*blk), Length: blk, Token: uint64(i + 1)}
			}
			batches, records, launches := fake.batches, fake.records, fake.launches
			postWait(t, p.init, ep, s)
			for i := range s {
				if d := testpattern.FirstDiff(tmem[perm[i]*blk:(perm[i]+1)*blk], lmem[i*blk:(i+1)*blk]); d >= 0 {
					t.Fatalf("WRITE slice %d: byte %d differs", i, d)
				}
			}
			if got := fake.batches - batches; got != c.batches {
				t.Errorf("%d batch calls for 600 copies, want %d", got, c.batches)
			}
			if got := fake.launches - launches; got != c.launches {
				t.Errorf("%d kernel launches for 600 copies, want %d", got, c.launches)
			}
			if got := fake.records - records; got != 3 {
				t.Errorf("%d events recorded for 600 copies in one Post, want 3 (one a group)", got)
			}
			// READ them back into a cleared buffer, in the other order.
			clear(lmem)
			for i := range s {
				s[i].Op, s[i].Token = transport.Read, uint64(n+i+1)
			}
			slices.Reverse(s)
			postWait(t, p.init, ep, s)
			want := make([]byte, n*blk)
			testpattern.Fill(want, 5)
			if d := testpattern.FirstDiff(lmem, want); d >= 0 {
				t.Fatalf("READ back: byte %d differs", d)
			}
		})
	}
}

// TestGroupMixedMemory: one Post (the kernel on) with GPU and host memory
// as the local side, slices the kernel takes and slices it does not (past gatherMax,
// or not 16-byte aligned): the small aligned device-to-device ones go to
// one launch, the others to one batch, the host one by itself, all under
// one event.
func TestGroupMixedMemory(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	tmem, tb, _, lmem, lreg, ep := p.target(4 << 20)
	hmem := make([]byte, 4096)
	h, rh := p.register(p.init, &p.ibufs, hmem, segtable.CPU(0), false)
	testpattern.Fill(lmem, 8)
	testpattern.Fill(hmem, 9)
	ta := uint64(tb.Addr)
	s := []transport.Slice{
		{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: ta, Length: 4096, Token: 1},
		{Op: transport.Write, LocalHandle: rh.Handle, Local: h.Pointer(0), Remote: ta + 4096, Length: 4096, Token: 2},
		{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[8192]), Remote: ta + 8192, Length: 4096, Token: 3},
		{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[1<<20]), Remote: ta + 1<<20, Length: 2 << 20, Token: 4}, // past gatherMax
		{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[20001]), Remote: ta + 20001, Length: 999, Token: 5},     // unaligned
	}
	batches, records, launches := fake.batches, fake.records, fake.launches
	r := newRecorder()
	if k, err := ep.Post(r, s); k != len(s) || err != nil {
		t.Fatalf("Post = %d, %v", k, err)
	}
	pollUntil(t, p.init, r, int64(len(s)))
	for i := range s {
		if err := r.result(t, s[i].Token); err != nil {
			t.Fatalf("slice %d: %v", s[i].Token, err)
		}
		want := hmem
		if s[i].LocalHandle != rh.Handle {
			at := uint64(uintptr(s[i].Local) - uintptr(unsafe.Pointer(&lmem[0])))
			want = lmem[at : at+s[i].Length]
		}
		if off := s[i].Remote - ta; !bytes.Equal(tmem[off:off+s[i].Length], want) {
			t.Errorf("slice %d: bytes differ at the target", s[i].Token)
		}
	}
	if fake.launches-launches != 1 || fake.batches-batches != 1 || fake.records-records != 1 {
		t.Errorf("%d launches, %d batch calls and %d events, want 1, 1 and 1", fake.launches-launches, fake.batches-batches, fake.records-records)
	}
}

// TestGatherSameGPUOnly: the kernel runs on the remote buffer's GPU, so
// only slices whose local buffer is on that GPU go to it; a local buffer
// of another GPU goes to the copy engines (which need no peer access).
func TestGatherSameGPUOnly(t *testing.T) {
	fake := newFake(2)
	p := newPair(t, fake, Config{})
	tmem, err := p.targ.Alloc(1<<16, 1)
	if err != nil {
		t.Fatal(err)
	}
	tb, treg := p.register(p.targ, &p.tbufs, tmem, segtable.CUDA(1), true)
	ep := p.open(p.desc(map[*segtable.Buffer]segtable.Registration{tb: treg}))
	defer ep.Close()
	for _, gpu := range []int{0, 1} {
		lmem, err := p.init.Alloc(1<<16, gpu)
		if err != nil {
			t.Fatal(err)
		}
		lb, lreg := p.register(p.init, &p.ibufs, lmem, segtable.CUDA(gpu), false)
		testpattern.Fill(lmem, uint64(gpu+20))
		s := []transport.Slice{
			{Op: transport.Write, LocalHandle: lreg.Handle, Local: lb.Pointer(0), Remote: uint64(tb.Addr), Length: 4096, Token: 1},
			{Op: transport.Write, LocalHandle: lreg.Handle, Local: lb.Pointer(8192), Remote: uint64(tb.Addr) + 8192, Length: 4096, Token: 2},
		}
		launches, batches := fake.launches, fake.batches
		r := newRecorder()
		if k, err := ep.Post(r, s); k != 2 || err != nil {
			t.Fatalf("Post = %d, %v", k, err)
		}
		pollUntil(t, p.init, r, 2)
		for i := range s {
			if err := r.result(t, s[i].Token); err != nil {
				t.Fatalf("local GPU %d, slice %d: %v", gpu, i, err)
			}
		}
		if !bytes.Equal(tmem[:4096], lmem[:4096]) || !bytes.Equal(tmem[8192:12288], lmem[8192:12288]) {
			t.Errorf("local GPU %d: bytes differ at the target", gpu)
		}
		wantLaunch, wantBatch := 0, 1
		if gpu == 1 {
			wantLaunch, wantBatch = 1, 0
		}
		if fake.launches-launches != wantLaunch || fake.batches-batches != wantBatch {
			t.Errorf("local GPU %d, remote GPU 1: %d launches and %d batch calls, want %d and %d", gpu, fake.launches-launches, fake.batches-batches, wantLaunch, wantBatch)
		}
	}
}

func TestDepthBackpressure(t *testing.T) {
	p := newPair(t, newFake(1), Config{Depth: 4})
	_, tb, _, lmem, lreg, ep := p.target(1 << 16)
	r := newRecorder()
	var s []transport.Slice
	for i := 0; i < 10; i++ {
		s = append(s, transport.Slice{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[i*64]), Remote: uint64(tb.Addr) + uint64(i*64), Length: 64, Token: uint64(i + 1)})
	}
	n, err := ep.Post(r, s)
	if n != 4 || err != nil {
		t.Fatalf("Post of 10 slices at depth 4 = %d, %v; want 4, nil", n, err)
	}
	if n, _ := ep.Post(r, s[4:]); n != 0 {
		t.Fatalf("Post into a full lane took %d", n)
	}
	deadline := time.Now().Add(time.Minute)
	for n < len(s) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d slices taken after a minute of polling", n, len(s))
		}
		p.init.Poll()
		k, err := ep.Post(r, s[n:])
		if err != nil {
			t.Fatal(err)
		}
		n += k
	}
	pollUntil(t, p.init, r, int64(len(s)))
	for i := range s {
		if err := r.result(t, s[i].Token); err != nil {
			t.Errorf("slice %d: %v", i, err)
		}
	}
}

// TestCopyFailures: a copy the driver refuses when queued and one that
// fails on the GPU each fail alone and drop their grants, whether the
// lane batches copies (the refused one in a batch: the batch is queued
// again a copy at a time) or not.
func TestCopyFailures(t *testing.T) {
	for _, noBatch := range []bool{false, true} {
		t.Run(fmt.Sprintf("noBatch=%v", noBatch), func(t *testing.T) { copyFailures(t, noBatch) })
	}
}

func copyFailures(t *testing.T, noBatch bool) {
	fake := newFake(1)
	fake.noBatch = noBatch
	p := newPair(t, fake, Config{})
	tmem, tb, treg, lmem, lreg, ep := p.target(1 << 16)
	fake.failLen = 33  // fails when queued
	fake.asyncLen = 44 // fails when it runs
	r := newRecorder()
	// The refused copy with a good one in one Post; the copy failing on
	// the GPU by itself, after them: a failure on the GPU is sticky (all
	// after it on the stream fail, as CUDA's context does), and it fails
	// the whole group its event covers.
	s := []transport.Slice{
		{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 33, Token: 1},
		{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[100]), Remote: uint64(tb.Addr) + 100, Length: 55, Token: 2},
	}
	for i := range lmem[100:155] {
		lmem[100+i] = byte(i + 1)
	}
	if n, err := ep.Post(r, s); n != 2 || err != nil {
		t.Fatalf("Post = %d, %v", n, err)
	}
	pollUntil(t, p.init, r, 2)
	if err := r.result(t, 1); !errors.Is(err, ErrDriver) {
		t.Errorf("copy refused by the driver: %v, want ErrDriver", err)
	}
	if err := r.result(t, 2); err != nil {
		t.Errorf("a good copy posted with a refused one: %v", err)
	}
	if !bytes.Equal(tmem[100:155], lmem[100:155]) {
		t.Errorf("the good copy's bytes did not land")
	}
	bad := transport.Slice{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 44, Token: 3}
	if n, err := ep.Post(r, []transport.Slice{bad}); n != 1 || err != nil {
		t.Fatalf("Post = %d, %v", n, err)
	}
	pollUntil(t, p.init, r, 3)
	if err := r.result(t, 3); !errors.Is(err, ErrDriver) || errors.Is(err, transport.ErrDenied) {
		t.Errorf("copy failing on the GPU: %v, want ErrDriver (retryable)", err)
	}
	// All dropped their grants: Unregister does not wait.
	ctxDone := make(chan error, 1)
	go func() { ctxDone <- p.targ.Unregister(tb, treg) }()
	select {
	case err := <-ctxDone:
		if err != nil {
			t.Fatalf("Unregister: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Unregister hangs: a failed copy kept its grant")
	}
	ok := transport.Slice{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 8, Token: 4}
	ep.Post(r, []transport.Slice{ok})
	if err := r.result(t, 4); !errors.Is(err, transport.ErrDenied) {
		t.Errorf("slice to an unregistered buffer: %v, want ErrDenied", err)
	}
}

func TestUnregisterWaitsForCopies(t *testing.T) {
	p := newPair(t, newFake(1), Config{})
	tmem, tb, treg, lmem, lreg, ep := p.target(1 << 16)
	for i := range lmem {
		lmem[i] = 0x5a
	}
	r := newRecorder()
	ep.Post(r, []transport.Slice{{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 1 << 16, Token: 1}})
	var returned atomic.Bool
	done := make(chan error, 1)
	go func() {
		err := p.targ.Unregister(tb, treg)
		returned.Store(true)
		done <- err
	}()
	time.Sleep(20 * time.Millisecond) // give a wrong Unregister time to return early
	if returned.Load() {
		t.Fatal("Unregister returned while a peer's copy into the buffer was in flight")
	}
	pollUntil(t, p.init, r, 1)
	if err := <-done; err != nil {
		t.Fatalf("Unregister: %v", err)
	}
	if err := r.result(t, 1); err != nil {
		t.Fatalf("the copy: %v", err)
	}
	if tmem[0] != 0x5a || tmem[len(tmem)-1] != 0x5a {
		t.Errorf("the copy did not land")
	}
}

func TestUnregisterTimesOut(t *testing.T) {
	p := newPair(t, newFake(1), Config{DrainTimeout: 50 * time.Millisecond})
	_, tb, treg, lmem, lreg, ep := p.target(4096)
	r := newRecorder()
	ep.Post(r, []transport.Slice{{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 64, Token: 1}})
	// Nobody polls: the copy keeps its grant, as a stuck peer would.
	if err := p.targ.Unregister(tb, treg); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Unregister under a stuck copy: %v, want a timeout", err)
	}
	pollUntil(t, p.init, r, 1)
}

func TestCloseInFlight(t *testing.T) {
	for _, what := range []string{"endpoint", "initiator"} {
		t.Run(what, func(t *testing.T) {
			fake := newFake(1)
			p := newPair(t, fake, Config{Depth: 64})
			_, tb, _, lmem, lreg, ep := p.target(1 << 16)
			r := newRecorder()
			var s []transport.Slice
			for i := 0; i < 40; i++ {
				s = append(s, transport.Slice{Op: transport.Op(1 + i%2), LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[i*64]), Remote: uint64(tb.Addr) + uint64(i*64), Length: 64, Token: uint64(i + 1)})
			}
			if n, err := ep.Post(r, s); n != 40 || err != nil {
				t.Fatalf("Post = %d, %v", n, err)
			}
			p.init.Poll() // some complete, most are in flight
			if what == "endpoint" {
				if err := ep.Close(); err != nil {
					t.Fatal(err)
				}
			} else if err := p.init.Close(); err != nil {
				t.Fatal(err)
			}
			if r.n.Load() != 40 {
				t.Fatalf("%d of 40 slices completed after Close", r.n.Load())
			}
			closed := 0
			for i := range s {
				if errors.Is(r.result(t, s[i].Token), transport.ErrClosed) {
					closed++
				}
			}
			if closed == 0 {
				t.Errorf("no slice completed with ErrClosed: the Close did not meet copies in flight")
			}
			n, _ := ep.Post(r, []transport.Slice{{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 8, Token: 100}})
			if n != 1 || !errors.Is(r.result(t, 100), transport.ErrClosed) {
				t.Errorf("Post after Close: want the slice completed with ErrClosed")
			}
			if fake.closes != fake.opens {
				t.Errorf("%d IPC handles opened, %d closed", fake.opens, fake.closes)
			}
		})
	}
}

func TestOpenRefusals(t *testing.T) {
	p := newPair(t, newFake(1), Config{})
	good := p.targ.Endpoint()
	a, err := parseAddr(good)
	if err != nil {
		t.Fatalf("own endpoint %q: %v", good, err)
	}
	other := a
	other.boot = "00000000-0000-0000-0000-000000000000"
	outside := a
	outside.table = "/etc/passwd"
	prefixed := a
	prefixed.table = filepath.Join(tableDir(), tablePrefix+"missing")
	key := strings.Repeat("0", 2*keyBytes) // any key: Open looks at the endpoint first
	for name, ep := range map[string]string{
		"another host": other.String(), "junk": "nvl1;;x;", "a file outside the table dir": outside.String(),
		"a missing table": prefixed.String(), "empty": "",
	} {
		d := &segtable.SegmentDesc{Version: 1, Name: "x", Endpoints: map[string]string{Name: ep},
			Buffers: []segtable.BufferDesc{{Addr: 4096, Length: 4096, Keys: map[string]string{Name: key}}}}
		if _, err := p.init.Open(context.Background(), d); !errors.Is(err, transport.ErrUnreachable) {
			t.Errorf("Open of %s: %v, want ErrUnreachable", name, err)
		}
	}
	// A segment of the host with no exported GPU memory: other transports
	// reach it.
	d0 := &segtable.SegmentDesc{Version: 1, Name: "x", Endpoints: map[string]string{Name: good},
		Buffers: []segtable.BufferDesc{{Addr: 4096, Length: 4096, Keys: map[string]string{Name: "", "tcp": "k"}}}}
	if _, err := p.init.Open(context.Background(), d0); !errors.Is(err, transport.ErrUnreachable) || !strings.Contains(err.Error(), "no buffer has an nvlink key") {
		t.Errorf("Open of a segment without GPU buffers: %v, want ErrUnreachable", err)
	}
	d := &segtable.SegmentDesc{Version: 1, Name: "x", Endpoints: map[string]string{"tcp": "1.2.3.4:5"}}
	if _, err := p.init.Open(context.Background(), d); !errors.Is(err, transport.ErrUnreachable) {
		t.Errorf("Open without an nvlink endpoint: %v, want ErrUnreachable", err)
	}
}

func TestJunkDescriptor(t *testing.T) {
	p := newPair(t, newFake(1), Config{})
	_, tb, treg, lmem, lreg, _ := p.target(1 << 16)
	k, err := parseKey(treg.Key)
	if err != nil {
		t.Fatal(err)
	}
	// A key naming a slot past the table, a key whose handle the driver
	// does not know, overlapping and empty buffers: none may panic, all
	// are denied or out of range.
	k1 := k
	k1.slot = maxSlots - 1
	k2 := k
	k2.handle.Reserved[60] ^= 1
	d := &segtable.SegmentDesc{Version: 1, Name: "junk", Endpoints: map[string]string{Name: p.targ.Endpoint()}, Buffers: []segtable.BufferDesc{
		{Addr: uint64(tb.Addr), Length: tb.Length, Keys: map[string]string{Name: k1.encode()}},
		{Addr: uint64(tb.Addr) + 10, Length: 5, Keys: map[string]string{Name: treg.Key}},
		{Addr: 1 << 50, Length: 0, Keys: map[string]string{Name: treg.Key}},
		{Addr: 1<<64 - 10, Length: 100, Keys: map[string]string{Name: treg.Key}},
	}}
	ep := p.open(d)
	defer ep.Close()
	r := newRecorder()
	sl := transport.Slice{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 8, Token: 1}
	ep.Post(r, []transport.Slice{sl})
	if err := r.result(t, 1); !errors.Is(err, transport.ErrDenied) {
		t.Errorf("slot past the table: %v, want ErrDenied", err)
	}
	d.Buffers = d.Buffers[:1]
	d.Buffers[0].Keys[Name] = k2.encode()
	ep.Update(d)
	sl.Token = 2
	ep.Post(r, []transport.Slice{sl})
	if err := r.result(t, 2); !errors.Is(err, transport.ErrDenied) {
		t.Errorf("a handle the driver refuses: %v, want ErrDenied", err)
	}
	d.Buffers[0].Keys[Name] = treg.Key
	ep.Update(d)
	sl.Token = 3
	ep.Post(r, []transport.Slice{sl})
	pollUntil(t, p.init, r, 3)
	if err := r.result(t, 3); err != nil {
		t.Errorf("after Update with the right key: %v", err)
	}
	// A key that claims a larger allocation than the one its handle
	// maps: the driver's size wins, and a copy past the mapping is denied.
	k3 := k
	k3.size, k3.length = 4*k.size, 4*k.size-(k.addr-k.base)
	d.Buffers[0] = segtable.BufferDesc{Addr: k3.addr, Length: k3.length, Keys: map[string]string{Name: k3.encode()}}
	ep.Update(d)
	sl.Token, sl.Remote = 4, k.addr+2*k.size
	ep.Post(r, []transport.Slice{sl})
	if err := r.result(t, 4); !errors.Is(err, transport.ErrDenied) {
		t.Errorf("a key that overstates its allocation: %v, want ErrDenied", err)
	}
}

func TestDriverErrors(t *testing.T) {
	e := &cudaError{fn: "cuMemAlloc_v2", code: cuErrOutOfMemory, desc: "out of memory"}
	if !errors.Is(e, ErrDriver) || !errors.Is(e, ErrOutOfMemory) || errors.Is(e, ErrNoDevice) {
		t.Errorf("out of memory maps wrongly")
	}
	if !strings.Contains(e.Error(), "CUDA_ERROR_OUT_OF_MEMORY") || !strings.Contains(e.Error(), "cuMemAlloc_v2") {
		t.Errorf("message %q lacks the call or code", e)
	}
	if e := (&cudaError{fn: "f", code: 12345}); !strings.Contains(e.Error(), "12345") {
		t.Errorf("unknown code message %q", e)
	}
	if !errors.Is(&cudaError{code: cuErrNoDevice}, ErrNoDevice) || !errors.Is(&cudaError{code: cuErrNotSupported}, transport.ErrNotSupported) {
		t.Errorf("codes map wrongly")
	}
}

func TestSetCurrentFailure(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	_, tb, _, lmem, lreg, ep := p.target(4096)
	fake.mu.Lock()
	fake.ctxErr = &cudaError{fn: "cuCtxSetCurrent", code: cuErrInvalidContext}
	fake.mu.Unlock()
	r := newRecorder()
	ep.Post(r, []transport.Slice{{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 8, Token: 1}})
	if err := r.result(t, 1); !errors.Is(err, ErrDriver) {
		t.Errorf("post with no context: %v, want ErrDriver", err)
	}
	fake.mu.Lock()
	fake.ctxErr = nil
	fake.mu.Unlock()
}

func TestTableCheck(t *testing.T) {
	if _, err := openTable("/dev/null"); err == nil {
		t.Errorf("opened /dev/null as a table")
	}
	f, err := os.CreateTemp(tableDir(), tablePrefix+"test-")
	if err != nil {
		t.Skipf("cannot create a file in %s: %v", tableDir(), err)
	}
	defer os.Remove(f.Name())
	f.Write(make([]byte, 4*lineSize))
	f.Close()
	if _, err := openTable(f.Name()); !errors.Is(err, errBadTable) {
		t.Errorf("a table file without the magic: %v, want errBadTable", err)
	}
}

func TestMappingsShared(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	tmem, err := p.targ.Alloc(8192, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, ra := p.register(p.targ, &p.tbufs, tmem[:4096], segtable.CUDA(0), true)
	b, rb := p.register(p.targ, &p.tbufs, tmem[4096:], segtable.CUDA(0), true)
	d := p.desc(map[*segtable.Buffer]segtable.Registration{a: ra, b: rb})
	e1, e2 := p.open(d), p.open(d)
	e2.Update(d) // the same descriptor again: nothing more to map
	if fake.opens != 1 {
		t.Fatalf("%d IPC opens for one allocation reached by two endpoints, want 1", fake.opens)
	}
	e1.Close()
	if fake.closes != 0 {
		t.Fatalf("the mapping was closed while another endpoint uses it")
	}
	e2.Close()
	if fake.closes != 1 {
		t.Fatalf("%d IPC closes after both endpoints closed, want 1", fake.closes)
	}
}

func TestUpdateRestartedPeer(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	_, tb, treg, lmem, lreg, ep := p.target(4096)
	// The peer restarts: a new transport (a new grant table) publishes the
	// same segment with a new buffer; the old one is gone.
	t2, err := newTransport(Config{}, fake)
	if err != nil {
		t.Fatal(err)
	}
	defer t2.Close()
	mem2, err := t2.Alloc(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	var bufs2 segtable.Buffers
	b2, err := bufs2.Register(mem2, segtable.CUDA(0), true)
	if err != nil {
		t.Fatal(err)
	}
	defer bufs2.Unregister(context.Background(), b2.ID)
	r2, err := t2.Register(b2)
	if err != nil {
		t.Fatal(err)
	}
	p.targ.Unregister(tb, treg)
	d := &segtable.SegmentDesc{Version: 1, Name: "target", Epoch: 2, Endpoints: map[string]string{Name: t2.Endpoint()},
		Buffers: []segtable.BufferDesc{{Addr: uint64(b2.Addr), Length: b2.Length, Keys: map[string]string{Name: r2.Key}}}}
	ep.Update(d)
	lmem[0] = 0x77
	r := newRecorder()
	ep.Post(r, []transport.Slice{
		{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(b2.Addr), Length: 64, Token: 1},
		{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 64, Token: 2},
	})
	pollUntil(t, p.init, r, 2)
	if err := r.result(t, 1); err != nil || mem2[0] != 0x77 {
		t.Fatalf("WRITE to the restarted peer: %v (byte %#x)", err, mem2[0])
	}
	if err := r.result(t, 2); !errors.Is(err, transport.ErrRange) {
		t.Errorf("WRITE to the old peer's buffer: %v, want ErrRange (no longer in the descriptor)", err)
	}
	ep.Close()
	t2.Unregister(b2, r2)
}

func TestPollDoesNotBlock(t *testing.T) {
	p := newPair(t, newFake(1), Config{})
	_, tb, _, lmem, lreg, ep := p.target(4096)
	r := newRecorder()
	ep.Post(r, []transport.Slice{{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[0]), Remote: uint64(tb.Addr), Length: 64, Token: 1}})
	l := p.init.devs[0].lane
	l.pollMu.Lock() // another poller is reaping this GPU
	done := make(chan int)
	go func() { done <- p.init.Poll() }()
	select {
	case n := <-done:
		if n != 0 {
			t.Errorf("Poll completed %d slices of a GPU another poller holds", n)
		}
	case <-time.After(10 * time.Second):
		l.pollMu.Unlock()
		<-done
		t.Fatal("Poll blocked on a GPU another poller holds")
	}
	l.pollMu.Unlock()
	pollUntil(t, p.init, r, 1)
}

// TestGatherParts: a launch gives each slice enough blocks that a thread
// moves gatherWords words of the group's longest kernel slice; a slice
// that goes to a copy engine (unaligned) does not count, and the next
// group starts afresh.
func TestGatherParts(t *testing.T) {
	if got := partsFor(32<<10, 256); got != 8/gatherWords {
		t.Errorf("partsFor(32 KiB, 256) = %d, want %d", got, 8/gatherWords)
	}
	if got := partsFor(16, 1024); got != 1 {
		t.Errorf("partsFor(16, 1024) = %d, want 1", got)
	}
	if got, want := partsFor(gatherMax, 32), uint32(gatherMax/(32*gatherAlign*gatherWords)); got != want || got > gatherMaxParts {
		t.Errorf("partsFor(1 MiB, 32) = %d, want %d (at most %d)", got, want, gatherMaxParts)
	}
	fake := newFake(1)
	p := newPair(t, fake, Config{Depth: 1024})
	const blk, big, n = 4 << 10, 64 << 10, groupMax + 16
	tmem, tb, _, lmem, lreg, ep := p.target(n*blk + big + 1<<20)
	testpattern.Fill(lmem, 7)
	s := make([]transport.Slice, n)
	for i := range s {
		s[i] = transport.Slice{Op: transport.Write, LocalHandle: lreg.Handle, Local: unsafe.Pointer(&lmem[i*blk]), Remote: uint64(tb.Addr) + uint64(i*blk), Length: blk, Token: uint64(i + 1)}
	}
	// The first group: one 64 KiB slice among 4 KiB ones, and a longer
	// unaligned one that goes to a copy engine.
	s[3].Local, s[3].Remote, s[3].Length = unsafe.Pointer(&lmem[n*blk]), uint64(tb.Addr)+uint64(n*blk), big
	s[5].Local, s[5].Remote, s[5].Length = unsafe.Pointer(&lmem[n*blk+big+1]), uint64(tb.Addr)+uint64(n*blk+big+1), 1<<20-1
	postWait(t, p.init, ep, s)
	for i := range s {
		off := int(s[i].Remote - uint64(tb.Addr))
		loc := int(uintptr(s[i].Local) - uintptr(unsafe.Pointer(&lmem[0])))
		if d := testpattern.FirstDiff(tmem[off:off+int(s[i].Length)], lmem[loc:loc+int(s[i].Length)]); d >= 0 {
			t.Fatalf("slice %d: byte %d differs", i, d)
		}
	}
	want := []uint32{partsFor(big, gatherThreads), partsFor(blk, gatherThreads)}
	if !slices.Equal(fake.parts, want) || want[0] != big/(gatherThreads*gatherAlign*gatherWords) || want[0] <= want[1] {
		t.Errorf("blocks a slice in each launch: %v, want %v", fake.parts, want)
	}
}
