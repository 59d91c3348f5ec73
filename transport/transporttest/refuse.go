// refuse.go holds the subtests of what a target refuses: ranges outside a
// buffer or across two (Bounds), a local-only buffer (LocalOnlyDenied) and
// a wrong key (WrongKeyDenied), each failing with a final error and moving
// nothing.

package transporttest

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

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

// testPipelinedRefusals posts refusals in one batch among transfers that
// succeed, as a KV cache's batch meets blocks evicted or never granted:
// READs and WRITEs of a buffer whose published key is another buffer's
// (refused by the target, where it checks keys) and of the gap between
// two buffers (refused wherever the transport checks ranges), beside
// READs and WRITEs of A, runs of WRITEs among them. Each refusal fails
// with a final error; each transfer around it succeeds with exactly its
// bytes; nothing else changes on either side, except a refused READ's own
// destination, which transport.Completer leaves undefined.
func testPipelinedRefusals(t *testing.T, su suite) {
	f := newFixture(t, su)
	regs := f.targ.regs
	keyed := regs[f.b].Key != ""
	ep := f.open(f.makeDesc(func(b *segtable.Buffer, k string) string {
		if b == f.b && keyed {
			return regs[f.c].Key // well formed and granted, but not for B
		}
		return k
	}))
	c := newCollector()
	const n = 16 << 10
	aAddr, bAddr := uint64(f.a.Addr), uint64(f.b.Addr)
	gap := bAddr + f.b.Length + 1
	aOff, lOff := f.tOff(aAddr), page
	testpattern.Fill(f.tarena[aOff:aOff+int(f.a.Length)], 21)
	testpattern.Fill(f.iarena[lOff:lOff+int(f.l.Length)], 22)
	wantT, wantI := slices.Clone(f.tarena), slices.Clone(f.iarena)
	type xfer struct {
		op     transport.Op
		loff   int
		remote uint64
		length int
		ok     bool
		rail   int
	}
	var xs []xfer
	// Each round's transfers on one rail (for transports that route by
	// Slice.Rail), so that refusals fall between transfers that succeed
	// on one connection.
	for i := range 16 {
		rail := i % ep.Rails()
		xs = append(xs, xfer{transport.Read, (6*i + 0) * n, aAddr + uint64(i)*n, n, true, rail})
		if keyed { // a transport without keys reaches B: no refusal to make there
			xs = append(xs, xfer{transport.Read, (6*i + 1) * n, bAddr + uint64(i%4)*n, n, false, rail})
		}
		xs = append(xs, xfer{transport.Write, (6*i + 2) * n, aAddr + uint64(16+i)*n, n, true, rail})
		if keyed {
			xs = append(xs, xfer{transport.Write, (6*i + 3) * n, bAddr + uint64(i%4)*n, n, false, rail})
		}
		xs = append(xs,
			xfer{transport.Write, (6*i + 4) * n, aAddr + uint64(32+i)*n, n, true, rail},
			xfer{transport.Read, (6*i + 5) * n, gap, 100, false, rail},
		)
	}
	var s []transport.Slice
	for _, x := range xs {
		s = append(s, f.slice(x.op, uint64(x.loff), x.remote, uint64(x.length), x.rail))
		lo := lOff + x.loff
		switch {
		case x.ok && x.op == transport.Write:
			copy(wantT[f.tOff(x.remote):], f.iarena[lo:lo+x.length])
		case x.ok:
			copy(wantI[lo:], f.tarena[f.tOff(x.remote):f.tOff(x.remote)+x.length])
		}
	}
	errs := f.run(ep, c, s)
	for i, x := range xs {
		err := errs[i]
		switch {
		case x.ok && err != nil:
			t.Errorf("%s %d of %d bytes at %#x, among refusals: %v", opName(x.op), i, x.length, x.remote, err)
		case !x.ok && err == nil:
			t.Errorf("%s %d of %d bytes at %#x succeeded; want a refusal", opName(x.op), i, x.length, x.remote)
		case !x.ok && !errors.Is(err, transport.ErrDenied) && !errors.Is(err, transport.ErrRange):
			t.Errorf("%s %d: error %v; want one wrapping transport.ErrRange or ErrDenied", opName(x.op), i, err)
		}
		if !x.ok && x.op == transport.Read {
			lo := lOff + x.loff // undefined: whatever it holds
			copy(wantI[lo:lo+x.length], f.iarena[lo:lo+x.length])
		}
	}
	expectArena(t, "target", f.tarena, wantT)
	expectArena(t, "initiator", f.iarena, wantI)
	c.check(t, nil)
}
