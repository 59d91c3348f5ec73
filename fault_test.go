package moonring_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// hangLimit bounds every wait of these tests: a hang detector, never a
// performance assertion.
const hangLimit = 30 * time.Second

// faultName is the name under which faultTransport is installed.
const faultName = "fault"

// faultTransport is the in-process transport under another name, with
// knobs to hold slices until the test releases them and to fail them. It
// delegates the copying, keys and checks to a local.Transport of its own,
// so data moves as it would. Install one on both engines; the initiator's
// Config.Transports names faultName so OpenSegment chooses it.
type faultTransport struct {
	inner *local.Transport
	name  string // faultName unless set

	mu      sync.Mutex
	hold    bool
	held    []heldSlice
	fail    error
	openErr error // Open fails with it when set
	copier  bool  // endpoints are transport.Copiers (set before Open)
	opens   int
	posted  int
}

type heldSlice struct {
	ep *faultEndpoint
	c  transport.Completer
	s  transport.Slice
}

var _ transport.Transport = (*faultTransport)(nil)

func newFaultTransport() *faultTransport { return &faultTransport{inner: local.New()} }

func (f *faultTransport) Name() string {
	if f.name != "" {
		return f.name
	}
	return faultName
}
func (f *faultTransport) Endpoint() string  { return f.inner.Endpoint() }
func (f *faultTransport) SliceSize() uint64 { return 0 }

func (f *faultTransport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	return f.inner.Register(b)
}

func (f *faultTransport) Unregister(b *segtable.Buffer, r segtable.Registration) error {
	return f.inner.Unregister(b, r)
}

// asLocal rewrites desc so that the inner local transport reads the
// endpoint and keys of the transport named name as its own.
func asLocal(d *segtable.SegmentDesc, name string) *segtable.SegmentDesc {
	c := d.Clone()
	c.Endpoints = map[string]string{local.Name: d.Endpoints[name]}
	for i := range c.Buffers {
		c.Buffers[i].Keys = map[string]string{local.Name: c.Buffers[i].Keys[name]} // c is flat (Clone), d may be Chunked
	}
	return c
}

func (f *faultTransport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	f.mu.Lock()
	f.opens++
	openErr := f.openErr
	f.mu.Unlock()
	if openErr != nil {
		return nil, openErr
	}
	ep, err := f.inner.Open(ctx, asLocal(desc, f.Name()))
	if err != nil {
		return nil, err
	}
	if f.copier {
		return &faultCopyEndpoint{faultEndpoint{t: f, inner: ep}}, nil
	}
	return &faultEndpoint{t: f, inner: ep}, nil
}

// faultCopyEndpoint is a faultEndpoint that the ring copies through
// synchronously (a transport.Copier, as shm and local are), failing with
// the transport's fail error when set.
type faultCopyEndpoint struct{ faultEndpoint }

func (e *faultCopyEndpoint) Copy(s *transport.Slice) error {
	f := e.t
	f.mu.Lock()
	f.posted++
	fail := f.fail
	f.mu.Unlock()
	if fail != nil {
		return fail
	}
	return e.inner.(transport.Copier).Copy(s)
}

func (f *faultTransport) Close() error {
	f.releaseWith(-1, transport.ErrClosed, nil)
	return f.inner.Close()
}

func (f *faultTransport) setHold(on bool) {
	f.mu.Lock()
	f.hold = on
	f.mu.Unlock()
}

func (f *faultTransport) setFail(err error) {
	f.mu.Lock()
	f.fail = err
	f.mu.Unlock()
}

func (f *faultTransport) heldCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.held)
}

// release moves the first n held slices (all when n < 0) and completes them.
func (f *faultTransport) release(n int) { f.releaseWith(n, nil, nil) }

// releaseWith completes the first n held slices of ep (of any endpoint when
// ep is nil), with err, or by moving them when err is nil.
func (f *faultTransport) releaseWith(n int, err error, ep *faultEndpoint) {
	f.mu.Lock()
	var list, keep []heldSlice
	for _, h := range f.held {
		if (ep == nil || h.ep == ep) && (n < 0 || len(list) < n) {
			list = append(list, h)
		} else {
			keep = append(keep, h)
		}
	}
	f.held = keep
	f.mu.Unlock()
	for _, h := range list {
		if err != nil {
			h.c.Complete(h.s.Token, err)
			continue
		}
		if _, perr := h.ep.inner.Post(h.c, []transport.Slice{h.s}); perr != nil {
			h.c.Complete(h.s.Token, perr)
		}
	}
}

// waitHeld waits until the transport holds n slices.
func (f *faultTransport) waitHeld(t testing.TB, n int) {
	t.Helper()
	deadline := time.Now().Add(hangLimit)
	for f.heldCount() < n {
		if time.Now().After(deadline) {
			t.Fatalf("hang: %d of %d slices held", f.heldCount(), n)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

type faultEndpoint struct {
	t     *faultTransport
	inner transport.Endpoint
}

func (e *faultEndpoint) Rails() int { return 1 }

func (e *faultEndpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	f := e.t
	f.mu.Lock()
	f.posted += len(s)
	if f.hold {
		for _, x := range s {
			f.held = append(f.held, heldSlice{e, c, x})
		}
		f.mu.Unlock()
		return len(s), nil
	}
	fail := f.fail
	f.mu.Unlock()
	if fail != nil {
		for _, x := range s {
			c.Complete(x.Token, fail)
		}
		return len(s), nil
	}
	return e.inner.Post(c, s)
}

func (e *faultEndpoint) Update(d *segtable.SegmentDesc) { e.inner.Update(asLocal(d, e.t.Name())) }

func (e *faultEndpoint) Close() error {
	e.t.releaseWith(-1, transport.ErrClosed, e)
	return e.inner.Close()
}

var engineSeq atomic.Uint64

// startEngine starts an engine closed at the end of the test, named after
// the test unless cfg names it.
func startEngine(t testing.TB, cfg moonring.Config) *moonring.Engine {
	t.Helper()
	if cfg.Name == "" {
		cfg.Name = fmt.Sprintf("%s-%d", t.Name(), engineSeq.Add(1))
	}
	e, err := moonring.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("Engine.Close: %v", err)
		}
	})
	return e
}

// faultPair is an initiator and a target engine joined by faultTransport.
type faultPair struct {
	a, b   *moonring.Engine
	fa, fb *faultTransport
	seg    moonring.SegmentID // b's segment, opened by a
	src    []byte             // a's, local-only
	srcID  moonring.BufferID
	dst    []byte // b's, remote-accessible
}

// newFaultPair starts the pair; cfg configures the initiator.
func newFaultPair(t testing.TB, cfg moonring.Config, size int) *faultPair {
	t.Helper()
	cfg.Transports = []string{faultName}
	p := &faultPair{a: startEngine(t, cfg), b: startEngine(t, moonring.Config{}), fa: newFaultTransport(), fb: newFaultTransport()}
	if err := p.a.InstallTransport(p.fa); err != nil {
		t.Fatal(err)
	}
	if err := p.b.InstallTransport(p.fb); err != nil {
		t.Fatal(err)
	}
	p.src = make([]byte, size)
	p.dst = make([]byte, size)
	fill(p.src, 11)
	var err error
	if p.srcID, err = p.a.RegisterLocalMemory(p.src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := p.b.RegisterLocalMemory(p.dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	if p.seg, err = p.a.OpenSegment(ctx, p.b.Name()); err != nil {
		t.Fatal(err)
	}
	return p
}

// write returns a WRITE of n bytes from src+off to dst+off.
func (p *faultPair) write(off, n int) moonring.TransferRequest {
	return moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(p.src[off:]), TargetID: p.seg,
		TargetOffset: uint64(moonring.AddressOf(p.dst[off:])), Length: uint64(n)}
}

func statusOf(t testing.TB, e *moonring.Engine, id moonring.BatchID, task int) moonring.TransferStatus {
	t.Helper()
	st, err := e.GetTransferStatus(id, task)
	if err != nil {
		t.Fatalf("GetTransferStatus(%d): %v", task, err)
	}
	return st
}

// waitStatus waits until task reaches a status for which ok holds.
func waitStatus(t testing.TB, e *moonring.Engine, id moonring.BatchID, task int, ok func(moonring.Status) bool) moonring.TransferStatus {
	t.Helper()
	deadline := time.Now().Add(hangLimit)
	for {
		st := statusOf(t, e, id, task)
		if ok(st.Status) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("hang: task %d stays %v", task, st.Status)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func terminal(s moonring.Status) bool { return s.Terminal() }

func waitBatch(t testing.TB, e *moonring.Engine, id moonring.BatchID) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	if err := e.WaitBatch(ctx, id); err != nil {
		t.Fatalf("hang: WaitBatch: %v", err)
	}
}

// TestUnregisterDuringTransfer: a held request keeps its source buffer
// registered; unregistering it fails with ErrBusy meanwhile, and the
// buffer still works afterwards; once the request is done it succeeds.
func TestUnregisterDuringTransfer(t *testing.T) {
	p := newFaultPair(t, moonring.Config{}, 64<<10)
	p.fa.setHold(true)
	id, err := p.a.AllocateBatchID(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.a.SubmitTransfer(id, []moonring.TransferRequest{p.write(0, 4096)}); err != nil {
		t.Fatal(err)
	}
	p.fa.waitHeld(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	err = p.a.UnregisterLocalMemory(ctx, p.src)
	cancel()
	if !errors.Is(err, moonring.ErrBusy) {
		t.Fatalf("UnregisterLocalMemory with a request in flight: %v; want ErrBusy", err)
	}
	// The segment the request goes to is busy as well.
	ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
	err = p.a.CloseSegment(ctx, p.seg)
	cancel()
	if !errors.Is(err, moonring.ErrBusy) {
		t.Fatalf("CloseSegment with a request in flight: %v; want ErrBusy", err)
	}
	p.fa.setHold(false)
	p.fa.release(-1)
	waitBatch(t, p.a, id)
	if st := statusOf(t, p.a, id, 0); st.Status != moonring.COMPLETED || st.Bytes != 4096 {
		t.Fatalf("held request after release: %+v", st)
	}
	if string(p.dst[:4096]) != string(p.src[:4096]) {
		t.Fatal("data differs")
	}
	if err := p.a.FreeBatchID(id); err != nil {
		t.Fatal(err)
	}
	// The failed unregistration left the buffer and segment in service.
	ctx, cancel = context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	if err := p.a.Transfer(ctx, p.write(4096, 100)); err != nil {
		t.Fatalf("transfer after a failed unregister: %v", err)
	}
	if err := p.a.UnregisterLocalMemory(ctx, p.src); err != nil {
		t.Fatalf("UnregisterLocalMemory once idle: %v", err)
	}
	// Gone now: a request naming it is refused at submission.
	err = p.a.Transfer(ctx, p.write(0, 10))
	if !errors.Is(err, moonring.ErrNotRegistered) {
		t.Fatalf("transfer from an unregistered buffer: %v; want ErrNotRegistered", err)
	}
}

// TestTargetUnregisterDuringTransfer: the target unregisters the buffer a
// held WRITE addresses. Nothing on the target uses it, so that succeeds;
// the slice, released later, must then be refused, not written.
func TestTargetUnregisterDuringTransfer(t *testing.T) {
	p := newFaultPair(t, moonring.Config{}, 64<<10)
	p.fa.setHold(true)
	id, err := p.a.AllocateBatchID(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.a.SubmitTransfer(id, []moonring.TransferRequest{p.write(0, 4096)}); err != nil {
		t.Fatal(err)
	}
	p.fa.waitHeld(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	if err := p.b.UnregisterLocalMemory(ctx, p.dst); err != nil {
		t.Fatalf("target UnregisterLocalMemory: %v", err)
	}
	p.fa.release(-1)
	waitBatch(t, p.a, id)
	st := statusOf(t, p.a, id, 0)
	if st.Status != moonring.FAILED || !(errors.Is(st.Err(), moonring.ErrRemoteRange) || errors.Is(st.Err(), moonring.ErrDenied)) {
		t.Fatalf("a write into memory the target unregistered: %v (%v); want FAILED, refused by the target", st.Status, st.Err())
	}
	for i, b := range p.dst {
		if b != 0 {
			t.Fatalf("byte %d of the unregistered buffer was written", i)
		}
	}
}

// TestEngineCloseInFlight closes an engine with requests held by the
// transport, queued in the SQ and waiting to be pushed: Close returns, and
// every task ends terminal.
func TestEngineCloseInFlight(t *testing.T) {
	p := newFaultPair(t, moonring.Config{BatchEntries: 4}, 256<<10)
	p.fa.setHold(true)
	id, err := p.a.AllocateBatchID(12)
	if err != nil {
		t.Fatal(err)
	}
	var reqs []moonring.TransferRequest
	for i := 0; i < 12; i++ {
		reqs = append(reqs, p.write(i*8192, 8192))
	}
	submitted := make(chan error, 1)
	go func() { submitted <- p.a.SubmitTransfer(id, reqs) }()
	p.fa.waitHeld(t, 4) // 4 in flight, 4 in the SQ, 4 waiting for room
	ring, err := p.a.NewRing(moonring.RingConfig{})
	if err != nil {
		t.Fatal(err)
	}
	e := moonring.Entry{Op: moonring.OpWrite, Segment: p.seg, Buffer: p.srcID, Remote: uint64(moonring.AddressOf(p.dst[200<<10:])), Length: 100, UserData: 7}
	if err := ring.SubmitOne(&e); err != nil {
		t.Fatal(err)
	}
	p.fa.waitHeld(t, 5)
	// A waiter on the batch hears of its end even though the count of
	// unfinished tasks reaches 0 in SubmitTransfer (the tasks it pushed
	// ended, then it counted off those it could not push), not in a
	// completion: it used to wait for good.
	waited := make(chan error, 1)
	go func() { waited <- p.a.WaitBatch(context.Background(), id) }()
	closed := make(chan error, 1)
	go func() { closed <- p.a.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(hangLimit):
		t.Fatal("hang: Close with work in flight")
	}
	select {
	case err := <-submitted:
		if err == nil {
			t.Log("SubmitTransfer pushed everything before Close")
		}
	case <-time.After(hangLimit):
		t.Fatal("hang: SubmitTransfer after Close")
	}
	select {
	case err := <-waited:
		if err != nil {
			t.Fatalf("WaitBatch: %v", err)
		}
	case <-time.After(hangLimit):
		t.Fatal("hang: WaitBatch after every task ended")
	}
	for i := range reqs {
		st := statusOf(t, p.a, id, i)
		if st.Status != moonring.FAILED || !errors.Is(st.Err(), moonring.ErrClosed) {
			t.Errorf("task %d after Close: %v (%v); want FAILED with ErrClosed", i, st.Status, st.Err())
		}
	}
	c := ring.Peek()
	if c == nil || c.UserData != 7 || !errors.Is(c.Err(), moonring.ErrClosed) {
		t.Fatalf("ring completion after Close: %+v; want 7 with ErrClosed", c)
	}
	ring.Advance(1)
	if c := ring.Peek(); c != nil {
		t.Fatalf("a second completion after Close: %+v", c)
	}
	if _, err := ring.Submit([]moonring.Entry{e}); !errors.Is(err, moonring.ErrClosed) {
		t.Fatalf("Submit after Close: %v", err)
	}
	if _, err := p.a.AllocateBatchID(1); !errors.Is(err, moonring.ErrClosed) {
		t.Fatalf("AllocateBatchID after Close: %v", err)
	}
	if err := p.a.FreeBatchID(id); err != nil {
		t.Fatalf("FreeBatchID after Close: %v (every task is terminal)", err)
	}
}

// TestPushTimeoutAccounting fills the batch ring so that SubmitTransfer
// gives up waiting for room: the tasks it pushed still run, the rest fail,
// and the batch stays busy until the pushed ones end.
func TestPushTimeoutAccounting(t *testing.T) {
	// SubmitTransfer gives up after half the timeout; the queued tasks
	// time out a whole timeout after the ring blocked. The other half is
	// the test's slack between the two (200 ms was too little on a loaded
	// 2-core machine under -race).
	p := newFaultPair(t, moonring.Config{BatchEntries: 4, Timeout: 4 * time.Second}, 256<<10)
	p.fa.setHold(true)
	id, err := p.a.AllocateBatchID(12)
	if err != nil {
		t.Fatal(err)
	}
	var reqs []moonring.TransferRequest
	for i := 0; i < 12; i++ {
		reqs = append(reqs, p.write(i*8192, 8192))
	}
	err = p.a.SubmitTransfer(id, reqs)
	if !errors.Is(err, moonring.ErrSQFull) {
		t.Fatalf("SubmitTransfer into a full ring: %v; want ErrSQFull", err)
	}
	before := make([]moonring.TransferStatus, len(reqs))
	waiting := 0
	for i := range reqs {
		before[i] = statusOf(t, p.a, id, i)
		if before[i].Status == moonring.WAITING {
			waiting++
		}
	}
	if held := p.fa.heldCount(); waiting == 0 {
		t.Fatalf("statuses right after SubmitTransfer gave up: %v; but %d tasks are in flight at the transport and more wait in the SQ: SubmitTransfer marked tasks it had pushed", before, held)
	}
	// Tasks wait in the SQ: the batch is busy.
	if err := p.a.FreeBatchID(id); !errors.Is(err, moonring.ErrBusy) {
		t.Fatalf("FreeBatchID with %d tasks queued: %v; want ErrBusy", waiting, err)
	}
	p.fa.setHold(false)
	p.fa.release(-1)
	waitBatch(t, p.a, id)
	for i := range reqs {
		st := waitStatus(t, p.a, id, i, terminal)
		if before[i].Status.Terminal() && st != before[i] {
			t.Errorf("task %d was %v (%v), then became %v (%v): a terminal status changed", i, before[i].Status, before[i].Err(), st.Status, st.Err())
		}
		if before[i].Status == moonring.WAITING && st.Status != moonring.COMPLETED {
			t.Errorf("task %d queued when SubmitTransfer gave up ended %v (%v); want COMPLETED once room came", i, st.Status, st.Err())
		}
	}
	if err := p.a.FreeBatchID(id); err != nil {
		t.Fatalf("FreeBatchID once every task ended: %v", err)
	}
}

// TestTransferCanceledContext: Transfer with a context already canceled
// returns promptly with the tasks canceled, and frees its batch.
func TestTransferCanceledContext(t *testing.T) {
	p := newFaultPair(t, moonring.Config{MaxBatches: 1}, 64<<10)
	p.fa.setHold(true)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	done := make(chan error, 1)
	go func() { done <- p.a.Transfer(ctx, p.write(0, 4096), p.write(4096, 4096)) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(hangLimit):
		t.Fatal("hang: Transfer with a canceled context")
	}
	if !errors.Is(err, moonring.ErrCanceled) {
		t.Fatalf("Transfer with a canceled context: %v; want ErrCanceled", err)
	}
	// The only batch slot was freed.
	id, err := p.a.AllocateBatchID(1)
	if err != nil {
		t.Fatalf("AllocateBatchID after the canceled Transfer: %v", err)
	}
	p.a.FreeBatchID(id)
	// The canceled slices come back late; nothing moves on their account
	// into a later transfer.
	p.fa.release(-1)
	p.fa.setHold(false)
	ctx2, cancel2 := context.WithTimeout(context.Background(), hangLimit)
	defer cancel2()
	if err := p.a.Transfer(ctx2, p.write(8192, 100)); err != nil {
		t.Fatalf("Transfer after: %v", err)
	}
}

// TestFailingTransport: a transport that fails every slice ends the task
// FAILED with ErrTransport after the retries.
func TestFailingTransport(t *testing.T) {
	p := newFaultPair(t, moonring.Config{RetryLimit: 2}, 64<<10)
	p.fa.setFail(transport.ErrPeer)
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	err := p.a.Transfer(ctx, p.write(0, 4096))
	if !errors.Is(err, moonring.ErrTransport) {
		t.Fatalf("Transfer over a failing transport: %v; want ErrTransport", err)
	}
	p.fa.mu.Lock()
	posted := p.fa.posted
	p.fa.mu.Unlock()
	if posted != 3 {
		t.Fatalf("%d posts; want 1 + RetryLimit 2", posted)
	}
	for _, b := range p.dst[:4096] {
		if b != 0 {
			t.Fatal("a failed transfer moved bytes")
		}
	}
	p.fa.setFail(transport.ErrDenied) // final: no retry
	if err := p.a.Transfer(ctx, p.write(0, 4096)); !errors.Is(err, moonring.ErrDenied) {
		t.Fatalf("Transfer denied by the peer: %v; want ErrDenied", err)
	}
}
