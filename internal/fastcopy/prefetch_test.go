package fastcopy

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"unsafe"

	"github.com/klauspost/cpuid/v2"
	"golang.org/x/sys/unix"
)

// Prefetch is a hint: it changes no byte, and addresses that are not
// mapped, or mapped with no access, fault nothing (a slice's next block
// may belong to a region unmapped meanwhile).
func TestPrefetchTouchesNothing(t *testing.T) {
	src, dst := guarded(t, 8<<10), guarded(t, 8<<10)
	fill(src, 1)
	fill(dst, 2)
	s0, d0 := bytes.Clone(src), bytes.Clone(dst)
	Prefetch(unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), uintptr(len(src)))
	if !bytes.Equal(src, s0) || !bytes.Equal(dst, d0) {
		t.Fatal("Prefetch changed memory")
	}
	page := unix.Getpagesize()
	m, err := unix.Mmap(-1, 0, 4*page, unix.PROT_NONE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	none := unsafe.Pointer(&m[0])
	Prefetch(none, none, 4<<10) // mapped with no access
	if err := unix.Munmap(m); err != nil {
		t.Fatal(err)
	}
	Prefetch(none, none, 4<<10) // not mapped at all
	Prefetch(nil, nil, 1<<20)
	Prefetch(unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), 0)
}

// On amd64 without the race detector and the sanitizers Prefetch is on,
// and every AMD64 CPU has PREFETCHW, so detecting it must find it there.
func TestPrefetchDetected(t *testing.T) {
	if runtime.GOARCH != "amd64" || !canPrefetch {
		t.Skipf("SKIP: Prefetch does nothing in this build (%s, race or sanitizer): nothing to detect", runtime.GOARCH)
	}
	if cpuid.CPU.VendorID == cpuid.AMD && !prefetchW {
		t.Fatal("an AMD CPU without PREFETCHW: the CPUID check is wrong")
	}
}

// BenchmarkScattered copies blocks at random between two 1 GiB pools of
// huge pages, as a KV cache's transfers go, with one goroutine or two
// (streams): plainly (store=plain: REP MOVSB from 32 KiB), plainly with
// the next block's head prefetched (store=plain+prefetch, Prefetch), and
// with Copy's non-temporal loop (store=stream, where the CPU has it), two
// or four at once (store=stream+pair, CopyPair; store=stream+group,
// Group), and sequential blocks (order=seq) beside them: the rate the
// memory gives a copy that the prefetchers follow. 32 KiB blocks at
// random against 1 MiB ones in order, both in groups on two streams, is
// the kv pattern's ratio in process (moonring bench --pattern kv: a
// request's scattered blocks against its bytes as 1 MiB transfers in
// order) with nothing of the engine's in it.
func BenchmarkScattered(b *testing.B) {
	const pool = 1 << 30
	get := func() []byte {
		m, err := unix.Mmap(-1, 0, pool, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { unix.Munmap(m) })
		unix.Madvise(m, unix.MADV_HUGEPAGE)
		unix.Madvise(m, unix.MADV_POPULATE_WRITE)
		return m
	}
	src, dst := get(), get()
	had := stream
	defer func() { stream = had }()
	for _, size := range []int{4 << 10, 32 << 10, 1 << 20} {
		type move struct{ s, d int }
		for _, order := range []string{"rand", "seq"} {
			rng := rand.New(rand.NewPCG(1, 2))
			ms := make([]move, (256<<20)/size)
			s0, d0 := rng.IntN(pool/(256<<20))*(256<<20), rng.IntN(pool/(256<<20))*(256<<20)
			for i := range ms {
				ms[i] = move{s0 + i*size, d0 + i*size}
				if order == "rand" {
					ms[i] = move{rng.IntN(pool/size) * size, rng.IntN(pool/size) * size}
				}
			}
			for _, store := range []string{"plain", "plain+prefetch", "stream", "stream+prefetch", "stream+pair", "stream+group"} {
				if strings.HasPrefix(store, "stream") && !had || order == "seq" && strings.HasSuffix(store, "+prefetch") {
					continue
				}
				for _, streams := range []int{1, 2} {
					b.Run(fmt.Sprintf("size=%dKiB/order=%s/store=%s/streams=%d", size>>10, order, store, streams), func(b *testing.B) {
						stream = strings.HasPrefix(store, "stream")
						pf := strings.HasSuffix(store, "+prefetch")
						pair := strings.HasSuffix(store, "+pair")
						group := strings.HasSuffix(store, "+group")
						b.SetBytes(int64(len(ms) * size))
						for b.Loop() {
							var wg sync.WaitGroup
							for g := range streams {
								wg.Go(func() {
									part := ms[g*len(ms)/streams : (g+1)*len(ms)/streams]
									for i := 0; pair && i < len(part); i += 2 {
										m, n := part[i], part[min(i+1, len(part)-1)]
										CopyPair(dst[m.d:m.d+size], src[m.s:m.s+size], dst[n.d:n.d+size], src[n.s:n.s+size])
									}
									if group {
										var g Group
										for _, m := range part {
											if g.Add(dst[m.d:m.d+size], src[m.s:m.s+size]) {
												g.Copy()
											}
										}
										g.Copy()
										return
									}
									for i, m := range part {
										if pair {
											break
										}
										if pf && i+1 < len(part) {
											n := part[i+1]
											Prefetch(unsafe.Pointer(&dst[n.d]), unsafe.Pointer(&src[n.s]), uintptr(size))
										}
										Copy(dst[m.d:m.d+size], src[m.s:m.s+size])
									}
								})
							}
							wg.Wait()
						}
					})
				}
			}
		}
	}
}
