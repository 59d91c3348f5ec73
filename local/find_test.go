package local

import (
	"context"
	"testing"
	"time"

	"github.com/moonring/moonring/segtable"
)

// TestFindNested: while an old registration drains under a new one of the
// same memory the regions nest, and find still finds the one holding a
// range (its search assumed they did not, and missed).
func TestFindNested(t *testing.T) {
	outer := &region{addr: 0x1000, length: 0x3000} // [0x1000, 0x4000), new
	inner := &region{addr: 0x2000, length: 0x100}  // [0x2000, 0x2100), draining
	rs := sorted(outer, inner)
	for _, c := range []struct {
		addr, n uint64
		want    *region
	}{
		{0x3000, 16, outer}, // past inner's end: inner comes last by start
		{0x2000, 16, inner},
		{0x1000, 0x3000, outer},
		{0x3ff0, 32, nil}, // past outer's end
		{0x800, 16, nil},  // before both
	} {
		if got := find(rs, c.addr, c.n); got != c.want {
			t.Errorf("find(%#x, %d) = %+v; want %+v", c.addr, c.n, got, c.want)
		}
	}
	// The inner one draining (a copy holds it): the outer one takes its range.
	inner.ref.Acquire()
	drained := make(chan error, 1)
	go func() { drained <- inner.ref.Drain(context.Background()) }()
	for deadline := time.Now().Add(30 * time.Second); !inner.ref.Closing(); {
		if time.Now().After(deadline) {
			t.Fatal("the drain never began")
		}
		time.Sleep(time.Millisecond)
	}
	if got := find(rs, 0x2000, 16); got != outer {
		t.Errorf("find in a draining region under a live one = %+v; want the live one", got)
	}
	// The same memory registered again before the old one starts to
	// drain: the newer one, last among equal starts, is found.
	again := &region{addr: 0x1000, length: 0x3000}
	if got := find(sorted(outer, again, inner), 0x3000, 16); got != again {
		t.Errorf("find with the same memory registered twice = %+v; want the newer", got)
	}
	inner.ref.Release()
	if err := <-drained; err != nil {
		t.Fatal(err)
	}
}

// sorted returns the regions rs, in that order, as a Transport holds them.
func sorted(rs ...*region) *segtable.Sorted[*region] {
	s := new(segtable.Sorted[*region])
	for _, r := range rs {
		s.Insert(uint64(r.addr), r)
	}
	return s
}
