// order.go holds InOrder, the Batch variant's subtest of the same name:
// one CopyBatch of large slices, some of which read or overwrite what
// earlier ones in the batch wrote or read, leaves what the slices one at a
// time in order leave (transport.BatchCopier's promise, which moving
// several at once must keep).

package transporttest

import (
	"slices"
	"testing"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// InOrderSpan is how many bytes of local and remote memory InOrder's
// slices address, from their starts.
const InOrderSpan = 2 << 20

// InOrder moves one batch of slices through bc with CopyBatch and fails t
// unless each succeeds and the batch leaves local and remote, the memory
// the slices address (InOrderSpan bytes or more each), as the slices one
// by one in order would. The slices are large enough to move together
// (transport.CopyGroups), in runs of four in which one reads or
// overwrites what an earlier one wrote or read, on either side, then a
// small one over what the two before it wrote, then four apart, then four
// in which the third reads what the first wrote. slice
// returns a slice of op between local[loff:] and the remote memory's byte
// at offset roff, n bytes long.
func InOrder(t *testing.T, bc transport.BatchCopier, local, remote []byte, slice func(op transport.Op, loff, roff, n uint64) transport.Slice) {
	t.Helper()
	const (
		blk  = 40<<10 + 3 // large enough to move with others, odd
		slot = 64 << 10
	)
	type xfer struct {
		op         transport.Op
		loff, roff uint64
		n          uint64
	}
	xs := []xfer{
		// The second reads what the first wrote (the other two apart, as
		// in the runs below).
		{transport.Write, 0, 0, blk}, {transport.Read, slot, 100, blk},
		{transport.Write, 2 * slot, 2*slot + 1, blk}, {transport.Read, 3*slot + 7, 3 * slot, blk},
		// The second overwrites what the first read.
		{transport.Write, 4 * slot, 4 * slot, blk}, {transport.Read, 4*slot + 50, 5 * slot, blk},
		{transport.Write, 6 * slot, 6 * slot, blk}, {transport.Read, 7 * slot, 7 * slot, blk},
		// The second overwrites what the first wrote, remote and local.
		{transport.Write, 8 * slot, 8 * slot, blk}, {transport.Write, 9 * slot, 8*slot + 1000, blk},
		{transport.Read, 10 * slot, 10 * slot, blk}, {transport.Read, 10*slot + 500, 11 * slot, blk},
		// A small one over what the two before it wrote.
		{transport.Write, 12 * slot, 12 * slot, blk}, {transport.Write, 13 * slot, 12*slot + 1000, blk},
		{transport.Write, 14 * slot, 12*slot + 2000, 4096},
		// Four apart.
		{transport.Write, 15 * slot, 15 * slot, 2 * blk}, {transport.Read, 17*slot + 7, 17 * slot, blk},
		{transport.Write, 18 * slot, 18*slot + 64, blk}, {transport.Read, 19 * slot, 19 * slot, blk + 77},
		// The third reads what the first wrote (in pairs, the second pair
		// after the first).
		{transport.Write, 20 * slot, 20 * slot, blk}, {transport.Write, 21 * slot, 21 * slot, blk},
		{transport.Read, 22 * slot, 20*slot + 300, blk}, {transport.Write, 23 * slot, 23 * slot, blk},
	}
	testpattern.Fill(local[:InOrderSpan], 1)
	testpattern.Fill(remote[:InOrderSpan], 2)
	wantL, wantR := slices.Clone(local[:InOrderSpan]), slices.Clone(remote[:InOrderSpan])
	s := make([]transport.Slice, len(xs))
	for i, x := range xs {
		s[i] = slice(x.op, x.loff, x.roff, x.n)
		l, r := wantL[x.loff:x.loff+x.n], wantR[x.roff:x.roff+x.n]
		if x.op == transport.Write {
			copy(r, l)
		} else {
			copy(l, r)
		}
	}
	errs := make([]error, len(s))
	bc.CopyBatch(s, errs)
	for i, err := range errs {
		if err != nil {
			t.Fatalf("slice %d: %v", i, err)
		}
	}
	expectArena(t, "local memory after the batch", local[:InOrderSpan], wantL)
	expectArena(t, "remote memory after the batch", remote[:InOrderSpan], wantR)
}

func testBatchInOrder(t *testing.T, su suite) {
	f := newFixture(t, su)
	bc := f.open(f.desc).(batchEndpoint).bc
	aOff := f.tOff(uint64(f.a.Addr))
	InOrder(t, bc, f.iarena[page:], f.tarena[aOff:], func(op transport.Op, loff, roff, n uint64) transport.Slice {
		return f.slice(op, loff, uint64(f.a.Addr)+roff, n, 0)
	})
}
