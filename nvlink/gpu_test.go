package nvlink

// Tests and benchmarks on a real GPU through libcuda.so.1. Without a
// driver they skip, saying why ("nvlink: no libcuda.so.1: ..."); CI has no
// GPU, so there the skip is expected. scripts/gpu-check.sh runs them on a
// machine with one.
//
// The target of the two-process tests is this test binary again, started
// with NVLINK_GPU_CHILD=1 (TestMain hands over to gpuChild): it allocates
// a GPU buffer, fills it with a known pattern, exports it and prints its
// segment descriptor as one JSON line; then it answers commands on stdin
// (internal/childproc's protocol):
//
//	check <seed> <offset> <length>   compare the buffer with testpattern's pattern of seed there: "ok" or "bad <why>"
//	fill <seed>                       refill the whole buffer with the pattern of seed: "ok"
//
// When stdin closes it unregisters, closes and exits.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

const (
	childEnv     = "NVLINK_GPU_CHILD"
	childSizeEnv = "NVLINK_GPU_SIZE"
	childSeed    = 0xC0FFEE
	// libraryEnv names the driver library the GPU tests load instead of
	// libcuda.so.1: TestMockCUDA points it at testdata/mockcuda.c built.
	libraryEnv = "NVLINK_TEST_LIBRARY"
)

func testConfig() Config { return Config{Library: os.Getenv(libraryEnv)} }

// gpuSize is the size of the target buffer: 64 MiB, the benchmarks' size.
const gpuSize = 64 << 20

// openGPU returns a transport on the real driver or skips the test.
func openGPU(tb testing.TB) *Transport {
	tb.Helper()
	return openGPUWith(tb, testConfig())
}

// openGPUWith is openGPU with cfg.
func openGPUWith(tb testing.TB, cfg Config) *Transport {
	tb.Helper()
	tr, err := New(cfg)
	if err != nil {
		if errors.Is(err, transport.ErrNotSupported) {
			tb.Skipf("no GPU to test on: %v", err)
		}
		tb.Fatalf("nvlink.New: %v", err)
	}
	return tr
}

// syncCopy copies between host memory and device memory of gpu and waits:
// the tests' way to fill and inspect GPU memory, not the transport's.
func syncCopy(tr *Transport, gpu int, dev unsafe.Pointer, host []byte, toDevice bool) error {
	tr.mu.Lock()
	d, err := tr.device(gpu)
	tr.mu.Unlock()
	if err != nil {
		return err
	}
	lockThread()
	defer unlockThread()
	if err := tr.drv.setCurrent(d.ctx); err != nil {
		return err
	}
	s, err := tr.drv.streamCreate()
	if err != nil {
		return err
	}
	defer tr.drv.streamDestroy(s)
	if toDevice {
		err = tr.drv.copyHtoD(uintptr(dev), unsafe.Pointer(unsafe.SliceData(host)), uint64(len(host)), s)
	} else {
		err = tr.drv.copyDtoH(unsafe.Pointer(unsafe.SliceData(host)), uintptr(dev), uint64(len(host)), s)
	}
	if err != nil {
		return err
	}
	return tr.drv.streamSync(s)
}

// gpuChild is the target process. It returns the exit code.
func gpuChild() int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "gpu child:", err); return 1 }
	size := gpuSize
	if s := os.Getenv(childSizeEnv); s != "" {
		size, _ = strconv.Atoi(s)
	}
	tr, err := New(testConfig())
	if err != nil {
		return fail(err)
	}
	defer tr.Close()
	mem, err := tr.Alloc(size, 0)
	if err != nil {
		return fail(err)
	}
	if err := syncCopy(tr, 0, unsafe.Pointer(unsafe.SliceData(mem)), testpattern.Bytes(childSeed, size), true); err != nil {
		return fail(err)
	}
	var bufs segtable.Buffers
	b, err := bufs.Register(mem, segtable.CUDA(0), true)
	if err != nil {
		return fail(err)
	}
	reg, err := tr.Register(b)
	if err != nil {
		return fail(err)
	}
	desc := segtable.SegmentDesc{Version: 1, Name: "gpu-child", Epoch: 1, Endpoints: map[string]string{Name: tr.Endpoint()},
		Buffers: []segtable.BufferDesc{{Addr: uint64(b.Addr), Length: b.Length, Location: string(b.Location), Keys: map[string]string{Name: reg.Key}}}}
	j, _ := json.Marshal(&desc)
	err = childproc.Serve(string(j), func(cmd string) string {
		f := strings.Fields(cmd)
		switch {
		case len(f) == 4 && f[0] == "check":
			seed, _ := strconv.ParseUint(f[1], 10, 64)
			off, _ := strconv.Atoi(f[2])
			n, _ := strconv.Atoi(f[3])
			if off < 0 || n <= 0 || off+n > size {
				return "bad range"
			}
			got := make([]byte, n)
			if err := syncCopy(tr, 0, b.Pointer(uint64(off)), got, false); err != nil {
				return fmt.Sprint("bad ", err)
			}
			if err := testpattern.Check(got, seed, uint64(off)); err != nil {
				return fmt.Sprint("bad ", err)
			}
			return "ok"
		case len(f) == 2 && f[0] == "fill":
			seed, _ := strconv.ParseUint(f[1], 10, 64)
			if err := syncCopy(tr, 0, b.Pointer(0), testpattern.Bytes(seed, size), true); err != nil {
				return fmt.Sprint("bad ", err)
			}
			return "ok"
		}
		return "bad command"
	})
	if err != nil {
		return fail(err)
	}
	// stdin closed: the test is over.
	if err := tr.Unregister(b, reg); err != nil {
		return fail(err)
	}
	bufs.Unregister(context.Background(), b.ID)
	return 0
}

// child is a running target process.
type child struct {
	*childproc.Proc
	desc *segtable.SegmentDesc
}

func startChild(tb testing.TB, size int) *child {
	tb.Helper()
	return startChildEnv(tb, childEnv, size)
}

// startChildEnv starts this test binary as the child that env selects
// (see TestMain), with size bytes of GPU memory. The test fails if the
// child does not exit cleanly once the test closes its stdin.
func startChildEnv(tb testing.TB, env string, size int) *child {
	tb.Helper()
	p := childproc.Start(tb, childproc.Config{Env: []string{env + "=1", childSizeEnv + "=" + strconv.Itoa(size)},
		Name: "target process", StopWait: 30 * time.Second})
	tb.Cleanup(func() {
		if err := p.Stop(); err != nil {
			tb.Errorf("target process: %v", err)
		}
	})
	d, err := segtable.UnmarshalDesc([]byte(p.Line))
	if err != nil {
		tb.Fatalf("target's descriptor: %v", err)
	}
	return &child{Proc: p, desc: d}
}

// ask sends cmd to the child and fails tb unless it answers "ok".
func (c *child) ask(tb testing.TB, cmd string) {
	tb.Helper()
	if a := c.Ask(tb, "%s", cmd); a != "ok" {
		tb.Fatalf("target process: %q: %s", cmd, a)
	}
}

// localGPU allocates size bytes of GPU 0's memory through tr and
// registers them, local-only; tb's cleanup unregisters them (after tr's
// Close, if the test closes it first: that Unregister returns at once).
func localGPU(tb testing.TB, tr *Transport, size int) (*segtable.Buffer, segtable.Registration) {
	tb.Helper()
	mem, err := tr.Alloc(size, 0)
	if err != nil {
		tb.Fatal(err)
	}
	bufs := new(segtable.Buffers)
	b, err := bufs.Register(mem, segtable.CUDA(0), false)
	if err != nil {
		tb.Fatal(err)
	}
	reg, err := tr.Register(b)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		tr.Unregister(b, reg)
		bufs.Unregister(context.Background(), b.ID)
	})
	return b, reg
}

// run posts s on ep and polls tr until every slice completed; it returns
// the first error.
func run(tb testing.TB, tr *Transport, ep transport.Endpoint, s []transport.Slice) error {
	tb.Helper()
	r := newRecorder()
	for done := 0; done < len(s); {
		n, err := ep.Post(r, s[done:])
		if err != nil {
			return err
		}
		done += n
		tr.Poll()
	}
	deadline := time.Now().Add(time.Minute)
	for r.n.Load() < int64(len(s)) {
		if time.Now().After(deadline) {
			tb.Fatalf("%d of %d slices completed in a minute", r.n.Load(), len(s))
		}
		tr.Poll()
	}
	for i := range s {
		if err := r.result(tb.(*testing.T), s[i].Token); err != nil {
			return err
		}
	}
	return nil
}

// TestGPUDriverError: a failing call comes back as an error with the
// code's sentinel and the driver's own description (cuGetErrorString).
func TestGPUDriverError(t *testing.T) {
	tr := openGPU(t)
	defer tr.Close()
	_, err := tr.drv.pciBusID(1 << 20)
	var ce *cudaError
	if !errors.As(err, &ce) || !errors.Is(err, ErrNoDevice) || ce.desc == "" {
		t.Fatalf("cuDeviceGet of GPU 1048576: %v; want a cudaError wrapping ErrNoDevice with the driver's description", err)
	}
	t.Logf("the driver says: %v", err)
	if _, err := tr.Alloc(1<<20, 1<<20); !errors.Is(err, ErrNoDevice) {
		t.Errorf("Alloc on GPU 1048576: %v, want ErrNoDevice", err)
	}
}

func TestGPUTwoProcesses(t *testing.T) {
	tr := openGPU(t)
	defer tr.Close()
	c := startChild(t, gpuSize)
	ep, err := tr.Open(context.Background(), c.desc)
	if err != nil {
		t.Fatalf("Open the target's segment: %v", err)
	}
	defer ep.Close()
	remote := c.desc.Buffers[0].Addr
	var bufs segtable.Buffers
	defer func() {
		for _, b := range bufs.All() {
			bufs.Unregister(context.Background(), b.ID)
		}
	}()
	mem, err := tr.Alloc(gpuSize, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := bufs.Register(mem, segtable.CUDA(0), false)
	if err != nil {
		t.Fatal(err)
	}
	reg, err := tr.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Unregister(b, reg)
	host := make([]byte, 1<<20)
	hb, err := bufs.Register(host, segtable.CPU(0), false)
	if err != nil {
		t.Fatal(err)
	}
	hreg, err := tr.Register(hb)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Unregister(hb, hreg)

	// READ the whole target buffer into GPU memory, in 4 slices.
	var s []transport.Slice
	for i := 0; i < 4; i++ {
		off := uint64(i * gpuSize / 4)
		s = append(s, transport.Slice{Op: transport.Read, LocalHandle: reg.Handle, Local: b.Pointer(off), Remote: remote + off, Length: gpuSize / 4, Token: uint64(i + 1)})
	}
	if err := run(t, tr, ep, s); err != nil {
		t.Fatalf("READ GPU to GPU: %v", err)
	}
	got := make([]byte, gpuSize)
	if err := syncCopy(tr, 0, b.Pointer(0), got, false); err != nil {
		t.Fatal(err)
	}
	if i := testpattern.FirstDiff(got, testpattern.Bytes(childSeed, gpuSize)); i >= 0 {
		t.Fatalf("READ GPU to GPU: byte %d differs", i)
	}
	// WRITE a new pattern into the target and let it check.
	if err := syncCopy(tr, 0, b.Pointer(0), testpattern.Bytes(7, gpuSize), true); err != nil {
		t.Fatal(err)
	}
	for i := range s {
		s[i].Op, s[i].Token = transport.Write, uint64(10+i)
	}
	if err := run(t, tr, ep, s); err != nil {
		t.Fatalf("WRITE GPU to GPU: %v", err)
	}
	c.ask(t, fmt.Sprintf("check 7 0 %d", gpuSize))
	// Host memory as the local side: READ then WRITE at an odd offset.
	c.ask(t, "fill 9")
	if err := run(t, tr, ep, []transport.Slice{{Op: transport.Read, LocalHandle: hreg.Handle, Local: hb.Pointer(0), Remote: remote + 12345, Length: 1 << 20, Token: 20}}); err != nil {
		t.Fatalf("READ GPU to host: %v", err)
	}
	if err := testpattern.Check(host, 9, 12345); err != nil {
		t.Fatalf("READ GPU to host: %v", err)
	}
	copy(host, testpattern.Bytes(11, 1<<20))
	if err := run(t, tr, ep, []transport.Slice{{Op: transport.Write, LocalHandle: hreg.Handle, Local: hb.Pointer(0), Remote: remote, Length: 1 << 20, Token: 21}}); err != nil {
		t.Fatalf("WRITE host to GPU: %v", err)
	}
	c.ask(t, fmt.Sprintf("check 11 0 %d", 1<<20))
	// Outside the buffer: refused before any copy.
	if err := run(t, tr, ep, []transport.Slice{{Op: transport.Write, LocalHandle: hreg.Handle, Local: hb.Pointer(0), Remote: remote + gpuSize - 10, Length: 20, Token: 22}}); !errors.Is(err, transport.ErrRange) {
		t.Fatalf("WRITE past the target buffer: %v, want ErrRange", err)
	}
}

// TestGPUStagingTCP moves GPU memory over the TCP transport on loopback
// through the staging endpoint (Stage): GPU -> pinned chunk -> TCP WRITE
// -> the target's host buffer, and back with READs; more slices than
// chunks, so chunks are reused.
func TestGPUStagingTCP(t *testing.T) {
	cfg := testConfig()
	cfg.StagingUnits = 64 // 16 MiB: four 4 MiB slices at once
	tr := openGPUWith(t, cfg)
	defer tr.Close()
	put, get := gpuCopies(t, tr)
	stagedTCP(t, tr, 4<<20, 32<<20, put, get)
}

// gpuCopies returns functions that fill and read GPU 0's memory with
// synchronous copies, failing t on an error.
func gpuCopies(t *testing.T, tr *Transport) (put, get func(dev unsafe.Pointer, data []byte)) {
	cp := func(toDevice bool) func(unsafe.Pointer, []byte) {
		return func(dev unsafe.Pointer, data []byte) {
			if err := syncCopy(tr, 0, dev, data, toDevice); err != nil {
				t.Fatal(err)
			}
		}
	}
	return cp(true), cp(false)
}

// BenchmarkNVLinkWrite and BenchmarkNVLinkRead move 64 MiB between this
// process's GPU memory and the target process's through IPC, one slice per
// operation (the default slice size is 64 MiB), with depth operations in
// flight; BenchmarkRawDtoD is the baseline, cuMemcpyDtoDAsync between two
// buffers of this process with the same depth of copies in flight, waited
// for the same way (event polling). Depth 1 shows the per-operation cost
// of posting and polling; depth 4 hides it behind the copies.
func BenchmarkNVLinkWrite(b *testing.B) {
	benchDepths(b, func(b *testing.B, d int) { benchNVLink(b, transport.Write, d) })
}
func BenchmarkNVLinkRead(b *testing.B) {
	benchDepths(b, func(b *testing.B, d int) { benchNVLink(b, transport.Read, d) })
}
func BenchmarkRawDtoD(b *testing.B) { benchDepths(b, benchRaw) }

func benchDepths(b *testing.B, f func(*testing.B, int)) {
	for _, d := range []int{1, 4} {
		b.Run(fmt.Sprintf("depth=%d", d), func(b *testing.B) { f(b, d) })
	}
}

func benchNVLink(b *testing.B, op transport.Op, depth int) {
	tr := openGPU(b)
	defer tr.Close()
	c := startChild(b, gpuSize)
	ep, err := tr.Open(context.Background(), c.desc)
	if err != nil {
		b.Fatal(err)
	}
	defer ep.Close()
	lb, reg := localGPU(b, tr, gpuSize)
	r := newRecorder()
	sl := []transport.Slice{{Op: op, LocalHandle: reg.Handle, Local: lb.Pointer(0), Remote: c.desc.Buffers[0].Addr, Length: gpuSize}}
	b.SetBytes(gpuSize)
	var posted int64
	for b.Loop() {
		for posted-r.n.Load() >= int64(depth) {
			tr.Poll()
		}
		posted++
		sl[0].Token = uint64(posted)
		for {
			n, err := ep.Post(r, sl)
			if err != nil {
				b.Fatalf("Post: %v", err)
			}
			if n == 1 {
				break
			}
			tr.Poll()
		}
	}
	for r.n.Load() < posted {
		tr.Poll()
	}
	b.StopTimer()
	r.mu.Lock()
	defer r.mu.Unlock()
	for t := uint64(1); t <= uint64(posted); t++ {
		if errs := r.got[t]; len(errs) != 1 || errs[0] != nil {
			b.Fatalf("slice %d: %v", t, errs)
		}
	}
}

func benchRaw(b *testing.B, depth int) {
	tr := openGPU(b)
	defer tr.Close()
	src, err := tr.Alloc(gpuSize, 0)
	if err != nil {
		b.Fatal(err)
	}
	dst, err := tr.Alloc(gpuSize, 0)
	if err != nil {
		b.Fatal(err)
	}
	d := tr.devs[0]
	lockThread()
	defer unlockThread()
	drv := tr.drv
	if err := drv.setCurrent(d.ctx); err != nil {
		b.Fatal(err)
	}
	s, err := drv.streamCreate()
	if err != nil {
		b.Fatal(err)
	}
	defer drv.streamDestroy(s)
	evs := make([]uintptr, depth)
	for i := range evs {
		if evs[i], err = drv.eventCreate(); err != nil {
			b.Fatal(err)
		}
		defer drv.eventDestroy(evs[i])
	}
	wait := func(ev uintptr) {
		for {
			done, err := drv.eventQuery(ev)
			if err != nil {
				b.Fatal(err)
			}
			if done {
				return
			}
		}
	}
	dp, sp := uintptr(unsafe.Pointer(unsafe.SliceData(dst))), uintptr(unsafe.Pointer(unsafe.SliceData(src)))
	b.SetBytes(gpuSize)
	n := 0
	for b.Loop() {
		ev := evs[n%depth]
		if n >= depth {
			wait(ev) // the copy that last used this event
		}
		if err := drv.copyDtoD(dp, sp, gpuSize, s); err != nil {
			b.Fatal(err)
		}
		if err := drv.eventRecord(ev, s); err != nil {
			b.Fatal(err)
		}
		n++
	}
	for i := 0; i < min(n, depth); i++ {
		wait(evs[(n-1-i)%depth])
	}
}
