package fastcopy

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"runtime"
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

// BenchmarkScattered copies blocks at random in two 1 GiB pools of
// transparent huge pages (as the kv pattern's), with and without
// Prefetch of the next block: the gain a copy loop gets from it.
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
	for _, size := range []int{4 << 10, 32 << 10, 1 << 20} {
		type move struct{ s, d int }
		rng := rand.New(rand.NewPCG(1, 2))
		ms := make([]move, (256<<20)/size)
		for i := range ms {
			ms[i] = move{rng.IntN(pool/size) * size, rng.IntN(pool/size) * size}
		}
		for _, pf := range []bool{false, true} {
			b.Run(fmt.Sprintf("size=%dKiB/prefetch=%v", size>>10, pf), func(b *testing.B) {
				b.SetBytes(int64(len(ms) * size))
				for b.Loop() {
					for i, m := range ms {
						if pf && i+1 < len(ms) {
							n := ms[i+1]
							Prefetch(unsafe.Pointer(&dst[n.d]), unsafe.Pointer(&src[n.s]), uintptr(size))
						}
						Copy(dst[m.d:m.d+size], src[m.s:m.s+size])
					}
				}
			})
		}
	}
}
