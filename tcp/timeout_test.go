package tcp

import (
	"context"
	"errors"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/transport"
)

// timeoutPair is a one-rail endpoint with a response timeout to a target
// serving a 1 MiB buffer, and a 1 MiB local buffer.
type timeoutPair struct {
	ep     transport.Endpoint
	local  []byte
	remote testBuf
	px     *proxy // between the two; nil when they talk directly
}

// newTimeoutPair opens the endpoint, through a proxy when proxied; the
// target's buffer is filled with fill. The test's cleanup closes it.
func newTimeoutPair(t *testing.T, timeout time.Duration, fill byte, proxied bool) *timeoutPair {
	t.Helper()
	targ := newSide(t, Config{})
	tp := &timeoutPair{remote: targ.register(t, targ.alloc(t, 1<<20, fill), true)}
	addr := targ.tr.Addr()
	if proxied {
		tp.px = newProxy(t, addr)
		addr = tp.px.addr()
	}
	init := newSide(t, Config{Rails: 1, ResponseTimeout: timeout})
	tp.local = init.alloc(t, 1<<20, 1)
	ep, err := init.tr.Open(context.Background(), targ.desc(addr, tp.remote))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep.Close() })
	tp.ep = ep
	return tp
}

// A target that keeps the connection up but stops answering: every slice
// out on it comes back with ErrPeer once ResponseTimeout passes, instead of
// holding its ring slot for ever.
func TestResponseTimeout(t *testing.T) {
	tp := newTimeoutPair(t, 200*time.Millisecond, 0, true)
	ep, local, remote, px := tp.ep, tp.local, tp.remote, tp.px
	// An idle connection outlives the timeout: nothing was owed.
	time.Sleep(500 * time.Millisecond)
	if !railsUp(ep.(*Endpoint)) {
		t.Fatal("an idle rail was dropped")
	}
	px.hold.Store(true)
	const n, size = 8, 4096
	s := make([]transport.Slice, n)
	for i := range s {
		s[i] = localSlice(transport.Read, local[i*size:(i+1)*size], remote.addr+uint64(i*size), uint64(i+1))
	}
	comp := make(chanCompleter, 2*n)
	if k, err := ep.Post(comp, s); k != n || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	for tok, err := range comp.await(t, n) {
		if !errors.Is(err, transport.ErrPeer) {
			t.Errorf("slice %d: %v; want ErrPeer after the response timeout", tok, err)
		}
	}
}

// The response timeout counts from when requests went out, not from when
// the connection last went idle: requests posted just before an idle
// connection's old deadline are answered, not failed.
func TestResponseTimeoutCountsFromPost(t *testing.T) {
	// A second: the answer must come within it of the Post, and a loaded
	// machine under -race can stall the receiver for a few hundred ms.
	tp := newTimeoutPair(t, time.Second, 0, false)
	ep, local, remote := tp.ep, tp.local, tp.remote
	for round := 0; round < 3; round++ {
		time.Sleep(950 * time.Millisecond) // idle almost a whole timeout
		const n, size = 8, 4096
		s := make([]transport.Slice, n)
		for i := range s {
			s[i] = localSlice(transport.Read, local[i*size:(i+1)*size], remote.addr+uint64(i*size), uint64(round*n+i+1))
		}
		comp := make(chanCompleter, 2*n)
		if k, err := ep.Post(comp, s); k != n || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		for tok, err := range comp.await(t, n) {
			if err != nil {
				t.Fatalf("round %d, slice %d: %v; the target answered in time", round, tok, err)
			}
		}
	}
}

// A READ payload that keeps arriving, slowly, takes as long as it needs:
// the response timeout bounds the wait for each part, not the whole
// payload (a 1 MiB READ through a link that gives 8 KiB every 10 ms takes
// over a second against a 300 ms timeout, and succeeds).
func TestResponseTimeoutSlowPayload(t *testing.T) {
	tp := newTimeoutPair(t, 300*time.Millisecond, 5, true)
	ep, local, remote, px := tp.ep, tp.local, tp.remote, tp.px
	px.trickle.Store(int64(10 * time.Millisecond))
	start := time.Now()
	comp := make(chanCompleter, 1)
	s := []transport.Slice{localSlice(transport.Read, local, remote.addr, 1)}
	if k, err := ep.Post(comp, s); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	for _, err := range comp.await(t, 1) {
		if err != nil {
			t.Fatalf("slow READ after %v: %v", time.Since(start), err)
		}
	}
	if el := time.Since(start); el < 600*time.Millisecond {
		t.Fatalf("the READ took %v: the proxy did not slow it past the timeout, the test proved nothing", el)
	}
	for i, b := range local {
		if b != 5 {
			t.Fatalf("byte %d is %d, want 5", i, b)
		}
	}
}

// A READ payload that trickles in and then stops fails with ErrPeer once
// ResponseTimeout passes with no byte more: the bytes that kept coming
// before held the slice up, the silence after them does not.
func TestResponseTimeoutStalledPayload(t *testing.T) {
	tp := newTimeoutPair(t, 300*time.Millisecond, 5, true)
	ep, local, remote, px := tp.ep, tp.local, tp.remote, tp.px
	px.trickle.Store(int64(10 * time.Millisecond))
	comp := make(chanCompleter, 1)
	s := []transport.Slice{localSlice(transport.Read, local, remote.addr, 1)}
	if k, err := ep.Post(comp, s); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	time.Sleep(150 * time.Millisecond) // some 120 KiB in
	px.hold.Store(true)
	for _, err := range comp.await(t, 1) {
		if !errors.Is(err, transport.ErrPeer) {
			t.Fatalf("a READ whose payload stopped coming: %v, want ErrPeer after the response timeout", err)
		}
	}
}

// A notification larger than the target's MaxLength allows (tag, name and
// message) completes with ErrRange at once; it used to go out, fail the
// connection at the target, and fail it again on every retry.
func TestNotifyOverMaxLength(t *testing.T) {
	targ := newSide(t, Config{MaxLength: 1024, SliceSize: 1024})
	targ.tr.SetNotify("target", func(*transport.Notification) error { return nil })
	remote := targ.register(t, targ.alloc(t, 4096, 0), true)
	init := newSide(t, Config{Rails: 1})
	init.tr.SetNotify("initiator", func(*transport.Notification) error { return nil })
	local := init.alloc(t, 4096, 3)
	ep, err := init.tr.Open(context.Background(), targ.desc(targ.tr.Addr(), remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	comp := make(chanCompleter, 4)
	big := transport.Slice{Op: transport.Notify, Local: unsafe.Pointer(&local[0]), Length: 2000, Remote: 7, Token: 1}
	small := transport.Slice{Op: transport.Notify, Local: unsafe.Pointer(&local[0]), Length: 100, Remote: 8, Token: 2}
	if k, err := ep.Post(comp, []transport.Slice{big, small}); k != 2 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	got := comp.await(t, 2)
	if !errors.Is(got[1], transport.ErrRange) {
		t.Errorf("notification past MaxLength: %v; want ErrRange", got[1])
	}
	if got[2] != nil {
		t.Errorf("notification within MaxLength: %v", got[2])
	}
	if !railsUp(ep.(*Endpoint)) {
		t.Error("the rail went down")
	}
}
