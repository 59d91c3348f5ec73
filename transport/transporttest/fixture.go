// fixture.go holds the memory of one subtest: the two sides (a transport
// and its table of registered buffers), the target's arena of buffers
// between canaries and the initiator's, the descriptor that grants them,
// the slices cut over them, and the checks that an arena is as expected.

package transporttest

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

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
	batch      bool // open batchEndpoints
}

func newFixture(t *testing.T, su suite) *fixture {
	t.Helper()
	return newFixtureSize(t, su, smallA)
}

func newFixtureSize(t *testing.T, su suite, aLen int) *fixture {
	t.Helper()
	it, tt := su.newPair(t)
	f := &fixture{
		t:     t,
		copy:  su.copy,
		hold:  su.hold,
		batch: su.batch,
		init:  &side{tr: it, regs: map[*segtable.Buffer]segtable.Registration{}},
		targ:  &side{tr: tt, regs: map[*segtable.Buffer]segtable.Registration{}},
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
	if f.batch {
		bc, ok := ep.(transport.BatchCopier)
		if !ok {
			f.t.Fatalf("%s: endpoint %T does not implement transport.BatchCopier, though the first one opened did", f.init.tr.Name(), ep)
		}
		return batchEndpoint{ep, bc}
	}
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

func (op opName) String() string { return [...]string{"op0", "READ", "WRITE"}[op] }

type opName transport.Op
