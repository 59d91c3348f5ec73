package nvlink

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/cpu"

	"github.com/moonring/moonring/transport"
)

// lane is one GPU's stream and the ring of copies queued on it. Each ring
// index owns one event, recorded right after the index's copy; events of
// one stream fire in order, so the poller queries only the oldest.
//
// Posting side: Post takes mu, checks room (tail-head < depth), queues the
// copy and records the event, fills ring[tail] and publishes it by storing
// tail+1. Completing side: the poller that holds pollMu reads entries below
// tail, queries their events in order and publishes each reaped entry by
// storing head+1, after which Post may reuse the index. Complete is called
// with only pollMu held, which Post never takes, so a Completer may post.
type lane struct {
	dev    *device
	stream uintptr
	events []uintptr
	ring   []pending
	mask   uint64

	mu   sync.Mutex    // the posting side
	tail atomic.Uint64 // written by Post under mu; read by pollers
	_    cpu.CacheLinePad

	pollMu sync.Mutex    // the completing side
	head   atomic.Uint64 // written by the poller under pollMu; read by Post
	dead   bool          // destroyed; under pollMu
	_      cpu.CacheLinePad
}

// pending is one copy in flight.
type pending struct {
	c      transport.Completer
	token  uint64
	closed *atomic.Bool // the posting endpoint's: set, the copy ends ErrClosed
	tab    *table       // the target's grant table, whose slot the copy counts on; nil for staging
	slot   int
}

// newLane makes the stream and events of d. The caller made d's context
// current on its locked thread.
func newLane(drv driver, d *device, depth int) (*lane, error) {
	l := &lane{dev: d, ring: make([]pending, depth), mask: uint64(depth - 1)}
	var err error
	if l.stream, err = drv.streamCreate(); err != nil {
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

// reap completes finished copies in order; with all, it first waits for
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
	for ; h != t; h++ {
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
		done, err := drv.eventQuery(l.events[h&l.mask])
		if !done && !all {
			break
		}
		if !done {
			err = syncErr
			if err == nil {
				err = fmt.Errorf("nvlink: copy not done after the stream synchronized")
			}
		}
		p := l.ring[h&l.mask]
		l.ring[h&l.mask] = pending{}
		// The grant first: once head passes h, Endpoint.reclaim may unmap
		// the table of a replaced view that this copy counted on.
		if p.tab != nil {
			p.tab.release(p.slot)
		}
		l.head.Store(h + 1)
		switch {
		case p.closed.Load():
			err = transport.ErrClosed
		case err != nil:
			err = fmt.Errorf("nvlink: copy on GPU %d: %w", l.dev.ordinal, err)
		}
		p.c.Complete(p.token, err)
		current = false // the Completer may have posted, on another context
		n++
	}
	return n
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
	l.ring[tail&l.mask] = pending{c: c, token: token, closed: closed, slot: -1}
	l.tail.Store(tail + 1)
	t.wakeup() // queued from the inner transport's goroutine, as a rule
	return false, nil
}
