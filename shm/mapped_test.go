//go:build linux

package shm_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/internal/testwait"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

// world is a target and an initiator transport with their buffers.
type world struct {
	t          *testing.T
	init, targ *shm.Transport
	ibufs      segtable.Buffers
	tbufs      segtable.Buffers
	tregs      map[*segtable.Buffer]segtable.Registration
	local      *segtable.Buffer
	lreg       segtable.Registration
	tok        atomic.Uint64
}

func newWorld(t *testing.T, icfg shm.Config) *world {
	t.Helper()
	return newWorldTarget(t, icfg, shm.Config{RevokeTimeout: 5 * time.Second})
}

// newWorldTarget is newWorld with the target's config given too.
func newWorldTarget(t *testing.T, icfg, tcfg shm.Config) *world {
	t.Helper()
	w := &world{t: t, tregs: map[*segtable.Buffer]segtable.Registration{}}
	var err error
	if w.init, err = shm.New(icfg); err != nil {
		t.Fatal(err)
	}
	if w.targ, err = shm.New(tcfg); err != nil {
		t.Fatal(err)
	}
	lmem := make([]byte, 8<<20)
	w.local, err = w.ibufs.Register(lmem, segtable.CPU(0), false)
	if err != nil {
		t.Fatal(err)
	}
	if w.lreg, err = w.init.Register(w.local); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.init.Close()
		w.targ.Close()
		ctx := context.Background()
		for _, b := range w.ibufs.All() {
			w.ibufs.Unregister(ctx, b.ID)
		}
		for _, b := range w.tbufs.All() {
			w.tbufs.Unregister(ctx, b.ID)
		}
	})
	return w
}

// shared registers memory from mem.AllocShared with the target.
func (w *world) shared(size int, remote bool) (*segtable.Buffer, []byte) {
	w.t.Helper()
	m, err := mem.AllocShared(size, 0)
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { mem.Free(m) })
	return w.register(m, remote), m
}

func (w *world) register(m []byte, remote bool) *segtable.Buffer {
	w.t.Helper()
	b, err := w.tbufs.Register(m, segtable.CPU(0), remote)
	if err != nil {
		w.t.Fatal(err)
	}
	r, err := w.targ.Register(b)
	if err != nil {
		w.t.Fatal(err)
	}
	w.tregs[b] = r
	return b
}

func (w *world) desc() *segtable.SegmentDesc {
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "target", Epoch: 1,
		Endpoints: map[string]string{shm.Name: w.targ.Endpoint()}}
	for _, b := range w.tbufs.All() {
		d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length,
			Keys: map[string]string{shm.Name: w.tregs[b].Key}})
	}
	return d
}

func (w *world) open() *shm.Endpoint {
	w.t.Helper()
	ep, err := w.init.Open(context.Background(), w.desc())
	if err != nil {
		w.t.Fatal(err)
	}
	w.t.Cleanup(func() { ep.Close() })
	return ep.(*shm.Endpoint)
}

func (w *world) slice(op transport.Op, loff uint64, raddr, n uint64) transport.Slice {
	return transport.Slice{Op: op, LocalHandle: w.lreg.Handle, Local: w.local.Pointer(loff),
		Remote: raddr, Length: n, Token: w.tok.Add(1)}
}

// TestMapped moves random slices through mapped buffers with data checked
// both ways, and checks that the buffers were mapped, not reached through
// process_vm calls.
func TestMapped(t *testing.T) {
	w := newWorld(t, shm.Config{})
	a, am := w.shared(4<<20, true)
	b, bm := w.shared(64<<10+100, true)
	ep := w.open()
	if m, v := ep.Granted(); m != 2 || v != 0 {
		t.Fatalf("granted %d mapped, %d vm; want 2 mapped", m, v)
	}
	lm := w.local.Bytes()
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 300 {
		buf, bmem := a, am
		if i%3 == 0 {
			buf, bmem = b, bm
		}
		n := 1 + r.Uint64N(min(buf.Length, 256<<10))
		if i%7 == 0 {
			buf, bmem = b, bm
			n = buf.Length
		}
		roff := r.Uint64N(buf.Length - n + 1)
		loff := r.Uint64N(uint64(len(lm)) - n + 1)
		op := transport.Op(1 + i%2)
		if op == transport.Write {
			testpattern.Fill(lm[loff:loff+n], uint64(i))
		} else {
			testpattern.Fill(bmem[roff:roff+n], uint64(i))
		}
		s := w.slice(op, loff, uint64(buf.Addr)+roff, n)
		if i%2 == 0 {
			if err := ep.Copy(&s); err != nil {
				t.Fatalf("slice %d (%v %d bytes): %v", i, op, n, err)
			}
		} else {
			// A mapped slice gains nothing from a batch: CopyNow moves it,
			// leaving its reference on the mapping in h.
			var h transport.Holds
			done, err := ep.CopyNow(&s, &h)
			if !done || err != nil || h.Len() != 1 {
				t.Fatalf("slice %d (%v %d bytes): CopyNow = %v, %v, %d held", i, op, n, done, err, h.Len())
			}
			h.Release()
		}
		if !bytes.Equal(lm[loff:loff+n], bmem[roff:roff+n]) {
			t.Fatalf("slice %d (%v %d bytes at +%d): data differ", i, op, n, roff)
		}
	}
	// Out of range, straddling, and past the end are refused.
	for _, s := range []transport.Slice{
		w.slice(transport.Write, 0, uint64(a.Addr)+a.Length-1, 2),
		w.slice(transport.Read, 0, uint64(b.Addr)+b.Length, 1),
		w.slice(transport.Read, 0, uint64(a.Addr)-1, 1),
	} {
		if err := ep.Copy(&s); !errors.Is(err, transport.ErrRange) && !errors.Is(err, transport.ErrDenied) {
			t.Errorf("slice at %#x+%d: %v, want ErrRange", s.Remote, s.Length, err)
		}
	}
}

// TestNotHandedOut: memory that shares its memfd with other memory, and
// local-only memory, is never mapped by a peer: the first goes through
// process_vm calls, the second is refused.
func TestNotHandedOut(t *testing.T) {
	w := newWorld(t, shm.Config{})
	m, err := mem.AllocShared(1<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free(m)
	part := w.register(m[:512<<10], true)
	_, lo := w.shared(64<<10, false)
	ep := w.open()
	if mp, v := ep.Granted(); mp != 0 || v != 1 {
		t.Fatalf("granted %d mapped, %d vm; want the part through process_vm only", mp, v)
	}
	testpattern.Fill(w.local.Bytes()[:4096], 3)
	s := w.slice(transport.Write, 0, uint64(part.Addr)+100, 4096)
	if err := ep.Copy(&s); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(m[100:4196], w.local.Bytes()[:4096]) {
		t.Fatal("process_vm write did not land")
	}
	s = w.slice(transport.Write, 0, uint64(uintptr(unsafe.Pointer(&lo[0]))), 16)
	if err := ep.Copy(&s); !errors.Is(err, transport.ErrDenied) {
		t.Fatalf("write to a local-only buffer: %v, want ErrDenied", err)
	}
}

// TestForcedVM: with NoMap the initiator reaches memfd memory through
// process_vm calls.
func TestForcedVM(t *testing.T) {
	w := newWorld(t, shm.Config{NoMap: true})
	a, am := w.shared(1<<20, true)
	ep := w.open()
	if mp, v := ep.Granted(); mp != 0 || v != 1 {
		t.Fatalf("granted %d mapped, %d vm; want 1 vm", mp, v)
	}
	testpattern.Fill(am, 9)
	s := w.slice(transport.Read, 0, uint64(a.Addr), a.Length)
	if err := ep.Copy(&s); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(w.local.Bytes()[:a.Length], am) {
		t.Fatal("process_vm read differs")
	}
}

// TestUnregisterMidBatch withdraws a mapped buffer while writers hammer it:
// every copy either finished before Unregister returned or failed, and
// nothing lands in the memory afterwards.
func TestUnregisterMidBatch(t *testing.T) {
	w := newWorld(t, shm.Config{})
	a, am := w.shared(1<<20, true)
	ep := w.open()
	testpattern.Fill(w.local.Bytes()[:1<<20], 5)
	var (
		wg       sync.WaitGroup
		done     atomic.Bool
		failed   atomic.Int64
		ok       atomic.Int64
		afterOK  atomic.Int64
		returned atomic.Bool
	)
	for g := range 3 {
		wg.Go(func() {
			for i := 0; !done.Load(); i++ {
				after := returned.Load()
				off := uint64((g*97 + i*4096) % (1<<20 - 65536))
				s := w.slice(transport.Write, off, uint64(a.Addr)+off, 65536)
				switch err := ep.Copy(&s); {
				case err == nil:
					ok.Add(1)
					if after {
						afterOK.Add(1)
					}
				case errors.Is(err, transport.ErrDenied):
					failed.Add(1)
				default:
					t.Errorf("copy: %v", err)
					return
				}
			}
		})
	}
	for ok.Load() < 100 {
		time.Sleep(time.Millisecond)
	}
	if err := w.targ.Unregister(a, w.tregs[a]); err != nil {
		t.Fatalf("Unregister: %v", err)
	}
	returned.Store(true)
	for i := range am {
		am[i] = 0xEE
	}
	n := failed.Load()
	for failed.Load() < n+100 {
		time.Sleep(time.Millisecond)
	}
	done.Store(true)
	wg.Wait()
	if afterOK.Load() != 0 {
		t.Fatalf("%d copies succeeded after Unregister returned", afterOK.Load())
	}
	for i, v := range am {
		if v != 0xEE {
			t.Fatalf("byte %d written after Unregister returned", i)
		}
	}
	if mp, _ := ep.Granted(); mp != 0 {
		t.Fatalf("still %d mapped after Unregister", mp)
	}
	t.Logf("%d copies before, %d refused after", ok.Load(), failed.Load())
}

// TestTargetCloseDropsMappings: after the target's Close returns, the
// initiator holds no mapping and every slice fails.
func TestTargetCloseDropsMappings(t *testing.T) {
	w := newWorld(t, shm.Config{})
	a, _ := w.shared(1<<20, true)
	ep := w.open()
	w.targ.Close()
	if mp, v := ep.Granted(); mp+v != 0 {
		t.Fatalf("still %d mapped, %d vm after the target closed", mp, v)
	}
	s := w.slice(transport.Write, 0, uint64(a.Addr), 64)
	if err := ep.Copy(&s); err == nil {
		t.Fatal("write after the target closed succeeded")
	}
}

// TestOtherHost: a descriptor from another boot id is unreachable without
// dialling, and garbage endpoints are refused cleanly.
func TestOtherHost(t *testing.T) {
	w := newWorld(t, shm.Config{})
	w.shared(4096, true)
	for _, ep := range []string{
		"00000000000000000000000000000000/" + "x",
		"", "zz/y", "abcd", "00000000000000000000000000000000/",
	} {
		d := w.desc()
		d.Endpoints[shm.Name] = ep
		if _, err := w.init.Open(context.Background(), d); !errors.Is(err, transport.ErrUnreachable) {
			t.Errorf("Open with endpoint %q: %v, want ErrUnreachable", ep, err)
		}
	}
}

// TestCopyBatch moves runs of process_vm slices with one call each: data
// checked both ways, a refused slice in the middle of a run fails alone,
// CopyNow leaves such slices alone, and a batch allocates nothing.
func TestCopyBatch(t *testing.T) {
	w := newWorld(t, shm.Config{NoMap: true})
	a, am := w.shared(1<<20, true)
	ep := w.open()
	lm := w.local.Bytes()
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		testpattern.Fill(lm[:1<<20], 11)
		testpattern.Fill(am, 12)
		var s []transport.Slice
		for i := range 40 {
			n := uint64(1 + i*97)
			off := uint64(i) * 16384
			s = append(s, w.slice(op, off, uint64(a.Addr)+off, n))
		}
		s[17].Remote = uint64(a.Addr) + a.Length // out of range
		errs := make([]error, len(s))
		ep.CopyBatch(s, errs)
		for i := range s {
			if i == 17 {
				if !errors.Is(errs[i], transport.ErrRange) && !errors.Is(errs[i], transport.ErrDenied) {
					t.Fatalf("%v slice %d out of range: %v", op, i, errs[i])
				}
				continue
			}
			if errs[i] != nil {
				t.Fatalf("%v slice %d: %v", op, i, errs[i])
			}
			off := uint64(i) * 16384
			if !bytes.Equal(lm[off:off+s[i].Length], am[off:off+s[i].Length]) {
				t.Fatalf("%v slice %d: data differ", op, i)
			}
		}
	}
	// A process_vm slice is left to batches: CopyNow moves nothing.
	testpattern.Fill(lm[:4096], 13)
	one := w.slice(transport.Read, 0, uint64(a.Addr), 4096)
	if done, err := ep.CopyNow(&one, nil); done || err != nil || bytes.Equal(lm[:4096], am[:4096]) {
		t.Fatalf("CopyNow of a process_vm slice = %v, %v (data moved: %v)", done, err, bytes.Equal(lm[:4096], am[:4096]))
	}
	s := []transport.Slice{w.slice(transport.Read, 0, uint64(a.Addr), 4096), w.slice(transport.Read, 4096, uint64(a.Addr)+4096, 4096)}
	errs := make([]error, 2)
	if n := testing.AllocsPerRun(100, func() { ep.CopyBatch(s, errs) }); n != 0 {
		t.Fatalf("CopyBatch allocates %v times", n)
	}
}

// TestCopyBatchMapped moves a batch of slices through six mapped buffers
// in turn, more than a batch holds references to at once, with a
// notification among them: runs of five large slices (which move four at
// once, a CopyGroup holding the references the Holds cannot) between
// small ones. Every byte lands both ways, a batch of copies allocates
// nothing, and it keeps no reference when it returns (one kept would hold
// the target's withdrawal of the buffer for ever): the target withdraws
// every buffer after it.
func TestCopyBatchMapped(t *testing.T) {
	w := newWorld(t, shm.Config{})
	var got atomic.Int64
	w.targ.SetNotify("target", func(n *transport.Notification) error {
		got.Add(1)
		return nil
	})
	w.init.SetNotify("initiator", func(*transport.Notification) error { return nil })
	const nbuf, size, stride = 6, 1 << 20, 100 << 10
	var bufs []*segtable.Buffer
	var mems [][]byte
	for range nbuf {
		b, m := w.shared(size, true)
		bufs, mems = append(bufs, b), append(mems, m)
	}
	ep := w.open()
	if mp, v := ep.Granted(); mp != nbuf || v != 0 {
		t.Fatalf("granted %d mapped, %d vm; want %d mapped", mp, v, nbuf)
	}
	lm := w.local.Bytes()
	const per = 10 // slices per buffer
	batch := func(op transport.Op) []transport.Slice {
		var s []transport.Slice
		for i := range nbuf * per {
			b, k := i%nbuf, i/nbuf // each buffer in turn
			n := uint64(32<<10 + 37*i)
			if i%6 == 5 {
				n = uint64(1000 + 37*i)
			}
			s = append(s, w.slice(op, uint64(i)*stride, uint64(bufs[b].Addr)+uint64(k)*stride, n))
			if i == nbuf*per/2 {
				copy(lm[7<<20:], "note")
				s = append(s, transport.Slice{Op: transport.Notify, Local: w.local.Pointer(7 << 20), Remote: 3, Length: 4, Token: w.tok.Add(1)})
			}
		}
		return s
	}
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		testpattern.Fill(lm[:nbuf*per*stride], 21)
		for i, m := range mems {
			testpattern.Fill(m, uint64(30+i))
		}
		s := batch(op)
		errs := make([]error, len(s))
		ep.CopyBatch(s, errs)
		if n := shm.HeldRefs(ep); n != 0 {
			// Not Fatal, nor a panic: the cleanups (Close) would wait
			// for them for ever.
			fmt.Fprintf(os.Stderr, "--- FAIL: TestCopyBatchMapped: %v: %d references held after CopyBatch returned\n", op, n)
			os.Exit(1)
		}
		for i := range s {
			if errs[i] != nil {
				t.Fatalf("%v slice %d: %v", op, i, errs[i])
			}
			if s[i].Op == transport.Notify {
				continue
			}
			local := unsafe.Slice((*byte)(s[i].Local), s[i].Length)
			b := slices.IndexFunc(bufs, func(b *segtable.Buffer) bool {
				return uint64(b.Addr) <= s[i].Remote && s[i].Remote < uint64(b.Addr)+b.Length
			})
			off := s[i].Remote - uint64(bufs[b].Addr)
			if d := testpattern.FirstDiff(local, mems[b][off:off+s[i].Length]); d >= 0 {
				t.Fatalf("%v slice %d: byte %d differs", op, i, d)
			}
		}
	}
	if got.Load() != 2 {
		t.Fatalf("%d notifications reached the target, want 2", got.Load())
	}
	// Without the notification, whose pool the race detector empties.
	s := slices.DeleteFunc(batch(transport.Write), func(s transport.Slice) bool { return s.Op == transport.Notify })
	errs := make([]error, len(s))
	if n := testing.AllocsPerRun(20, func() { ep.CopyBatch(s, errs) }); n != 0 {
		t.Fatalf("CopyBatch allocates %v times", n)
	}
	done := make(chan error, 1)
	go func() {
		for _, b := range bufs {
			if err := w.targ.Unregister(b, w.tregs[b]); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Unregister: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("hang: withdrawing the buffers after CopyBatch (a reference kept)")
	}
	if mp, _ := ep.Granted(); mp != 0 {
		t.Fatalf("still %d mapped after Unregister", mp)
	}
}

// TestCopyBatchMappedInOrder: a batch of large copies through a mapping,
// which move four at once, some reading or overwriting what earlier ones
// wrote or read, leaves what they leave one by one in order
// (transporttest.InOrder; the conformance suite's buffers are not memfds,
// so its slices go through process_vm calls).
func TestCopyBatchMappedInOrder(t *testing.T) {
	w := newWorld(t, shm.Config{})
	b, m := w.shared(transporttest.InOrderSpan, true)
	ep := w.open()
	if mp, _ := ep.Granted(); mp != 1 {
		t.Fatalf("granted %d mapped; want 1", mp)
	}
	transporttest.InOrder(t, ep, w.local.Bytes(), m, func(op transport.Op, loff, roff, n uint64) transport.Slice {
		return w.slice(op, loff, uint64(b.Addr)+roff, n)
	})
}

// TestNotifyAllocs: a notification is one round trip on the control
// socket that allocates nothing, and reaches the target's engine.
func TestNotifyAllocs(t *testing.T) {
	w := newWorld(t, shm.Config{})
	w.shared(4096, true)
	var got atomic.Int64
	w.targ.SetNotify("target", func(n *transport.Notification) error {
		if n.From == "initiator" && n.Tag == 7 && string(n.Msg) == "hello" {
			got.Add(1)
		}
		return nil
	})
	w.init.SetNotify("initiator", func(*transport.Notification) error { return nil })
	ep := w.open()
	copy(w.local.Bytes(), "hello")
	s := transport.Slice{Op: transport.Notify, Local: w.local.Pointer(0), Remote: 7, Length: 5}
	if err := ep.Copy(&s); err != nil || got.Load() != 1 {
		t.Fatalf("notify: %v, %d delivered", err, got.Load())
	}
	n := testing.AllocsPerRun(50, func() { ep.Copy(&s) })
	if n > 0 && !shm.RaceEnabled { // the race detector's sync.Pool drops what it is given
		t.Errorf("a notification allocates %v times", n)
	}
	if got.Load() != 52 {
		t.Errorf("%d notifications delivered, want 52", got.Load())
	}
}

// A buffer whose memfd's last page also holds another registered buffer
// (the same allocation's tail, registered on its own) is not handed out as
// a file: mapping the file would give the peer the other buffer too, even
// a local-only one. It is reached through process_vm calls instead, and
// the data still moves.
func TestSharedTailNotHandedOut(t *testing.T) {
	w := newWorld(t, shm.Config{})
	m, err := mem.AllocShared(4096+100, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Free(m) })
	a := w.register(m, true)
	w.register(m[len(m):cap(m)], false) // the tail page's rest, local-only
	ep := w.open()
	if mapped, vm := ep.Granted(); mapped != 0 || vm != 1 {
		t.Fatalf("granted %d mapped, %d vm; want the buffer through process_vm only", mapped, vm)
	}
	lm := w.local.Bytes()
	testpattern.Fill(m, 9)
	s := w.slice(transport.Read, 0, uint64(a.Addr), a.Length)
	if err := ep.Copy(&s); err != nil {
		t.Fatalf("READ: %v", err)
	}
	if !bytes.Equal(lm[:a.Length], m) {
		t.Fatal("READ: data differ")
	}
}

// TestSharedTailAfterMapping: once a buffer's memfd was handed out whole,
// the rest of its last page, which the peer's mapping covers, can no
// longer be registered; it used to be, and the peer could then reach that
// memory through the mapping it already had.
func TestSharedTailAfterMapping(t *testing.T) {
	w := newWorld(t, shm.Config{})
	m, err := mem.AllocShared(4096+100, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Free(m) })
	w.register(m, true)
	ep := w.open()
	if mapped, vm := ep.Granted(); mapped != 1 || vm != 0 {
		t.Fatalf("granted %d mapped, %d vm; want the buffer mapped", mapped, vm)
	}
	tail, err := w.tbufs.Register(m[len(m):cap(m)], segtable.CPU(0), false)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.targ.Register(tail); !errors.Is(err, segtable.ErrOverlap) {
		t.Errorf("registering the tail of a mapped file: %v, want ErrOverlap", err)
	}
}

// TestUnregisterDuringClose: an Unregister that comes while Close revokes
// every buffer at the peers waits, as Close does, until no peer uses the
// buffer; so does a second Close. Both used to return at once, while a
// peer could still be copying. A second Unregister of a buffer being
// unregistered is refused rather than left waiting for good.
func TestUnregisterDuringClose(t *testing.T) {
	w := newWorld(t, shm.Config{})
	b, _ := w.shared(1<<20, true)
	ep := w.open()
	// A copy whose reference on b the initiator keeps (CopyNow's Holds):
	// it answers a revoke only once that is released.
	var h transport.Holds
	s := w.slice(transport.Write, 0, uint64(b.Addr), 4096)
	if done, err := ep.CopyNow(&s, &h); !done || err != nil || h.Len() != 1 {
		t.Fatalf("CopyNow = %v, %v with %d held; want a mapped copy holding its reference", done, err, h.Len())
	}
	t.Cleanup(h.Release) // before the world's cleanup, should the test fail
	closed := make(chan struct{})
	go func() { w.targ.Close(); close(closed) }()
	testwait.For(t, time.Minute, "the target's Close did not begin", func() bool { return shm.Closing(w.targ) })
	unreg := make(chan error, 1)
	go func() { unreg <- w.targ.Unregister(b, w.tregs[b]) }()
	second := make(chan struct{})
	go func() { w.targ.Close(); close(second) }()
	select {
	case err := <-unreg:
		t.Fatalf("Unregister returned (%v) while a peer still held the buffer", err)
	case <-second:
		t.Fatal("a second Close returned while a peer still held a buffer")
	case <-time.After(100 * time.Millisecond):
	}
	if err := w.targ.Unregister(b, w.tregs[b]); !errors.Is(err, segtable.ErrNotFound) {
		t.Errorf("a second Unregister of the same buffer: %v, want ErrNotFound", err)
	}
	h.Release()
	if err := <-unreg; err != nil {
		t.Errorf("Unregister during Close: %v", err)
	}
	<-closed
	<-second
}
