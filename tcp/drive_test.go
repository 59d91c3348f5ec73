package tcp

// Tests of a caller reading its own answers (drive.go).

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// countUntil completes slices into a channel and is done once it has
// seen n completions.
type countUntil struct {
	ch   chanCompleter
	got  atomic.Int32
	want atomic.Int32
	// at, if set, runs at each completion, before it is counted: it sees
	// the memory as the completion leaves it.
	at func(tok uint64, err error)
}

func (u *countUntil) Complete(tok uint64, err error) {
	if u.at != nil {
		u.at(tok, err)
	}
	u.got.Add(1)
	u.ch.Complete(tok, err)
}

func (u *countUntil) Done() bool { return u.got.Load() >= u.want.Load() }

// rail0 is the endpoint's one rail.
func rail0(t *testing.T, ep transport.Endpoint) *conn {
	t.Helper()
	c := ep.(*Endpoint).rails[0].Load()
	if c == nil {
		t.Fatal("no rail")
	}
	return c
}

func driven(s transport.Slice) transport.Slice {
	s.Driven = true
	return s
}

// A Driven slice posted to an idle connection is read by Drive on the
// caller's goroutine: the receiver stays parked (the connection is owed
// to the driver before Drive, idle after it, and holds no read buffer
// then), and the bytes are right.
// A slice that is not Driven wakes the receiver instead.
func TestDriveReadsAnswer(t *testing.T) {
	tp := newTimeoutPair(t, 0, 7, false)
	c := rail0(t, tp.ep)
	u := &countUntil{ch: make(chanCompleter, 8)}

	// The first Driven slice finds the receiver reading: it reads the
	// answer, and lets the reading go since nothing else is in flight.
	u.want.Store(1)
	s := driven(localSlice(transport.Read, tp.local[:64], tp.remote.addr, 1))
	if k, err := tp.ep.Post(u, []transport.Slice{s}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	tp.ep.(*Endpoint).Drive(u, 0) // nothing owed: returns at once
	u.ch.await(t, 1)
	waitFor(t, "the receiver to let the reading go", func() bool { return c.rd.Load() == rdIdle })
	if c.holdsIn.Load() {
		t.Fatal("the receiver let the reading go holding a read buffer")
	}

	for i := range 20 {
		clear(tp.local[:4096])
		u.want.Add(1)
		s := driven(localSlice(transport.Read, tp.local[:4096], tp.remote.addr, uint64(i+2)))
		if k, err := tp.ep.Post(u, []transport.Slice{s}); k != 1 || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		if st := c.rd.Load(); st != rdOwed {
			t.Fatalf("after a Driven post to an idle connection: state %d, want owed (%d)", st, rdOwed)
		}
		tp.ep.(*Endpoint).Drive(u, 0)
		if !u.Done() {
			t.Fatalf("Drive returned before the answer")
		}
		if st := c.rd.Load(); st != rdIdle {
			t.Fatalf("after Drive: state %d, want idle (%d)", st, rdIdle)
		}
		if c.holdsIn.Load() {
			t.Fatal("after Drive, idle, the connection holds a read buffer")
		}
		for tok, err := range u.ch.await(t, 1) {
			if err != nil {
				t.Fatalf("slice %d: %v", tok, err)
			}
		}
		if !bytes.Equal(tp.local[:4096], bytes.Repeat([]byte{7}, 4096)) {
			t.Fatal("READ's bytes wrong")
		}
	}

	// Not Driven: the receiver is woken and reads it.
	s = localSlice(transport.Write, tp.local[:64], tp.remote.addr, 99)
	if k, err := tp.ep.Post(u.ch, []transport.Slice{s}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	for tok, err := range u.ch.await(t, 1) {
		if tok != 99 || err != nil {
			t.Fatalf("slice %d: %v", tok, err)
		}
	}
	if st := c.rd.Load(); st != rdRecv {
		t.Fatalf("after a slice not Driven: state %d, want the receiver's (%d)", st, rdRecv)
	}
}

// Posters racing one another and the receiver's letting go: Driven or
// not at random, each poster driving after a Driven post. Every slice
// completes once, with the right bytes, and none waits for ever (the
// race detector checks the hand-overs of the reading).
func TestDriveRaces(t *testing.T) {
	tp := newTimeoutPair(t, 0, 0, false)
	const posters, rounds, size = 4, 300, 1024
	// The target's buffer holds a pattern each READ checks.
	pat := make([]byte, posters*size)
	for i := range pat {
		pat[i] = byte(i*7 + 3)
	}
	w := localSlice(transport.Write, pat, tp.remote.addr, 1)
	comp := make(chanCompleter, 1)
	if k, err := tp.ep.Post(comp, []transport.Slice{w}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	comp.await(t, 1)
	ep := tp.ep.(*Endpoint)
	var wg sync.WaitGroup
	errs := make(chan error, posters)
	for p := range posters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(p), 1))
			u := &countUntil{ch: make(chanCompleter, 2)}
			dst := tp.local[(p+1)*size*2 : (p+1)*size*2+size]
			for i := range rounds {
				clear(dst)
				u.want.Add(1)
				s := localSlice(transport.Read, dst, tp.remote.addr+uint64(p*size), uint64(i))
				if rng.IntN(3) > 0 {
					s.Driven = true
				}
				if k, err := ep.Post(u, []transport.Slice{s}); k != 1 || err != nil {
					errs <- errors.Join(errors.New("post"), err)
					return
				}
				if s.Driven {
					ep.Drive(u, 0)
				}
				select {
				case x := <-u.ch:
					if x.err != nil || x.token != uint64(i) {
						errs <- errors.Join(errors.New("completion"), x.err)
						return
					}
				case <-time.After(hang):
					errs <- errors.New("hang")
					return
				}
				if !bytes.Equal(dst, pat[p*size:(p+1)*size]) {
					errs <- errors.New("bytes wrong")
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// idleOwed gets the rail to the idle state a Driven slice finds owed.
func idleOwed(t *testing.T, tp *timeoutPair, u *countUntil) *conn {
	t.Helper()
	c := rail0(t, tp.ep)
	u.want.Add(1)
	s := driven(localSlice(transport.Write, tp.local[:64], tp.remote.addr, 1000))
	if k, err := tp.ep.Post(u, []transport.Slice{s}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	tp.ep.(*Endpoint).Drive(u, 0)
	u.ch.await(t, 1)
	waitFor(t, "the rail idle", func() bool { return c.rd.Load() == rdIdle })
	return c
}

// leaveDriven has a driver wait for an answer the proxy drops, on a rail
// with the given response timeout, and leave at its deadline (how
// "deadline") or on Interrupt; it returns once the driver has left, with
// the slice (token 1) still out.
func leaveDriven(t *testing.T, timeout time.Duration, how string) (*timeoutPair, *countUntil, *conn) {
	t.Helper()
	tp := newTimeoutPair(t, timeout, 5, true)
	u := &countUntil{ch: make(chanCompleter, 4)}
	c := idleOwed(t, tp, u)
	tp.px.hold.Store(true)
	u.want.Add(1)
	s := driven(localSlice(transport.Read, tp.local[:4096], tp.remote.addr, 1))
	if k, err := tp.ep.Post(u, []transport.Slice{s}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	deadline := int64(0)
	if how == "deadline" {
		deadline = time.Now().Add(100 * time.Millisecond).UnixNano()
	}
	left := make(chan struct{})
	go func() {
		tp.ep.(*Endpoint).Drive(u, deadline)
		close(left)
	}()
	if how == "interrupt" {
		waitFor(t, "the driver reading", func() bool { return c.rd.Load() == rdDriven })
		time.Sleep(20 * time.Millisecond) // in its read, most likely
		tp.ep.(*Endpoint).Interrupt()
	}
	select {
	case <-left:
	case <-time.After(hang):
		t.Fatal("the driver did not leave")
	}
	return tp, u, c
}

// A driver whose answer does not come leaves at its deadline, or when
// interrupted, and hands the slice to the receiver, which then owns it:
// the response timeout (300 ms) fails it with ErrPeer (the proxy drops
// the answer).
func TestDriveLeaves(t *testing.T) {
	for _, how := range []string{"deadline", "interrupt"} {
		t.Run(how, func(t *testing.T) {
			_, u, c := leaveDriven(t, 300*time.Millisecond, how)
			if u.Done() {
				t.Fatal("completed while the proxy held the answer")
			}
			if st := c.rd.Load(); st != rdRecv {
				t.Fatalf("after leaving with a slice in flight: state %d, want the receiver's (%d)", st, rdRecv)
			}
			for tok, err := range u.ch.await(t, 1) {
				if tok != 1 || !errors.Is(err, transport.ErrPeer) {
					t.Fatalf("slice %d: %v, want ErrPeer (the response timeout)", tok, err)
				}
			}
		})
	}
}

// A connection that breaks under a driver fails its slice with ErrPeer;
// the driver leaves and the connection dies (no wait for a reader that
// will not come).
func TestDriveConnBreaks(t *testing.T) {
	tp := newTimeoutPair(t, 0, 5, true)
	u := &countUntil{ch: make(chanCompleter, 4)}
	c := idleOwed(t, tp, u)
	tp.px.hold.Store(true)
	u.want.Add(1)
	s := driven(localSlice(transport.Read, tp.local[:4096], tp.remote.addr, 1))
	if k, err := tp.ep.Post(u, []transport.Slice{s}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	left := make(chan struct{})
	go func() {
		tp.ep.(*Endpoint).Drive(u, 0)
		close(left)
	}()
	waitFor(t, "the driver reading", func() bool { return c.rd.Load() == rdDriven })
	tp.px.kill()
	for tok, err := range u.ch.await(t, 1) {
		if !errors.Is(err, transport.ErrPeer) {
			t.Fatalf("slice %d: %v, want ErrPeer", tok, err)
		}
	}
	select {
	case <-left:
	case <-time.After(hang):
		t.Fatal("the driver did not leave")
	}
	select {
	case <-c.dead:
	case <-time.After(hang):
		t.Fatal("the broken connection never died")
	}
}

// Drive allocates nothing.
func TestDriveAllocs(t *testing.T) {
	tp := newTimeoutPair(t, 0, 5, false)
	u := &countUntil{ch: make(chanCompleter, 4)}
	idleOwed(t, tp, u)
	s := []transport.Slice{driven(localSlice(transport.Read, tp.local[:8], tp.remote.addr, 1))}
	ep := tp.ep.(*Endpoint)
	allocs := testing.AllocsPerRun(200, func() {
		u.want.Add(1)
		if k, err := ep.Post(u, s); k != 1 || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		ep.Drive(u, 0)
		<-u.ch
	})
	if allocs != 0 && countAllocs(t) {
		t.Fatalf("%v allocations per driven READ", allocs)
	}
}

// A connection left idle to drivers is read again by the receiver after
// idleWatch: a peer that closes it is seen (the connection fails and is
// redialed) without a request, and a Driven slice posted while the
// receiver reads is answered through it, after which it lets go again.
func TestDriveWatch(t *testing.T) {
	targ := newSide(t, Config{})
	remote := targ.register(t, targ.alloc(t, 1<<20, 3), true)
	px := newProxy(t, targ.tr.Addr())
	init := newSide(t, Config{Rails: 1, idleWatch: 300 * time.Millisecond})
	local := init.alloc(t, 1<<20, 1)
	ep, err := init.tr.Open(t.Context(), targ.desc(px.addr(), remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	tp := &timeoutPair{ep: ep, local: local, remote: remote, px: px}
	u := &countUntil{ch: make(chanCompleter, 4)}
	c := idleOwed(t, tp, u)
	waitFor(t, "the receiver reading again", func() bool { return c.rd.Load() == rdRecv })

	// A Driven slice now goes through the receiver, which lets go after.
	u.want.Add(1)
	s := driven(localSlice(transport.Read, local[:64], remote.addr, 2))
	if k, err := ep.Post(u, []transport.Slice{s}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	ep.(*Endpoint).Drive(u, 0)
	u.ch.await(t, 1)
	waitFor(t, "the receiver to let go again", func() bool { return c.rd.Load() == rdIdle })

	// Idle, then closed by the peer's side: seen with no request.
	px.kill()
	waitFor(t, "the closed connection seen", func() bool { return c.failed.Load() })
}

// With no response timeout (ResponseTimeout < 0) a driver still leaves at
// its deadline or on Interrupt, and the connection stays up: the past
// deadline an Interrupt puts on the socket is cleared for the next reader
// (it failed the rail, or spun the receiver, before).
func TestDriveLeavesNoResponseTimeout(t *testing.T) {
	for _, how := range []string{"deadline", "interrupt"} {
		t.Run(how, func(t *testing.T) {
			_, u, c := leaveDriven(t, -1, how)
			time.Sleep(200 * time.Millisecond)
			if c.failed.Load() {
				t.Fatal("the connection failed after the driver left")
			}
			select {
			case x := <-u.ch:
				t.Fatalf("slice %d completed (%v) while the proxy held its answer", x.token, x.err)
			default:
			}
		})
	}
}
