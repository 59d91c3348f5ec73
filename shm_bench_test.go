package moonring_test

import (
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/shm"
)

// shmSizes are the sizes of the shm benchmarks, each with the requests in
// flight and so the working set: depth blocks of size on each side.
var shmSizes = []benchSize{
	{"4KiB", 4 << 10, 64},
	{"64KiB", 64 << 10, 32},
	{"1MiB", 1 << 20, 8},
	{"64MiB", 64 << 20, 2},
}

// benchSHM drives op against a child target over shm. With heap set both
// buffers are Go memory, which shm reaches through process_vm calls (the
// fallback path); else both come from Alloc and the target's is mapped.
func benchSHM(b *testing.B, op moonring.Op, heap bool) { benchSHMStride(b, op, heap, true) }

// sameDepth is the requests the one-block benchmarks keep in flight: half
// the ring. Their working set does not grow with it (every request is on
// the same block), and ucx_perftest's put, beside which they run, keeps its
// puts outstanding without a completion each; fewer in flight measures the
// hand-offs between the reaper and the poller more than the copies.
const sameDepth = 128

// benchSHMStride is benchSHM; with spread unset, every request in flight
// uses the first block of each buffer, as ucx_perftest does, sameDepth of
// them. The reaper spins, as ucx_perftest's does: the target process has
// no part in the copies, so the two cores are the poller's and the
// reaper's. With
// MOONRING_BENCH_WAIT=1 it blocks in CQ().Wait instead: run so with
// GOMAXPROCS=1, the poller and the reaper share one core and hand over
// without crossing cores, as ucx_perftest's one thread does (with one P the
// poller parks at once, so a spinning reaper would starve it).
func benchSHMStride(b *testing.B, op moonring.Op, heap, spread bool) {
	for _, sz := range shmSizes {
		b.Run("size="+sz.name, func(b *testing.B) {
			span, stride, depth := sz.bytes*sz.depth, sz.bytes, sz.depth
			if !spread {
				span, stride, depth = sz.bytes, 0, sameDepth
			}
			env := []string{"MOONRING_SIZE=" + strconv.Itoa(span), "MOONRING_SHM=1"}
			if heap {
				env = append(env, "MOONRING_HEAP=1")
			}
			c := startChild(b, "target", env...)
			bc := benchConfig()
			bc.SHM = &shm.Config{}
			e, seg, d := remoteEngine(b, c, bc)
			if name, _ := e.SegmentTransport(seg); name != shm.Name {
				b.Fatalf("segment opened over %q, want shm", name)
			}
			buf := make([]byte, span)
			if !heap {
				var err error
				if buf, err = e.Alloc(span, "cpu:0"); err != nil {
					b.Fatal(err)
				}
				defer e.Free(buf)
			}
			fill(buf, 5)
			id, err := e.RegisterLocalMemory(buf, "cpu:0", false)
			if err != nil {
				b.Fatal(err)
			}
			defer e.UnregisterLocalMemory(b.Context(), buf)
			r, err := e.NewRing(moonring.RingConfig{Entries: 256})
			if err != nil {
				b.Fatal(err)
			}
			defer r.Close()
			driveStride(b, r, moonring.Entry{Op: op, Segment: seg, Buffer: id, Remote: d.Buffers[0].Addr, Length: uint64(sz.bytes)}, sz.bytes, depth, stride, os.Getenv("MOONRING_BENCH_WAIT") == "")
		})
	}
}

// BenchmarkShmWrite writes into a child process's buffer (from its
// Alloc) through the shm transport: the initiator maps it and copies.
func BenchmarkShmWrite(b *testing.B) { benchSHM(b, moonring.OpWrite, false) }

// BenchmarkShmRead reads a child process's mapped buffer.
func BenchmarkShmRead(b *testing.B) { benchSHM(b, moonring.OpRead, false) }

// BenchmarkShmWriteSame is BenchmarkShmWrite with every request on the
// same block of each buffer: the working set of ucx_perftest's put, beside
// which scripts/bench-vs-ucx.sh runs it.
func BenchmarkShmWriteSame(b *testing.B) { benchSHMStride(b, moonring.OpWrite, false, false) }

// BenchmarkShmReadSame is BenchmarkShmRead on one block, as ucx_perftest's
// get.
func BenchmarkShmReadSame(b *testing.B) { benchSHMStride(b, moonring.OpRead, false, false) }

// BenchmarkShmVMRead reads a child process's Go buffer, which is not a
// memfd: the fallback path, process_vm_readv (one call per run of slices).
func BenchmarkShmVMRead(b *testing.B) { benchSHM(b, moonring.OpRead, true) }

// BenchmarkShmVMWrite writes through the fallback path (process_vm_writev).
func BenchmarkShmVMWrite(b *testing.B) { benchSHM(b, moonring.OpWrite, true) }

// BenchmarkShmCopyBaseline is copy() over the working set of the shm
// benchmarks: block i of one buffer to block i of another, cycling over
// depth blocks; between Go heap buffers (mem=heap, which get transparent
// huge pages) and between buffers from Alloc with shm installed (mem=memfd,
// the memory the shm benchmarks move, which gets huge pages only where
// shmem_enabled allows), and on one block of such memory (mem=memfd-same,
// the working set of the *Same benchmarks and of ucx_perftest).
func BenchmarkShmCopyBaseline(b *testing.B) {
	e := newEngineCfg(b, moonring.Config{SHM: &shm.Config{}})
	for _, kind := range []string{"heap", "memfd", "memfd-same"} {
		for _, sz := range shmSizes {
			b.Run("mem="+kind+"/size="+sz.name, func(b *testing.B) {
				span, depth := sz.bytes*sz.depth, sz.depth
				if kind == "memfd-same" { // one block, as the *Same benchmarks
					span, depth = sz.bytes, 1
				}
				src, dst := make([]byte, span), make([]byte, span)
				if kind != "heap" {
					var err error
					if src, err = e.Alloc(span, "cpu:0"); err != nil {
						b.Fatal(err)
					}
					defer e.Free(src)
					if dst, err = e.Alloc(span, "cpu:0"); err != nil {
						b.Fatal(err)
					}
					defer e.Free(dst)
				}
				fill(src, 3)
				fill(dst, 4)
				b.SetBytes(int64(sz.bytes))
				i := 0
				for b.Loop() {
					o := i * sz.bytes
					copy(dst[o:o+sz.bytes], src[o:o+sz.bytes])
					if i++; i == depth {
						i = 0
					}
				}
				b.ReportMetric(float64(b.N)*float64(sz.bytes)/b.Elapsed().Seconds()/1e9, "GB/s")
			})
		}
	}
}

// BenchmarkProcessVMReadvBaseline is raw process_vm_readv, one call per
// block, from a child process's Go buffer into a Go buffer over the same
// working set as BenchmarkShmVMRead.
func BenchmarkProcessVMReadvBaseline(b *testing.B) {
	for _, sz := range shmSizes {
		b.Run("size="+sz.name, func(b *testing.B) {
			span := sz.bytes * sz.depth
			c := startChild(b, "target", "MOONRING_SIZE="+strconv.Itoa(span), "MOONRING_HEAP=1")
			d := c.targetDesc(b)
			dst := make([]byte, span)
			pid := c.Pid()
			b.SetBytes(int64(sz.bytes))
			i := 0
			for b.Loop() {
				o := i * sz.bytes
				local := []unix.Iovec{{Base: &dst[o]}}
				local[0].SetLen(sz.bytes)
				remote := []unix.RemoteIovec{{Base: uintptr(d.Buffers[0].Addr) + uintptr(o), Len: sz.bytes}}
				if n, err := unix.ProcessVMReadv(pid, local, remote, 0); err != nil || n != sz.bytes {
					b.Fatalf("process_vm_readv: %d, %v", n, err)
				}
				if i++; i == sz.depth {
					i = 0
				}
			}
			b.ReportMetric(float64(b.N)*float64(sz.bytes)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

func newEngineCfg(t testing.TB, cfg moonring.Config) *moonring.Engine {
	t.Helper()
	e, err := moonring.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}
