// Package transporttest is the conformance suite that every transport
// passes: the in-process transport now, TCP, shared memory, RDMA and EFA
// as they arrive. It drives a transport the way the engine does, through
// Register, Open, Post and a Completer, and checks what the engine relies
// on: bytes land where they were addressed and nowhere else, every accepted
// slice is completed exactly once, a peer refuses what it did not grant,
// and closing never strands a slice.
//
// # Lifetimes
//
// Run calls newPair once per subtest for two fresh transports and closes
// both when the subtest ends (some subtests close them earlier, on
// purpose); newPair must not close them itself. Memory the suite registers
// is Go memory, pinned by a segtable.Buffers table per side and unpinned at
// the end of each subtest.
package transporttest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// hang bounds every wait of the suite. It is a hang detector, not a
// performance assertion: a correct transport needs a tiny fraction of it.
const hang = 60 * time.Second

// page separates the suite's buffers; canary bytes fill the space between.
const page = 4096

// Sizes of the target's buffers. A is large enough for the 16 MiB transfer
// at an odd offset in the subtest that needs it (bigA) and 4 MiB elsewhere;
// B starts where A ends, so a range across the two is contiguous memory
// that no single buffer grants. L, the initiator's buffer, is as long as A.
const (
	bigA   = 16<<20 + 64<<10
	smallA = 4 << 20
	bLen   = 64 << 10
	cLen   = 64 << 10
	dLen   = 8 << 10
)

const canary = 0xA5

// Run runs the suite against the transports that newPair returns: the
// initiator opens endpoints and posts slices, the target registers the
// memory that the slices address. The subtests run under "Post". When the
// initiator's endpoints implement transport.Copier, they run a second time
// under "Copy", moving every slice with Copy, which the engine then calls
// instead of Post; and when they hold references (transport.HoldingCopier,
// transport.InlineCopier), a third time under "Hold", as the engine's
// poller copies one-slice requests. A variant that cannot apply is not run
// (the run's log says so), rather than skipped: a skip is kept for what the
// machine cannot give. Declare the interfaces the transport must have with
// RunWith's Options.Want, so that losing one fails the test instead of
// quietly running fewer variants.
func Run(t *testing.T, newPair func(t *testing.T) (initiator, target transport.Transport)) {
	RunWith(t, Options{}, newPair)
}

// Options adjust a run of the suite.
type Options struct {
	// Want lists the optional interfaces the transport must implement
	// (see Interface). Before the subtests, the suite opens one endpoint
	// on a pair from newPair and fails the test for each one missing. An
	// interface it implements and Want does not list is only logged.
	Want []Interface

	// Skip names subtests (as "UnregisterTarget") that the transport
	// cannot pass for a reason outside it, with that reason; they are
	// skipped loudly. A name that is not a subtest of the suite fails the
	// run, so a renamed subtest cannot be skipped silently.
	Skip map[string]string
}

// Interface names an optional interface of package transport, for
// Options.Want. The endpoint ones are looked for on an endpoint the
// initiator opened, the transport ones on both transports of the pair.
type Interface string

// The optional interfaces, by where they are implemented.
const (
	// The initiator's endpoints: Copier runs the Copy variant;
	// HoldingCopier or InlineCopier runs the Hold variant.
	Copier        Interface = "Copier"
	BatchCopier   Interface = "BatchCopier"
	InlineCopier  Interface = "InlineCopier"
	HoldingCopier Interface = "HoldingCopier"

	// Both transports.
	Notifier            Interface = "Notifier"
	ContextUnregisterer Interface = "ContextUnregisterer"
	Poller              Interface = "Poller"
	InFlight            Interface = "InFlight"
	Waker               Interface = "Waker"
	DeviceMemory        Interface = "DeviceMemory"
	Stager              Interface = "Stager"
)

// interfaces says, for each Interface, whether v implements it; the
// endpoint ones are asked of endpoints, the others of transports.
var interfaces = []struct {
	name     Interface
	endpoint bool
	is       func(v any) bool
}{
	{Copier, true, is[transport.Copier]},
	{BatchCopier, true, is[transport.BatchCopier]},
	{InlineCopier, true, is[transport.InlineCopier]},
	{HoldingCopier, true, is[transport.HoldingCopier]},
	{Notifier, false, is[transport.Notifier]},
	{ContextUnregisterer, false, is[transport.ContextUnregisterer]},
	{Poller, false, is[transport.Poller]},
	{InFlight, false, is[transport.InFlight]},
	{Waker, false, is[transport.Waker]},
	{DeviceMemory, false, is[transport.DeviceMemory]},
	{Stager, false, is[transport.Stager]},
}

func is[I any](v any) bool { _, ok := v.(I); return ok }

// RunWith is Run with options.
func RunWith(t *testing.T, o Options, newPair func(t *testing.T) (initiator, target transport.Transport)) {
	for name := range o.Skip {
		if !slices.Contains(subtests, name) {
			t.Fatalf("transporttest: no subtest %q to skip (have %v)", name, subtests)
		}
	}
	have, name := probe(t, newPair)
	for _, w := range o.Want {
		if _, known := have[w]; !known {
			t.Fatalf("transporttest: Options.Want names %q, which is no interface the suite knows", w)
		}
	}
	for _, w := range o.Want {
		if !have[w] {
			t.Errorf("transporttest: %s does not implement transport.%s, which its test wants (Options.Want)", name, w)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	for _, x := range interfaces {
		if have[x.name] && !slices.Contains(o.Want, x.name) {
			t.Logf("transporttest: %s implements transport.%s too, which Options.Want does not list: losing it would not fail this test", name, x.name)
		}
	}
	t.Run("Post", func(t *testing.T) { runAll(t, suite{newPair: newPair, skip: o.Skip}) })
	if have[Copier] {
		t.Run("Copy", func(t *testing.T) { runAll(t, suite{newPair: newPair, copy: true, skip: o.Skip}) })
	} else {
		t.Logf("transporttest: no Copy variant: the endpoints do not implement transport.Copier")
	}
	if have[HoldingCopier] || have[InlineCopier] {
		t.Run("Hold", func(t *testing.T) { runAll(t, suite{newPair: newPair, copy: true, hold: true, skip: o.Skip}) })
	} else {
		t.Logf("transporttest: no Hold variant: the endpoints hold no references (neither transport.HoldingCopier nor transport.InlineCopier)")
	}
}

// probe makes a pair with newPair, opens an endpoint to one buffer of the
// target, and reports which optional interfaces the endpoint and the
// transports implement, and the initiator's name. It closes everything
// before it returns.
func probe(t *testing.T, newPair func(t *testing.T) (initiator, target transport.Transport)) (map[Interface]bool, string) {
	t.Helper()
	it, tt := newPair(t)
	init := &side{tr: it, regs: map[*segtable.Buffer]segtable.Registration{}}
	targ := &side{tr: tt, regs: map[*segtable.Buffer]segtable.Registration{}}
	mem := make([]byte, page)
	defer func() {
		init.close(t)
		targ.close(t)
		ctx, cancel := context.WithTimeout(context.Background(), hang)
		defer cancel()
		for _, b := range targ.bufs.All() {
			if _, err := targ.bufs.Unregister(ctx, b.ID); err != nil {
				t.Errorf("segtable unregister: %v", err)
			}
		}
	}()
	b, reg := targ.register(t, mem, true)
	name := tt.Name()
	desc := &segtable.SegmentDesc{
		Version:   segtable.DescVersion,
		Name:      "transporttest-probe",
		Epoch:     1,
		Endpoints: map[string]string{name: tt.Endpoint()},
		Buffers:   []segtable.BufferDesc{{Addr: uint64(b.Addr), Length: b.Length, Keys: map[string]string{name: reg.Key}}},
	}
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	ep, err := it.Open(ctx, desc)
	if err != nil {
		t.Fatalf("%s: Open (to see which interfaces its endpoints implement): %v", it.Name(), err)
	}
	defer ep.Close()
	have := map[Interface]bool{}
	for _, x := range interfaces {
		if x.endpoint {
			have[x.name] = x.is(ep)
		} else {
			have[x.name] = x.is(it) && x.is(tt)
		}
	}
	return have, it.Name()
}

// subtests are the names runAll gives its subtests.
var subtests = []string{"Basics", "ReadWriteSizes", "Bounds", "LocalOnlyDenied", "WrongKeyDenied", "Concurrent",
	"PostAfterEndpointClose", "PostAfterInitiatorClose", "PostAfterTargetClose", "EndpointCloseInFlight",
	"InitiatorCloseInFlight", "TargetCloseInFlight", "UnregisterTarget"}

// suite is how a run of the suite reaches the transports.
type suite struct {
	newPair func(t *testing.T) (initiator, target transport.Transport)
	// copy moves slices with the endpoints' Copy method rather than Post.
	copy bool
	// hold (with copy) moves them as the engine's poller does with an
	// endpoint that can hold references (transport.HoldingCopier,
	// transport.InlineCopier): the references of a Post's slices are held
	// until all of them are done.
	hold bool
	// skip maps subtests to skip to the reason.
	skip map[string]string
}

func runAll(t *testing.T, su suite) {
	run := func(name string, fn func(t *testing.T, su suite)) {
		t.Run(name, func(t *testing.T) {
			if why, ok := su.skip[name]; ok {
				t.Skip("SKIP: " + why)
			}
			fn(t, su)
		})
	}
	closing := func(initiator bool) func(*testing.T, suite) {
		return func(t *testing.T, su suite) { testPostAfterTransportClose(t, su, initiator) }
	}
	inFlight := func(what int) func(*testing.T, suite) {
		return func(t *testing.T, su suite) { testCloseInFlight(t, su, what) }
	}
	run("Basics", testBasics)
	run("ReadWriteSizes", testReadWriteSizes)
	run("Bounds", testBounds)
	run("LocalOnlyDenied", testLocalOnly)
	run("WrongKeyDenied", testWrongKey)
	run("Concurrent", testConcurrent)
	run("PostAfterEndpointClose", testPostAfterEndpointClose)
	run("PostAfterInitiatorClose", closing(true))
	run("PostAfterTargetClose", closing(false))
	run("EndpointCloseInFlight", inFlight(closeEndpoint))
	run("InitiatorCloseInFlight", inFlight(closeInitiator))
	run("TargetCloseInFlight", inFlight(closeTarget))
	run("UnregisterTarget", testUnregisterTarget)
}

// copyEndpoint moves the slices posted to it with the endpoint's Copy, one
// by one on the caller's goroutine, and completes each with its result.
type copyEndpoint struct {
	transport.Endpoint
	cp transport.Copier
}

func (e copyEndpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	for i := range s {
		c.Complete(s[i].Token, e.cp.Copy(&s[i]))
	}
	return len(s), nil
}

// holdEndpoint moves the slices posted to it as the engine's poller moves
// a round's one-slice requests: with CopyHold, or CopyNow and Copy for the
// slices CopyNow leaves, holding the references in one Holds that it gives
// back after the last slice. Each slice completes as soon as it moved.
type holdEndpoint struct{ transport.Endpoint }

func (e holdEndpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	var h transport.Holds
	for i := range s {
		var err error
		switch cp := e.Endpoint.(type) {
		case transport.InlineCopier:
			var done bool
			if done, err = cp.CopyNow(&s[i], &h); !done {
				err = cp.Copy(&s[i])
			}
		case transport.HoldingCopier:
			err = cp.CopyHold(&s[i], &h)
		}
		c.Complete(s[i].Token, err)
	}
	h.Release()
	return len(s), nil
}

// side is one transport with its table of registered memory.
type side struct {
	tr     transport.Transport
	bufs   segtable.Buffers
	regs   map[*segtable.Buffer]segtable.Registration
	closed bool
}

func (s *side) register(t *testing.T, mem []byte, remote bool) (*segtable.Buffer, segtable.Registration) {
	t.Helper()
	b, err := s.bufs.Register(mem, "", remote)
	if err != nil {
		t.Fatalf("segtable register: %v", err)
	}
	reg, err := s.tr.Register(b)
	if err != nil {
		t.Fatalf("%s: Register(%d bytes, remote %v): %v", s.tr.Name(), len(mem), remote, err)
	}
	b.Regs[0].Store(&reg)
	s.regs[b] = reg
	return b, reg
}

func (s *side) close(t *testing.T) {
	t.Helper()
	if s.closed {
		return
	}
	s.closed = true
	if err := s.tr.Close(); err != nil {
		t.Errorf("%s: Close: %v", s.tr.Name(), err)
	}
}

// fixture is the memory of one subtest. On the target, one arena holds
//
//	canary | A | B | gap (canary) | C | canary | D (local-only) | canary
//
// with A, B and C remote-accessible; on the initiator an arena holds the
// local buffer L between canaries.
type fixture struct {
	t          *testing.T
	init, targ *side
	tarena     []byte
	iarena     []byte
	a, b, c, d *segtable.Buffer
	l          *segtable.Buffer
	desc       *segtable.SegmentDesc
	tokens     atomic.Uint64
	copy       bool // open copyEndpoints
	hold       bool // open holdEndpoints
}

func newFixture(t *testing.T, su suite) *fixture {
	t.Helper()
	return newFixtureSize(t, su, smallA)
}

func newFixtureSize(t *testing.T, su suite, aLen int) *fixture {
	t.Helper()
	it, tt := su.newPair(t)
	f := &fixture{
		t:    t,
		copy: su.copy,
		hold: su.hold,
		init: &side{tr: it, regs: map[*segtable.Buffer]segtable.Registration{}},
		targ: &side{tr: tt, regs: map[*segtable.Buffer]segtable.Registration{}},
	}
	t.Cleanup(func() {
		f.init.close(t)
		f.targ.close(t)
		// Unpin: a Pinner still holding memory when collected is fatal.
		ctx, cancel := context.WithTimeout(context.Background(), hang)
		defer cancel()
		for _, s := range []*side{f.init, f.targ} {
			for _, b := range s.bufs.All() {
				if _, err := s.bufs.Unregister(ctx, b.ID); err != nil {
					t.Errorf("segtable unregister: %v", err)
				}
			}
		}
	})
	offA := page
	offB := offA + aLen
	offGap := offB + bLen
	offC := offGap + page
	offD := offC + cLen + page
	f.tarena = make([]byte, offD+dLen+page)
	f.iarena = make([]byte, page+aLen+page)
	f.resetArenas()
	f.a, _ = f.targ.register(t, f.tarena[offA:offB], true)
	f.b, _ = f.targ.register(t, f.tarena[offB:offGap], true)
	f.c, _ = f.targ.register(t, f.tarena[offC:offC+cLen], true)
	f.d, _ = f.targ.register(t, f.tarena[offD:offD+dLen], false)
	f.l, _ = f.init.register(t, f.iarena[page:page+aLen], false)
	f.desc = f.makeDesc(nil)
	return f
}

// makeDesc describes the target's buffers, D (local-only) included with its
// key: the target must refuse D itself, whatever the descriptor says. key,
// when not nil, rewrites the key published for a buffer.
func (f *fixture) makeDesc(key func(b *segtable.Buffer, k string) string) *segtable.SegmentDesc {
	name := f.targ.tr.Name()
	d := &segtable.SegmentDesc{
		Version:   segtable.DescVersion,
		Name:      "transporttest-target",
		Epoch:     1,
		Endpoints: map[string]string{name: f.targ.tr.Endpoint()},
	}
	for _, b := range []*segtable.Buffer{f.a, f.b, f.c, f.d} {
		k := f.targ.regs[b].Key
		if key != nil {
			k = key(b, k)
		}
		d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length, Keys: map[string]string{name: k}})
	}
	slices.SortFunc(d.Buffers, func(x, y segtable.BufferDesc) int {
		switch {
		case x.Addr < y.Addr:
			return -1
		case x.Addr > y.Addr:
			return 1
		}
		return 0
	})
	if err := d.Validate(); err != nil {
		f.t.Fatalf("suite built a bad descriptor: %v", err)
	}
	return d
}

func (f *fixture) resetArenas() {
	for i := range f.tarena {
		f.tarena[i] = canary
	}
	for i := range f.iarena {
		f.iarena[i] = canary
	}
}

func (f *fixture) open(desc *segtable.SegmentDesc) transport.Endpoint {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	ep, err := f.init.tr.Open(ctx, desc)
	if err != nil {
		f.t.Fatalf("%s: Open: %v", f.init.tr.Name(), err)
	}
	if ep.Rails() < 1 {
		f.t.Fatalf("%s: Rails() = %d, want >= 1", f.init.tr.Name(), ep.Rails())
	}
	f.t.Cleanup(func() { ep.Close() })
	if f.hold {
		switch ep.(type) {
		case transport.HoldingCopier, transport.InlineCopier:
			return holdEndpoint{ep}
		}
		// The probe's endpoint held references; this one does not.
		f.t.Fatalf("%s: endpoint %T holds no references (neither transport.HoldingCopier nor transport.InlineCopier), though the first one opened did", f.init.tr.Name(), ep)
	}
	if f.copy {
		cp, ok := ep.(transport.Copier)
		if !ok {
			f.t.Fatalf("%s: endpoint %T does not implement transport.Copier, though the first one opened did", f.init.tr.Name(), ep)
		}
		return copyEndpoint{ep, cp}
	}
	return ep
}

// slice builds one slice from local offset loff of L to remote address
// raddr, with a fresh token.
func (f *fixture) slice(op transport.Op, loff uint64, raddr, n uint64, rail int) transport.Slice {
	return transport.Slice{
		Op: op, Rail: uint16(rail), LocalHandle: f.init.regs[f.l].Handle,
		Local: f.l.Pointer(loff), Remote: raddr, Length: n, Token: f.tokens.Add(1),
	}
}

// cut splits a transfer of n bytes into slices no longer than the
// transport's slice size (1 MiB when it names none), spread over the rails.
func (f *fixture) cut(ep transport.Endpoint, op transport.Op, loff uint64, raddr, n uint64) []transport.Slice {
	max := f.init.tr.SliceSize()
	if max == 0 {
		max = 1 << 20
	}
	var s []transport.Slice
	for off := uint64(0); off < n; off += max {
		s = append(s, f.slice(op, loff+off, raddr+off, min(max, n-off), len(s)%ep.Rails()))
	}
	return s
}

// collector is the suite's Completer: it records every completion and
// reports a token completed twice or never posted.
type collector struct {
	mu     sync.Mutex
	got    map[uint64]error
	dups   []uint64
	signal chan struct{}
}

func newCollector() *collector {
	return &collector{got: map[uint64]error{}, signal: make(chan struct{}, 1)}
}

func (c *collector) Complete(token uint64, err error) {
	c.mu.Lock()
	if _, ok := c.got[token]; ok {
		c.dups = append(c.dups, token)
	}
	c.got[token] = err
	c.mu.Unlock()
	select {
	case c.signal <- struct{}{}:
	default:
	}
}

func (c *collector) completed(token uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.got[token]
	return ok
}

func (c *collector) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.got)
}

// await waits until every token of s has completed and returns their
// errors in order, or an error wrapping errHang.
func (c *collector) await(s []transport.Slice) ([]error, error) {
	deadline := time.Now().Add(hang)
	for {
		c.mu.Lock()
		done := 0
		for i := range s {
			if _, ok := c.got[s[i].Token]; ok {
				done++
			}
		}
		c.mu.Unlock()
		if done == len(s) {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w: %d of %d slices completed after %v", errHang, done, len(s), hang)
		}
		select {
		case <-c.signal:
		case <-time.After(10 * time.Millisecond):
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	errs := make([]error, len(s))
	for i := range s {
		errs[i] = c.got[s[i].Token]
	}
	return errs, nil
}

// wait is await on the test goroutine.
func (c *collector) wait(t *testing.T, s []transport.Slice) []error {
	t.Helper()
	errs, err := c.await(s)
	if err != nil {
		t.Fatal(err)
	}
	return errs
}

var errHang = errors.New("transporttest: hang")

// check reports tokens completed twice or completed without being accepted.
func (c *collector) check(t *testing.T, accepted map[uint64]bool) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.dups) > 0 {
		t.Errorf("%d slices completed more than once (tokens %v)", len(c.dups), c.dups[:min(len(c.dups), 8)])
	}
	if accepted == nil {
		return
	}
	for tok := range c.got {
		if !accepted[tok] {
			t.Errorf("token %d completed but Post never accepted it", tok)
		}
	}
	for tok := range accepted {
		if _, ok := c.got[tok]; !ok {
			t.Errorf("token %d accepted but never completed", tok)
		}
	}
}

// post posts every slice of s, retrying the rest when the endpoint is full
// (Post's backpressure contract). It returns how many were accepted and
// Post's error, if any stopped it, or an error wrapping errHang when the
// endpoint never took them.
func post(ep transport.Endpoint, c transport.Completer, s []transport.Slice) (int, error) {
	done := 0
	deadline := time.Now().Add(hang)
	for done < len(s) {
		n, err := ep.Post(c, s[done:])
		if n < 0 || n > len(s)-done {
			return done, fmt.Errorf("%w: Post of %d slices returned %d", errHang, len(s)-done, n)
		}
		done += n
		if err != nil {
			return done, err
		}
		if done < len(s) {
			if time.Now().After(deadline) {
				return done, fmt.Errorf("%w: endpoint took %d of %d slices in %v", errHang, done, len(s), hang)
			}
			if n == 0 {
				time.Sleep(10 * time.Microsecond)
			}
			runtime.Gosched()
		}
	}
	return done, nil
}

// mustPost is post on the test goroutine: a hang is fatal.
func mustPost(t *testing.T, ep transport.Endpoint, c transport.Completer, s []transport.Slice) (int, error) {
	t.Helper()
	n, err := post(ep, c, s)
	if errors.Is(err, errHang) {
		t.Fatal(err)
	}
	return n, err
}

// run posts s, waits for all and returns their errors; a Post error fails
// the test.
func (f *fixture) run(ep transport.Endpoint, c *collector, s []transport.Slice) []error {
	f.t.Helper()
	if n, err := mustPost(f.t, ep, c, s); err != nil {
		f.t.Fatalf("Post accepted %d of %d slices: %v", n, len(s), err)
	}
	return c.wait(f.t, s)
}

// runOne posts one slice and returns its completion error, or Post's error
// when Post refused it.
func (f *fixture) runOne(ep transport.Endpoint, c *collector, s transport.Slice) error {
	f.t.Helper()
	one := []transport.Slice{s}
	if n, err := mustPost(f.t, ep, c, one); err != nil {
		if n != 0 {
			f.t.Fatalf("Post accepted %d of 1 slice and failed: %v", n, err)
		}
		return fmt.Errorf("post: %w", err)
	}
	return c.wait(f.t, one)[0]
}

// tOff returns the offset in the target arena of address addr.
func (f *fixture) tOff(addr uint64) int {
	return int(addr - uint64(uintptr(unsafe.Pointer(unsafe.SliceData(f.tarena)))))
}

// expectArena compares a whole arena with want and reports the first
// differing byte.
func expectArena(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if i := testpattern.FirstDiff(got, want); i >= 0 {
		t.Fatalf("%s: byte %d of the arena is %#x, want %#x (a byte outside the addressed range changed, or the data is wrong)", what, i, got[i], want[i])
	}
}

func testBasics(t *testing.T, su suite) {
	f := newFixture(t, su)
	if f.init.tr.Name() == "" || f.targ.tr.Name() != f.init.tr.Name() {
		t.Fatalf("names %q and %q: want the same non-empty name", f.init.tr.Name(), f.targ.tr.Name())
	}
	if s := f.init.tr.SliceSize(); s != 0 && s < 4096 {
		t.Errorf("SliceSize() = %d: a positive slice size below 4 KiB makes no sense", s)
	}
	ep := f.open(f.desc)
	c := newCollector()
	// An empty post accepts nothing and completes nothing.
	if n, err := ep.Post(c, nil); n != 0 || err != nil {
		t.Fatalf("Post(nil) = %d, %v; want 0, nil", n, err)
	}
	if c.count() != 0 {
		t.Fatalf("Post(nil) completed %d slices", c.count())
	}
}

func testReadWriteSizes(t *testing.T, su suite) {
	f := newFixtureSize(t, su, bigA)
	ep := f.open(f.desc)
	c := newCollector()
	accepted := map[uint64]bool{}
	sizes := []uint64{1, 7, 4 << 10, 64<<10 + 3, 1 << 20, 16 << 20}
	offsets := []uint64{0, 1, 3, 4093, 4097}
	wantT := slices.Clone(f.tarena)
	wantI := slices.Clone(f.iarena)
	aOff := f.tOff(uint64(f.a.Addr))
	lOff := page
	for i, n := range sizes {
		for j, off := range offsets {
			if off+n > bigA {
				continue
			}
			// Only the largest size is expensive; one odd offset suffices.
			if n == 16<<20 && off != 4097 {
				continue
			}
			loff := uint64((j*7 + 5) % 61) // a different odd-ish local offset
			seed := uint64(i*100 + j)

			// WRITE: L[loff:] -> A[off:].
			src := f.iarena[lOff+int(loff) : lOff+int(loff+n)]
			testpattern.Fill(src, seed)
			copy(wantI[lOff+int(loff):], src)
			s := f.cut(ep, transport.Write, loff, uint64(f.a.Addr)+off, n)
			for i, err := range f.run(ep, c, s) {
				if err != nil {
					t.Fatalf("WRITE %d bytes at offset %d, slice %d: %v", n, off, i, err)
				}
				accepted[s[i].Token] = true
			}
			copy(wantT[aOff+int(off):], src)
			expectArena(t, fmt.Sprintf("target after WRITE of %d bytes at A+%d", n, off), f.tarena, wantT)
			expectArena(t, fmt.Sprintf("initiator after WRITE of %d bytes", n), f.iarena, wantI)

			// READ: A[off:] (new content) -> L[loff+1:].
			remote := f.tarena[aOff+int(off) : aOff+int(off+n)]
			testpattern.Fill(remote, seed+7)
			copy(wantT[aOff+int(off):], remote)
			s = f.cut(ep, transport.Read, loff+1, uint64(f.a.Addr)+off, n)
			for i, err := range f.run(ep, c, s) {
				if err != nil {
					t.Fatalf("READ %d bytes at offset %d, slice %d: %v", n, off, i, err)
				}
				accepted[s[i].Token] = true
			}
			copy(wantI[lOff+int(loff+1):], remote)
			expectArena(t, fmt.Sprintf("initiator after READ of %d bytes from A+%d", n, off), f.iarena, wantI)
			expectArena(t, fmt.Sprintf("target after READ of %d bytes", n), f.tarena, wantT)
		}
	}
	// B and C work as well (they are not A's neighbours by accident).
	for _, b := range []*segtable.Buffer{f.b, f.c} {
		n := b.Length
		src := f.iarena[lOff : lOff+int(n)]
		testpattern.Fill(src, uint64(b.Addr))
		copy(wantI[lOff:], src)
		s := f.cut(ep, transport.Write, 0, uint64(b.Addr), n)
		for i, err := range f.run(ep, c, s) {
			if err != nil {
				t.Fatalf("WRITE all of a %d-byte buffer: %v", n, err)
			}
			accepted[s[i].Token] = true
		}
		copy(wantT[f.tOff(uint64(b.Addr)):], src)
		expectArena(t, "target after WRITE of a whole buffer", f.tarena, wantT)
	}
	c.check(t, accepted)
}

// refused posts s alone and checks that it fails with an error wrapping
// ErrRange or ErrDenied (only ErrDenied when deniedOnly) and that neither
// arena changed.
func (f *fixture) refused(ep transport.Endpoint, c *collector, what string, s transport.Slice, deniedOnly bool) {
	f.t.Helper()
	wantT := slices.Clone(f.tarena)
	wantI := slices.Clone(f.iarena)
	err := f.runOne(ep, c, s)
	switch {
	case err == nil:
		f.t.Errorf("%s: %v of %d bytes at %#x succeeded; want a refusal", what, s.Op, s.Length, s.Remote)
	case deniedOnly && !errors.Is(err, transport.ErrDenied):
		f.t.Errorf("%s: error %v; want one wrapping transport.ErrDenied", what, err)
	case !errors.Is(err, transport.ErrDenied) && !errors.Is(err, transport.ErrRange):
		f.t.Errorf("%s: error %v; want one wrapping transport.ErrRange or ErrDenied (final errors: the engine must not retry them)", what, err)
	}
	expectArena(f.t, what+": target", f.tarena, wantT)
	expectArena(f.t, what+": initiator", f.iarena, wantI)
}

func (op opName) String() string { return [...]string{"op0", "READ", "WRITE"}[op] }

type opName transport.Op

func testBounds(t *testing.T, su suite) {
	f := newFixture(t, su)
	ep := f.open(f.desc)
	c := newCollector()
	aEnd := uint64(f.a.Addr) + f.a.Length
	bEnd := uint64(f.b.Addr) + f.b.Length
	cAddr, cEnd := uint64(f.c.Addr), uint64(f.c.Addr)+f.c.Length
	cases := []struct {
		name   string
		remote uint64
		n      uint64
	}{
		{"past the end of C", cEnd - 10, 20},
		{"one byte past the end of C", cEnd, 1},
		{"in the gap between B and C", bEnd + 1, 10},
		{"the whole gap", bEnd, page},
		{"straddling adjacent A and B", aEnd - 5, 10},
		{"straddling B, the gap and C", bEnd - 5, page + 10},
		{"before A", uint64(f.a.Addr) - 1, 2},
		{"below every buffer", uint64(f.a.Addr) - page, 16},
		{"C and one byte more", cAddr, f.c.Length + 1},
		{"address wrapping around", math.MaxUint64 - 3, 8},
		{"huge length", uint64(f.a.Addr), 1 << 62},
		{"huge length ending in range", uint64(f.c.Addr) + 8, math.MaxUint64 - 4},
	}
	for _, tc := range cases {
		for _, op := range []transport.Op{transport.Read, transport.Write} {
			s := f.slice(op, 0, tc.remote, tc.n, 0)
			f.refused(ep, c, fmt.Sprintf("%s %s", opName(op), tc.name), s, false)
		}
	}
	c.check(t, nil)
}

func testLocalOnly(t *testing.T, su suite) {
	f := newFixture(t, su)
	ep := f.open(f.desc) // the descriptor lists D with its real key
	c := newCollector()
	for i := range f.iarena[page : page+int(dLen)] {
		f.iarena[page+i] = byte(i)
	}
	d := uint64(f.d.Addr)
	for _, op := range []transport.Op{transport.Read, transport.Write} {
		f.refused(ep, c, fmt.Sprintf("%s of all of local-only D", opName(op)), f.slice(op, 0, d, dLen, 0), true)
		f.refused(ep, c, fmt.Sprintf("%s of 1 byte of local-only D", opName(op)), f.slice(op, 0, d+17, 1, 0), true)
	}
	c.check(t, nil)
}

func testWrongKey(t *testing.T, su suite) {
	f := newFixture(t, su)
	c := newCollector()
	regs := f.targ.regs
	variants := []struct {
		name string
		key  func(b *segtable.Buffer, k string) string
	}{
		// Another buffer's key: well formed, granted, but not for A.
		{"another buffer's key", func(b *segtable.Buffer, k string) string {
			if b == f.a {
				return regs[f.c].Key
			}
			return k
		}},
		{"a garbled key", func(b *segtable.Buffer, k string) string {
			if b == f.a {
				return "not-a-key-" + k + "-x"
			}
			return k
		}},
		{"no key", func(b *segtable.Buffer, k string) string {
			if b == f.a {
				return ""
			}
			return k
		}},
	}
	if regs[f.a].Key == "" {
		t.Skipf("%s publishes no keys", f.targ.tr.Name())
	}
	for _, v := range variants {
		ep := f.open(f.makeDesc(v.key))
		for _, op := range []transport.Op{transport.Read, transport.Write} {
			f.refused(ep, c, fmt.Sprintf("%s of A with %s", opName(op), v.name), f.slice(op, 0, uint64(f.a.Addr)+3, 100, 0), true)
		}
		// The same endpoint still reaches C, whose key is right.
		if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.c.Addr), 100, 0)); err != nil {
			t.Errorf("WRITE to C with the right key through the endpoint with %s: %v", v.name, err)
		}
	}
	c.check(t, nil)
}

func testConcurrent(t *testing.T, su suite) {
	f := newFixture(t, su)
	const (
		workers = 4
		rounds  = 20
		perPost = 8
		region  = 256 << 10 // per worker, in A and in L
	)
	c := newCollector()
	var mu sync.Mutex
	accepted := map[uint64]bool{}
	aOff := f.tOff(uint64(f.a.Addr))
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		// Post is called by one goroutine at a time per endpoint: each
		// worker opens its own, and they share the Completer.
		ep := f.open(f.desc)
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			base := uint64(w * region)
			for r := 0; r < rounds; r++ {
				// perPost disjoint pieces of the worker's region.
				piece := uint64(region / perPost)
				var ws, rs []transport.Slice
				for i := 0; i < perPost; i++ {
					n := 1 + rng.Uint64N(piece/2-1)
					off := base + uint64(i)*piece + rng.Uint64N(piece/2)
					src := f.iarena[page+int(off) : page+int(off+n)]
					testpattern.Fill(src, uint64(w<<20|r<<8|i))
					ws = append(ws, f.slice(transport.Write, off, uint64(f.a.Addr)+off, n, i%ep.Rails()))
				}
				n, err := post(ep, c, ws)
				mu.Lock()
				for _, s := range ws[:n] {
					accepted[s.Token] = true
				}
				mu.Unlock()
				if err != nil {
					errs <- fmt.Errorf("worker %d: Post: %v", w, err)
					return
				}
				werrs, err := c.await(ws)
				if err != nil {
					errs <- fmt.Errorf("worker %d: %v", w, err)
					return
				}
				for i, err := range werrs {
					if err != nil {
						errs <- fmt.Errorf("worker %d: WRITE: %v", w, err)
						return
					}
					off := ws[i].Remote - uint64(f.a.Addr)
					if !bytes.Equal(f.tarena[aOff+int(off):aOff+int(off+ws[i].Length)], f.iarena[page+int(off):page+int(off+ws[i].Length)]) {
						errs <- fmt.Errorf("worker %d: WRITE of %d bytes at A+%d: data differs", w, ws[i].Length, off)
						return
					}
					// Read it back into the second half of the piece.
					back := off + piece/2
					if back+ws[i].Length > base+uint64(i+1)*piece {
						back = base + uint64(i)*piece + piece/2
					}
					rs = append(rs, f.slice(transport.Read, back, ws[i].Remote, ws[i].Length, i%ep.Rails()))
				}
				n, err = post(ep, c, rs)
				mu.Lock()
				for _, s := range rs[:n] {
					accepted[s.Token] = true
				}
				mu.Unlock()
				if err != nil {
					errs <- fmt.Errorf("worker %d: Post: %v", w, err)
					return
				}
				rerrs, err := c.await(rs)
				if err != nil {
					errs <- fmt.Errorf("worker %d: %v", w, err)
					return
				}
				for i, err := range rerrs {
					if err != nil {
						errs <- fmt.Errorf("worker %d: READ: %v", w, err)
						return
					}
					loff := uint64(uintptr(rs[i].Local) - f.l.Addr)
					roff := rs[i].Remote - uint64(f.a.Addr)
					if !bytes.Equal(f.iarena[page+int(loff):page+int(loff+rs[i].Length)], f.tarena[aOff+int(roff):aOff+int(roff+rs[i].Length)]) {
						errs <- fmt.Errorf("worker %d: READ of %d bytes from A+%d: data differs", w, rs[i].Length, roff)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	c.check(t, accepted)
	// Nothing outside the workers' regions of A was written.
	for i := aOff + workers*region; i < len(f.tarena); i++ {
		if f.tarena[i] != canary {
			t.Fatalf("target byte %d outside every addressed range changed", i)
		}
	}
	for i := 0; i < aOff; i++ {
		if f.tarena[i] != canary {
			t.Fatalf("target byte %d before A changed", i)
		}
	}
}

// closedOK checks the outcome of posting s after something closed: Post
// may refuse it with an error, or accept it and complete it with one; either
// way nothing may move. Only the bytes s addresses (and a margin) are
// compared: over a network, slices accepted before the Close may still land
// elsewhere in the target's memory, which the suite must not read while the
// target writes it.
func (f *fixture) closedOK(ep transport.Endpoint, c *collector, what string, s transport.Slice) {
	f.t.Helper()
	tw := window(f.tarena, uintptr(s.Remote), s.Length)
	iw := window(f.iarena, uintptr(s.Local), s.Length)
	wantT := slices.Clone(tw)
	wantI := slices.Clone(iw)
	if err := f.runOne(ep, c, s); err == nil {
		f.t.Errorf("%s: slice succeeded; want an error", what)
	}
	expectArena(f.t, what+": target", tw, wantT)
	expectArena(f.t, what+": initiator", iw, wantI)
}

// window returns the part of arena that [addr, addr+n) touches, widened by
// 64 bytes on each side and clipped to the arena.
func window(arena []byte, addr uintptr, n uint64) []byte {
	base := uintptr(unsafe.Pointer(unsafe.SliceData(arena)))
	lo := int(addr-base) - 64
	hi := int(addr-base) + int(n) + 64
	return arena[max(lo, 0):min(max(hi, 0), len(arena))]
}

func testPostAfterEndpointClose(t *testing.T, su suite) {
	f := newFixture(t, su)
	ep := f.open(f.desc)
	other := f.open(f.desc)
	c := newCollector()
	testpattern.Fill(f.iarena[page:page+4096], 1)
	if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.a.Addr), 4096, 0)); err != nil {
		t.Fatalf("WRITE before Close: %v", err)
	}
	if err := ep.Close(); err != nil {
		t.Fatalf("endpoint Close: %v", err)
	}
	for _, op := range []transport.Op{transport.Read, transport.Write} {
		f.closedOK(ep, c, fmt.Sprintf("%s after endpoint Close", opName(op)), f.slice(op, 0, uint64(f.a.Addr)+8192, 4096, 0))
	}
	// Closing one endpoint leaves the others alone.
	if err := f.runOne(other, c, f.slice(transport.Write, 0, uint64(f.a.Addr)+8192, 4096, 0)); err != nil {
		t.Errorf("WRITE through another endpoint after one closed: %v", err)
	}
	c.check(t, nil)
}

func testPostAfterTransportClose(t *testing.T, su suite, initiator bool) {
	f := newFixture(t, su)
	ep := f.open(f.desc)
	c := newCollector()
	if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.a.Addr), 64, 0)); err != nil {
		t.Fatalf("WRITE before Close: %v", err)
	}
	who := "target"
	if initiator {
		who = "initiator"
		f.init.close(t)
	} else {
		f.targ.close(t)
	}
	for _, op := range []transport.Op{transport.Read, transport.Write} {
		f.closedOK(ep, c, fmt.Sprintf("%s after %s Close", opName(op), who), f.slice(op, 0, uint64(f.a.Addr)+128, 64, 0))
	}
	if initiator {
		ctx, cancel := context.WithTimeout(context.Background(), hang)
		defer cancel()
		if ep2, err := f.init.tr.Open(ctx, f.desc); err == nil {
			ep2.Close()
			t.Errorf("Open after the initiator's Close succeeded")
		}
	}
	c.check(t, nil)
}

const (
	closeEndpoint = iota
	closeInitiator
	closeTarget
)

func testCloseInFlight(t *testing.T, su suite, what int) {
	f := newFixture(t, su)
	const workers = 3
	c := newCollector()
	var mu sync.Mutex
	accepted := map[uint64]bool{}
	eps := make([]transport.Endpoint, workers)
	for i := range eps {
		eps[i] = f.open(f.desc)
	}
	var (
		wg      sync.WaitGroup
		started sync.WaitGroup
		stop    atomic.Bool
	)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		started.Add(1)
		go func() {
			defer wg.Done()
			ep := eps[w]
			first := true
			// Each of 16 regions (of L and of A) takes a new slice only
			// once its last one completed: slices in flight never share a
			// byte, so an asynchronous transport's copies do not race.
			var last [16]uint64
			var ks []int
			for i := 0; !stop.Load(); i++ {
				var s []transport.Slice
				ks = ks[:0]
				for k := range last {
					if last[k] != 0 && !c.completed(last[k]) {
						continue
					}
					off := uint64(w<<20 + k<<16)
					s = append(s, f.slice(transport.Op(1+(i+k)%2), off, uint64(f.a.Addr)+off, 1+uint64(i*k%4096), k%ep.Rails()))
					ks = append(ks, k)
				}
				if len(s) == 0 {
					runtime.Gosched()
					continue
				}
				n, err := ep.Post(c, s)
				mu.Lock()
				for j, x := range s[:n] {
					accepted[x.Token] = true
					last[ks[j]] = x.Token
				}
				mu.Unlock()
				if first {
					first = false
					started.Done()
				}
				if err != nil {
					return // the endpoint cannot take slices any more
				}
				if n < len(s) {
					runtime.Gosched()
				}
			}
		}()
	}
	started.Wait()
	time.Sleep(time.Millisecond) // let the posting overlap Close; not a timing assertion
	switch what {
	case closeEndpoint:
		for _, ep := range eps {
			if err := ep.Close(); err != nil {
				t.Errorf("endpoint Close: %v", err)
			}
		}
	case closeInitiator:
		f.init.close(t)
	case closeTarget:
		f.targ.close(t)
	}
	// Posting goes on for a while after Close, then stops.
	time.Sleep(time.Millisecond)
	stop.Store(true)
	wg.Wait()
	mu.Lock()
	all := make([]transport.Slice, 0, len(accepted))
	for tok := range accepted {
		all = append(all, transport.Slice{Token: tok})
	}
	mu.Unlock()
	c.wait(t, all)
	// No completion arrives twice or for a slice never accepted.
	c.check(t, accepted)
	// After Close every new slice fails.
	for w, ep := range eps {
		c2 := newCollector()
		f.closedOK(ep, c2, fmt.Sprintf("WRITE on endpoint %d after Close", w), f.slice(transport.Write, 0, uint64(f.c.Addr), 8, 0))
	}
	if len(accepted) == 0 {
		t.Fatalf("no slice was accepted before Close: the test proved nothing")
	}
}

func testUnregisterTarget(t *testing.T, su suite) {
	f := newFixture(t, su)
	ep := f.open(f.desc)
	c := newCollector()
	testpattern.Fill(f.iarena[page:page+4096], 3)
	if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.c.Addr), 4096, 0)); err != nil {
		t.Fatalf("WRITE to C before Unregister: %v", err)
	}
	if err := f.targ.tr.Unregister(f.c, f.targ.regs[f.c]); err != nil {
		t.Fatalf("target Unregister(C): %v", err)
	}
	for _, op := range []transport.Op{transport.Read, transport.Write} {
		f.closedOK(ep, c, fmt.Sprintf("%s to C after the target unregistered it", opName(op)), f.slice(op, 0, uint64(f.c.Addr)+5, 100, 0))
	}
	// The other buffers are untouched by C's unregistration.
	if err := f.runOne(ep, c, f.slice(transport.Write, 0, uint64(f.b.Addr), 4096, 0)); err != nil {
		t.Errorf("WRITE to B after C was unregistered: %v", err)
	}
	c.check(t, nil)
}
