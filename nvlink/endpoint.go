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
	t *Transport

	remotes atomic.Pointer[[]remote] // the view, by address; replaced by Update
	use     segtable.Ref             // Post calls in progress; Close drains it
	closed  atomic.Bool

	// mu guards what follows. It is taken under Transport.mu, except by
	// Close's first step, and retired changes only with both held.
	mu      sync.Mutex
	addr    string                // the descriptor's endpoint tab came from
	tab     *table                // the peer's table, for views to come; unmapped at Close
	held    map[*mapping]struct{} // the mappings the view uses, a reference each
	retired []retired             // what replaced views used, until their copies are done
}

// retired is what a view that Update replaced held, and the point in each
// lane past which no copy can use it: Post queues a copy only under its
// lane's lock with the current view, so every copy of the replaced view
// lies below the lane's tail as Update read it after the swap.
type retired struct {
	maps  []*mapping
	tab   *table   // nil when the next view kept it
	fence []uint64 // per device of Transport.devs: the lane's tail then
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

// PostWidth asks the engine for Posts of up to groupMax slices (a group:
// one event, one kernel launch or batched copy), or a quarter of the
// depth when that is smaller, so that several groups are in flight while
// the next is posted. Safe for concurrent use; it never changes.
func (e *Endpoint) PostWidth() int { return max(min(groupMax, e.t.cfg.Depth/4), 1) }

var _ transport.WidePoster = (*Endpoint)(nil)

// Update takes the segment's new descriptor: buffers added or removed,
// and a restarted peer's new grant table. What the old view used and the
// new one does not (the mappings of removed buffers, a restarted peer's
// allocations and table) is dropped once no copy that may use it is in
// flight: here when none is, else by a later Poll or Update. Safe for
// concurrent use.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	t := e.t
	t.mu.Lock()
	defer t.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return // Close has dropped, or will drop, what a view would use
	}
	tab, old := e.tab, (*table)(nil)
	if s := desc.Endpoints[Name]; s != e.addr {
		// Mapped under the locks: two Updates racing must not retire a
		// table the other one's view names.
		if nt, err := t.peerTable(desc); err == nil {
			old, e.tab, e.addr, tab = e.tab, nt, s, nt
		} else {
			tab = nil // a peer this transport cannot reach now: deny all
		}
	}
	e.update(desc, tab, old)
	e.reclaim()
}

// update builds the endpoint's view of desc's buffers, mapping allocations
// it names, and retires the previous view's mappings and, when not nil,
// the table old. Every check a descriptor could fail is made here, once,
// so that Post only looks up. t.mu and e.mu are held and e is not closed.
func (e *Endpoint) update(desc *segtable.SegmentDesc, tab, old *table) {
	bufs := slices.Clone(desc.AllBuffers()) // flat: O(n) a republish (see segtable.SegmentDesc.AllBuffers)
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
	// The new view takes its own references, also to mappings the old one
	// holds: those are dropped with the old view, and only the last
	// reference closes a handle.
	held := make(map[*mapping]struct{}, len(e.held))
	var end uint64
	for i, b := range bufs {
		if b.Length == 0 || b.Addr+b.Length < b.Addr || (i > 0 && b.Addr < end) {
			continue // a malformed descriptor: such a buffer is never reached
		}
		end = b.Addr + b.Length
		r := remote{addr: b.Addr, length: b.Length, slot: -1}
		r.deny = e.resolve(&r, b, tab, held)
		rs = append(rs, r)
	}
	e.remotes.Store(&rs)
	prev := e.held
	e.held = held
	if len(prev) == 0 && old == nil {
		return
	}
	rt := retired{tab: old, fence: make([]uint64, len(e.t.devs))}
	for m := range prev {
		rt.maps = append(rt.maps, m)
	}
	for i, d := range e.t.devs {
		if !d.ready.Load() {
			continue // never started: no copy of any view is on it
		}
		// Taking the lock waits for a Post that checked the view under
		// it; any Post after this sees the new view.
		d.lane.mu.Lock()
		rt.fence[i] = d.lane.tail.Load()
		d.lane.mu.Unlock()
	}
	e.retired = append(e.retired, rt)
	e.t.retiring.Add(1)
}

// reclaim drops what replaced views used once no copy of theirs is in
// flight: a lane's head passes an index only after the copy there is done
// and its grant released. t.mu and e.mu are held.
func (e *Endpoint) reclaim() {
	t := e.t
	keep := e.retired[:0]
	for _, rt := range e.retired {
		done := true
		for i, d := range t.devs {
			if d.ready.Load() && d.lane.head.Load() < rt.fence[i] {
				done = false
				break
			}
		}
		if done {
			e.drop(rt)
		} else {
			keep = append(keep, rt)
		}
	}
	clear(e.retired[len(keep):])
	e.retired = keep
}

// drop releases what a replaced view used. t.mu and e.mu are held.
func (e *Endpoint) drop(rt retired) {
	for _, m := range rt.maps {
		e.t.unmapHandle(m)
	}
	if rt.tab != nil {
		rt.tab.unmap()
	}
	e.t.retiring.Add(-1)
}

// resolve fills r from the buffer's key, or says why it is denied; held
// gets a reference to each mapping the view uses. t.mu and e.mu are held.
func (e *Endpoint) resolve(r *remote, b segtable.BufferDesc, tab *table, held map[*mapping]struct{}) error {
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
	if _, ok := held[m]; ok {
		e.t.unmapHandle(m) // held already: one reference per view
	} else {
		held[m] = struct{}{}
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
	queued := false
	// held is the lane whose lock this Post holds, with a group open on it
	// (see lane). Every unlock flushes the group first, and a slice that
	// fails is completed only after the unlock: a Completer may post.
	var held *lane
	let := func() {
		if held != nil {
			queued = held.flush(t.drv) || queued
			held.mu.Unlock()
			held = nil
		}
	}
	// A classic loop: a slice whose view Update replaced is checked again
	// (i--), which a range loop would not allow.
	for i := 0; i < len(s); i++ {
		sl := &s[i]
		view, r, loc, err := e.check(sl)
		if err != nil {
			let()
			c.Complete(sl.Token, err)
			cur = 0
			continue
		}
		l := r.dev.lane
		if held != l {
			let()
			l.mu.Lock()
			held = l
		}
		if e.closed.Load() || t.closed.Load() {
			let()
			c.Complete(sl.Token, transport.ErrClosed)
			cur = 0
			continue
		}
		// r's mapping and table are only sure to be there while its view
		// is current under this lock (see retired): everything that
		// touches them, the grant and the group's flush included, happens
		// before the unlock.
		if e.remotes.Load() != view {
			let()
			i--
			continue
		}
		if !r.tab.acquire(r.slot, r.gen) {
			err := transport.ErrDenied // unregistered, or registered anew
			if r.tab.closed() {
				err = transport.ErrClosed
			}
			let()
			c.Complete(sl.Token, err)
			cur = 0
			continue
		}
		if cur != r.dev.ctx {
			if err := t.drv.setCurrent(r.dev.ctx); err != nil {
				r.tab.release(r.slot)
				let()
				c.Complete(sl.Token, fmt.Errorf("nvlink: post on GPU %d: %w", r.dev.ordinal, err))
				cur = 0
				continue
			}
			cur = r.dev.ctx
		}
		idx, room := l.add(pending{c: c, token: sl.Token, closed: &e.closed, tab: r.tab, slot: r.slot})
		if !room {
			r.tab.release(r.slot)
			let()
			if queued {
				t.wakeup() // as below: the copies queued before this one
			}
			return i, nil // full: the caller retries the rest after a Poll
		}
		e.enqueue(l, sl, r, loc, idx)
		if l.full() {
			queued = l.flush(t.drv) || queued
		}
	}
	let()
	if queued {
		// From a goroutine a parked poller lent its rings, nothing else
		// would wake it to see the copies finish.
		t.wakeup()
	}
	return len(s), nil
}

// check validates a slice against the endpoint's view of the segment and
// the transport's registrations, and returns the view it used. It touches
// no mapping or table: the view may be replaced, and what it holds
// dropped, before the caller locks the lane.
func (e *Endpoint) check(sl *transport.Slice) (*[]remote, *remote, *region, error) {
	if e.closed.Load() || e.t.closed.Load() {
		return nil, nil, nil, transport.ErrClosed
	}
	if sl.Op == transport.Notify {
		return nil, nil, nil, ErrNotify
	}
	if sl.Op != transport.Read && sl.Op != transport.Write {
		return nil, nil, nil, fmt.Errorf("nvlink: op %d: %w", sl.Op, transport.ErrNotSupported)
	}
	view := e.remotes.Load()
	r := find(*view, sl.Remote, sl.Length)
	if r == nil {
		return nil, nil, nil, transport.ErrRange
	}
	if r.deny != nil {
		return nil, nil, nil, r.deny
	}
	loc := e.t.regions()[sl.LocalHandle]
	if loc == nil {
		return nil, nil, nil, fmt.Errorf("nvlink: local handle %d not registered: %w", sl.LocalHandle, transport.ErrDenied)
	}
	off := uint64(uintptr(sl.Local) - loc.addr)
	if uintptr(sl.Local) < loc.addr || sl.Length > loc.length || off > loc.length-sl.Length {
		return nil, nil, nil, fmt.Errorf("nvlink: local range outside its buffer: %w", transport.ErrRange)
	}
	return view, r, loc, nil
}

// enqueue queues the copy of sl, the entry at ring index idx of l's open
// group: a small aligned device-to-device copy to the gather kernel when
// the lane has it, another into the batch arrays when the lane batches,
// any other at once. A copy that cannot be queued leaves its
// error in the entry. l.mu is held and r's context is current.
func (e *Endpoint) enqueue(l *lane, sl *transport.Slice, r *remote, loc *region, idx uint64) {
	d := e.t.drv
	rp := r.ptr + uintptr(sl.Remote-r.addr)
	var err error
	switch {
	case loc.dev != nil:
		dst, src := rp, uintptr(sl.Local)
		if sl.Op == transport.Read {
			dst, src = src, dst
		}
		// The kernel runs on the remote buffer's GPU: a local buffer of
		// another GPU would need peer access, which copy engines do not.
		if l.gather != 0 && loc.dev == r.dev && gatherable(dst, src, sl.Length) {
			l.descs[idx&l.mask] = gatherDesc{dst: uint64(dst), src: uint64(src), n: sl.Length}
			l.nk++
			l.kmax = max(l.kmax, sl.Length)
			return
		}
		if l.batch {
			l.bdst[l.nb], l.bsrc[l.nb], l.bsize[l.nb], l.bidx[l.nb] = dst, src, sl.Length, idx
			l.nb++
			return
		}
		err = d.copyDtoD(dst, src, sl.Length, l.stream)
	case sl.Op == transport.Write:
		err = d.copyHtoD(rp, sl.Local, sl.Length, l.stream)
	default:
		err = d.copyDtoH(sl.Local, rp, sl.Length, l.stream)
	}
	if err != nil {
		l.ring[idx&l.mask].err = fmt.Errorf("nvlink: post on GPU %d: %w", r.dev.ordinal, err)
		return
	}
	l.queued = true
}

// Close completes the endpoint's slices in flight with ErrClosed once
// their copies have stopped (it waits for the streams: Close is not a hot
// path), then drops its mappings and peer tables, those of replaced views
// included. Idempotent and safe for concurrent use.
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
	t.settle()
	t.mu.Lock()
	delete(t.eps, e)
	e.mu.Lock()
	for m := range e.held {
		t.unmapHandle(m)
	}
	clear(e.held)
	// Every copy of the endpoint's stopped and was reaped above: what
	// replaced views used goes too, fence or not.
	for _, rt := range e.retired {
		e.drop(rt)
	}
	e.retired = nil
	if e.tab != nil {
		e.tab.unmap()
		e.tab = nil
	}
	e.mu.Unlock()
	t.mu.Unlock()
	if err != nil {
		return fmt.Errorf("nvlink: close endpoint: %w", err)
	}
	return nil
}
