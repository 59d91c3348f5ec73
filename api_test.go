package moonring_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// tcpPair is an initiator and a target engine over TCP on one store, with
// a remote-accessible buffer of size at the target and a local one at the
// initiator, and the target's segment open at the initiator.
type tcpPair struct {
	ini, tgt *moonring.Engine
	local    []byte
	remote   []byte
	seg      moonring.SegmentID
}

func newTCPPair(t *testing.T, size int) *tcpPair {
	t.Helper()
	store := metadata.NewMemory()
	key := []byte("api test key")
	p := &tcpPair{
		tgt: keyedEngine(t, store, t.Name()+"-target", key),
		ini: keyedEngine(t, store, t.Name()+"-initiator", key),
	}
	p.local, p.remote = make([]byte, size), make([]byte, size)
	if _, err := p.tgt.RegisterLocalMemory(p.remote, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	if _, err := p.ini.RegisterLocalMemory(p.local, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	var err error
	if p.seg, err = p.ini.OpenSegment(t.Context(), p.tgt.Name()); err != nil {
		t.Fatal(err)
	}
	return p
}

func (p *tcpPair) write() moonring.TransferRequest { return p.writeAt(0, len(p.local)) }

// writeAt is a WRITE of n bytes at off, from the local buffer to the
// remote one. A canceled or timed-out WRITE may still have slices landing
// at the target: tests that go on writing use other ranges.
func (p *tcpPair) writeAt(off, n int) moonring.TransferRequest {
	return moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(p.local[off:]), TargetID: p.seg,
		TargetOffset: uint64(moonring.AddressOf(p.remote[off:])), Length: uint64(n)}
}

// TestTransferContextErrors: a Transfer whose context ends first fails
// with an error that matches ErrCanceled and the context's own error, so a
// caller tells its deadline from a CancelTransfer.
func TestTransferContextErrors(t *testing.T) {
	const part = 32 << 20
	p := newTCPPair(t, 2*part)
	canceled, cancel := context.WithCancel(t.Context())
	cancel()
	err := p.ini.Transfer(canceled, p.writeAt(0, part))
	if !errors.Is(err, moonring.ErrCanceled) || !errors.Is(err, context.Canceled) {
		t.Fatalf("Transfer with a canceled context: %v, want ErrCanceled and context.Canceled", err)
	}
	expired, cancel2 := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel2()
	err = p.ini.Transfer(expired, p.writeAt(part, part))
	if !errors.Is(err, moonring.ErrCanceled) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Transfer past its deadline: %v, want ErrCanceled and context.DeadlineExceeded", err)
	}
	// WaitBatch: the task is held by the transport, so the batch cannot
	// have finished before the wait (a WRITE over TCP could, on a loaded
	// machine, and WaitBatch then rightly returns nil).
	fp := newFaultPair(t, moonring.Config{}, 1<<16)
	fp.fa.setHold(true)
	id, err := fp.a.AllocateBatchID(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := fp.a.SubmitTransfer(id, []moonring.TransferRequest{fp.write(0, 4096)}); err != nil {
		t.Fatal(err)
	}
	fp.fa.waitHeld(t, 1)
	if err := fp.a.WaitBatch(expired, id); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitBatch past its deadline: %v", err)
	}
	fp.fa.setHold(false)
	fp.fa.release(-1)
	if err := fp.a.WaitBatch(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	fp.a.FreeBatchID(id)
}

// TestUnregisterContextError: an unregister that gives up on its context
// says so (ErrBusy and the context's error) and names who holds the buffer.
func TestUnregisterContextError(t *testing.T) {
	p := newTCPPair(t, 256<<20)
	id, err := p.ini.AllocateBatchID(1)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.ini.SubmitTransfer(id, []moonring.TransferRequest{p.write()}); err != nil {
		t.Fatal(err)
	}
	// Once a poller has taken it, the request holds the buffer.
	for st, _ := p.ini.GetTransferStatus(id, 0); st.Status == moonring.WAITING; st, _ = p.ini.GetTransferStatus(id, 0) {
		time.Sleep(10 * time.Microsecond)
	}
	expired, cancel := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel()
	err = p.ini.UnregisterLocalMemory(expired, p.local)
	if err == nil {
		t.Skip("the 64 MiB WRITE ended before the unregister looked (not an error; nothing to check)")
	}
	if !errors.Is(err, moonring.ErrBusy) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("UnregisterLocalMemory past its deadline: %v, want ErrBusy and context.DeadlineExceeded", err)
	}
	if err := p.ini.WaitBatch(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	p.ini.FreeBatchID(id)
}

// TestErrorsSayWhat: a wrong key is ErrDenied (at the descriptor and at the
// transport), freeing registered memory is ErrRegistered, an overlapping
// registration is ErrOverlap.
func TestErrorsSayWhat(t *testing.T) {
	store := metadata.NewMemory()
	tgt := keyedEngine(t, store, "errors-target", []byte("key one"))
	other := keyedEngine(t, store, "errors-other", []byte("key two"))
	if _, err := other.OpenSegment(t.Context(), tgt.Name()); !errors.Is(err, moonring.ErrDenied) || !errors.Is(err, metadata.ErrForged) {
		t.Fatalf("OpenSegment with another key: %v, want ErrDenied", err)
	}
	// One descriptor key, another TCP key: the descriptor verifies, the
	// hello does not.
	e, err := moonring.New(moonring.Config{Name: "errors-tcp", Metadata: store, Key: []byte("key one"), Transports: []string{"tcp"}, TCP: &tcp.Config{Key: []byte("key three")}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := e.OpenSegment(t.Context(), tgt.Name()); !errors.Is(err, moonring.ErrDenied) || errors.Is(err, moonring.ErrNoTransport) {
		t.Fatalf("OpenSegment refused by the TCP hello: %v, want ErrDenied", err)
	}

	buf, err := tgt.Alloc(1<<20, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tgt.RegisterLocalMemory(buf[:4096], "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := tgt.RegisterLocalMemory(buf[:8192], "cpu:0", false); !errors.Is(err, moonring.ErrOverlap) {
		t.Fatalf("overlapping registration: %v, want ErrOverlap", err)
	}
	if err := tgt.Free(buf); !errors.Is(err, moonring.ErrRegistered) || errors.Is(err, moonring.ErrBusy) {
		t.Fatalf("Free of registered memory: %v, want ErrRegistered", err)
	}
	if err := tgt.UnregisterLocalMemory(t.Context(), buf[:4096]); err != nil {
		t.Fatal(err)
	}
	if err := tgt.Free(buf); err != nil {
		t.Fatal(err)
	}
}

// TestSegmentInfoAndRemove: Segment describes an open segment; a target's
// RemoveLocalSegment makes it unopenable (and a registration meanwhile
// does not publish it again) until PublishLocalSegment.
func TestSegmentInfoAndRemove(t *testing.T) {
	p := newTCPPair(t, 1<<16)
	info, err := p.ini.Segment(p.seg)
	if err != nil {
		t.Fatal(err)
	}
	if info.Name != p.tgt.Name() || info.Transport != "tcp" || info.Epoch == 0 || len(info.Buffers) != 1 ||
		info.Buffers[0].Addr != uint64(moonring.AddressOf(p.remote)) || info.Buffers[0].Length != uint64(len(p.remote)) {
		t.Fatalf("Segment = %+v", info)
	}
	if _, err := p.ini.Segment(p.seg + 100); !errors.Is(err, moonring.ErrBadSegment) {
		t.Fatalf("Segment of an unknown id: %v", err)
	}
	if err := p.tgt.RemoveLocalSegment(t.Context()); err != nil {
		t.Fatal(err)
	}
	third := keyedEngine(t, metadataOf(p.tgt), t.Name()+"-third", []byte("api test key"))
	if _, err := third.OpenSegment(t.Context(), p.tgt.Name()); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("OpenSegment of a removed segment: %v, want ErrNotFound", err)
	}
	if _, err := p.tgt.RegisterLocalMemory(make([]byte, 4096), "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	if _, err := third.OpenSegment(t.Context(), p.tgt.Name()); !errors.Is(err, metadata.ErrNotFound) {
		t.Fatalf("a registration republished a removed segment: %v", err)
	}
	if err := p.tgt.RemoveLocalSegment(t.Context()); err != nil {
		t.Fatalf("second RemoveLocalSegment: %v", err)
	}
	if err := p.tgt.PublishLocalSegment(t.Context()); err != nil {
		t.Fatal(err)
	}
	seg, err := third.OpenSegment(t.Context(), p.tgt.Name())
	if err != nil {
		t.Fatal(err)
	}
	if info, err := third.Segment(seg); err != nil || len(info.Buffers) != 2 {
		t.Fatalf("republished segment: %+v, %v", info, err)
	}
}

func metadataOf(e *moonring.Engine) metadata.Store { return e.Config().Metadata }

// TestTransferRequestForms: a TransferRequest names its local side by
// buffer and offset as a ring Entry does; a bad one is refused with the
// code that says why; the zero Opcode is not a transfer; a per-request
// Timeout ends a task TIMEOUT.
func TestTransferRequestForms(t *testing.T) {
	p := newTCPPair(t, 256<<20)
	id, err := p.ini.RegisterLocalMemory(make([]byte, 8192), "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	req := moonring.TransferRequest{Opcode: moonring.Read, Buffer: id, Local: 4096, TargetID: p.seg,
		TargetOffset: uint64(moonring.AddressOf(p.remote)), Length: 4096}
	if err := p.ini.Transfer(t.Context(), req); err != nil {
		t.Fatalf("by buffer and offset: %v", err)
	}
	for _, c := range []struct {
		name   string
		change func(r *moonring.TransferRequest)
		want   error
	}{
		{"past the buffer", func(r *moonring.TransferRequest) { r.Local = 8000 }, moonring.ErrLocalRange},
		{"unknown buffer", func(r *moonring.TransferRequest) { r.Buffer = id + 1000 }, moonring.ErrBadBuffer},
		{"both forms", func(r *moonring.TransferRequest) { r.Source = moonring.AddressOf(p.local) }, moonring.ErrInvalid},
		{"zero opcode", func(r *moonring.TransferRequest) { r.Opcode = 0 }, moonring.ErrInvalid},
		{"cancel opcode", func(r *moonring.TransferRequest) { r.Opcode = moonring.OpCancel }, moonring.ErrInvalid},
	} {
		r := req
		c.change(&r)
		if err := p.ini.Transfer(t.Context(), r); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	w := p.write()
	w.Timeout = time.Millisecond
	err = p.ini.Transfer(t.Context(), w)
	if !errors.Is(err, moonring.ErrTimeout) {
		t.Fatalf("256 MiB with a 1 ms Timeout: %v, want ErrTimeout", err)
	}
}

// stuckTransport is a transport whose UnregisterContext waits for its
// context: a peer that never lets go of a buffer.
type stuckTransport struct{}

func (stuckTransport) Name() string                                             { return "stuck" }
func (stuckTransport) Endpoint() string                                         { return "stuck" }
func (stuckTransport) SliceSize() uint64                                        { return 0 }
func (stuckTransport) Close() error                                             { return nil }
func (stuckTransport) Unregister(*segtable.Buffer, segtable.Registration) error { return nil }
func (stuckTransport) Register(*segtable.Buffer) (segtable.Registration, error) {
	return segtable.Registration{Key: "k"}, nil
}
func (stuckTransport) Open(context.Context, *segtable.SegmentDesc) (transport.Endpoint, error) {
	return nil, transport.ErrUnreachable
}
func (stuckTransport) UnregisterContext(ctx context.Context, _ *segtable.Buffer, _ segtable.Registration) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestFreeAfterStuckUnregister: memory whose unregister gave up while a
// transport's peers still held it is not freed (unmapped under them) before
// Close.
func TestFreeAfterStuckUnregister(t *testing.T) {
	e, err := moonring.New(moonring.Config{Name: t.Name()})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.InstallTransport(stuckTransport{}); err != nil {
		t.Fatal(err)
	}
	buf, err := e.Alloc(1<<16, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.RegisterLocalMemory(buf, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	if err := e.UnregisterLocalMemory(ctx, buf); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("UnregisterLocalMemory with a stuck peer: %v", err)
	}
	if err := e.Free(buf); !errors.Is(err, moonring.ErrBusy) {
		t.Fatalf("Free while peers may still move its bytes: %v, want ErrBusy", err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.Free(buf); err != nil {
		t.Fatalf("Free after Close: %v", err)
	}
}

// TestTargetBuffer: a request names its remote side by buffer and offset
// as well as by address; a buffer or range it does not have is refused.
func TestTargetBuffer(t *testing.T) {
	p := newTCPPair(t, 1<<16)
	testpattern.Fill(p.local, 5)
	req := moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(p.local), TargetID: p.seg,
		TargetBuffer: 1, TargetOffset: 4096, Length: 8192}
	if err := p.ini.Transfer(t.Context(), req); err != nil {
		t.Fatal(err)
	}
	if i := testpattern.FirstDiff(p.remote[4096:4096+8192], p.local[:8192]); i >= 0 {
		t.Fatalf("remote buffer 1 at offset 4096: differs at %d", i)
	}
	for _, c := range []struct {
		name   string
		change func(r *moonring.TransferRequest)
	}{
		{"no such buffer", func(r *moonring.TransferRequest) { r.TargetBuffer = 2 }},
		{"negative", func(r *moonring.TransferRequest) { r.TargetBuffer = -1 }},
		{"past the end", func(r *moonring.TransferRequest) { r.TargetOffset = 1<<16 - 100 }},
		{"offset overflows", func(r *moonring.TransferRequest) { r.TargetOffset = ^uint64(0) - 10 }},
	} {
		r := req
		c.change(&r)
		if err := p.ini.Transfer(t.Context(), r); !errors.Is(err, moonring.ErrRemoteRange) {
			t.Errorf("%s: %v, want ErrRemoteRange", c.name, err)
		}
	}
}
