package nvlink

// The KV-cache workload on a GPU: a request's cache is thousands of small
// blocks scattered over a paged pool on each side (32 KiB per layer per K
// or V in a Llama-3-8B-like layout), not one large buffer. Each block is a
// slice and a copy; what a copy costs the CPU, not NVLink's bandwidth,
// decides the rate. These run on a GPU (scripts/gpu-check.sh) and, small,
// against the C model (TestMockCUDA).

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// kvBlock is one block of the KV workload: 16 tokens of one layer's K or
// V in Llama-3-8B (16 x 8 heads x 128 x 2 bytes).
const kvBlock = 32 << 10

// kvShape returns the blocks of one request and the pool they are drawn
// from on each side: a 4k-token request, 16,384 blocks (512 MiB) of a
// 1 GiB pool, on a GPU; 256 blocks of a 16 MiB pool against the C model,
// whose copies are memcpy on the CPU.
func kvShape() (blocks, pool int) {
	if os.Getenv(libraryEnv) != "" {
		return 256, 16 << 20
	}
	return 16384, 1 << 30
}

// kvPlan returns where each block of a request sits in the local pool and
// in the remote one: distinct blocks of each pool, in random order.
func kvPlan(seed uint64, blocks, pool int) (local, remote []uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	lp, rp := rng.Perm(pool/kvBlock), rng.Perm(pool/kvBlock)
	local, remote = make([]uint64, blocks), make([]uint64, blocks)
	for i := range blocks {
		local[i], remote[i] = uint64(lp[i]*kvBlock), uint64(rp[i]*kvBlock)
	}
	return local, remote
}

// counter is a Completer that counts completions and failures without
// allocating.
type counter struct{ n, failed atomic.Int64 }

func (c *counter) Complete(_ uint64, err error) {
	if err != nil {
		c.failed.Add(1)
	}
	c.n.Add(1)
}

// TestGPUScattered: a request's blocks scattered over both pools, READ
// into this process's GPU memory and WRITTEN back to the target's, each
// block checked where it landed, by copy engines and by the gather kernel; posting and reaping a Post's worth of
// block copies allocates nothing.
func TestGPUScattered(t *testing.T) {
	lib := os.Getenv(libraryEnv)
	t.Run("copy-engines", func(t *testing.T) { gpuScattered(t, Config{Library: lib, NoCopyKernel: true}) })
	t.Run("kernel", func(t *testing.T) { gpuScattered(t, Config{Library: lib}) })
}

func gpuScattered(t *testing.T, cfg Config) {
	tr := openGPUWith(t, cfg)
	defer tr.Close()
	blocks, pool := kvShape()
	blocks = min(blocks, 2048) // enough for 8 groups; the check copies it all to the host
	c := startChild(t, pool)
	ep, err := tr.Open(context.Background(), c.desc)
	if err != nil {
		t.Fatalf("Open the target's segment: %v", err)
	}
	defer ep.Close()
	remote := c.desc.Buffers[0].Addr
	b, reg := localGPU(t, tr, pool)
	if d, ok := tr.drv.(*cudaDriver); ok {
		t.Logf("the driver batches copies: %v (CUDA 12.8's signature with failIdx: %v)", d.canBatch(), d.batchFailIdx)
	}
	if l := tr.devs[0].lane; !cfg.NoCopyKernel && l.gather == 0 {
		t.Errorf("GPU 0's lane has no gather kernel: %v", l.gatherErr)
	}
	loff, roff := kvPlan(3, blocks, pool)
	s := make([]transport.Slice, blocks)
	for i := range s {
		s[i] = transport.Slice{Op: transport.Read, LocalHandle: reg.Handle, Local: b.Pointer(loff[i]), Remote: remote + roff[i], Length: kvBlock, Token: uint64(i + 1)}
	}
	if err := run(t, tr, ep, s); err != nil {
		t.Fatalf("scattered READ: %v", err)
	}
	got := make([]byte, pool)
	if err := syncCopy(tr, 0, b.Pointer(0), got, false); err != nil {
		t.Fatal(err)
	}
	for i := range s {
		if err := testpattern.Check(got[loff[i]:loff[i]+kvBlock], childSeed, roff[i]); err != nil {
			t.Fatalf("scattered READ, block %d (local %d, remote %d): %v", i, loff[i], roff[i], err)
		}
	}
	// WRITE them back over a refilled target: its pattern is whole again
	// where the blocks landed.
	c.ask(t, "fill 9")
	for i := range s {
		s[i].Op, s[i].Token = transport.Write, uint64(blocks+i+1)
	}
	if err := run(t, tr, ep, s); err != nil {
		t.Fatalf("scattered WRITE: %v", err)
	}
	for i := range s {
		c.ask(t, fmt.Sprintf("check %d %d %d", childSeed, roff[i], kvBlock))
		if i == 64 {
			break // the child checks a block a round trip: 64 are enough to see the order right
		}
	}
	// A Post of 64 block copies and its reaping allocate nothing.
	var cnt counter
	group := s[:64]
	allocs := testing.AllocsPerRun(20, func() {
		want := cnt.n.Load() + int64(len(group))
		for done := 0; done < len(group); {
			n, err := ep.Post(&cnt, group[done:])
			if err != nil {
				t.Fatal(err)
			}
			done += n
			tr.Poll()
		}
		for cnt.n.Load() < want {
			tr.Poll()
		}
	})
	if cnt.failed.Load() != 0 {
		t.Fatalf("%d of the repeated copies failed", cnt.failed.Load())
	}
	if raceEnabled {
		t.Logf("%.1f allocations a Post of 64 and its reaping, not checked: the race detector's sync.Pool drops items", allocs)
	} else if allocs != 0 {
		t.Errorf("a Post of 64 block copies and its reaping: %.1f allocations, want 0", allocs)
	}
	// Against the C model, the kernel's last launch: a column a slice of
	// the Post of 64, partsFor(32 KiB) rows of gatherThreads threads a
	// block (cuLaunchKernel's grid and block in their places).
	if grid, rows, block, ok := mockLastLaunch(t, cfg.Library); ok && !cfg.NoCopyKernel {
		want := partsFor(kvBlock, gatherThreads)
		if grid != uint32(len(group)) || rows != want || block != gatherThreads {
			t.Errorf("the last gather launch: grid %d x %d, block %d; want %d x %d blocks of %d threads", grid, rows, block, len(group), want, gatherThreads)
		}
	}
}

// mockLastLaunch returns the grid (x, y) and block sizes of the last
// kernel launch of lib when lib is the C model (testdata/mockcuda.c); ok
// is false for any other library.
func mockLastLaunch(t *testing.T, lib string) (grid, rows, block uint32, ok bool) {
	if lib == "" {
		return 0, 0, 0, false
	}
	h, err := purego.Dlopen(lib, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		t.Fatalf("dlopen %s: %v", lib, err)
	}
	fn, err := purego.Dlsym(h, "mock_last_launch")
	if err != nil {
		return 0, 0, 0, false // not the model
	}
	var y, b uint32
	g, _, _ := purego.SyscallN(fn, uintptr(unsafe.Pointer(&y)), uintptr(unsafe.Pointer(&b)))
	return uint32(g), y, b, true
}

// BenchmarkKVNVLink moves one request's KV cache between two engines in
// two processes through a ring (up to 4,096 blocks in flight): as its
// scattered 32 KiB blocks, copied by the gather kernel (the default), by
// copy engines with the copies of a Post batched (NoCopyKernel) or a call
// each (NoBatchCopies too), and the same bytes as contiguous 1 MiB blocks,
// by the kernel (the default) and by copy engines; kv-rings4 moves the
// scattered blocks through four rings on four pollers (Config.Pollers),
// a quarter each, from four goroutines, with the default Depth (four
// groups of 256 in flight on the GPU's lane: about one a ring) and with
// 4,096. Bytes are the request's; set beside RawKV.
func BenchmarkKVNVLink(b *testing.B) {
	blocks, pool := kvShape()
	lib := os.Getenv(libraryEnv)
	pairs := map[string]*enginePair{
		"kv":            newEnginePairWith(b, pool, Config{Library: lib}),
		"kv-copyengine": newEnginePairWith(b, pool, Config{Library: lib, NoCopyKernel: true}),
		"kv-percopy":    newEnginePairWith(b, pool, Config{Library: lib, NoBatchCopies: true, NoCopyKernel: true}),
	}
	pairs["contiguous"], pairs["contiguous-copyengine"], pairs["kv-lists"] = pairs["kv"], pairs["kv-copyengine"], pairs["kv"]
	pairs["kv-rings4"] = newEnginePairPollers(b, pool, Config{Library: lib}, 4)
	pairs["kv-rings4-depth4096"] = newEnginePairPollers(b, pool, Config{Library: lib, Depth: 4096}, 4)
	loff, roff := kvPlan(5, blocks, pool)
	for _, op := range []struct {
		name string
		op   moonring.Op
	}{{"write", moonring.OpWrite}, {"read", moonring.OpRead}} {
		for _, shape := range []string{"kv", "kv-lists", "kv-rings4", "kv-rings4-depth4096", "kv-copyengine", "kv-percopy", "contiguous", "contiguous-copyengine"} {
			b.Run(op.name+"/"+shape, func(b *testing.B) {
				p := pairs[shape]
				var es []moonring.Entry
				if strings.HasPrefix(shape, "contiguous") {
					for off := 0; off < blocks*kvBlock; off += 1 << 20 {
						es = append(es, moonring.Entry{Op: op.op, Segment: p.seg, Buffer: p.id, Local: uint64(off), Remote: p.dst + uint64(off), Length: 1 << 20})
					}
				} else {
					for i := range blocks {
						es = append(es, moonring.Entry{Op: op.op, Segment: p.seg, Buffer: p.id, Local: loff[i], Remote: p.dst + roff[i], Length: kvBlock})
					}
				}
				for i := range es {
					es[i].UserData = uint64(i)
				}
				// Fewer entries than blocks: the submission queue fills and
				// the loop goes on as completions free it. kv-rings4 splits
				// the request over 4 rings, each on a poller of its own.
				nr := 1
				if strings.HasPrefix(shape, "kv-rings4") {
					nr = 4
				}
				entries := min(4096, blocks/4/nr)
				rs := make([]*moonring.Ring, nr)
				for i := range rs {
					r, err := p.e.NewRing(moonring.RingConfig{Entries: entries})
					if err != nil {
						b.Fatal(err)
					}
					defer r.Close()
					rs[i] = r
				}
				b.SetBytes(int64(blocks * kvBlock))
				errs := make([]error, nr)
				if shape == "kv-lists" {
					// The request as a prepared list, made and freed each
					// time, 256 blocks an entry.
					for b.Loop() {
						if err := moveList(p, op.op, es, rs[0], entries); err != nil {
							b.Fatal(err)
						}
					}
					return
				}
				for b.Loop() {
					var wg sync.WaitGroup
					for i, r := range rs {
						part := es[i*len(es)/nr : (i+1)*len(es)/nr]
						wg.Go(func() { errs[i] = moveAll(r, part, entries) })
					}
					wg.Wait()
					for _, err := range errs {
						if err != nil {
							b.Fatal(err)
						}
					}
				}
			})
		}
	}
}

// moveList moves the blocks of es (entries of one buffer and segment)
// as a prepared list, 256 blocks an entry of r, and frees it.
func moveList(p *enginePair, op moonring.Op, es []moonring.Entry, r *moonring.Ring, entries int) error {
	blocks := make([]moonring.Block, len(es))
	for i, e := range es {
		blocks[i] = moonring.Block{Local: e.Local, Remote: e.Remote, Length: e.Length}
	}
	id, err := p.e.PrepareList(blocks)
	if err != nil {
		return err
	}
	defer p.e.FreeList(id)
	var les []moonring.Entry
	for first := 0; first < len(blocks); first += 256 {
		les = append(les, moonring.ListEntry(op, p.id, p.seg, id, first, min(256, len(blocks)-first), uint64(len(les))))
	}
	return moveAll(r, les, entries)
}

// moveAll submits es to r (of entries entries) and reaps their
// completions, failing on the first that did not complete.
func moveAll(r *moonring.Ring, es []moonring.Entry, entries int) error {
	cqes := make([]moonring.Completion, 2*entries)
	sent, done := 0, 0
	for done < len(es) {
		if sent < len(es) {
			n, err := r.Submit(es[sent:])
			if err != nil && !errors.Is(err, moonring.ErrSQFull) {
				return err
			}
			sent += n
		}
		n := r.PeekBatch(cqes)
		for i := range n {
			if err := cqes[i].Err(); err != nil {
				return fmt.Errorf("completion: %w", err)
			}
		}
		r.Advance(n)
		done += n
	}
	return nil
}

// BenchmarkRawKV is the baseline of BenchmarkKVNVLink: the request's
// blocks copied between two pools of GPU 0 in this process on one stream,
// one event at the end waited for by polling: the gather kernel, in one
// launch over all of them ("kernel") or in launches of 64 or 256 slices
// as a ring's Posts make ("kernel-256"), in the lane's geometry or with
// another block size ("-t256") or blocks a slice ("-p2"), a
// cuMemcpyDtoDAsync per
// block ("percopy"; "percopy-events" records an event after each, as
// nvlink did before it grouped a Post's copies), a cuMemcpyBatchAsync per
// 256 blocks ("batch", where
// the driver has it), and the same bytes as contiguous 1 MiB copies.
func BenchmarkRawKV(b *testing.B) {
	tr := openGPUWith(b, Config{Library: os.Getenv(libraryEnv)})
	defer tr.Close()
	blocks, pool := kvShape()
	src, err := tr.Alloc(pool, 0)
	if err != nil {
		b.Fatal(err)
	}
	dst, err := tr.Alloc(pool, 0)
	if err != nil {
		b.Fatal(err)
	}
	sp, dp := uintptr(unsafe.Pointer(unsafe.SliceData(src))), uintptr(unsafe.Pointer(unsafe.SliceData(dst)))
	loff, roff := kvPlan(5, blocks, pool)
	shapes := []string{"kernel", "percopy", "percopy-events", "batch", "contiguous"}
	// The kernel's launch geometry: threads a block (-tN; else
	// gatherThreads), launches over the whole request or of 64 or 256
	// slices each (a ring's Post is one group, one launch; a wide one
	// holds 256), and blocks a slice (-pN; else what the lane gives a 32
	// KiB slice, or 1 with -tN).
	lp := int(partsFor(kvBlock, gatherThreads)) // the lane's rows for a 32 KiB slice
	geometry := map[string]struct{ threads, per, parts int }{
		"kernel": {gatherThreads, blocks, lp}, "kernel-64": {gatherThreads, 64, lp}, "kernel-256": {gatherThreads, 256, lp},
		"kernel-256-p2": {gatherThreads, 256, 2}, "kernel-64-t256": {256, 64, 1}, "kernel-256-t256": {256, 256, 1},
		"kernel-256-t256-p4": {256, 256, 4}, "kernel-256-t512-p2": {512, 256, 2},
	}
	shapes = append(shapes, "kernel-64", "kernel-256", "kernel-256-p2", "kernel-64-t256", "kernel-256-t256",
		"kernel-256-t256-p4", "kernel-256-t512-p2")
	for _, shape := range shapes {
		geo, isKernel := geometry[shape]
		b.Run(shape, func(b *testing.B) {
			drv := tr.drv
			if shape == "batch" && !drv.canBatch() {
				b.Skip("the driver has no cuMemcpyBatchAsync (CUDA before 12.8)")
			}
			l := tr.devs[0].lane
			if isKernel && l.gather == 0 {
				b.Fatalf("no gather kernel: %v", l.gatherErr)
			}
			lockThread()
			defer unlockThread()
			if err := drv.setCurrent(tr.devs[0].ctx); err != nil {
				b.Fatal(err)
			}
			s, err := drv.streamCreate()
			if err != nil {
				b.Fatal(err)
			}
			defer drv.streamDestroy(s)
			ev, err := drv.eventCreate()
			if err != nil {
				b.Fatal(err)
			}
			defer drv.eventDestroy(ev)
			evs := make([]uintptr, DefaultDepth)
			for i := range evs {
				if evs[i], err = drv.eventCreate(); err != nil {
					b.Fatal(err)
				}
				defer drv.eventDestroy(evs[i])
			}
			var dsts, srcs []uintptr
			var sizes []uint64
			if shape == "contiguous" {
				for off := 0; off < blocks*kvBlock; off += 1 << 20 {
					dsts, srcs, sizes = append(dsts, dp+uintptr(off)), append(srcs, sp+uintptr(off)), append(sizes, 1<<20)
				}
			} else {
				for i := range blocks {
					dsts, srcs, sizes = append(dsts, dp+uintptr(roff[i])), append(srcs, sp+uintptr(loff[i])), append(sizes, kvBlock)
				}
			}
			var ka gatherArgs
			if isKernel {
				// The request's descriptors in a ring of their own, as
				// large as the request.
				host, dev, err := drv.hostAllocMapped(uint64(blocks) * 24)
				if err != nil {
					b.Fatal(err)
				}
				defer drv.hostFree(host)
				ds := unsafe.Slice((*gatherDesc)(host), blocks)
				for i := range ds {
					ds[i] = gatherDesc{dst: uint64(dsts[i]), src: uint64(srcs[i]), n: sizes[i]}
				}
				ka = gatherArgs{desc: uint64(dev), mask: uint32(blocks - 1), threads: uint32(geo.threads), parts: uint32(geo.parts)}
			}
			b.SetBytes(int64(blocks * kvBlock))
			for b.Loop() {
				if isKernel {
					for i := 0; i < blocks; i += geo.per {
						ka.start = uint32(i)
						if err := drv.launchGather(l.gather, &ka, uint32(min(geo.per, blocks-i)), s); err != nil {
							b.Fatal(err)
						}
					}
				} else if shape == "batch" {
					for i := 0; i < len(dsts); i += groupMax {
						j := min(i+groupMax, len(dsts))
						if err := drv.copyBatch(dsts[i:j], srcs[i:j], sizes[i:j], s); err != nil {
							b.Fatal(err)
						}
					}
				} else {
					for i := range dsts {
						if err := drv.copyDtoD(dsts[i], srcs[i], sizes[i], s); err != nil {
							b.Fatal(err)
						}
						if shape == "percopy-events" { // an event a copy, as nvlink recorded before copies were grouped
							if err := drv.eventRecord(evs[i%len(evs)], s); err != nil {
								b.Fatal(err)
							}
						}
					}
				}
				if err := drv.eventRecord(ev, s); err != nil {
					b.Fatal(err)
				}
				for {
					done, err := drv.eventQuery(ev)
					if err != nil {
						b.Fatal(err)
					}
					if done {
						break
					}
				}
			}
		})
	}
}
