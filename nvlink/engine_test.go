package nvlink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
)

// engineChildEnv makes the test binary the target engine of the
// engine-level NVLink tests (engineChild).
const engineChildEnv = "NVLINK_ENGINE_CHILD"

// engineChild is a target engine in its own process: nvlink installed,
// NVLINK_GPU_SIZE bytes of GPU 0's memory from Engine.Alloc registered
// remote-accessible. It prints its segment descriptor and serves until its
// standard input closes (internal/childproc's protocol, no commands).
func engineChild() int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "engine child:", err); return 1 }
	size, _ := strconv.Atoi(os.Getenv(childSizeEnv))
	e, err := moonring.New(moonring.Config{Name: fmt.Sprintf("nvlink-engine-%d", os.Getpid())})
	if err != nil {
		return fail(err)
	}
	defer e.Close()
	tr, err := New(testConfig())
	if err != nil {
		return fail(err)
	}
	if err := e.InstallTransport(tr); err != nil {
		return fail(err)
	}
	mem, err := e.Alloc(size, "cuda:0")
	if err != nil {
		return fail(err)
	}
	if _, err := e.RegisterLocalMemory(mem, "cuda:0", true); err != nil {
		return fail(err)
	}
	d, err := e.Config().Metadata.Get(context.Background(), e.Name())
	if err != nil {
		return fail(err)
	}
	j, err := json.Marshal(d)
	if err != nil {
		return fail(err)
	}
	if err := childproc.Serve(string(j), nil); err != nil {
		return fail(err)
	}
	return 0
}

// enginePair is an engine with nvlink installed and the segment of a
// target engine in another process (engineChild), opened through nvlink.
type enginePair struct {
	tr  *Transport
	e   *moonring.Engine
	seg moonring.SegmentID
	dst uint64 // the target's GPU buffer
	mem []byte // size bytes of this engine's GPU 0 memory, registered
	id  moonring.BufferID
}

func newEnginePair(tb testing.TB, size int) *enginePair {
	tb.Helper()
	return newEnginePairWith(tb, size, testConfig())
}

// newEnginePairWith is newEnginePair with this engine's nvlink configured
// by cfg.
func newEnginePairWith(tb testing.TB, size int, cfg Config) *enginePair {
	tb.Helper()
	return newEnginePairPollers(tb, size, cfg, 1)
}

// newEnginePairPollers is newEnginePairWith with pollers pollers a NUMA
// node in this engine (moonring.Config.Pollers).
func newEnginePairPollers(tb testing.TB, size int, cfg Config, pollers int) *enginePair {
	tb.Helper()
	p := &enginePair{tr: openGPUWith(tb, cfg)}
	c := startChildEnv(tb, engineChildEnv, size)
	store := metadata.NewMemory()
	var err error
	if p.e, err = moonring.New(moonring.Config{Name: fmt.Sprintf("%s-%d", tb.Name(), time.Now().UnixNano()), Metadata: store, Pollers: pollers}); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.e.Close() })
	if err := p.e.InstallTransport(p.tr); err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := store.Put(ctx, c.desc); err != nil {
		tb.Fatal(err)
	}
	if p.seg, err = p.e.OpenSegment(ctx, c.desc.Name); err != nil {
		tb.Fatal(err)
	}
	if tn, err := p.e.SegmentTransport(p.seg); tn != Name || err != nil {
		tb.Fatalf("target engine reached through %q (%v), want nvlink", tn, err)
	}
	p.dst = c.desc.Buffers[0].Addr
	if p.mem, err = p.e.Alloc(size, "cuda:0"); err != nil {
		tb.Fatal(err)
	}
	if p.id, err = p.e.RegisterLocalMemory(p.mem, "cuda:0", false); err != nil {
		tb.Fatal(err)
	}
	return p
}

func (p *enginePair) req(op moonring.Opcode, off, n int) moonring.TransferRequest {
	return moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(p.mem) + uintptr(off), TargetID: p.seg, TargetOffset: p.dst + uint64(off), Length: uint64(n)}
}

// TestGPUEngineNVLink: two engines in two processes, GPU memory to GPU
// memory through the engine's rings and pollers over CUDA IPC: a WRITE of
// the whole buffer, then READs of its halves swapped, checked byte for
// byte.
func TestGPUEngineNVLink(t *testing.T) {
	const size = 16 << 20
	p := newEnginePair(t, size)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dev := unsafe.Pointer(unsafe.SliceData(p.mem))
	put := func(data []byte) {
		if err := syncCopy(p.tr, 0, dev, data, true); err != nil {
			t.Fatal(err)
		}
	}
	want := testpattern.Bytes(21, size)
	put(want)
	if err := p.e.Transfer(ctx, p.req(moonring.Write, 0, size)); err != nil {
		t.Fatalf("WRITE: %v", err)
	}
	put(make([]byte, size))
	h := size / 2
	r1, r2 := p.req(moonring.Read, 0, h), p.req(moonring.Read, h, h)
	r1.TargetOffset, r2.TargetOffset = p.dst+uint64(h), p.dst
	if err := p.e.Transfer(ctx, r1, r2); err != nil {
		t.Fatalf("READ: %v", err)
	}
	got := make([]byte, size)
	if err := syncCopy(p.tr, 0, dev, got, false); err != nil {
		t.Fatal(err)
	}
	if i := testpattern.FirstDiff(got[:h], want[h:]); i >= 0 {
		t.Fatalf("first half read back: byte %d differs", i)
	}
	if i := testpattern.FirstDiff(got[h:], want[:h]); i >= 0 {
		t.Fatalf("second half read back: byte %d differs", h+i)
	}
}

// BenchmarkEngineNVLink moves 64 MiB requests between two engines in two
// processes through CUDA IPC: through a ring, with depth requests in
// flight (an io_uring user reaping its CQ in a loop), to set beside
// RawDtoD at the same depth; and one request at a time through the batch
// API's Transfer, which adds a goroutine's wake-up per request.
func BenchmarkEngineNVLink(b *testing.B) {
	p := newEnginePair(b, gpuSize)
	for _, op := range []struct {
		name string
		op   moonring.Opcode
		sq   moonring.Op
	}{{"write", moonring.Write, moonring.OpWrite}, {"read", moonring.Read, moonring.OpRead}} {
		for _, depth := range []int{1, 4} {
			b.Run(fmt.Sprintf("%s/depth=%d", op.name, depth), func(b *testing.B) {
				r, err := p.e.NewRing(moonring.RingConfig{Entries: 16})
				if err != nil {
					b.Fatal(err)
				}
				defer r.Close()
				e := moonring.Entry{Op: op.sq, Segment: p.seg, Buffer: p.id, Remote: p.dst, Length: gpuSize}
				cqes := make([]moonring.Completion, 16)
				reap := func() int {
					n := r.PeekBatch(cqes)
					for i := range n {
						if err := cqes[i].Err(); err != nil {
							b.Fatalf("completion: %v", err)
						}
					}
					r.Advance(n)
					return n
				}
				inflight := 0
				b.SetBytes(gpuSize)
				b.ResetTimer()
				for range b.N { // not b.Loop: the timer must run until the last completion
					for inflight >= depth {
						inflight -= reap()
					}
					if err := r.SubmitOne(&e); err != nil {
						b.Fatal(err)
					}
					inflight++
				}
				for inflight > 0 {
					inflight -= reap()
				}
			})
		}
		b.Run(op.name+"/transfer", func(b *testing.B) {
			req := p.req(op.op, 0, gpuSize)
			b.SetBytes(gpuSize)
			for b.Loop() {
				if err := p.e.Transfer(context.Background(), req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// stagingPair is two engines in this process: a, with tr and the
// transport via ("tcp" or "shm") installed, and b, with via and dst
// registered remote-accessible; seg is b's segment as a opens it, through
// via, which reaches only host memory, so a stages GPU memory through
// tr's arena. Over shm, dst comes from b's Alloc: a memfd a maps.
type stagingPair struct {
	a, b *moonring.Engine
	dst  []byte
	seg  moonring.SegmentID
}

func newStagingPair(tb testing.TB, tr *Transport, size int, via string) *stagingPair {
	tb.Helper()
	name := fmt.Sprintf("%s-%d", tb.Name(), time.Now().UnixNano())
	p := &stagingPair{}
	ca := moonring.Config{Name: name + "-a", Transports: []string{via}}
	cb := moonring.Config{Name: name + "-b"}
	switch via {
	case tcp.Name:
		ca.TCP, cb.TCP = &tcp.Config{}, &tcp.Config{}
	case shm.Name:
		ca.SHM, cb.SHM = &shm.Config{}, &shm.Config{}
	default:
		tb.Fatalf("staging over %q", via)
	}
	var err error
	if p.b, err = moonring.New(cb); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.b.Close() })
	if p.a, err = moonring.New(ca); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.a.Close() })
	if err := p.a.InstallTransport(tr); err != nil {
		tb.Fatal(err)
	}
	p.dst = make([]byte, size)
	if via == shm.Name {
		if p.dst, err = p.b.Alloc(size, "cpu:0"); err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { p.b.Free(p.dst) }) // after b's Close
	}
	if _, err := p.b.RegisterLocalMemory(p.dst, "cpu:0", true); err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if p.seg, err = p.a.OpenSegment(ctx, name+"-b"); err != nil {
		tb.Fatal(err)
	}
	if tn, err := p.a.SegmentTransport(p.seg); tn != via || err != nil {
		tb.Fatalf("segment reached through %q (%v), want %s", tn, err, via)
	}
	return p
}

// alloc returns size bytes of a's memory at loc, registered.
func (p *stagingPair) alloc(tb testing.TB, size int, loc moonring.Location) []byte {
	tb.Helper()
	mem, err := p.a.Alloc(size, loc)
	if err != nil {
		tb.Fatal(err)
	}
	if _, err := p.a.RegisterLocalMemory(mem, loc, false); err != nil {
		tb.Fatal(err)
	}
	return mem
}

// req is a request between a's mem and the same offset of b's dst.
func (p *stagingPair) req(op moonring.Opcode, mem []byte, off, n int) moonring.TransferRequest {
	return moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(mem) + uintptr(off), TargetID: p.seg,
		TargetOffset: uint64(moonring.AddressOf(p.dst)) + uint64(off), Length: uint64(n)}
}

// engineStaging moves GPU memory between an engine and another engine's
// host memory over via (a stagingPair): the batch API WRITEs size bytes
// from GPU 0 and READs them back, whole and from an unaligned offset. put
// and get fill and read GPU memory.
func engineStaging(t *testing.T, tr *Transport, size int, via string, put, get func(dev unsafe.Pointer, data []byte)) {
	t.Helper()
	p := newStagingPair(t, tr, size, via)
	mem := p.alloc(t, size, "cuda:0")
	dst := p.dst
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dev := unsafe.Pointer(unsafe.SliceData(mem))
	put(dev, testpattern.Bytes(3, size))
	if err := p.a.Transfer(ctx, p.req(moonring.Write, mem, 0, size)); err != nil {
		t.Fatalf("WRITE from GPU memory over TCP: %v", err)
	}
	if i := testpattern.FirstDiff(dst, testpattern.Bytes(3, size)); i >= 0 {
		t.Fatalf("WRITE from GPU memory over TCP: byte %d differs", i)
	}
	copy(dst, testpattern.Bytes(5, size))
	if err := p.a.Transfer(ctx, p.req(moonring.Read, mem, 0, size)); err != nil {
		t.Fatalf("READ into GPU memory over TCP: %v", err)
	}
	got := make([]byte, size)
	get(dev, got)
	if i := testpattern.FirstDiff(got, testpattern.Bytes(5, size)); i >= 0 {
		t.Fatalf("READ into GPU memory over TCP: byte %d differs", i)
	}
	// Unaligned, several requests at once, both ways.
	copy(dst, testpattern.Bytes(7, size))
	const off = 1001
	n := size/2 - 3*off
	if err := p.a.Transfer(ctx, p.req(moonring.Read, mem, off, n), p.req(moonring.Write, mem, size/2+off, n)); err != nil {
		t.Fatalf("unaligned READ and WRITE: %v", err)
	}
	get(dev, got)
	want := testpattern.Bytes(7, size)
	if i := testpattern.FirstDiff(got[off:off+n], want[off:off+n]); i >= 0 {
		t.Fatalf("unaligned READ: byte %d differs", off+i)
	}
	if i := testpattern.FirstDiff(dst[size/2+off:size/2+off+n], testpattern.Bytes(5, size)[size/2+off:size/2+off+n]); i >= 0 {
		t.Fatalf("unaligned WRITE: byte %d differs", size/2+off+i)
	}
	if err := p.a.UnregisterLocalMemory(ctx, mem); err != nil {
		t.Fatal(err)
	}
	if err := p.a.Free(mem); err != nil {
		t.Fatal(err)
	}
}

// TestEngineStaging runs engineStaging on the fake driver, over TCP and
// over shm.
func TestEngineStaging(t *testing.T) {
	for _, via := range []string{tcp.Name, shm.Name} {
		t.Run(via, func(t *testing.T) {
			fake := newFake(1)
			// 6 MiB: one of shm's slices (4 MiB, stretched up to 5), or
			// four of TCP's (1 MiB, up to 1.25) at once.
			tr, err := newTransport(Config{StagingUnits: 24}, fake)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { // after the engines' Close, which Cleanup runs first
				if err := fake.leaks(); err != nil {
					t.Errorf("after the engine closed: %v", err)
				}
			})
			host := func(p unsafe.Pointer, n int) []byte { return unsafe.Slice((*byte)(p), n) }
			engineStaging(t, tr, 8<<20+4096, via,
				func(p unsafe.Pointer, data []byte) { copy(host(p, len(data)), data) },
				func(p unsafe.Pointer, data []byte) { copy(data, host(p, len(data))) })
		})
	}
}

// TestGPUEngineStaging runs engineStaging on the GPU (or the C model),
// over TCP and over shm.
func TestGPUEngineStaging(t *testing.T) {
	for _, via := range []string{tcp.Name, shm.Name} {
		t.Run(via, func(t *testing.T) { gpuEngineStaging(t, via) })
	}
}

func gpuEngineStaging(t *testing.T, via string) {
	tr := openGPU(t)
	put, get := gpuCopies(t, tr)
	engineStaging(t, tr, 64<<20+4096, via, put, get)
}

// TestEngineStagingLifecycle: the staging registrations follow the
// transports: TCP installed after the GPU buffer was registered still
// stages it; nvlink cannot be uninstalled while a segment stages through
// it, can once it is closed, and then GPU memory reaches nothing; the
// engine's Close frees the arena (the fake's leak check).
func TestEngineStagingLifecycle(t *testing.T) {
	fake := newFake(1)
	tr, err := newTransport(Config{StagingUnits: 8}, fake)
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("%s-%d", t.Name(), time.Now().UnixNano())
	b, err := moonring.New(moonring.Config{Name: name + "-b", TCP: &tcp.Config{}})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	a, err := moonring.New(moonring.Config{Name: name + "-a", Transports: []string{"tcp"}})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := a.InstallTransport(tr); err != nil {
		t.Fatal(err)
	}
	mem, err := a.Alloc(1<<20, "cuda:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.RegisterLocalMemory(mem, "cuda:0", false); err != nil {
		t.Fatal(err)
	}
	ti, err := tcp.New(tcp.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.InstallTransport(ti); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, 1<<20)
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	seg, err := a.OpenSegment(ctx, name+"-b")
	if err != nil {
		t.Fatal(err)
	}
	copy(mem, testpattern.Bytes(9, len(mem))) // the fake's device memory is Go memory
	w := moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(mem), TargetID: seg,
		TargetOffset: uint64(moonring.AddressOf(dst)), Length: uint64(len(mem))}
	if err := a.Transfer(ctx, w); err != nil {
		t.Fatalf("WRITE over TCP installed after the GPU buffer: %v", err)
	}
	if i := testpattern.FirstDiff(dst, mem); i >= 0 {
		t.Fatalf("byte %d differs", i)
	}
	// The staging arena is registered, but no request may name it: not
	// even one to the engine's own segment.
	arena, err := tr.StagingArena()
	if err != nil {
		t.Fatal(err)
	}
	host := make([]byte, 64)
	if _, err := a.RegisterLocalMemory(host, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(host),
		TargetID: moonring.LocalSegmentID, TargetOffset: uint64(moonring.AddressOf(arena)), Length: 64}); err == nil {
		t.Error("a WRITE into the staging arena through the local segment succeeded")
	}
	if err := a.UninstallTransport(Name); !errors.Is(err, moonring.ErrBusy) {
		t.Fatalf("uninstall nvlink while a segment stages through it: %v, want ErrBusy", err)
	}
	if err := a.CloseSegment(ctx, seg); err != nil {
		t.Fatal(err)
	}
	if err := a.UninstallTransport(Name); err != nil {
		t.Fatalf("uninstall nvlink: %v", err)
	}
	if err := fake.leaks(); err != nil {
		t.Errorf("after nvlink was uninstalled: %v", err)
	}
	if w.TargetID, err = a.OpenSegment(ctx, name+"-b"); err != nil {
		t.Fatal(err)
	}
	if err := a.Transfer(ctx, w); !errors.Is(err, moonring.ErrNoTransport) {
		t.Errorf("WRITE from GPU memory with nvlink gone: %v, want ErrNoTransport", err)
	}
}

// BenchmarkStagedTCP moves 64 MiB requests between this engine and
// another over TCP on loopback, from and to GPU memory (staged through
// pinned chunks) and, as the baseline in the same run, from and to host
// memory on the same path: the ratio is what staging costs.
func BenchmarkStagedTCP(b *testing.B) {
	tr := openGPU(b)
	const size = 64 << 20
	p := newStagingPair(b, tr, size, tcp.Name)
	gpu := p.alloc(b, size, "cuda:0")
	host := p.alloc(b, size, "cpu:0")
	for i := range host {
		host[i] = byte(i)
	}
	if err := syncCopy(tr, 0, unsafe.Pointer(unsafe.SliceData(gpu)), host, true); err != nil {
		b.Fatal(err)
	}
	for _, src := range []struct {
		name string
		mem  []byte
	}{{"gpu", gpu}, {"host", host}} {
		for _, op := range []struct {
			name string
			op   moonring.Opcode
		}{{"write", moonring.Write}, {"read", moonring.Read}} {
			b.Run(src.name+"/"+op.name, func(b *testing.B) {
				r := p.req(op.op, src.mem, 0, size)
				b.SetBytes(size)
				for b.Loop() {
					if err := p.a.Transfer(context.Background(), r); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
