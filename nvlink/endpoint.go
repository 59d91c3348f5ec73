package nvlink

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Endpoint reaches the exported GPU buffers of one segment of another
// process of the host. Safe for concurrent use; it lives until its Close
// or its transport's.
type Endpoint struct {
	t    *Transport
	addr string // the descriptor's endpoint the current table came from

	remotes atomic.Pointer[[]remote] // by address; replaced by Update
	use     segtable.Ref             // Post calls in progress; Close drains it
	closed  atomic.Bool

	mu   sync.Mutex            // serializes Update and Close
	tabs []*table              // every table remotes may name, unmapped at Close
	held map[*mapping]struct{} // mappings remotes may use, dropped at Close
}

// remote is one buffer of the segment as this process reaches it.
type remote struct {
	addr, length uint64 // the target's addresses, from the descriptor
	ptr          uintptr
	dev          *device
	tab          *table
	slot         int
	gen          uint32
	deny         error // non-nil: slices to the buffer fail with it
}

var _ transport.Endpoint = (*Endpoint)(nil)

// Rails returns 1: one stream per GPU carries the copies.
func (e *Endpoint) Rails() int { return 1 }

// Update takes the segment's new descriptor: buffers added or removed,
// and a restarted peer's new grant table.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	e.mu.Lock()
	if e.closed.Load() {
		e.mu.Unlock()
		return
	}
	tab := e.tabs[len(e.tabs)-1]
	if s := desc.Endpoints[Name]; s != e.addr {
		if nt, err := e.t.peerTable(desc); err == nil {
			e.tabs = append(e.tabs, nt)
			tab = nt
			e.addr = s
		} else {
			tab = nil // a peer this transport cannot reach now: deny all
		}
	}
	e.mu.Unlock()
	e.update(desc, tab)
}

// update builds the endpoint's view of desc's buffers, mapping allocations
// not mapped yet. Every check a descriptor could fail is made here, once,
// so that Post only looks up.
func (e *Endpoint) update(desc *segtable.SegmentDesc, tab *table) {
	bufs := slices.Clone(desc.Buffers)
	slices.SortFunc(bufs, func(a, b segtable.BufferDesc) int {
		switch {
		case a.Addr < b.Addr:
			return -1
		case a.Addr > b.Addr:
			return 1
		}
		return 0
	})
	rs := make([]remote, 0, len(bufs))
	var end uint64
	t := e.t
	t.mu.Lock()
	defer t.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return // Close has dropped, or will drop, what a view would use
	}
	for i, b := range bufs {
		if b.Length == 0 || b.Addr+b.Length < b.Addr || (i > 0 && b.Addr < end) {
			continue // a malformed descriptor: such a buffer is never reached
		}
		end = b.Addr + b.Length
		r := remote{addr: b.Addr, length: b.Length, slot: -1}
		r.deny = e.resolve(&r, b, tab)
		rs = append(rs, r)
	}
	e.remotes.Store(&rs)
}

// resolve fills r from the buffer's key, or says why it is denied. t.mu
// and e.mu are held.
func (e *Endpoint) resolve(r *remote, b segtable.BufferDesc, tab *table) error {
	if tab == nil {
		return fmt.Errorf("%w: the segment's nvlink endpoint is unreachable", transport.ErrDenied)
	}
	s, ok := b.Keys[Name]
	if !ok || s == "" {
		return fmt.Errorf("%w: no nvlink key (not GPU memory, or not remote-accessible)", transport.ErrDenied)
	}
	k, err := parseKey(s)
	if err != nil {
		return fmt.Errorf("%w: %w", transport.ErrDenied, err)
	}
	if k.addr != b.Addr || k.length != b.Length {
		return fmt.Errorf("%w: the key is for [%#x, +%d), not this buffer", transport.ErrDenied, k.addr, k.length)
	}
	if int(k.slot) >= tab.slots {
		return fmt.Errorf("%w: slot %d outside the peer's table", transport.ErrDenied, k.slot)
	}
	d := e.t.bus[k.bus]
	if d == nil {
		return fmt.Errorf("%w: GPU %s is not visible to this process", transport.ErrDenied, k.bus)
	}
	if err := e.t.start(d); err != nil {
		return fmt.Errorf("%w: %w", transport.ErrDenied, err)
	}
	m, err := e.t.mapHandle(d, k.handle)
	if err != nil {
		return fmt.Errorf("%w: open IPC handle: %w", transport.ErrDenied, err)
	}
	if k.addr-k.base > m.size || k.length > m.size-(k.addr-k.base) {
		e.t.unmapHandle(m)
		return fmt.Errorf("%w: the key names [%d, +%d) of an allocation of %d bytes", transport.ErrDenied, k.addr-k.base, k.length, m.size)
	}
	if _, ok := e.held[m]; ok {
		e.t.unmapHandle(m) // held already: one reference per endpoint
	} else {
		e.held[m] = struct{}{}
	}
	r.ptr = m.ptr + uintptr(k.addr-k.base)
	r.dev, r.tab, r.slot, r.gen = d, tab, int(k.slot), k.gen
	return nil
}

// find returns the buffer that holds [addr, addr+n), or nil.
func find(rs []remote, addr, n uint64) *remote {
	i, j := 0, len(rs) // sort.Search by hand: this runs for every slice
	for i < j {
		h := int(uint(i+j) >> 1)
		if rs[h].addr+rs[h].length > addr {
			j = h
		} else {
			i = h + 1
		}
	}
	if i == len(rs) {
		return nil
	}
	r := &rs[i]
	if addr < r.addr || n == 0 || n > r.length || addr-r.addr > r.length-n {
		return nil
	}
	return r
}

// Post queues a copy per slice on the stream of the GPU that holds the
// slice's remote buffer, with an event behind it; Poll completes them. A
// slice that fails a check completes at once: ErrRange outside every
// buffer, ErrDenied for a buffer without a valid key or no longer granted,
// ErrClosed after Close. Post takes fewer than len(s) slices when a GPU
// has Config.Depth copies in flight. It does not block.
func (e *Endpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	if !e.use.Acquire() {
		for i := range s {
			c.Complete(s[i].Token, transport.ErrClosed)
		}
		return len(s), nil
	}
	defer e.use.Release()
	t := e.t
	lockThread()
	defer unlockThread()
	var cur uintptr // the context current on this thread, 0 when unknown
	for i := range s {
		sl := &s[i]
		r, loc, err := e.check(sl)
		if err != nil {
			c.Complete(sl.Token, err)
			cur = 0
			continue
		}
		if !r.tab.acquire(r.slot, r.gen) {
			err := transport.ErrDenied // unregistered, or registered anew
			if r.tab.closed() {
				err = transport.ErrClosed
			}
			c.Complete(sl.Token, err)
			cur = 0
			continue
		}
		l := r.dev.lane
		l.mu.Lock()
		if e.closed.Load() || t.closed.Load() {
			l.mu.Unlock()
			r.tab.release(r.slot)
			c.Complete(sl.Token, transport.ErrClosed)
			cur = 0
			continue
		}
		tail := l.tail.Load()
		if tail-l.head.Load() > l.mask {
			l.mu.Unlock()
			r.tab.release(r.slot)
			return i, nil // full: the caller retries the rest after a Poll
		}
		if cur != r.dev.ctx {
			if err = t.drv.setCurrent(r.dev.ctx); err == nil {
				cur = r.dev.ctx
			}
		}
		if err == nil {
			err = e.enqueue(l, sl, r, loc, tail)
		}
		if err != nil {
			l.mu.Unlock()
			r.tab.release(r.slot)
			c.Complete(sl.Token, fmt.Errorf("nvlink: post on GPU %d: %w", r.dev.ordinal, err))
			cur = 0
			continue
		}
		l.ring[tail&l.mask] = pending{c: c, token: sl.Token, ep: e, tab: r.tab, slot: r.slot}
		l.tail.Store(tail + 1)
		l.mu.Unlock()
	}
	return len(s), nil
}

// check validates a slice against the endpoint's view of the segment and
// the transport's registrations.
func (e *Endpoint) check(sl *transport.Slice) (*remote, *region, error) {
	if e.closed.Load() || e.t.closed.Load() {
		return nil, nil, transport.ErrClosed
	}
	if sl.Op == transport.Notify {
		return nil, nil, ErrNotify
	}
	if sl.Op != transport.Read && sl.Op != transport.Write {
		return nil, nil, fmt.Errorf("nvlink: op %d: %w", sl.Op, transport.ErrNotSupported)
	}
	r := find(*e.remotes.Load(), sl.Remote, sl.Length)
	if r == nil {
		return nil, nil, transport.ErrRange
	}
	if r.deny != nil {
		return nil, nil, r.deny
	}
	loc := e.t.regions()[sl.LocalHandle]
	if loc == nil {
		return nil, nil, fmt.Errorf("nvlink: local handle %d not registered: %w", sl.LocalHandle, transport.ErrDenied)
	}
	off := uint64(uintptr(sl.Local) - loc.addr)
	if uintptr(sl.Local) < loc.addr || sl.Length > loc.length || off > loc.length-sl.Length {
		return nil, nil, fmt.Errorf("nvlink: local range outside its buffer: %w", transport.ErrRange)
	}
	return r, loc, nil
}

// enqueue queues the copy of sl and records the lane's event at index
// tail. l.mu is held and r's context is current.
func (e *Endpoint) enqueue(l *lane, sl *transport.Slice, r *remote, loc *region, tail uint64) error {
	d := e.t.drv
	rp := r.ptr + uintptr(sl.Remote-r.addr)
	var err error
	switch {
	case loc.dev != nil && sl.Op == transport.Write:
		err = d.copyDtoD(rp, uintptr(sl.Local), sl.Length, l.stream)
	case loc.dev != nil:
		err = d.copyDtoD(uintptr(sl.Local), rp, sl.Length, l.stream)
	case sl.Op == transport.Write:
		err = d.copyHtoD(rp, sl.Local, sl.Length, l.stream)
	default:
		err = d.copyDtoH(sl.Local, rp, sl.Length, l.stream)
	}
	if err != nil {
		return err
	}
	if err := d.eventRecord(l.events[tail&l.mask], l.stream); err != nil {
		// The copy is queued but has no event: wait for it here (a failure
		// path) so that the grant is not dropped under a running copy.
		d.streamSync(l.stream)
		return err
	}
	return nil
}

// Close completes the endpoint's slices in flight with ErrClosed once
// their copies have stopped (it waits for the streams: Close is not a hot
// path), then drops its mappings and peer tables. Idempotent.
func (e *Endpoint) Close() error {
	e.mu.Lock()
	if e.closed.Swap(true) {
		e.mu.Unlock()
		return nil
	}
	e.mu.Unlock()
	// Post calls in progress finish (they check closed under each lane's
	// lock, so none queues after this); Completers called from Close may
	// post again and are refused.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	err := e.use.Drain(ctx)
	cancel()
	t := e.t
	for _, d := range t.devs {
		if !d.ready.Load() {
			continue
		}
		l := d.lane
		l.mu.Lock()
		l.mu.Unlock() //nolint:staticcheck // a barrier: Posts past their closed check are done
		l.pollMu.Lock()
		l.reap(t.drv, true)
		l.pollMu.Unlock()
	}
	t.mu.Lock()
	delete(t.eps, e)
	e.mu.Lock()
	for m := range e.held {
		t.unmapHandle(m)
	}
	clear(e.held)
	for _, tab := range e.tabs {
		tab.unmap()
	}
	e.tabs = nil
	e.mu.Unlock()
	t.mu.Unlock()
	if err != nil {
		return fmt.Errorf("nvlink: close endpoint: %w", err)
	}
	return nil
}
