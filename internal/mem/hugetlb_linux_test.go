package mem

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/hugetest"
)

// pageSizeAt is the page size of the mapping at addr (/proc/self/smaps'
// KernelPageSize, in KiB).
func pageSizeAt(t *testing.T, addr uintptr) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	in := false
	for line := range strings.Lines(string(b)) {
		if f := strings.Fields(line); len(f) > 0 && !strings.HasSuffix(f[0], ":") {
			lo, _, _ := strings.Cut(f[0], "-")
			v, _ := strconv.ParseUint(lo, 16, 64)
			in = uintptr(v) == addr
			continue
		}
		if v, ok := strings.CutPrefix(line, "KernelPageSize:"); ok && in {
			n, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			return n
		}
	}
	t.Fatalf("no mapping at %#x in smaps", addr)
	return 0
}

// mapped is how many KiB of reserved huge pages this process maps.
func mapped(t *testing.T) int {
	t.Helper()
	n, err := hugetest.Mapped(0)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// AllocHugeTLB takes reserved huge pages, private or as a sealed memfd
// that another mapping shares, and gives them back at Free; it refuses,
// with ErrNoHugeTLB, a size that is not a multiple of HugeTLBSize and more
// pages than the kernel has.
func TestAllocHugeTLB(t *testing.T) {
	if _, err := AllocHugeTLB(HugeTLBSize+pageSize, -1, true); !errors.Is(err, ErrNoHugeTLB) {
		t.Fatalf("a size of 2 MiB and a page: %v, want ErrNoHugeTLB", err)
	}
	if why := hugetest.Need(2); why != "" {
		t.Skip("SKIPPED: " + why)
	}
	total, err := hugetest.Total()
	if err != nil {
		t.Fatal(err)
	}
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprintf("shared=%v", shared), func(t *testing.T) {
			before := mapped(t)
			if over, _ := os.ReadFile("/proc/sys/vm/nr_overcommit_hugepages"); strings.TrimSpace(string(over)) == "0" {
				if _, err := AllocHugeTLB((total+1)*HugeTLBSize, -1, shared); !errors.Is(err, ErrNoHugeTLB) {
					t.Fatalf("%d pages of %d: %v, want ErrNoHugeTLB", total+1, total, err)
				}
				if got := mapped(t); got != before {
					t.Fatalf("a refused allocation maps %d KiB of huge pages", got-before)
				}
			}
			b, err := AllocHugeTLB(2*HugeTLBSize, 0, shared)
			if err != nil {
				t.Fatal(err)
			}
			if len(b) != 2*HugeTLBSize || cap(b) != len(b) {
				t.Fatalf("len %d cap %d", len(b), cap(b))
			}
			if got := mapped(t) - before; got != 2*HugeTLBSize>>10 {
				t.Fatalf("%d KiB of huge pages mapped, want %d", got, 2*HugeTLBSize>>10)
			}
			if kb := pageSizeAt(t, base(b)); kb != HugeTLBSize>>10 {
				t.Fatalf("pages of %d KiB", kb)
			}
			for i := 0; i < len(b); i += pageSize {
				b[i] = byte(i / pageSize)
			}
			f, off, err := File(base(b), uint64(len(b)))
			switch {
			case !shared:
				if !errors.Is(err, ErrNotAllocated) {
					t.Fatalf("File of private memory: %v", err)
				}
			case err != nil:
				t.Fatal(err)
			default:
				fd := int(f.Fd())
				if seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); err != nil || seals&Seals != Seals {
					t.Fatalf("seals %#x (%v), want %#x", seals, err, Seals)
				}
				var st unix.Stat_t
				if err := unix.Fstat(fd, &st); err != nil || off != 0 || st.Size != int64(len(b)) {
					t.Fatalf("file of %d bytes at %d (%v)", st.Size, off, err)
				}
				m, err := unix.Mmap(fd, 0, len(b), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
				if err != nil {
					t.Fatal(err)
				}
				m[HugeTLBSize+7] = 99
				if m[5*pageSize] != 5 || b[HugeTLBSize+7] != 99 {
					t.Fatal("the two mappings do not share pages")
				}
				unix.Munmap(m)
				f.Close()
			}
			if err := Free(b); err != nil {
				t.Fatal(err)
			}
			if got := mapped(t); got != before {
				t.Fatalf("%d KiB of huge pages mapped after Free, want %d", got, before)
			}
		})
	}
}
