package cq_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"
	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/cq"
)

// hang bounds every wait of these tests; it detects a hang and is never
// reached when the code is right, so it asserts nothing about speed.
const hang = 30 * time.Second

// Reader modes of postRun.
const (
	readSpin  = iota // Peek or PeekBatch in a loop, never blocking
	readWait         // Wait(ctx, 1), then PeekBatch
	readEvent        // poll the eventfd, then PeekBatch until empty
	readModes
)

// postRun is one concurrent run of producers posting to one ring.
type postRun struct {
	Producers int
	PerProd   int
	Batch     int // 1: Post; more: PostBatch of 1..Batch
	SizeLog   int
	ReadBatch int // 0: Peek and Advance(1); more: PeekBatch of up to ReadBatch
	Mode      int
	Head      int // completions each producer posts before the reader starts
}

// runPosts checks that every completion arrives once, in its producer's
// order, and, when the producers post more than the ring holds before the
// reader starts, that Overflowed counts it.
func runPosts(r postRun) string {
	ring, err := cq.New(1 << r.SizeLog)
	if err != nil {
		return err.Error()
	}
	defer ring.Close()
	fd := -1
	if r.Mode == readEvent {
		if fd, err = ring.EventFD(); err != nil {
			return err.Error()
		}
	}
	head := min(r.Head, r.PerProd)
	var posted, wg sync.WaitGroup
	posted.Add(r.Producers)
	for p := range r.Producers {
		wg.Go(func() {
			buf := make([]cq.Completion, r.Batch)
			for i := 0; i < r.PerProd; {
				n := min(1+(i*7+p)%r.Batch, r.PerProd-i)
				if i < head {
					n = min(n, head-i)
				}
				for j := range n {
					buf[j] = cq.Completion{UserData: uint64(p)<<32 | uint64(i+j), Bytes: uint64(i + j), Status: cq.Completed}
				}
				if r.Batch == 1 {
					ring.Post(&buf[0])
				} else {
					ring.PostBatch(buf[:n])
				}
				i += n
				if i == head {
					posted.Done()
				}
			}
			if head == 0 {
				posted.Done()
			}
		})
	}
	defer wg.Wait()
	posted.Wait()
	if r.Producers*head > ring.Cap() && ring.Overflowed() == 0 {
		return fmt.Sprintf("%d completions posted to a %d-slot ring, Overflowed = 0", r.Producers*head, ring.Cap())
	}

	next := make([]int, r.Producers)
	dst := make([]cq.Completion, max(r.ReadBatch, 1))
	total := r.Producers * r.PerProd
	deadline := time.Now().Add(hang)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	take := func(c *cq.Completion) string {
		p, i := int(c.UserData>>32), int(uint32(c.UserData))
		if p >= r.Producers || i != next[p] || c.Bytes != uint64(i) {
			return fmt.Sprintf("got producer %d completion %d, want %d", p, i, next[min(p, r.Producers-1)])
		}
		next[p]++
		return ""
	}
	for seen := 0; seen < total; {
		switch r.Mode {
		case readWait:
			if err := ring.Wait(ctx, 1); err != nil {
				return fmt.Sprintf("Wait: %v with %d of %d taken, %d ready", err, seen, total, ring.Ready())
			}
		case readEvent:
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			n, err := unix.Poll(pfd, int(time.Until(deadline).Milliseconds()))
			if err != nil && err != unix.EINTR {
				return fmt.Sprintf("poll: %v", err)
			}
			if n == 0 && err == nil {
				return fmt.Sprintf("eventfd not readable with %d of %d taken, %d ready", seen, total, ring.Ready())
			}
		}
		got := 0
		if r.ReadBatch == 0 {
			if c := ring.Peek(); c != nil {
				if msg := take(c); msg != "" {
					return msg
				}
				ring.Advance(1)
				got = 1
			}
		} else {
			got = ring.PeekBatch(dst)
			for k := range dst[:got] {
				if msg := take(&dst[k]); msg != "" {
					return msg
				}
			}
			ring.Advance(got)
		}
		seen += got
		if got == 0 {
			if time.Now().After(deadline) {
				return fmt.Sprintf("hang: %d of %d taken, %d ready, Overflowed %d", seen, total, ring.Ready(), ring.Overflowed())
			}
			runtime.Gosched()
		}
	}
	wg.Wait()
	if c := ring.Peek(); c != nil || ring.Ready() != 0 {
		return fmt.Sprintf("extra completion %+v after all arrived", *c)
	}
	if fd >= 0 {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if n, _ := unix.Poll(pfd, 0); n != 0 {
			return "eventfd readable after the ring was drained"
		}
	}
	return ""
}

func TestPostProducers(t *testing.T) {
	props := properties(t, 40)
	props.Property("many producers: nothing dropped, duplicated or reordered", prop.ForAll(runPosts,
		gen.Struct(reflect.TypeOf(postRun{}), map[string]gopter.Gen{
			"Producers": gen.IntRange(1, 4),
			"PerProd":   gen.IntRange(1, 2000),
			"Batch":     gen.IntRange(1, 10),
			"SizeLog":   gen.OneConstOf(1, 3, 3, 10),
			"ReadBatch": gen.IntRange(0, 16),
			"Mode":      gen.IntRange(0, readModes-1),
			"Head":      gen.IntRange(0, 20),
		})))
	props.TestingRun(t)
}

func TestPostOverflowTiny(t *testing.T) {
	// Four producers, an 8-slot ring and 20 completions posted before the
	// reader starts: overflow is certain, and the reader's every mode must
	// still see each completion once, in order.
	for mode := range readModes {
		for _, batch := range []int{1, 10} {
			for _, readBatch := range []int{0, 3, 8} {
				r := postRun{Producers: 4, PerProd: 1000, Batch: batch, SizeLog: 3, ReadBatch: readBatch, Mode: mode, Head: 5}
				if msg := runPosts(r); msg != "" {
					t.Errorf("%+v: %s", r, msg)
				}
			}
		}
	}
}

func TestWaitReady(t *testing.T) {
	r := newRing(t, 8)
	done := make(chan error, 1)
	go func() { done <- r.Wait(context.Background(), 3) }()
	c := cq.Completion{Status: cq.Completed}
	r.Post(&c)
	r.Post(&c)
	select {
	case err := <-done:
		t.Fatalf("Wait(3) returned %v with 2 ready", err)
	default:
	}
	r.Post(&c)
	select {
	case err := <-done:
		if err != nil || r.Ready() != 3 {
			t.Fatalf("Wait(3) = %v with %d ready", err, r.Ready())
		}
	case <-time.After(hang):
		t.Fatal("Wait(3) did not return with 3 ready")
	}
	// Ready already: no blocking.
	for _, n := range []int{-1, 0, 1, 3} {
		if err := r.Wait(context.Background(), n); err != nil {
			t.Errorf("Wait(%d) with 3 ready = %v", n, err)
		}
	}
}

func TestWaitCapped(t *testing.T) {
	// Wait for more than the ring holds returns once it is full, and it
	// moves overflowed completions in as room appears.
	r := newRing(t, 8)
	for i := range 12 {
		r.Post(&cq.Completion{UserData: uint64(i)})
	}
	if err := r.Wait(context.Background(), 100); err != nil || r.Ready() != 8 {
		t.Fatalf("Wait(100) on a full 8-slot ring = %v, Ready %d", err, r.Ready())
	}
	r.Advance(6)
	if err := r.Wait(context.Background(), 6); err != nil || r.Ready() != 6 {
		t.Fatalf("Wait(6) with 2 in the ring and 4 overflowed = %v, Ready %d", err, r.Ready())
	}
	dst := make([]cq.Completion, 8)
	if n := r.PeekBatch(dst); n != 6 || dst[0].UserData != 6 || dst[5].UserData != 11 {
		t.Fatalf("after overflow: %v", dst[:n])
	}
}

func TestWaitCanceled(t *testing.T) {
	r := newRing(t, 8)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Wait(ctx, 1) }()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("canceled Wait = %v, want context.Canceled", err)
		}
	case <-time.After(hang):
		t.Fatal("canceled Wait did not return")
	}
	ctx, cancel = context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if err := r.Wait(ctx, 1); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Wait past its deadline = %v, want DeadlineExceeded", err)
	}
	// The ring still works after a canceled Wait.
	r.Post(&cq.Completion{UserData: 1})
	if err := r.Wait(context.Background(), 1); err != nil || r.Peek().UserData != 1 {
		t.Fatalf("Wait after a canceled one = %v", err)
	}
}

func TestWaitClosed(t *testing.T) {
	r := newRing(t, 8)
	done := make(chan error, 1)
	go func() { done <- r.Wait(context.Background(), 1) }()
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, cq.ErrClosed) {
			t.Fatalf("Wait during Close = %v, want ErrClosed", err)
		}
	case <-time.After(hang):
		t.Fatal("Close did not wake Wait")
	}
	if err := r.Wait(context.Background(), 1); !errors.Is(err, cq.ErrClosed) {
		t.Fatalf("Wait after Close = %v, want ErrClosed", err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("second Close = %v", err)
	}

	// Completions posted before Close stay readable.
	r = newRing(t, 8)
	r.Post(&cq.Completion{UserData: 1})
	r.Post(&cq.Completion{UserData: 2})
	r.Close()
	if err := r.Wait(context.Background(), 2); err != nil {
		t.Fatalf("Wait(2) after Close with 2 ready = %v", err)
	}
	if err := r.Wait(context.Background(), 3); !errors.Is(err, cq.ErrClosed) {
		t.Fatalf("Wait(3) after Close with 2 ready = %v, want ErrClosed", err)
	}
	if c := r.Peek(); c == nil || c.UserData != 1 {
		t.Fatalf("Peek after Close = %v", c)
	}
}

func TestEventFD(t *testing.T) {
	r := newRing(t, 8)
	fd, err := r.EventFD()
	if err != nil {
		t.Fatal(err)
	}
	if fd2, err := r.EventFD(); err != nil || fd2 != fd {
		t.Fatalf("second EventFD = %d, %v; want %d", fd2, err, fd)
	}
	check := func(step string, want bool) {
		t.Helper()
		if got := readable(t, fd); got != want {
			t.Fatalf("%s: eventfd readable %v, want %v (Ready %d)", step, got, want, r.Ready())
		}
	}
	check("new ring", false)
	r.Post(&cq.Completion{UserData: 1})
	check("one posted", true)
	r.PostBatch([]cq.Completion{{UserData: 2}, {UserData: 3}})
	check("three posted", true)
	r.Advance(1)
	check("two left", true)
	r.Advance(2)
	check("drained", false)
	r.Post(&cq.Completion{UserData: 4})
	check("posted again", true)
	r.Advance(1)
	check("drained again", false)

	// Overflow, then drain a few at a time.
	for i := range 20 {
		r.Post(&cq.Completion{UserData: uint64(i)})
	}
	if r.Overflowed() != 12 {
		t.Fatalf("20 posted to 8 slots: Overflowed %d, want 12", r.Overflowed())
	}
	dst := make([]cq.Completion, 3)
	for left := 20; left > 0; {
		check(fmt.Sprintf("%d left", left), true)
		n := r.PeekBatch(dst)
		if n == 0 || dst[0].UserData != uint64(20-left) {
			t.Fatalf("%d left: PeekBatch = %v", left, dst[:n])
		}
		r.Advance(n)
		left -= n
	}
	check("overflow drained", false)
}

func TestEventFDLate(t *testing.T) {
	// An eventfd made while completions wait starts readable.
	r := newRing(t, 8)
	r.Post(&cq.Completion{})
	fd, err := r.EventFD()
	if err != nil {
		t.Fatal(err)
	}
	if !readable(t, fd) {
		t.Fatal("eventfd made after a Post is not readable")
	}
	r.Advance(1)
	if readable(t, fd) {
		t.Fatal("eventfd readable after the ring was drained")
	}
}

func TestEventFDClose(t *testing.T) {
	r, err := cq.New(8)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := r.EventFD()
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != unix.EBADF {
		t.Fatalf("eventfd after Close: fcntl = %v, want EBADF", err)
	}
	// A closed ring makes no new eventfd that nothing would close.
	if fd, err := r.EventFD(); !errors.Is(err, cq.ErrClosed) {
		if err == nil {
			unix.Close(fd)
		}
		t.Fatalf("EventFD after Close = %d, %v; want ErrClosed", fd, err)
	}
	// Posting to and draining a closed ring touches no descriptor.
	r.Post(&cq.Completion{})
	r.Advance(1)
}

func TestRingNoAlloc(t *testing.T) {
	for _, withFD := range []bool{false, true} {
		if withFD && raceEnabled {
			t.Log("eventfd case skipped: the race detector's annotations of unix.Read and unix.Write allocate")
			continue
		}
		r := newRing(t, 8)
		if withFD {
			if _, err := r.EventFD(); err != nil {
				t.Fatal(err)
			}
		}
		c := cq.Completion{UserData: 1, Status: cq.Completed}
		batch := make([]cq.Completion, 4)
		dst := make([]cq.Completion, 4)
		ctx := context.Background()
		if n := testing.AllocsPerRun(100, func() {
			r.Post(&c)
			if p := r.Peek(); p == nil || p.Err() != nil {
				panic("no completion")
			}
			r.Advance(1)
		}); n != 0 {
			t.Errorf("eventfd %v: Post+Peek+Advance allocate %v times per run", withFD, n)
		}
		if n := testing.AllocsPerRun(100, func() {
			r.PostBatch(batch)
			if err := r.Wait(ctx, 4); err != nil {
				panic(err)
			}
			r.Advance(r.PeekBatch(dst))
		}); n != 0 {
			t.Errorf("eventfd %v: PostBatch+Wait+PeekBatch+Advance allocate %v times per run", withFD, n)
		}
	}
}

func TestEventFDProducers(t *testing.T) {
	// Many turns between empty and not: the eventfd must never stay quiet
	// while a completion waits, or the reader, which sleeps in poll, hangs.
	for _, r := range []postRun{
		{Producers: 1, PerProd: 4000, Batch: 1, SizeLog: 10, Mode: readEvent},
		{Producers: 3, PerProd: 1000, Batch: 1, SizeLog: 10, Mode: readEvent},
		{Producers: 2, PerProd: 1000, Batch: 4, SizeLog: 2, ReadBatch: 1, Mode: readEvent},
	} {
		if msg := runPosts(r); msg != "" {
			t.Errorf("%+v: %s", r, msg)
		}
	}
}

func TestOverflowNotStranded(t *testing.T) {
	// The reader empties a full ring while a Post overflows: the posted
	// completion must then be readable, not held back on the overflow list
	// with no Advance left to move it in.
	r := newRing(t, 8)
	full := make([]cq.Completion, 8)
	dst := make([]cq.Completion, 8)
	for round := range 20000 {
		r.PostBatch(full)
		start := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			<-start
			r.Advance(r.PeekBatch(dst))
		})
		wg.Go(func() {
			<-start
			r.Post(&cq.Completion{UserData: 1})
		})
		close(start)
		wg.Wait()
		// The reader took the eight that filled the ring; the new one
		// came in or overflowed after them.
		if c := r.Peek(); c == nil || c.UserData != 1 || r.Ready() != 1 {
			t.Fatalf("round %d: Peek = %v, Ready %d, Overflowed %d: the posted completion is stranded", round, c, r.Ready(), r.Overflowed())
		}
		r.Advance(1)
	}
}

func TestEventFDNotLost(t *testing.T) {
	// The reader empties the ring while a Post arrives: the eventfd must be
	// readable afterwards, since the new completion waits.
	r := newRing(t, 8)
	fd, err := r.EventFD()
	if err != nil {
		t.Fatal(err)
	}
	r.Post(&cq.Completion{UserData: 0})
	for round := range 20000 {
		start := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			<-start
			if c := r.Peek(); c == nil || c.UserData != uint64(round) {
				panic(fmt.Sprintf("round %d: Peek = %v", round, c))
			}
			r.Advance(1)
		})
		wg.Go(func() {
			<-start
			r.Post(&cq.Completion{UserData: uint64(round + 1)})
		})
		close(start)
		wg.Wait()
		if r.Ready() != 1 || !readable(t, fd) {
			t.Fatalf("round %d: eventfd readable %v with %d ready", round, readable(t, fd), r.Ready())
		}
	}
}

func TestEventFDNotStale(t *testing.T) {
	// A Post whose completion the reader takes before the Post's own write
	// to the eventfd must not leave it readable on an empty ring once the
	// reader has looked again: an epoll loop would spin until the next
	// completion.
	r := newRing(t, 8)
	fd, err := r.EventFD()
	if err != nil {
		t.Fatal(err)
	}
	for round := range 20000 {
		start := make(chan struct{})
		var wg sync.WaitGroup
		wg.Go(func() {
			<-start
			for r.Peek() == nil {
				runtime.Gosched()
			}
			r.Advance(1)
		})
		wg.Go(func() {
			<-start
			r.Post(&cq.Completion{UserData: uint64(round)})
		})
		close(start)
		wg.Wait()
		if c := r.Peek(); c != nil || readable(t, fd) {
			t.Fatalf("round %d: eventfd readable %v after the reader found the ring empty (Peek %v)", round, readable(t, fd), c)
		}
	}
}
