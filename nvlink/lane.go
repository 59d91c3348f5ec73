package nvlink

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/cpu"

	"github.com/moonring/moonring/transport"
)

// lane is one GPU's stream and the ring of copies queued on it.
//
// Copies are queued in groups: the slices one Post puts on the lane (up to
// groupMax), or one staged copy. A group's copies are queued one call each,
// or small device-to-device ones in one launch of the gather kernel
// (kernel.go, when the lane has it), or device-to-device ones in one
// cuMemcpyBatchAsync where the driver has it, and one event is recorded
// after the group's last copy, at the
// group's last ring index. Events of one stream fire in order, so the
// poller queries only the oldest group's event and completes the group
// whole when it has fired.
//
// Posting side: Post takes mu, checks room (tail+grp-head < depth), fills
// the ring entries of the open group above tail, and on flush queues the
// batched copies, records the event and publishes the group by storing
// tail past it; no group stays open across an unlock. Completing side: the
// poller that holds pollMu reads groups below tail, queries their events in
// order and publishes each reaped entry by storing head+1, after which Post
// may reuse the index. Complete is called with only pollMu held, which Post
// never takes, so a Completer may post.
type lane struct {
	dev    *device
	stream uintptr
	events []uintptr
	ring   []pending
	mask   uint64

	mu   sync.Mutex    // the posting side
	tail atomic.Uint64 // written by Post under mu; read by pollers
	// The open group, under mu: grp entries above tail, of which nb
	// device-to-device copies wait in the batch arrays (batch only).
	grp    int
	queued bool // a copy of the open group is queued on the stream
	batch  bool // queue device-to-device copies with copyBatch
	nb     int
	bdst   []uintptr
	bsrc   []uintptr
	bsize  []uint64
	bidx   []uint64 // the ring index of each batched copy
	// The gather kernel (kernel.go), when the lane has it: gather is its
	// function (0: none), descs the descriptor ring in mapped host memory,
	// nk the open group's slices for it, kmax the longest of them.
	gather    uintptr
	gatherMod uintptr
	descs     []gatherDesc
	args      gatherArgs
	nk        int
	kmax      uint64
	gatherErr error // why the lane has no kernel, when one was wanted
	_         cpu.CacheLinePad

	pollMu sync.Mutex    // the completing side
	head   atomic.Uint64 // written by the poller under pollMu; read by Post
	dead   bool          // destroyed; under pollMu
	_      cpu.CacheLinePad
}

// groupMax bounds a group: the copies one event covers, and one
// cuMemcpyBatchAsync's count.
const groupMax = 256

// pending is one copy in flight.
type pending struct {
	c      transport.Completer
	token  uint64
	closed *atomic.Bool // the posting endpoint's: set, the copy ends ErrClosed
	tab    *table       // the target's grant table, whose slot the copy counts on; nil for staging
	slot   int
	end    uint64 // on a group's first entry: the ring index of its last
	synced bool   // on a group's last entry: no event; the group is done (its copies failed, or the stream was waited for)
	err    error  // the copy failed when queued: completed with this, whatever the event says
}

// newLane makes the stream and events of d, and loads the gather kernel
// when kernel is set (a driver that cannot leaves the lane on copy
// engines; gatherErr says why). The caller made d's context current on
// its locked thread.
func newLane(drv driver, d *device, depth int, batch, kernel bool) (*lane, error) {
	l := &lane{dev: d, ring: make([]pending, depth), mask: uint64(depth - 1), batch: batch}
	if batch {
		n := min(depth, groupMax)
		l.bdst, l.bsrc, l.bsize, l.bidx = make([]uintptr, n), make([]uintptr, n), make([]uint64, n), make([]uint64, n)
	}
	if kernel {
		l.gatherErr = l.loadGather(drv, depth)
	}
	var err error
	if l.stream, err = drv.streamCreate(); err != nil {
		l.destroy(drv)
		return nil, err
	}
	for i := 0; i < depth; i++ {
		e, err := drv.eventCreate()
		if err != nil {
			l.destroy(drv)
			return nil, err
		}
		l.events = append(l.events, e)
	}
	return l, nil
}

// loadGather loads the kernel and maps its descriptor ring.
func (l *lane) loadGather(drv driver, depth int) error {
	fn, mod, err := drv.loadGather()
	if err != nil {
		return err
	}
	p, dev, err := drv.hostAllocMapped(uint64(depth) * uint64(unsafe.Sizeof(gatherDesc{})))
	if err != nil {
		drv.unloadGather(mod)
		return err
	}
	l.gather, l.gatherMod = fn, mod
	l.descs = unsafe.Slice((*gatherDesc)(p), depth)
	l.args.desc, l.args.mask = uint64(dev), uint32(depth-1)
	return nil
}

// destroy releases the stream and events. pollMu is held (or the lane was
// never shared) and the lane is empty; d's context is current.
func (l *lane) destroy(drv driver) {
	if l.dead {
		return
	}
	l.dead = true
	if l.stream != 0 {
		drv.streamSync(l.stream)
	}
	for _, e := range l.events {
		drv.eventDestroy(e)
	}
	if l.stream != 0 {
		drv.streamDestroy(l.stream)
	}
	if l.gather != 0 {
		drv.unloadGather(l.gatherMod)
		drv.hostFree(unsafe.Pointer(unsafe.SliceData(l.descs)))
		l.gather, l.descs = 0, nil
	}
}

// poll reaps finished copies if no other poller is at it.
func (l *lane) poll(drv driver) int {
	if l.head.Load() == l.tail.Load() || !l.pollMu.TryLock() {
		return 0
	}
	n := l.reap(drv, false)
	l.pollMu.Unlock()
	return n
}

// reap completes finished groups in order; with all, it first waits for
// the stream (Close only). pollMu is held.
func (l *lane) reap(drv driver, all bool) int {
	if l.dead {
		return 0
	}
	h, t := l.head.Load(), l.tail.Load()
	if h == t {
		return 0
	}
	lockThread()
	defer unlockThread()
	current := false
	var syncErr error
	n := 0
	for h != t {
		end := l.ring[h&l.mask].end // h starts a group: groups are reaped whole
		done, err := true, error(nil)
		if !l.ring[end&l.mask].synced {
			if !current {
				if err := drv.setCurrent(l.dev.ctx); err != nil {
					if !all {
						return n
					}
					syncErr = err
				}
				current = true
				if all && syncErr == nil {
					syncErr = drv.streamSync(l.stream)
				}
			}
			done, err = drv.eventQuery(l.events[end&l.mask])
		}
		if !done && !all {
			break
		}
		if !done {
			err = syncErr
			if err == nil {
				err = fmt.Errorf("nvlink: copy not done after the stream synchronized")
			}
		}
		if err != nil {
			err = fmt.Errorf("nvlink: copy on GPU %d: %w", l.dev.ordinal, err)
		}
		for ; h <= end; h++ {
			p := l.ring[h&l.mask]
			l.ring[h&l.mask] = pending{}
			// The grant first: once head passes h, Endpoint.reclaim may
			// unmap the table of a replaced view that this copy counted on.
			if p.tab != nil {
				p.tab.release(p.slot)
			}
			l.head.Store(h + 1)
			perr := err
			switch {
			case p.closed.Load():
				perr = transport.ErrClosed
			case p.err != nil:
				perr = p.err
			}
			p.c.Complete(p.token, perr)
			n++
		}
		current = false // the Completer may have posted, on another context
	}
	return n
}

// add opens or extends the group with the entry at ring index tail+grp,
// which it returns; room reports none (tail+grp-head reached the depth).
// l.mu is held.
func (l *lane) add(p pending) (idx uint64, room bool) {
	idx = l.tail.Load() + uint64(l.grp)
	if idx-l.head.Load() > l.mask {
		return 0, false
	}
	l.ring[idx&l.mask] = p
	if l.gather != 0 {
		l.descs[idx&l.mask].n = 0 // a launch covers the group: not the kernel's unless enqueue says so
	}
	l.grp++
	return idx, true
}

// full reports whether the open group reached groupMax (or the batch
// arrays' size): the caller flushes before adding more.
func (l *lane) full() bool {
	return l.grp >= groupMax || (l.batch && l.nb == len(l.bdst))
}

// copyOne queues one device-to-device copy of the open group, the entry
// at ring index idx, on the copy engine; a refusal stays in the entry.
func (l *lane) copyOne(drv driver, dst, src uintptr, n uint64, idx uint64) {
	if err := drv.copyDtoD(dst, src, n, l.stream); err != nil {
		l.ring[idx&l.mask].err = fmt.Errorf("nvlink: post on GPU %d: %w", l.dev.ordinal, err)
		return
	}
	l.queued = true
}

// flush ends the open group: its kernel's slices in one launch, its
// batched copies in one call (one call each if the driver refuses the
// launch or the batch), the event after its last copy,
// and tail stored past it. A copy that could not be queued keeps its error
// in its entry; if the event cannot be recorded,
// the stream is waited for and the group marked synced, every entry
// failed. l.mu is held and the lane's context is current. It reports
// whether it published a group.
func (l *lane) flush(drv driver) bool {
	if l.grp == 0 {
		return false
	}
	tail := l.tail.Load()
	last := tail + uint64(l.grp) - 1
	if l.nk > 0 {
		l.args.start = uint32(tail) // the kernel masks it: the ring's size divides 2^32
		l.args.parts = partsFor(l.kmax, l.args.blockThreads())
		if err := drv.launchGather(l.gather, &l.args, uint32(l.grp), l.stream); err == nil {
			l.queued = true
		} else {
			// Not launched: a copy each on the copy engine.
			for i := tail; i <= last; i++ {
				if d := &l.descs[i&l.mask]; d.n != 0 {
					l.copyOne(drv, uintptr(d.dst), uintptr(d.src), d.n, i)
				}
			}
		}
		l.nk, l.kmax = 0, 0
	}
	if l.nb > 1 {
		err := drv.copyBatch(l.bdst[:l.nb], l.bsrc[:l.nb], l.bsize[:l.nb], l.stream)
		if err == nil {
			l.queued, l.nb = true, 0
		} else if errors.Is(err, transport.ErrNotSupported) {
			l.batch = false // this driver batches no such copy: one call each from now on
		}
	}
	// One copy, or a batch the driver refused: a call each, so that one bad
	// copy fails alone.
	for k := range l.nb {
		l.copyOne(drv, l.bdst[k], l.bsrc[k], l.bsize[k], l.bidx[k])
	}
	l.nb = 0
	l.ring[tail&l.mask].end = last
	if !l.queued {
		l.ring[last&l.mask].synced = true // nothing runs: each entry has its error
	} else if err := drv.eventRecord(l.events[last&l.mask], l.stream); err != nil {
		// Queued without an event: wait for the copies here (a failure
		// path) so that no grant is dropped under a running copy.
		drv.streamSync(l.stream)
		err = fmt.Errorf("nvlink: post on GPU %d: %w", l.dev.ordinal, err)
		for i := tail; i <= last; i++ {
			if l.ring[i&l.mask].err == nil {
				l.ring[i&l.mask].err = err
			}
		}
		l.ring[last&l.mask].synced = true
	}
	l.grp, l.queued = 0, false
	l.tail.Store(last + 1)
	return true
}

// settle waits for every GPU's stream and completes the copies queued on
// it, for an endpoint's Close: each lane's posting lock first, as a
// barrier (a Post past its closed check has queued its copies), then its
// reap with all, which synchronizes the stream.
func (t *Transport) settle() {
	for _, d := range t.devs {
		if !d.ready.Load() {
			continue
		}
		l := d.lane
		l.mu.Lock()
		l.mu.Unlock() //nolint:staticcheck // the barrier
		l.pollMu.Lock()
		l.reap(t.drv, true)
		l.pollMu.Unlock()
	}
}

// stage queues a copy between GPU memory at dev and pinned host memory at
// host for a staged slice, completing token through c once its event
// fired. full reports a lane with no room (nothing was queued).
func (l *lane) stage(t *Transport, toDevice bool, dev uintptr, host unsafe.Pointer, n uint64, c transport.Completer, token uint64, closed *atomic.Bool) (full bool, err error) {
	lockThread()
	defer unlockThread()
	l.mu.Lock()
	defer l.mu.Unlock()
	if closed.Load() || t.closed.Load() {
		return false, transport.ErrClosed
	}
	tail := l.tail.Load()
	if tail-l.head.Load() > l.mask {
		return true, nil
	}
	d := t.drv
	if err := d.setCurrent(l.dev.ctx); err != nil {
		return false, err
	}
	if toDevice {
		err = d.copyHtoD(dev, host, n, l.stream)
	} else {
		err = d.copyDtoH(host, dev, n, l.stream)
	}
	if err == nil {
		if err = d.eventRecord(l.events[tail&l.mask], l.stream); err != nil {
			d.streamSync(l.stream) // queued without an event: let it finish before the chunk is reused
		}
	}
	if err != nil {
		return false, fmt.Errorf("nvlink: staging copy on GPU %d: %w", l.dev.ordinal, err)
	}
	l.ring[tail&l.mask] = pending{c: c, token: token, closed: closed, slot: -1, end: tail}
	l.tail.Store(tail + 1)
	t.wakeup() // queued from the inner transport's goroutine, as a rule
	return false, nil
}
