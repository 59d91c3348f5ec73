package segtable_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"
	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/segtable"
)

// hang bounds waits that only a bug prolongs; it asserts nothing about speed.
const hang = 30 * time.Second

func TestLocation(t *testing.T) {
	if segtable.CPU(1) != "cpu:1" || segtable.CUDA(12) != "cuda:12" {
		t.Fatalf("CPU(1) = %q, CUDA(12) = %q", segtable.CPU(1), segtable.CUDA(12))
	}
	for _, c := range []struct {
		loc   segtable.Location
		kind  string
		index int
		ok    bool
	}{
		{"", "cpu", -1, true},
		{"cpu", "cpu", -1, true},
		{"cuda", "cuda", -1, true},
		{"cpu:0", "cpu", 0, true},
		{"cpu:17", "cpu", 17, true},
		{"cuda:3", "cuda", 3, true},
		{segtable.CPU(4), "cpu", 4, true},
		{segtable.CUDA(7), "cuda", 7, true},
		{"cpu:", "", 0, false},
		{"cpu:-1", "", 0, false},
		{"cpu:+1", "", 0, false},
		{"cpu:01", "", 0, false},
		{"cpu:1x", "", 0, false},
		{"cpu:1:2", "", 0, false},
		{"cpu: 1", "", 0, false},
		{"cpu:0x1", "", 0, false},
		{"cpu:99999999999999999999999", "", 0, false},
		{"gpu:0", "", 0, false},
		{"CPU:0", "", 0, false},
		{":0", "", 0, false},
		{"cuda0", "", 0, false},
	} {
		kind, index, err := c.loc.Parse()
		if (err == nil) != c.ok || kind != c.kind || index != c.index {
			t.Errorf("Location(%q).Parse() = %q, %d, %v; want %q, %d, ok %v", c.loc, kind, index, err, c.kind, c.index, c.ok)
		}
	}
}

func TestRef(t *testing.T) {
	var r segtable.Ref
	if r.InUse() != 0 || !r.Acquire() || !r.Acquire() || r.InUse() != 2 {
		t.Fatalf("zero Ref: two Acquires, InUse %d", r.InUse())
	}
	r.Release()
	r.Release()
	if r.InUse() != 0 {
		t.Fatalf("after two Releases InUse = %d", r.InUse())
	}
	if err := r.Drain(context.Background()); err != nil {
		t.Fatalf("Drain of an unused Ref = %v", err)
	}
	if r.Acquire() || r.InUse() != 0 {
		t.Fatalf("Acquire after Drain succeeded (InUse %d)", r.InUse())
	}
}

// TestRefDrainFor: DrainFor of an unused Ref returns at once and
// allocates nothing; one with a reference held gives up after its limit
// with ErrBusy and DeadlineExceeded, and the Ref takes references again.
func TestRefDrainFor(t *testing.T) {
	refs := make([]segtable.Ref, 101) // on the heap, as a transport's are
	i := 0
	allocs := testing.AllocsPerRun(100, func() {
		r := &refs[i]
		i++
		if err := r.DrainFor(time.Hour); err != nil {
			t.Fatalf("DrainFor of an unused Ref = %v", err)
		}
		if r.Acquire() {
			t.Fatal("Acquire after DrainFor succeeded")
		}
	})
	if allocs != 0 {
		t.Errorf("DrainFor of an unused Ref: %.0f allocations", allocs)
	}
	var r segtable.Ref
	r.Acquire()
	err := r.DrainFor(time.Millisecond)
	if !errors.Is(err, segtable.ErrBusy) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("DrainFor with a reference held = %v", err)
	}
	if !r.Acquire() || r.InUse() != 2 {
		t.Fatalf("after DrainFor gave up: Acquire refused (InUse %d)", r.InUse())
	}
}

func TestRefDrainWaits(t *testing.T) {
	var r segtable.Ref
	r.Acquire()
	done := make(chan error, 1)
	go func() { done <- r.Drain(context.Background()) }()
	// Drain refuses new references from the start; wait until it has begun.
	waitRefused(t, r.Acquire, r.Release)
	select {
	case err := <-done:
		t.Fatalf("Drain returned %v while a reference is held", err)
	default:
	}
	if r.InUse() != 1 {
		t.Fatalf("InUse = %d while draining, want 1", r.InUse())
	}
	r.Release()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Drain = %v", err)
		}
	case <-time.After(hang):
		t.Fatal("Drain did not return after the last Release")
	}
	if r.Acquire() {
		t.Fatal("Acquire after a finished Drain succeeded")
	}
}

// waitRefused waits until acquire fails, releasing what it takes meanwhile.
func waitRefused(t *testing.T, acquire func() bool, release func()) {
	t.Helper()
	deadline := time.Now().Add(hang)
	for acquire() {
		release()
		if time.Now().After(deadline) {
			t.Fatal("Acquire still succeeds: draining never began")
		}
		runtime.Gosched()
	}
}

func TestRefDrainBusy(t *testing.T) {
	var r segtable.Ref
	r.Acquire()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := r.Drain(ctx); !errors.Is(err, segtable.ErrBusy) {
		t.Fatalf("Drain with a canceled ctx and a held reference = %v, want ErrBusy", err)
	}
	if !r.Acquire() || r.InUse() != 2 {
		t.Fatalf("Acquire after a failed Drain: InUse %d, want 2", r.InUse())
	}
	ctx, cancel = context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if err := r.Drain(ctx); !errors.Is(err, segtable.ErrBusy) {
		t.Fatalf("Drain past its deadline = %v, want ErrBusy", err)
	}
	r.Release()
	r.Release()
	if !r.Acquire() {
		t.Fatal("Acquire after the second failed Drain failed")
	}
	r.Release()
	if err := r.Drain(context.Background()); err != nil {
		t.Fatalf("Drain with no reference held = %v", err)
	}
}

// TestRefTwoDrains: of two Drains, the one that gives up first leaves the
// entry closing for the other, which ends once the reference goes. It
// used to clear the closing bit under the other's wait: references came
// in again and the other Drain, waiting for a count of zero with the bit
// set, never returned.
func TestRefTwoDrains(t *testing.T) {
	var r segtable.Ref
	r.Acquire()
	long := make(chan error, 1)
	go func() { long <- r.Drain(context.Background()) }()
	waitRefused(t, r.Acquire, r.Release)
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if err := r.Drain(ctx); !errors.Is(err, segtable.ErrBusy) {
		t.Fatalf("the short Drain = %v, want ErrBusy", err)
	}
	if r.Acquire() {
		t.Fatal("Acquire succeeded after one of two Drains gave up: the entry is still closing")
	}
	r.Release()
	select {
	case err := <-long:
		if err != nil {
			t.Fatalf("the long Drain = %v", err)
		}
	case <-time.After(hang):
		t.Fatal("hang: the long Drain after the other gave up")
	}
}

func TestRefDrainConcurrent(t *testing.T) {
	// No reference is held once Drain has returned, and none is taken
	// after. Users stop once Acquire fails, as requests of a closing entry
	// do; a failed Acquire may lift the count for an instant, so InUse is
	// checked once they are gone.
	for range 200 {
		var r segtable.Ref
		var drained atomic.Bool
		var bad atomic.Int64
		var wg sync.WaitGroup
		for range 4 {
			wg.Go(func() {
				for r.Acquire() {
					if drained.Load() {
						bad.Add(1)
					}
					runtime.Gosched()
					if drained.Load() {
						bad.Add(1)
					}
					r.Release()
				}
			})
		}
		runtime.Gosched()
		if err := r.Drain(context.Background()); err != nil {
			t.Fatal(err)
		}
		drained.Store(true)
		wg.Wait()
		if bad.Load() != 0 || r.InUse() != 0 || r.Acquire() {
			t.Fatalf("after Drain: %d uses of a reference, InUse %d", bad.Load(), r.InUse())
		}
	}
}

// unregisterAll unregisters what is left in bs when the test ends: a Buffers
// dropped with pinned memory panics in the runtime's leak check.
func unregisterAll(t *testing.T, bs *segtable.Buffers) {
	t.Cleanup(func() {
		for _, b := range bs.All() {
			if _, err := bs.Unregister(context.Background(), b.ID); err != nil {
				t.Errorf("cleanup: %v", err)
			}
		}
	})
}

func TestRegisterRefused(t *testing.T) {
	var bs segtable.Buffers
	unregisterAll(t, &bs)
	if _, err := bs.Register(nil, "", false); !errors.Is(err, segtable.ErrEmpty) {
		t.Errorf("Register(nil) = %v, want ErrEmpty", err)
	}
	if _, err := bs.Register(make([]byte, 0, 8), "", false); !errors.Is(err, segtable.ErrEmpty) {
		t.Errorf("Register(empty slice) = %v, want ErrEmpty", err)
	}
	if _, err := bs.Register(make([]byte, 8), "gpu:0", false); err == nil {
		t.Error("Register with a bad location succeeded")
	}
	if len(bs.All()) != 0 {
		t.Errorf("refused registrations left %d buffers", len(bs.All()))
	}
}

func TestBuffer(t *testing.T) {
	var bs segtable.Buffers
	unregisterAll(t, &bs)
	mem := make([]byte, 64)
	b, err := bs.Register(mem[8:40], segtable.CPU(1), true)
	if err != nil {
		t.Fatal(err)
	}
	if b.ID == 0 || b.Addr != uintptr(unsafe.Pointer(&mem[8])) || b.Length != 32 || b.Location != "cpu:1" || !b.Remote {
		t.Fatalf("Register: %+v", b)
	}
	if got := b.Bytes(); len(got) != 32 || &got[0] != &mem[8] {
		t.Fatalf("Bytes does not alias the registered memory")
	}
	if b.Pointer(5) != unsafe.Pointer(&mem[13]) {
		t.Fatal("Pointer(5) is not the sixth byte")
	}
	b.Bytes()[0] = 0x5a
	if mem[8] != 0x5a {
		t.Fatal("a write through Bytes did not reach the memory")
	}
	for _, c := range []struct {
		off, n uint64
		want   bool
	}{
		{0, 32, true}, {0, 1, true}, {31, 1, true}, {16, 16, true},
		{0, 0, false}, {31, 2, false}, {32, 1, false}, {0, 33, false},
		{1, ^uint64(0), false}, {^uint64(0), 1, false}, {^uint64(0) - 30, 32, false},
	} {
		if got := b.Contains(c.off, c.n); got != c.want {
			t.Errorf("Contains(%d, %d) = %v, want %v", c.off, c.n, got, c.want)
		}
	}
}

func TestRegisterMmap(t *testing.T) {
	// Memory that is not Go's registers, resolves and unregisters too.
	mem, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Skip("mmap:", err)
	}
	defer unix.Munmap(mem)
	var bs segtable.Buffers
	b, err := bs.Register(mem, "", false)
	if err != nil {
		t.Fatal(err)
	}
	if bs.Find(uintptr(unsafe.Pointer(&mem[100])), 10) != b {
		t.Fatal("Find in mmap'd memory failed")
	}
	if _, err := bs.Unregister(context.Background(), b.ID); err != nil {
		t.Fatal(err)
	}
}

func TestUnregisterWaits(t *testing.T) {
	var bs segtable.Buffers
	unregisterAll(t, &bs)
	mem := make([]byte, 128)
	b, err := bs.Register(mem, "", false)
	if err != nil {
		t.Fatal(err)
	}
	addr := uintptr(unsafe.Pointer(&mem[0]))
	if !b.Acquire() {
		t.Fatal("Acquire of a registered buffer failed")
	}

	// A short ctx: ErrBusy, and the buffer stays in every index.
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if got, err := bs.Unregister(ctx, b.ID); !errors.Is(err, segtable.ErrBusy) || got != nil {
		t.Fatalf("Unregister with a reference held and a short ctx = %v, %v; want ErrBusy", got, err)
	}
	if bs.Get(b.ID) != b || bs.Find(addr, 1) != b || len(bs.All()) != 1 {
		t.Fatal("a failed Unregister removed the buffer")
	}
	if !b.Acquire() {
		t.Fatal("Acquire after a failed Unregister failed")
	}
	b.Release()

	// A patient Unregister waits for the reference, then succeeds.
	type result struct {
		b   *segtable.Buffer
		err error
	}
	done := make(chan result, 1)
	go func() {
		b, err := bs.Unregister(context.Background(), b.ID)
		done <- result{b, err}
	}()
	waitRefused(t, b.Acquire, b.Release)
	select {
	case r := <-done:
		t.Fatalf("Unregister returned %v, %v while a reference is held", r.b, r.err)
	default:
	}
	b.Release()
	select {
	case r := <-done:
		if r.err != nil || r.b != b {
			t.Fatalf("Unregister = %v, %v", r.b, r.err)
		}
	case <-time.After(hang):
		t.Fatal("Unregister did not return after the last Release")
	}
	if bs.Get(b.ID) != nil || bs.Find(addr, 1) != nil || len(bs.All()) != 0 {
		t.Fatal("the unregistered buffer is still found")
	}
	if _, err := bs.Unregister(context.Background(), b.ID); !errors.Is(err, segtable.ErrNotFound) {
		t.Fatalf("second Unregister = %v, want ErrNotFound", err)
	}
	// The memory can be registered again, under a new ID.
	b2, err := bs.Register(mem, "", false)
	if err != nil {
		t.Fatal(err)
	}
	if b2.ID == b.ID || bs.Get(b.ID) != nil {
		t.Fatalf("re-registration reused ID %#x or revived it", b.ID)
	}
	if _, err := bs.Unregister(context.Background(), b2.ID); err != nil {
		t.Fatal(err)
	}
}

func TestUnregisterBusy(t *testing.T) {
	// Users that take no references answer Busy; Unregister waits for them.
	var busy atomic.Bool
	var asked atomic.Int64
	bs := segtable.Buffers{Busy: func(*segtable.Buffer) bool {
		asked.Add(1)
		return busy.Load()
	}}
	unregisterAll(t, &bs)
	mem := make([]byte, 64)
	b, err := bs.Register(mem, "", false)
	if err != nil {
		t.Fatal(err)
	}
	busy.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if _, err := bs.Unregister(ctx, b.ID); !errors.Is(err, segtable.ErrBusy) {
		t.Fatalf("Unregister while Busy = %v, want ErrBusy", err)
	}
	if asked.Load() == 0 || b.Closing() || bs.Get(b.ID) != b {
		t.Fatalf("after a failed Unregister: Busy asked %d times, Closing %v", asked.Load(), b.Closing())
	}
	done := make(chan error, 1)
	go func() {
		_, err := bs.Unregister(context.Background(), b.ID)
		done <- err
	}()
	deadline := time.Now().Add(hang)
	for !b.Closing() {
		if time.Now().After(deadline) {
			t.Fatal("Unregister never marked the buffer closing")
		}
		runtime.Gosched()
	}
	select {
	case err := <-done:
		t.Fatalf("Unregister returned %v while Busy", err)
	default:
	}
	busy.Store(false)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(hang):
		t.Fatal("Unregister did not return once Busy said false")
	}
	if bs.Get(b.ID) != nil {
		t.Fatal("buffer still registered")
	}
}

func TestStaleIDAfterManyReuses(t *testing.T) {
	// One slot registered and unregistered over and over: an ID that named
	// an earlier buffer must never name a later one, however often the slot
	// is reused.
	var bs segtable.Buffers
	unregisterAll(t, &bs)
	mem := make([]byte, 16)
	seen := map[segtable.BufferID]bool{}
	first, err := bs.Register(mem, "", false)
	if err != nil {
		t.Fatal(err)
	}
	old := first.ID
	seen[old] = true
	if _, err := bs.Unregister(context.Background(), old); err != nil {
		t.Fatal(err)
	}
	for i := range 5000 {
		b, err := bs.Register(mem, "", false)
		if err != nil {
			t.Fatalf("registration %d: %v", i, err)
		}
		if seen[b.ID] {
			t.Fatalf("registration %d reused ID %#x", i, b.ID)
		}
		seen[b.ID] = true
		if got := bs.Get(old); got != nil {
			t.Fatalf("registration %d: the first buffer's ID %#x names buffer %#x", i, old, got.ID)
		}
		if _, err := bs.Unregister(context.Background(), b.ID); err != nil {
			t.Fatal(err)
		}
	}
}

// bufOp is one step of the model test of Buffers.
type bufOp struct {
	Kind int
	A, B uint32
}

const (
	bufRegister = iota
	bufRegisterBadLoc
	bufUnregisterLive
	bufUnregisterStale
	bufUnregisterRandom
	bufGet
	bufFind
	bufKinds
)

func (o bufOp) String() string {
	names := [...]string{"Register", "RegisterBadLoc", "UnregisterLive", "UnregisterStale", "UnregisterRandom", "Get", "Find"}
	return fmt.Sprintf("%s(%d,%d)", names[o.Kind], o.A, o.B)
}

// modelBuf is a registered buffer as the model knows it: a range of the arena.
type modelBuf struct {
	id     segtable.BufferID
	off, n int
	loc    segtable.Location
	remote bool
}

const arenaSize = 1024

// runBufOps applies ops to a Buffers over one arena and to a list, and
// returns the first difference, or "".
func runBufOps(ops []bufOp) (msg string) {
	var bs segtable.Buffers
	arena := make([]byte, arenaSize)
	base := uintptr(unsafe.Pointer(&arena[0]))
	var live []modelBuf
	var dead []segtable.BufferID
	issued := map[segtable.BufferID]bool{}
	defer func() {
		// Unpin everything: a Buffers dropped with pinned memory panics in
		// the runtime's leak check.
		for _, m := range live {
			if _, err := bs.Unregister(context.Background(), m.id); err != nil && msg == "" {
				msg = fmt.Sprintf("final Unregister(%#x): %v", m.id, err)
			}
		}
	}()
	locs := []segtable.Location{"", "cpu:0", "cuda:1"}
	overlaps := func(off, n int) bool {
		for _, m := range live {
			if off < m.off+m.n && m.off < off+n {
				return true
			}
		}
		return false
	}
	findLive := func(id segtable.BufferID) int {
		return slices.IndexFunc(live, func(m modelBuf) bool { return m.id == id })
	}
	checkBuf := func(b *segtable.Buffer, m modelBuf) string {
		if b == nil {
			return fmt.Sprintf("buffer %#x [%d,+%d) not found", m.id, m.off, m.n)
		}
		if b.ID != m.id || b.Addr != base+uintptr(m.off) || b.Length != uint64(m.n) || b.Location != m.loc || b.Remote != m.remote {
			return fmt.Sprintf("buffer %+v, want %+v at arena offset %d", b, m, m.off)
		}
		return ""
	}
	for i, o := range ops {
		fail := func(format string, args ...any) string {
			return fmt.Sprintf("step %d %v: %s", i, o, fmt.Sprintf(format, args...))
		}
		switch o.Kind {
		case bufRegister:
			off := int(o.A % (arenaSize + 1))
			n := min(int(o.B%160), arenaSize-off)
			if o.B%11 == 0 {
				n = 0
			}
			m := modelBuf{off: off, n: n, loc: locs[o.A%3], remote: o.B%2 == 1}
			b, err := bs.Register(arena[off:off+n], m.loc, m.remote)
			switch {
			case n == 0:
				if !errors.Is(err, segtable.ErrEmpty) || b != nil {
					return fail("Register of 0 bytes = %v, %v; want ErrEmpty", b, err)
				}
			case overlaps(off, n):
				if !errors.Is(err, segtable.ErrOverlap) || b != nil {
					return fail("overlapping Register [%d,+%d) = %v, %v; want ErrOverlap", off, n, b, err)
				}
			default:
				if err != nil {
					return fail("Register [%d,+%d) = %v", off, n, err)
				}
				if b.ID == 0 || issued[b.ID] {
					return fail("Register issued ID %#x again", b.ID)
				}
				issued[b.ID] = true
				m.id = b.ID
				if msg := checkBuf(b, m); msg != "" {
					return fail("%s", msg)
				}
				live = append(live, m)
			}
		case bufRegisterBadLoc:
			off := int(o.A % arenaSize)
			if b, err := bs.Register(arena[off:off+1], "nvme:0", false); err == nil || b != nil {
				return fail("Register with a bad location = %v, %v", b, err)
			}
		case bufUnregisterLive, bufUnregisterStale, bufUnregisterRandom:
			var id segtable.BufferID
			switch {
			case o.Kind == bufUnregisterLive && len(live) > 0:
				id = live[int(o.A)%len(live)].id
			case o.Kind == bufUnregisterStale && len(dead) > 0:
				id = dead[int(o.A)%len(dead)]
			default:
				id = segtable.BufferID(o.A)
			}
			b, err := bs.Unregister(context.Background(), id)
			if j := findLive(id); j >= 0 {
				if err != nil {
					return fail("Unregister(%#x) of a live buffer = %v", id, err)
				}
				if msg := checkBuf(b, live[j]); msg != "" {
					return fail("Unregister returned: %s", msg)
				}
				live = slices.Delete(live, j, j+1)
				dead = append(dead, id)
			} else if !errors.Is(err, segtable.ErrNotFound) || b != nil {
				return fail("Unregister(%#x) of no live buffer = %v, %v; want ErrNotFound", id, b, err)
			}
		case bufGet:
			ids := []segtable.BufferID{segtable.BufferID(o.A), segtable.BufferID(o.B), 0}
			if len(live) > 0 {
				ids = append(ids, live[int(o.A)%len(live)].id)
			}
			for _, id := range ids {
				b := bs.Get(id)
				if j := findLive(id); j >= 0 {
					if msg := checkBuf(b, live[j]); msg != "" {
						return fail("Get(%#x): %s", id, msg)
					}
				} else if b != nil {
					return fail("Get(%#x) = buffer %#x, want nil", id, b.ID)
				}
			}
		case bufFind:
			// Addresses from just below to just past the arena, lengths
			// from 0 to past any buffer, and a few that overflow.
			rel := int(o.A%(arenaSize+64)) - 32
			n := uint64(o.B % 200)
			switch o.B % 17 {
			case 0:
				n = ^uint64(0)
			case 1:
				n = ^uint64(0) - uint64(rel) + 1
			}
			addr := base + uintptr(rel)
			want := -1
			for j, m := range live {
				if n > 0 && rel >= m.off && rel < m.off+m.n && n <= uint64(m.off+m.n-rel) {
					want = j
				}
			}
			b := bs.Find(addr, n)
			if want < 0 {
				if b != nil {
					return fail("Find(arena%+d, %d) = buffer %#x, want nil", rel, n, b.ID)
				}
			} else if msg := checkBuf(b, live[want]); msg != "" {
				return fail("Find(arena%+d, %d): %s", rel, n, msg)
			}
		}
		// Invariants after every step: All is the live set sorted by
		// address, every live ID resolves, no dead one does.
		all := bs.All()
		if len(all) != len(live) {
			return fail("All holds %d buffers, want %d", len(all), len(live))
		}
		for j, b := range all {
			if j > 0 && all[j-1].Addr+uintptr(all[j-1].Length) > b.Addr {
				return fail("All is not sorted and disjoint at %d", j)
			}
			k := findLive(b.ID)
			if k < 0 {
				return fail("All holds buffer %#x, which the model does not", b.ID)
			}
			if msg := checkBuf(bs.Get(b.ID), live[k]); msg != "" {
				return fail("Get(%#x): %s", b.ID, msg)
			}
		}
		for _, id := range dead {
			if bs.Get(id) != nil && findLive(id) < 0 {
				return fail("stale ID %#x resolves", id)
			}
		}
	}
	return ""
}

func TestBuffersModel(t *testing.T) {
	props := properties(t, 300)
	props.Property("Buffers matches a list", prop.ForAll(runBufOps,
		gen.SliceOf(gen.Struct(reflect.TypeOf(bufOp{}), map[string]gopter.Gen{
			"Kind": gen.Weighted([]gen.WeightedGen{
				{Weight: 6, Gen: gen.Const(bufRegister)},
				{Weight: 1, Gen: gen.Const(bufRegisterBadLoc)},
				{Weight: 3, Gen: gen.Const(bufUnregisterLive)},
				{Weight: 1, Gen: gen.Const(bufUnregisterStale)},
				{Weight: 1, Gen: gen.Const(bufUnregisterRandom)},
				{Weight: 2, Gen: gen.Const(bufGet)},
				{Weight: 4, Gen: gen.Const(bufFind)},
			}),
			"A": gen.UInt32(),
			"B": gen.UInt32(),
		}))))
	props.TestingRun(t)
}

func TestRegisterAlloc(t *testing.T) {
	// Memory of mem.Alloc, which Register leaves unpinned (it is not
	// Go's), registers, resolves and unregisters, at its start and
	// inside it, and the same memory registers again.
	buf, err := mem.Alloc(1<<16, -1)
	if err != nil {
		t.Skip("mem.Alloc:", err)
	}
	defer mem.Free(buf)
	var bs segtable.Buffers
	for range 2 {
		a, err := bs.Register(buf[:4096], "", false)
		if err != nil {
			t.Fatal(err)
		}
		b, err := bs.Register(buf[8192:12288], "cpu:0", true)
		if err != nil {
			t.Fatal(err)
		}
		if bs.Find(uintptr(unsafe.Pointer(&buf[100])), 10) != a || bs.Find(uintptr(unsafe.Pointer(&buf[9000])), 10) != b || bs.Get(b.ID) != b {
			t.Fatal("lookups in Alloc's memory failed")
		}
		for _, x := range []*segtable.Buffer{a, b} {
			if _, err := bs.Unregister(context.Background(), x.ID); err != nil {
				t.Fatal(err)
			}
		}
		if bs.Len() != 0 {
			t.Fatalf("%d buffers left", bs.Len())
		}
	}
}

func TestBuffersConcurrent(t *testing.T) {
	// Lock-free lookups while buffers come and go: what Find returns holds
	// the range asked for, and what Get returns carries the ID asked for.
	var bs segtable.Buffers
	unregisterAll(t, &bs)
	arena := make([]byte, 4096)
	base := uintptr(unsafe.Pointer(&arena[0]))
	var stop atomic.Bool
	var wg sync.WaitGroup
	var mu sync.Mutex
	var ids []segtable.BufferID
	var bad atomic.Value
	for g := range 2 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 9))
			for !stop.Load() {
				addr, n := base+uintptr(r.IntN(4096)), uint64(1+r.IntN(64))
				if b := bs.Find(addr, n); b != nil && (addr < b.Addr || uint64(addr-b.Addr)+n > b.Length) {
					bad.Store(fmt.Sprintf("Find(%#x, %d) = [%#x, +%d)", addr, n, b.Addr, b.Length))
				}
				mu.Lock()
				var id segtable.BufferID
				if len(ids) > 0 {
					id = ids[r.IntN(len(ids))]
				}
				mu.Unlock()
				if b := bs.Get(id); b != nil && b.ID != id {
					bad.Store(fmt.Sprintf("Get(%#x) = buffer %#x", id, b.ID))
				}
			}
		})
	}
	r := rand.New(rand.NewPCG(1, 2))
	var live []segtable.BufferID
	for range 3000 {
		if len(live) > 0 && r.IntN(2) == 0 {
			j := r.IntN(len(live))
			if _, err := bs.Unregister(context.Background(), live[j]); err != nil {
				t.Error(err)
			}
			live = slices.Delete(live, j, j+1)
			continue
		}
		off := r.IntN(4000)
		if b, err := bs.Register(arena[off:off+1+r.IntN(96)], "", false); err == nil {
			live = append(live, b.ID)
			mu.Lock()
			ids = append(ids, b.ID)
			mu.Unlock()
		}
	}
	stop.Store(true)
	wg.Wait()
	for _, id := range live {
		if _, err := bs.Unregister(context.Background(), id); err != nil {
			t.Error(err)
		}
	}
	if msg := bad.Load(); msg != nil {
		t.Fatal(msg)
	}
}

// TestBuffersMany registers more buffers than a chunk of the ID table or
// of the address index holds, in random order, unregisters a random half
// one by one and the rest with UnregisterAll, checking Get, Find,
// Overlapping, Len and All against the model all along.
func TestBuffersMany(t *testing.T) {
	const n, size = 3000, 64
	mem := make([]byte, n*2*size) // buffer i at [2i*size, 2i*size+size): gaps between
	var bs segtable.Buffers
	live := map[int]*segtable.Buffer{}
	rng := rand.New(rand.NewPCG(19, 2))
	check := func(step string) {
		t.Helper()
		if bs.Len() != len(live) || len(bs.All()) != len(live) {
			t.Fatalf("%s: Len %d, All %d, want %d", step, bs.Len(), len(bs.All()), len(live))
		}
		all := bs.All()
		for i := 1; i < len(all); i++ {
			if all[i-1].Addr >= all[i].Addr {
				t.Fatalf("%s: All out of order at %d", step, i)
			}
		}
		for range 300 {
			i := rng.IntN(n)
			b := live[i]
			at := mem[2*i*size:]
			addr := uintptr(unsafe.Pointer(&at[0]))
			if got := bs.Find(addr+3, 8); got != b {
				t.Fatalf("%s: Find in buffer %d = %v, want %v", step, i, got, b)
			}
			if got := bs.Find(addr+size, 1); got != nil {
				t.Fatalf("%s: Find in the gap after %d = %v", step, i, got)
			}
			if got := bs.Overlapping(addr-5, 10); got != b {
				t.Fatalf("%s: Overlapping the start of %d = %v, want %v", step, i, got, b)
			}
			if got := bs.Overlapping(addr+size, size); got != nil {
				t.Fatalf("%s: Overlapping the gap after %d = %v", step, i, got)
			}
			if b != nil && bs.Get(b.ID) != b {
				t.Fatalf("%s: Get(%#x) != buffer %d", step, b.ID, i)
			}
		}
	}
	var ids []segtable.BufferID
	for _, i := range rng.Perm(n) {
		b, err := bs.Register(mem[2*i*size:2*i*size+size], "", true)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := bs.Register(mem[2*i*size+size/2:2*i*size+size+1], "", true); !errors.Is(err, segtable.ErrOverlap) {
			t.Fatalf("overlapping the end of buffer %d: %v", i, err)
		}
		live[i] = b
		ids = append(ids, b.ID)
	}
	check("registered")
	for _, i := range rng.Perm(n)[:n/2] {
		if _, err := bs.Unregister(context.Background(), live[i].ID); err != nil {
			t.Fatal(err)
		}
		delete(live, i)
	}
	check("half unregistered")
	gone, err := bs.UnregisterAll(context.Background())
	if err != nil || len(gone) != n-n/2 {
		t.Fatalf("UnregisterAll: %d buffers, %v", len(gone), err)
	}
	clear(live)
	check("all unregistered")
	for _, id := range ids {
		if bs.Get(id) != nil {
			t.Fatalf("Get(%#x) after UnregisterAll", id)
		}
	}
	b, err := bs.Register(mem[:size], "", true)
	if err != nil || slices.Contains(ids, b.ID) {
		t.Fatalf("registered again: %v, ID reused %v", err, b != nil && slices.Contains(ids, b.ID))
	}
	if _, err := bs.Unregister(context.Background(), b.ID); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkBuffersRegister registers n buffers one by one into an empty
// table, then unregisters them one by one: the table's own share of
// registration and of an engine's Close.
func BenchmarkBuffersRegister(b *testing.B) {
	for _, n := range []int{1000, 10000, 100000} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			mem := make([]byte, n*64)
			ids := make([]segtable.BufferID, n)
			for b.Loop() {
				var bs segtable.Buffers
				for i := range n {
					x, err := bs.Register(mem[i*64:(i+1)*64], "", true)
					if err != nil {
						b.Fatal(err)
					}
					ids[i] = x.ID
				}
				for _, id := range ids {
					if _, err := bs.Unregister(context.Background(), id); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/buffer")
		})
	}
}
