package local_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

// TestConformance: Post, Copy, batch and Hold variants; losing Copier,
// BatchCopier, InlineCopier, HoldingCopier or Notifier fails it.
func TestConformance(t *testing.T) {
	want := []transporttest.Interface{transporttest.Copier, transporttest.BatchCopier, transporttest.InlineCopier, transporttest.HoldingCopier, transporttest.Notifier}
	transporttest.RunWith(t, transporttest.Options{Want: want}, func(t *testing.T) (transport.Transport, transport.Transport) {
		return local.New(), local.New()
	})
}

// twoBuffers registers src and dst in bufs, to be unregistered when the
// test ends.
func twoBuffers(t *testing.T, bufs *segtable.Buffers, src, dst []byte) (bs, bd *segtable.Buffer) {
	t.Helper()
	var err error
	if bs, err = bufs.Register(src, "", false); err != nil {
		t.Fatal(err)
	}
	if bd, err = bufs.Register(dst, "", false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		bufs.Unregister(context.Background(), bd.ID)
		bufs.Unregister(context.Background(), bs.ID)
	})
	return bs, bd
}

// TestCopyHold: a copy that leaves its reference in a Holds keeps the
// target region from being unregistered until the holds are released, and
// later copies to the same region take no second reference.
func TestCopyHold(t *testing.T) {
	tr := local.New()
	defer tr.Close()
	var bufs segtable.Buffers
	src, dst := make([]byte, 8192), make([]byte, 8192)
	for i := range src {
		src[i] = byte(i * 7)
	}
	bs, bd := twoBuffers(t, &bufs, src, dst)
	rd, err := tr.Register(bd)
	if err != nil {
		t.Fatal(err)
	}
	ep := tr.Self().(transport.HoldingCopier)
	var h transport.Holds
	for i := range 2 {
		s := transport.Slice{Op: transport.Write, Local: bs.Pointer(uint64(i) * 4096), Remote: uint64(bd.Addr) + uint64(i)*4096, Length: 4096}
		if err := ep.CopyHold(&s, &h); err != nil {
			t.Fatal(err)
		}
	}
	if h.Len() != 1 || !bytes.Equal(src, dst) {
		t.Fatalf("%d references held (want 1), data equal %v", h.Len(), bytes.Equal(src, dst))
	}
	done := make(chan error, 1)
	go func() { done <- tr.Unregister(bd, rd) }()
	select {
	case err := <-done:
		t.Fatalf("Unregister returned while a copy's reference was held: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	h.Release()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Unregister still waits after the holds were released")
	}
	s := transport.Slice{Op: transport.Write, Local: bs.Pointer(0), Remote: uint64(bd.Addr), Length: 1}
	if err := ep.CopyHold(&s, &h); err == nil {
		t.Fatal("a copy to an unregistered region succeeded")
	}
}

// TestCopyBatchGroups: a batch of large slices, which CopyBatch moves
// four at a time, leaves what moving them one by one in order leaves,
// each with its own result: refused slices among those that move, blocks
// of unequal lengths and odd offsets, a small slice that ends a group, and
// groups in which a later slice reads or overwrites what an earlier one
// writes or reads (which must move in order).
func TestCopyBatchGroups(t *testing.T) {
	tr := local.New()
	defer tr.Close()
	var bufs segtable.Buffers
	const size = 4 << 20
	src, dst := make([]byte, size), make([]byte, size)
	testpattern.Fill(src, 1)
	testpattern.Fill(dst, 2)
	bs, bd := twoBuffers(t, &bufs, src, dst)
	rd, err := tr.Register(bd)
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Unregister(bd, rd)
	srcM, dstM := bytes.Clone(src), bytes.Clone(dst)
	type xfer struct {
		op         transport.Op
		loff, roff uint64
		n          uint64
		refused    bool
	}
	const blk = 32 << 10
	xs := []xfer{
		{transport.Write, 0, 5 * blk, blk, false},
		{transport.Write, 3 * blk, 40 * blk, blk, false},
		{transport.Read, 7*blk + 3, 9*blk + 5, blk + 4097, false},
		{transport.Write, 11 * blk, size, blk, true}, // past the region: refused inside a group
		{transport.Read, 20 * blk, 60 * blk, 3 * blk, false},
		{transport.Write, 30*blk + 1, 70*blk + 63, 2*blk + 1, false},
		{transport.Read, 40 * blk, size + blk, blk, true},
		{transport.Write, 50 * blk, 80 * blk, blk, false},
		{transport.Write, 52 * blk, 80*blk + 100, 4096, false}, // small, over what the one before wrote: the two before it move first
		{transport.Write, 90 * blk, 100 * blk, blk, false},
		{transport.Read, 91 * blk, 100 * blk, blk, false}, // reads what the one before wrote
		{transport.Read, 110 * blk, 99 * blk, blk, false},
		{transport.Read, 90*blk + 100, 120 * blk, blk, false}, // overwrites what the third before read
		{transport.Write, 0, 10 * blk, blk, false},
		{transport.Write, 2 * blk, 14 * blk, blk, false},
		{transport.Read, 4 * blk, 18 * blk, blk, false},
		{transport.Read, 8 * blk, 22 * blk, blk + 77, false}, // four apart
	}
	s := make([]transport.Slice, len(xs))
	for i, x := range xs {
		s[i] = transport.Slice{Op: x.op, Local: bs.Pointer(x.loff), Remote: uint64(bd.Addr) + x.roff, Length: x.n, Token: uint64(i + 1)}
		if x.refused {
			continue
		}
		if x.op == transport.Write {
			copy(dstM[x.roff:x.roff+x.n], srcM[x.loff:x.loff+x.n])
		} else {
			copy(srcM[x.loff:x.loff+x.n], dstM[x.roff:x.roff+x.n])
		}
	}
	errs := make([]error, len(s))
	tr.Self().(transport.BatchCopier).CopyBatch(s, errs)
	for i, x := range xs {
		if x.refused != (errs[i] != nil) || x.refused && !errors.Is(errs[i], transport.ErrRange) {
			t.Errorf("slice %d (refused %v): %v", i, x.refused, errs[i])
		}
	}
	if !bytes.Equal(src, srcM) || !bytes.Equal(dst, dstM) {
		t.Fatalf("the batch left other bytes than its slices one by one: local equal %v, target equal %v", bytes.Equal(src, srcM), bytes.Equal(dst, dstM))
	}
}
