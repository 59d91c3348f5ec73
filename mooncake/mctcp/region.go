package mctcp

// region.go: the buffers the target serves. A Mooncake request names an
// address, not a buffer, so the table is sorted by address and a request's
// range must lie wholly inside one entry. A request holds its entry's
// reference while it moves the bytes; Unregister takes the entry out of
// the table, then waits for those references (each bounded by
// FrameTimeout and MinRate).

import (
	"context"
	"fmt"
	"slices"
	"time"
	"unsafe"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// region is one registered, remote-accessible buffer.
type region struct {
	id     segtable.BufferID
	addr   uint64
	length uint64
	base   unsafe.Pointer
	ref    segtable.Ref
}

// Register serves b to peers when it is remote-accessible. The
// registration is empty either way: Mooncake's protocol has no key, and
// the initiator needs no handle (Slice.Local is the address).
func (t *Transport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	if t.closed.Load() {
		return segtable.Registration{}, fmt.Errorf("mctcp: register: %w", transport.ErrClosed)
	}
	if !b.Remote || b.Length == 0 {
		return segtable.Registration{}, nil
	}
	r := &region{id: b.ID, addr: uint64(b.Addr), length: b.Length, base: b.Pointer(0)}
	t.mu.Lock()
	defer t.mu.Unlock()
	rs := *t.regs.Load()
	i, _ := slices.BinarySearchFunc(rs, r.addr, func(x *region, a uint64) int { return cmpU64(x.addr, a) })
	if (i > 0 && rs[i-1].addr+rs[i-1].length > r.addr) || (i < len(rs) && r.addr+r.length > rs[i].addr) {
		return segtable.Registration{}, fmt.Errorf("mctcp: register buffer %d: overlaps a registered buffer: %w", b.ID, segtable.ErrOverlap)
	}
	rs = slices.Insert(slices.Clone(rs), i, r)
	t.regs.Store(&rs)
	return segtable.Registration{}, nil
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Unregister stops serving b once no request moves its bytes (a minute at
// most; see UnregisterContext).
func (t *Transport) Unregister(b *segtable.Buffer, reg segtable.Registration) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return t.UnregisterContext(ctx, b, reg)
}

// UnregisterContext is Unregister with its wait bounded by ctx: the buffer
// leaves the table at once (no new request finds it), then the call waits
// for the requests already moving its bytes, each bounded by FrameTimeout
// plus its length at MinRate. When ctx ends first it returns an error
// wrapping ctx's; those requests may go on until they end or Close closes
// their connections, so the memory may be reused only after Close. Safe
// for concurrent use.
func (t *Transport) UnregisterContext(ctx context.Context, b *segtable.Buffer, reg segtable.Registration) error {
	if !b.Remote || b.Length == 0 {
		return nil
	}
	t.mu.Lock()
	var r *region
	rs := slices.DeleteFunc(slices.Clone(*t.regs.Load()), func(x *region) bool {
		if x.id == b.ID && x.addr == uint64(b.Addr) {
			r = x
			return true
		}
		return false
	})
	if r != nil {
		t.regs.Store(&rs)
	}
	t.mu.Unlock()
	if r == nil {
		return fmt.Errorf("mctcp: unregister buffer %d: %w", b.ID, segtable.ErrNotFound)
	}
	if err := r.ref.Drain(ctx); err != nil {
		return fmt.Errorf("mctcp: unregister buffer %d: %w", b.ID, err)
	}
	return nil
}

// hold finds the region that holds [addr, addr+length) wholly and takes
// its reference; nil when none does (or it is being unregistered). A
// zero length is refused, as Mooncake's server refuses it.
func (t *Transport) hold(addr, length uint64) *region {
	if length == 0 || addr+length < addr {
		return nil
	}
	rs := *t.regs.Load()
	// The last region starting at or below addr.
	i, j := 0, len(rs)
	for i < j {
		h := int(uint(i+j) >> 1)
		if rs[h].addr <= addr {
			i = h + 1
		} else {
			j = h
		}
	}
	if i == 0 {
		return nil
	}
	r := rs[i-1]
	if addr-r.addr >= r.length || length > r.length-(addr-r.addr) {
		return nil
	}
	if !r.ref.Acquire() {
		return nil
	}
	return r
}

// bytes returns the region's bytes [addr, addr+length), which hold checked.
func (r *region) bytes(addr, length uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Add(r.base, addr-r.addr)), length)
}
