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
	"context"
	"slices"
	"testing"
	"time"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// hang bounds every wait of the suite. It is a hang detector, not a
// performance assertion: a correct transport needs a tiny fraction of it.
const hang = 60 * time.Second

// Run runs the suite against the transports that newPair returns: the
// initiator opens endpoints and posts slices, the target registers the
// memory that the slices address. The subtests run under "Post". When the
// initiator's endpoints implement transport.Copier, they run a second time
// under "Copy", moving every slice with Copy, which the engine then calls
// instead of Post; when they move several at once (transport.BatchCopier),
// under "Batch", each Post's slices in one CopyBatch, as the engine moves
// a batch; and when they hold references (transport.HoldingCopier,
// transport.InlineCopier), under "Hold", as the engine's poller copies
// one-slice requests. A variant that cannot apply is not run
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
	if have[BatchCopier] {
		t.Run("Batch", func(t *testing.T) { runAll(t, suite{newPair: newPair, batch: true, skip: o.Skip}) })
	} else {
		t.Logf("transporttest: no Batch variant: the endpoints do not implement transport.BatchCopier")
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
var subtests = []string{"Basics", "ReadWriteSizes", "Bounds", "LocalOnlyDenied", "WrongKeyDenied", "PipelinedRefusals", "Concurrent",
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
	// batch moves each Post's slices with one call of the endpoint's
	// CopyBatch (transport.BatchCopier), as the engine's poller and copy
	// workers move a batch, and then completes them.
	batch bool
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
	run("PipelinedRefusals", testPipelinedRefusals)
	run("Concurrent", testConcurrent)
	run("PostAfterEndpointClose", testPostAfterEndpointClose)
	run("PostAfterInitiatorClose", closing(true))
	run("PostAfterTargetClose", closing(false))
	run("EndpointCloseInFlight", inFlight(closeEndpoint))
	run("InitiatorCloseInFlight", inFlight(closeInitiator))
	run("TargetCloseInFlight", inFlight(closeTarget))
	run("UnregisterTarget", testUnregisterTarget)
	if su.batch {
		run("InOrder", testBatchInOrder)
	}
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

// batchEndpoint moves the slices posted to it with one call of the
// endpoint's CopyBatch on the caller's goroutine, and then completes each
// with its result.
type batchEndpoint struct {
	transport.Endpoint
	bc transport.BatchCopier
}

func (e batchEndpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	errs := make([]error, len(s))
	e.bc.CopyBatch(s, errs)
	for i := range s {
		c.Complete(s[i].Token, errs[i])
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
