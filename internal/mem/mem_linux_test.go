package mem

import (
	"bufio"
	"errors"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func TestAllocFree(t *testing.T) {
	for _, size := range []int{1, pageSize - 1, pageSize, pageSize + 1, 3*pageSize + 17, hugePageSize, hugePageSize + 1} {
		for _, node := range []int{-1, 0} {
			b, err := Alloc(size, node)
			if err != nil {
				t.Fatalf("Alloc(%d, %d): %v", size, node, err)
			}
			want, _ := roundUp(size)
			if len(b) != size || cap(b) != want || cap(b)%pageSize != 0 {
				t.Fatalf("Alloc(%d) len %d cap %d, want len %d cap %d", size, len(b), cap(b), size, want)
			}
			if base(b)%uintptr(pageSize) != 0 {
				t.Fatalf("Alloc(%d) at %#x, not page aligned", size, base(b))
			}
			vec := make([]byte, cap(b)/pageSize)
			if _, _, errno := unix.Syscall(unix.SYS_MINCORE, base(b), uintptr(cap(b)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
				t.Fatal(errno)
			}
			for i, v := range vec {
				if v&1 == 0 {
					t.Fatalf("Alloc(%d): page %d not resident: not populated", size, i)
				}
			}
			full := b[:cap(b)]
			for i := 0; i < len(full); i += pageSize {
				if full[i] != 0 {
					t.Fatalf("fresh memory not zero at %d", i)
				}
				full[i] = byte(i / pageSize)
			}
			full[len(full)-1] = 0xAB
			for i := 0; i < len(full)-1; i += pageSize {
				if full[i] != byte(i/pageSize) {
					t.Fatalf("page %d lost its write", i/pageSize)
				}
			}
			last := base(b) + uintptr(cap(b)) - 1
			if !IsAllocated(base(b)) || !IsAllocated(last) || IsAllocated(last+1) {
				t.Fatalf("IsAllocated wrong at the edges of [%#x, %#x]", base(b), last)
			}
			if err := Free(b); err != nil {
				t.Fatalf("Free: %v", err)
			}
			if IsAllocated(base(b)) {
				t.Fatalf("IsAllocated after Free")
			}
		}
	}
}

func TestAllocBadSize(t *testing.T) {
	for _, size := range []int{0, -1, int(^uint(0) >> 1)} {
		if b, err := Alloc(size, -1); !errors.Is(err, ErrBadSize) {
			t.Errorf("Alloc(%d) = len %d, %v; want ErrBadSize", size, len(b), err)
		}
		if b, _, err := AllocGuarded(size); !errors.Is(err, ErrBadSize) {
			t.Errorf("AllocGuarded(%d) = len %d, %v; want ErrBadSize", size, len(b), err)
		}
	}
}

func TestFreeRefusesForeignSlices(t *testing.T) {
	b, err := Alloc(2*pageSize, -1)
	if err != nil {
		t.Fatal(err)
	}
	foreign := make([]byte, 2*pageSize)
	guarded, freeGuarded, err := AllocGuarded(pageSize)
	if err != nil {
		t.Fatal(err)
	}
	defer freeGuarded()
	for name, s := range map[string][]byte{
		"nil":           nil,
		"heap":          foreign,
		"guarded":       guarded,
		"interior":      b[pageSize:],
		"interior byte": b[1:],
		"short cap":     b[:pageSize:pageSize],
	} {
		if err := Free(s); !errors.Is(err, ErrNotAllocated) {
			t.Errorf("Free(%s) = %v, want ErrNotAllocated", name, err)
		}
	}
	// Nothing was unmapped: the buffer is still whole.
	b[0], b[len(b)-1] = 1, 2
	guarded[0] = 3
	// A length change is fine: Free needs the start and the capacity.
	if err := Free(b[:0]); err != nil {
		t.Fatalf("Free of the real buffer: %v", err)
	}
	if err := Free(b); !errors.Is(err, ErrNotAllocated) {
		t.Fatalf("double Free = %v, want ErrNotAllocated", err)
	}
}

func TestAllocGuarded(t *testing.T) {
	for _, size := range []int{1, 7, pageSize - 1, pageSize, pageSize + 1, 5*pageSize - 3} {
		buf, free, err := AllocGuarded(size)
		if err != nil {
			t.Fatalf("AllocGuarded(%d): %v", size, err)
		}
		if len(buf) != size || cap(buf) != size {
			t.Fatalf("AllocGuarded(%d) len %d cap %d", size, len(buf), cap(buf))
		}
		end := base(buf) + uintptr(size)
		if end%uintptr(pageSize) != 0 {
			t.Fatalf("AllocGuarded(%d) ends at %#x, not at a page boundary", size, end)
		}
		if IsAllocated(base(buf)) {
			t.Fatalf("guarded buffer counted by IsAllocated")
		}
		for i := range buf {
			buf[i] = byte(i)
		}
		for i := range buf {
			if buf[i] != byte(i) {
				t.Fatalf("byte %d lost its write", i)
			}
		}
		// Both neighbouring pages are mapped with no access: an overrun or
		// underrun faults instead of reaching another mapping.
		lower := (base(buf) &^ uintptr(pageSize-1)) - uintptr(pageSize)
		for name, addr := range map[string]uintptr{"upper": end, "upper last": end + uintptr(pageSize) - 1, "lower": lower} {
			if prot := protOf(t, addr); prot != "---p" {
				t.Fatalf("%s guard page at %#x has protection %q, want ---p", name, addr, prot)
			}
		}
		for _, addr := range []uintptr{base(buf), end - 1} {
			if prot := protOf(t, addr); prot != "rw-p" {
				t.Fatalf("buffer byte at %#x has protection %q, want rw-p", addr, prot)
			}
		}
		if err := free(); err != nil {
			t.Fatalf("free: %v", err)
		}
		if err := free(); !errors.Is(err, ErrNotAllocated) {
			t.Fatalf("second free = %v, want ErrNotAllocated", err)
		}
	}
}

func TestBind(t *testing.T) {
	b, err := Alloc(4*pageSize, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer Free(b)
	// Node 0 exists on every Linux machine.
	if err := bind(b[:cap(b)], 0); err != nil {
		t.Fatalf("bind to node 0: %v", err)
	}
	b[0] = 1
	if err := bind(b[:cap(b)], -1); !errors.Is(err, unix.EINVAL) {
		t.Fatalf("bind to node -1 = %v, want EINVAL", err)
	}
	// A node that does not exist is refused (unless mbind itself is
	// forbidden here, which bind reports as success).
	if err := bind(b[:cap(b)], maxNode-1); err == nil {
		_, _, errno := unix.Syscall6(unix.SYS_MBIND, 0, 0, 0, 0, 0, 0)
		if errno != unix.ENOSYS && errno != unix.EPERM {
			t.Fatalf("bind to node %d succeeded", maxNode-1)
		}
	}
	if numNodes() < 1 {
		t.Fatalf("numNodes = %d", numNodes())
	}
}

func TestConcurrentAllocFree(t *testing.T) {
	done := make(chan error)
	for g := range 4 {
		go func() {
			var err error
			for i := range 50 {
				var b []byte
				if b, err = Alloc((g+1)*pageSize+i, -1); err != nil {
					break
				}
				b[len(b)-1] = byte(i)
				if err = Free(b); err != nil {
					break
				}
			}
			done <- err
		}()
	}
	for range 4 {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	runtime.GC()
}

// protOf returns the permissions ("rw-p", "---p") that /proc/self/maps lists
// for the mapping holding addr, "" when none does.
func protOf(t *testing.T, addr uintptr) string {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		lo, hi, ok := strings.Cut(fields[0], "-")
		if !ok || len(fields) < 2 {
			continue
		}
		l, err1 := strconv.ParseUint(lo, 16, 64)
		h, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 == nil && err2 == nil && uint64(addr) >= l && uint64(addr) < h {
			return fields[1]
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return ""
}

// TestAllocShared maps the memfd behind shared memory a second time and
// sees the writes of both mappings in each other, and proves the seals: the
// file can be neither shrunk nor grown, so no peer mapping can fault.
func TestAllocShared(t *testing.T) {
	b, err := AllocShared(3*pageSize+5, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !IsAllocated(base(b)) {
		t.Fatal("shared allocation not live")
	}
	f, off, err := File(base(b)+uintptr(pageSize)+3, 100)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if off != int64(pageSize)+3 {
		t.Fatalf("offset %d, want %d", off, pageSize+3)
	}
	if _, _, err := File(base(b)+uintptr(cap(b))-10, 11); !errors.Is(err, ErrNotAllocated) {
		t.Fatalf("File past the end: %v, want ErrNotAllocated", err)
	}
	fd := int(f.Fd())
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&Seals != Seals {
		t.Fatalf("seals %#x (%v), want %#x", seals, err, Seals)
	}
	if err := unix.Ftruncate(fd, int64(pageSize)); !errors.Is(err, unix.EPERM) {
		t.Fatalf("shrinking a sealed memfd: %v, want EPERM", err)
	}
	if err := unix.Ftruncate(fd, int64(16*pageSize)); !errors.Is(err, unix.EPERM) {
		t.Fatalf("growing a sealed memfd: %v, want EPERM", err)
	}
	m, err := unix.Mmap(fd, 0, cap(b), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	b[7] = 42
	m[pageSize+1] = 43
	if m[7] != 42 || b[pageSize+1] != 43 {
		t.Fatal("the two mappings do not share pages")
	}
	if err := Free(b); err != nil {
		t.Fatal(err)
	}
	if _, _, err := File(base(b), 1); !errors.Is(err, ErrNotAllocated) {
		t.Fatalf("File after Free: %v", err)
	}
	// The second mapping keeps the pages alive after Free.
	if m[7] != 42 {
		t.Fatal("pages lost after Free")
	}
	unix.Munmap(m)
	if _, _, err := File(0x1000, 1); !errors.Is(err, ErrNotAllocated) {
		t.Fatalf("File of private memory: %v", err)
	}
}
