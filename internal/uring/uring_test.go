//go:build linux

package uring

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/leakcheck"
)

// needUring skips the test loudly when io_uring is not usable here, or
// fails it under MOONRING_CI=1: a CI runner whose seccomp profile or sysctl
// blocks io_uring would otherwise never test the binding (nor tcp's
// io_uring sender) and stay green.
func needUring(t testing.TB) {
	t.Helper()
	if err := Available(); err != nil {
		if os.Getenv("MOONRING_CI") == "1" {
			t.Fatalf("io_uring not usable under MOONRING_CI=1 (allow io_uring_setup in the runner: seccomp profile, kernel.io_uring_disabled): %v", err)
		}
		t.Skipf("SKIP io_uring: not usable on this kernel or in this sandbox, nothing of the binding was tested: %v", err)
	}
}

// newRing returns a ring closed at the end of the test, or skips the test
// loudly when io_uring is not usable here (fails it in CI: needUring).
func newRing(t testing.TB, entries uint32) *Ring {
	t.Helper()
	needUring(t)
	r, err := New(entries)
	if err != nil {
		t.Fatalf("New(%d): %v", entries, err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return r
}

// socketpair returns a connected AF_UNIX stream pair closed at the end of
// the test (unless the test closes an end itself, setting it to -1).
func socketpair(t *testing.T) *[2]int {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("socketpair: %v", err)
	}
	p := &fds
	t.Cleanup(func() {
		for _, fd := range p {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	})
	return p
}

// iovecs builds an iovec array over bufs.
func iovecs(bufs ...[]byte) []unix.Iovec {
	iov := make([]unix.Iovec, len(bufs))
	for i, b := range bufs {
		iov[i].Base = &b[0]
		iov[i].SetLen(len(b))
	}
	return iov
}

// pin pins the iovec array and its buffers (the caller's duty, see the
// package documentation) until the test ends.
func pin(t *testing.T, iov []unix.Iovec, bufs ...[]byte) {
	var p runtime.Pinner
	if len(iov) > 0 {
		p.Pin(&iov[0])
	}
	for _, b := range bufs {
		p.Pin(&b[0])
	}
	t.Cleanup(p.Unpin)
}

// mustSQE returns the next SQE or fails the test.
func mustSQE(t testing.TB, r *Ring) *SQE {
	t.Helper()
	s := r.SQE()
	if s == nil {
		t.Fatal("SQE() = nil on a ring with room")
	}
	return s
}

// reapAll consumes every waiting completion into a map user data -> res.
func reapAll(t *testing.T, r *Ring, got map[uint64]int32) int {
	t.Helper()
	n := 0
	for {
		ud, res, ok := r.PeekCQE()
		if !ok {
			return n
		}
		if _, dup := got[ud]; dup {
			t.Fatalf("user data %d completed twice", ud)
		}
		got[ud] = res
		r.CQEAdvance(1)
		n++
	}
}

var featureNames = []string{
	"SINGLE_MMAP", "NODROP", "SUBMIT_STABLE", "RW_CUR_POS", "CUR_PERSONALITY",
	"FAST_POLL", "POLL_32BITS", "SQPOLL_NONFIXED", "EXT_ARG", "NATIVE_WORKERS",
	"RSRC_TAGS", "CQE_SKIP", "LINKED_FILE", "REG_REG_RING", "RECVSEND_BUNDLE",
	"MIN_TIMEOUT", "RW_ATTR", "NO_IOWAIT",
}

// TestKernel logs what this kernel offers, for the record.
func TestKernel(t *testing.T) {
	r := newRing(t, 8)
	var names []string
	for i := range 32 {
		if r.features&(1<<i) == 0 {
			continue
		}
		if i < len(featureNames) {
			names = append(names, featureNames[i])
		} else {
			names = append(names, fmt.Sprintf("bit%d", i))
		}
	}
	var u unix.Utsname
	unix.Uname(&u)
	t.Logf("kernel %s: features %#x = %s; New(8): %d SQ entries, %d CQ entries, single mmap %v",
		unix.ByteSliceToString(u.Release[:]), r.features, strings.Join(names, "|"),
		r.sqEntries, len(r.cqes), &r.sqRing[0] == &r.cqRing[0])
	if len(r.cqes) != 2*int(r.sqEntries) {
		t.Errorf("CQ entries %d, want twice the SQ's %d", len(r.cqes), r.sqEntries)
	}
}

func TestNop(t *testing.T) {
	for _, batch := range []int{1, 32} {
		t.Run(fmt.Sprintf("batch=%d", batch), func(t *testing.T) {
			r := newRing(t, 32)
			got := map[uint64]int32{}
			const rounds = 50
			for round := range rounds {
				for i := range batch {
					PrepNop(mustSQE(t, r), uint64(round*batch+i)+1000)
				}
				n, err := r.SubmitAndWait(uint32(batch))
				if err != nil || n != batch {
					t.Fatalf("round %d: SubmitAndWait(%d) = %d, %v", round, batch, n, err)
				}
				if k := reapAll(t, r, got); k != batch {
					t.Fatalf("round %d: reaped %d CQEs, want %d", round, k, batch)
				}
			}
			for ud := uint64(1000); ud < 1000+rounds*uint64(batch); ud++ {
				res, ok := got[ud]
				if !ok || res != 0 {
					t.Fatalf("user data %d: res %d, seen %v", ud, res, ok)
				}
			}
			if len(got) != rounds*batch {
				t.Fatalf("%d completions, want %d", len(got), rounds*batch)
			}
		})
	}
}

// TestWrapAround drives a small ring (8 SQ, 16 CQ entries) through thousands
// of NOPs in random batches against a model: the set of operations in flight
// and the two limits that make SQE return nil.
func TestWrapAround(t *testing.T) {
	r := newRing(t, 8)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	const sqN, cqN = 8, 16
	inFlight := map[uint64]bool{} // prepared and not yet reaped
	unsubmitted := 0
	next := uint64(0)
	reaped := 0
	for reaped < 20000 {
		for range rng.IntN(12) {
			s := r.SQE()
			wantNil := unsubmitted == sqN || len(inFlight) == cqN
			if (s == nil) != wantNil {
				t.Fatalf("op %d: SQE() nil = %v, model: %d unsubmitted, %d in flight", next, s == nil, unsubmitted, len(inFlight))
			}
			if s == nil {
				break
			}
			PrepNop(s, next)
			inFlight[next] = true
			next++
			unsubmitted++
		}
		submitted := len(inFlight)
		var n int
		var err error
		if w := uint32(rng.IntN(submitted + 1)); rng.IntN(2) == 0 {
			n, err = r.SubmitAndWait(w)
		} else {
			n, err = r.Submit()
		}
		if err != nil || n != unsubmitted {
			t.Fatalf("submit: %d, %v; want %d", n, err, unsubmitted)
		}
		unsubmitted = 0
		for range rng.IntN(len(inFlight) + 1) {
			ud, res, err := r.WaitCQE()
			if err != nil {
				t.Fatalf("WaitCQE: %v", err)
			}
			if !inFlight[ud] || res != 0 {
				t.Fatalf("completion %d (res %d) not in flight", ud, res)
			}
			delete(inFlight, ud)
			r.CQEAdvance(1)
			reaped++
		}
	}
	for len(inFlight) > 0 {
		ud, _, err := r.WaitCQE()
		if err != nil || !inFlight[ud] {
			t.Fatalf("drain: %d, %v", ud, err)
		}
		delete(inFlight, ud)
		r.CQEAdvance(1)
	}
	if _, _, err := r.WaitCQE(); !errors.Is(err, ErrNothingInFlight) {
		t.Fatalf("WaitCQE on an idle ring: %v, want ErrNothingInFlight", err)
	}
	t.Logf("%d ops through 8 SQ / 16 CQ slots: SQ index wrapped %d times", next, next/sqN)
}

func TestSocketpairVectored(t *testing.T) {
	r := newRing(t, 8)
	fds := socketpair(t)

	parts := [][]byte{[]byte("hello, "), []byte("io_uring "), []byte("world")}
	want := "hello, io_uring world"
	wiov := iovecs(parts...)
	pin(t, wiov, parts...)
	PrepWritev(mustSQE(t, r), fds[0], wiov, 0, 1)
	if n, err := r.SubmitAndWait(1); n != 1 || err != nil {
		t.Fatalf("SubmitAndWait: %d, %v", n, err)
	}
	ud, res, ok := r.PeekCQE()
	if !ok || ud != 1 || res != int32(len(want)) {
		t.Fatalf("writev CQE: ud %d res %d ok %v, want 1 %d", ud, res, ok, len(want))
	}
	r.CQEAdvance(1)

	a, b := make([]byte, 10), make([]byte, 11)
	riov := iovecs(a, b)
	pin(t, riov, a, b)
	PrepReadv(mustSQE(t, r), fds[1], riov, 0, 2)
	if _, err := r.SubmitAndWait(1); err != nil {
		t.Fatal(err)
	}
	ud, res, _ = r.PeekCQE()
	r.CQEAdvance(1)
	if ud != 2 || res != int32(len(want)) || string(a)+string(b) != want {
		t.Fatalf("readv: ud %d res %d data %q, want %q", ud, res, string(a)+string(b), want)
	}

	// writev and recv in one batch; recv waits for the whole message.
	PrepWritev(mustSQE(t, r), fds[0], wiov, 0, 3)
	got := make([]byte, len(want))
	pin(t, nil, got)
	PrepRecv(mustSQE(t, r), fds[1], got, unix.MSG_WAITALL, 4)
	if n, err := r.SubmitAndWait(2); n != 2 || err != nil {
		t.Fatalf("SubmitAndWait(2): %d, %v", n, err)
	}
	res2 := map[uint64]int32{}
	reapAll(t, r, res2)
	if res2[3] != int32(len(want)) || res2[4] != int32(len(want)) || string(got) != want {
		t.Fatalf("writev+recv: %v, data %q", res2, got)
	}

	// send the other way.
	msg := []byte("pong")
	back := make([]byte, 8)
	pin(t, nil, msg, back)
	PrepSend(mustSQE(t, r), fds[1], msg, unix.MSG_NOSIGNAL, 5)
	PrepRecv(mustSQE(t, r), fds[0], back, 0, 6)
	if _, err := r.SubmitAndWait(2); err != nil {
		t.Fatal(err)
	}
	clear(res2)
	reapAll(t, r, res2)
	if res2[5] != 4 || res2[6] != 4 || string(back[:4]) != "pong" {
		t.Fatalf("send+recv: %v, data %q", res2, back)
	}
}

// TestEchoRounds runs many send/recv pairs through a 4-entry ring, so the
// indices wrap with real I/O and buffers in flight.
func TestEchoRounds(t *testing.T) {
	r := newRing(t, 4)
	fds := socketpair(t)
	out, in := make([]byte, 64), make([]byte, 64)
	pin(t, nil, out, in)
	for round := range 500 {
		n := 1 + round%len(out)
		for i := range n {
			out[i] = byte(round + i)
		}
		PrepRecv(mustSQE(t, r), fds[1], in[:n], unix.MSG_WAITALL, 2*uint64(round)+1)
		PrepSend(mustSQE(t, r), fds[0], out[:n], unix.MSG_NOSIGNAL, 2*uint64(round))
		if _, err := r.SubmitAndWait(2); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		got := map[uint64]int32{}
		reapAll(t, r, got)
		if got[2*uint64(round)] != int32(n) || got[2*uint64(round)+1] != int32(n) || string(in[:n]) != string(out[:n]) {
			t.Fatalf("round %d: %v, %x != %x", round, got, in[:n], out[:n])
		}
	}
}

func TestErrorCQE(t *testing.T) {
	r := newRing(t, 4)
	fds := socketpair(t)
	closed := fds[0]
	unix.Close(closed)
	fds[0] = -1
	buf := []byte("lost")
	iov := iovecs(buf)
	pin(t, iov, buf)
	PrepWritev(mustSQE(t, r), closed, iov, 0, 7)
	PrepRecv(mustSQE(t, r), -1, buf, 0, 8)
	if _, err := r.SubmitAndWait(2); err != nil {
		t.Fatal(err)
	}
	got := map[uint64]int32{}
	reapAll(t, r, got)
	for _, ud := range []uint64{7, 8} {
		if got[ud] != -int32(unix.EBADF) {
			t.Errorf("ud %d: res %d, want -EBADF (%d)", ud, got[ud], -int32(unix.EBADF))
		}
		if err := ResultError(got[ud]); !errors.Is(err, unix.EBADF) {
			t.Errorf("ResultError(%d) = %v, want EBADF", got[ud], err)
		}
	}
	if ResultError(0) != nil || ResultError(5) != nil {
		t.Error("ResultError of a success is not nil")
	}
	var sink error
	if n := testing.AllocsPerRun(100, func() { sink = ResultError(-int32(unix.ECONNRESET)) }); n != 0 || sink != unix.ECONNRESET {
		t.Errorf("ResultError: %v allocations, %v", n, sink)
	}
}

func TestSQFull(t *testing.T) {
	r := newRing(t, 4) // 4 SQ, 8 CQ entries
	for i := range 4 {
		PrepNop(mustSQE(t, r), uint64(i))
	}
	if r.SQE() != nil {
		t.Fatal("SQE() on a full SQ is not nil")
	}
	if n, err := r.Submit(); n != 4 || err != nil {
		t.Fatalf("Submit: %d, %v", n, err)
	}
	for i := range 4 {
		PrepNop(mustSQE(t, r), uint64(4+i))
	}
	if n, err := r.Submit(); n != 4 || err != nil {
		t.Fatalf("Submit: %d, %v", n, err)
	}
	// The SQ is empty now, but 8 operations are unreaped: as many as the
	// CQ holds.
	if r.SQE() != nil {
		t.Fatal("SQE() with the CQ's worth of operations in flight is not nil")
	}
	if _, _, err := r.WaitCQE(); err != nil {
		t.Fatal(err)
	}
	r.CQEAdvance(1)
	PrepNop(mustSQE(t, r), 8)
	if _, err := r.SubmitAndWait(8); err != nil {
		t.Fatal(err)
	}
	if k := reapAll(t, r, map[uint64]int32{}); k != 8 {
		t.Fatalf("reaped %d, want 8", k)
	}
	if _, err := r.SubmitAndWait(1); !errors.Is(err, ErrNothingInFlight) {
		t.Fatalf("SubmitAndWait(1) with nothing in flight: %v", err)
	}
}

func TestPrepAfterSubmitPanics(t *testing.T) {
	r := newRing(t, 4)
	s := mustSQE(t, r)
	PrepNop(s, 1)
	if _, err := r.SubmitAndWait(1); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("Prep on a submitted SQE did not panic")
		}
		r.CQEAdvance(1)
	}()
	PrepNop(s, 2)
}

func TestUnpreparedSQEIsNop(t *testing.T) {
	r := newRing(t, 4)
	mustSQE(t, r)
	if _, err := r.SubmitAndWait(1); err != nil {
		t.Fatal(err)
	}
	if ud, res, ok := r.PeekCQE(); !ok || ud != 0 || res != 0 {
		t.Fatalf("CQE %d %d %v, want a NOP with user data 0", ud, res, ok)
	}
	r.CQEAdvance(1)
}

func TestCloseTwice(t *testing.T) {
	needUring(t)
	r, err := New(4)
	if err != nil {
		t.Fatal(err)
	}
	PrepNop(mustSQE(t, r), 1)
	if err := r.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if r.SQE() != nil {
		t.Error("SQE after Close is not nil")
	}
	if _, err := r.Submit(); !errors.Is(err, ErrClosed) {
		t.Errorf("Submit after Close: %v", err)
	}
	if _, err := r.SubmitAndWait(1); !errors.Is(err, ErrClosed) {
		t.Errorf("SubmitAndWait after Close: %v", err)
	}
	if _, _, ok := r.PeekCQE(); ok {
		t.Error("PeekCQE after Close found a CQE")
	}
	if _, _, err := r.WaitCQE(); !errors.Is(err, ErrClosed) {
		t.Errorf("WaitCQE after Close: %v", err)
	}
	r.CQEAdvance(1) // no-op, no panic
}

// TestCloseCancelsInFlight closes a ring with a recv waiting for data that
// never comes, plus a published-but-unreaped NOP and an unsubmitted SQE.
// Close must return, and the recv must not take data sent afterwards.
func TestCloseCancelsInFlight(t *testing.T) {
	needUring(t)
	r, err := New(4)
	if err != nil {
		t.Fatal(err)
	}
	fds := socketpair(t)
	buf := make([]byte, 16)
	pin(t, nil, buf)
	PrepRecv(mustSQE(t, r), fds[1], buf, 0, 1)
	PrepNop(mustSQE(t, r), 2)
	if _, err := r.Submit(); err != nil {
		t.Fatal(err)
	}
	PrepNop(mustSQE(t, r), 3) // never submitted
	if err := r.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := unix.Write(fds[0], []byte("late")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 8)
	n, err := unix.Read(fds[1], got)
	if err != nil || string(got[:n]) != "late" {
		t.Fatalf("read after Close: %q, %v: the cancelled recv took the data", got[:n], err)
	}
	if string(buf) != string(make([]byte, 16)) {
		t.Fatalf("buffer of the cancelled recv was written: %q", buf)
	}
}

// TestRingKeepsMemoryAlive hands the ring the only reference to a recv buffer
// and a writev iovec array; the garbage collector must not free them before
// their CQEs are reaped, and must free them after.
func TestRingKeepsMemoryAlive(t *testing.T) {
	r := newRing(t, 4)
	fds := socketpair(t)
	var freed atomic.Int32
	func() {
		// No Pinner here on purpose: only the ring refers to these.
		buf := make([]byte, 4096)
		runtime.AddCleanup(&buf[0], func(int) { freed.Add(1) }, 0)
		PrepRecv(mustSQE(t, r), fds[1], buf, 0, 1)
		payload := make([]byte, 4096)
		copy(payload, "kept")
		iov := iovecs(payload)
		runtime.AddCleanup(&iov[0], func(int) { freed.Add(1) }, 0)
		runtime.AddCleanup(&payload[0], func(int) { freed.Add(1) }, 0)
		PrepWritev(mustSQE(t, r), fds[0], iov, 0, 2)
	}()
	// The recv may or may not complete within Submit; GC while the
	// operations are (or may be) in flight and their CQEs are unreaped.
	if _, err := r.Submit(); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		runtime.GC()
		time.Sleep(time.Millisecond)
	}
	if n := freed.Load(); n != 0 {
		t.Fatalf("%d objects freed while the ring still referenced them", n)
	}
	if _, err := r.SubmitAndWait(2); err != nil {
		t.Fatal(err)
	}
	got := map[uint64]int32{}
	reapAll(t, r, got)
	if got[1] <= 0 || got[2] != 4096 {
		t.Fatalf("completions %v", got)
	}
	deadline := time.Now().Add(5 * time.Second)
	for freed.Load() != 3 && time.Now().Before(deadline) {
		runtime.GC()
		time.Sleep(5 * time.Millisecond)
	}
	if n := freed.Load(); n != 3 {
		t.Fatalf("%d of 3 objects freed after their CQEs were reaped: the ring still holds them", n)
	}
}

// TestWaitSurvivesSignals waits in io_uring_enter on a thread that is hit by
// signals until the data arrives.
func TestWaitSurvivesSignals(t *testing.T) {
	r := newRing(t, 4)
	fds := socketpair(t)
	buf := make([]byte, 8)
	pin(t, nil, buf)
	PrepRecv(mustSQE(t, r), fds[1], buf, 0, 9)
	if _, err := r.Submit(); err != nil {
		t.Fatal(err)
	}
	tid := make(chan int)
	type result struct {
		ud  uint64
		res int32
		err error
	}
	done := make(chan result)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		tid <- unix.Gettid()
		ud, res, err := r.WaitCQE()
		done <- result{ud, res, err}
	}()
	target := <-tid
	for range 20 {
		unix.Tgkill(os.Getpid(), target, unix.SIGURG) // the runtime ignores a stray SIGURG
		time.Sleep(2 * time.Millisecond)
	}
	if _, err := unix.Write(fds[0], []byte("signal")); err != nil {
		t.Fatal(err)
	}
	got := <-done
	if got.err != nil || got.ud != 9 || got.res != 6 || string(buf[:6]) != "signal" {
		t.Fatalf("WaitCQE: %+v, data %q", got, buf)
	}
	r.CQEAdvance(1)
	t.Logf("io_uring_enter retried after EINTR %d times", r.eintr)
}

func TestAllocs(t *testing.T) {
	r := newRing(t, 8)
	fds := socketpair(t)
	msg, in := []byte("zero allocations"), make([]byte, 16)
	wiov, riov := iovecs(msg), iovecs(in)
	pin(t, wiov, msg)
	pin(t, riov, in)
	round := func() {
		for i := range 4 {
			PrepNop(r.SQE(), uint64(i))
		}
		PrepWritev(r.SQE(), fds[0], wiov, 0, 10)
		PrepReadv(r.SQE(), fds[1], riov, 0, 11)
		if _, err := r.SubmitAndWait(6); err != nil {
			panic(err)
		}
		for {
			if _, _, ok := r.PeekCQE(); !ok {
				break
			}
			r.CQEAdvance(1)
		}
	}
	if n := testing.AllocsPerRun(100, round); n != 0 {
		t.Fatalf("%v allocations per submit-and-reap round, want 0", n)
	}
}

func TestSetupErrors(t *testing.T) {
	for _, errno := range []unix.Errno{unix.ENOSYS, unix.EPERM, unix.EACCES, unix.EINVAL} {
		err := setupError(errno)
		if !errors.Is(err, ErrUnsupported) || !errors.Is(err, errno) {
			t.Errorf("setupError(%v) = %v: want both ErrUnsupported and the errno", errno, err)
		}
		t.Logf("%v: %v", errno, err)
	}
	if err := setupError(unix.ENOMEM); errors.Is(err, ErrUnsupported) || !errors.Is(err, unix.ENOMEM) {
		t.Errorf("setupError(ENOMEM) = %v: a transient error is not ErrUnsupported", err)
	}
	for _, n := range []uint32{0, maxEntries + 1} {
		if _, err := New(n); errors.Is(err, ErrUnsupported) || !errors.Is(err, unix.EINVAL) {
			t.Errorf("New(%d) = %v: want EINVAL, not ErrUnsupported", n, err)
		}
	}
}

func TestAvailableCached(t *testing.T) {
	a, b := Available(), Available()
	if a != b {
		t.Fatalf("Available: %v then %v", a, b)
	}
	needUring(t)
}

// TestNoFDLeak opens and closes rings, some with operations in flight, and
// compares the fd table before and after.
func TestNoFDLeak(t *testing.T) {
	needUring(t)
	fds := socketpair(t)
	buf := make([]byte, 8)
	pin(t, nil, buf)
	before := leakcheck.FDs()
	for i := range 50 {
		r, err := New(uint32(1 + i%16))
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			PrepRecv(r.SQE(), fds[1], buf, 0, 1)
			if _, err := r.Submit(); err != nil {
				t.Fatal(err)
			}
		}
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if after := leakcheck.FDs(); len(after) != len(before) {
		t.Fatalf("fds before %d, after %d:\n%s", len(before), len(after), strings.Join(after, "\n"))
	}
}

// Used counts the rings set up and the SQEs the kernel took: what a test
// of a path that should use io_uring asserts.
func TestUsed(t *testing.T) {
	needUring(t)
	before := Used()
	r := newRing(t, 8)
	for i := range 3 {
		PrepNop(mustSQE(t, r), uint64(i))
	}
	if n, err := r.SubmitAndWait(3); n != 3 || err != nil {
		t.Fatalf("SubmitAndWait: %d, %v", n, err)
	}
	r.CQEAdvance(3)
	after := Used()
	if after.Rings != before.Rings+1 || after.Submitted != before.Submitted+3 {
		t.Fatalf("Used: %+v, then %+v after a ring and 3 NOPs", before, after)
	}
	if _, err := New(0); err == nil || Used().Rings != after.Rings {
		t.Fatalf("a refused New counted: %v, %+v", err, Used())
	}
}
