package moonring

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/transport"
)

// Local memory: allocating it, registering it with every transport and
// unregistering it once no request uses it.

// BufferSpec is one buffer for RegisterLocalMemoryBatch.
type BufferSpec struct {
	Buf      []byte
	Location Location
	Remote   bool
}

// RegisterLocalMemory registers buf with the engine and every installed
// transport. A remote-accessible buffer is published in the engine's
// segment so peers may read and write it; a local-only one may only be the
// local side of requests. buf must stay valid (Go memory is pinned) until
// UnregisterLocalMemory. Overlapping and empty ranges are refused.
func (e *Engine) RegisterLocalMemory(buf []byte, loc Location, remoteAccessible bool) (BufferID, error) {
	ids, err := e.RegisterLocalMemoryBatch([]BufferSpec{{buf, loc, remoteAccessible}})
	if err != nil {
		return 0, err
	}
	return ids[0], nil
}

// RegisterLocalMemoryBatch registers several buffers and publishes the
// segment once. It registers all or none.
func (e *Engine) RegisterLocalMemoryBatch(specs []BufferSpec) ([]BufferID, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return nil, ErrClosed
	}
	var done []*segtable.Buffer
	undo := func() {
		for _, b := range done {
			e.unregisterLocked(b)
		}
	}
	remote := false
	for _, s := range specs {
		b, err := e.buffers.Register(s.Buf, s.Location, s.Remote)
		if err != nil {
			undo()
			return nil, fmt.Errorf("moonring: register memory: %w", err)
		}
		done = append(done, b)
		for slot, t := range e.transports {
			if t == nil || !transport.Serves(t, b.Location) {
				continue
			}
			reg, err := t.Register(b)
			if err != nil {
				undo()
				return nil, fmt.Errorf("moonring: register memory with %s: %w", t.Name(), err)
			}
			b.Regs[slot].Store(&reg)
		}
		e.stage(b)
		e.described(b)
		remote = remote || s.Remote
	}
	ids := make([]BufferID, len(done))
	for i, b := range done {
		ids[i] = b.ID
	}
	if remote {
		ctx := newDeadlineCtx(e.cfg.Timeout)
		err := e.publishCtx(ctx)
		ctx.cancel()
		if err != nil {
			undo()
			return nil, err
		}
	}
	return ids, nil
}

// unregisterLocked removes a buffer that no request holds. mu must be held.
func (e *Engine) unregisterLocked(b *segtable.Buffer) error {
	// Out of the table first, waiting for requests that found it (the
	// table is read lock-free), then out of the transports.
	var err error
	if _, uerr := e.buffers.Unregister(context.Background(), b.ID); uerr != nil {
		err = uerr
	}
	e.undescribed(b)
	for slot, t := range e.transports {
		err = errors.Join(err, e.unregisterFrom(t, slot, b))
	}
	return err
}

// unregisterFrom drops b's registration with t in slot; a staged one was
// never t's. mu must be held.
func (e *Engine) unregisterFrom(t transport.Transport, slot int, b *segtable.Buffer) error {
	if r := b.Regs[slot].Swap(nil); r != nil && !r.Staged && t != nil {
		return t.Unregister(b, *r)
	}
	return nil
}

// unregisterFromContext is unregisterFrom for a caller with a deadline: a
// transport that can bound its wait on peers
// (transport.ContextUnregisterer) waits no longer than ctx. mu must be
// held.
func (e *Engine) unregisterFromContext(ctx context.Context, t transport.Transport, slot int, b *segtable.Buffer) error {
	if cu, ok := t.(transport.ContextUnregisterer); ok {
		if r := b.Regs[slot].Swap(nil); r != nil && !r.Staged {
			return cu.UnregisterContext(ctx, b, *r)
		}
		return nil
	}
	return e.unregisterFrom(t, slot, b)
}

// UnregisterLocalMemory unregisters the buffer that starts at buf's first
// byte. Requests taken from now on that name it fail; the call waits for
// those in flight, and if ctx ends first it leaves the buffer registered
// and returns an error wrapping ErrBusy. It then waits for the transports
// to withdraw the buffer from peers, and those that wait on peers (tcp,
// shm) stop waiting when ctx ends too: the error then wraps ctx's, the
// buffer is no longer the engine's, and its memory may be reused only
// after Close, which ends every peer's use of it.
func (e *Engine) UnregisterLocalMemory(ctx context.Context, buf []byte) error {
	return e.UnregisterLocalMemoryBatch(ctx, [][]byte{buf})
}

// UnregisterLocalMemoryBatch unregisters several buffers and republishes
// the segment once. It stops at the first buffer it cannot unregister.
func (e *Engine) UnregisterLocalMemoryBatch(ctx context.Context, bufs [][]byte) error {
	var err error
	remote := false
	for _, buf := range bufs {
		if len(buf) == 0 {
			err = fmt.Errorf("moonring: unregister memory: %w", ErrNotRegistered)
			break
		}
		addr := uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
		b := e.buffers.Find(addr, 1)
		if b == nil || b.Addr != addr {
			err = fmt.Errorf("moonring: unregister memory %#x: %w", addr, ErrNotRegistered)
			break
		}
		// Refuse new requests and wait for those in flight, without the
		// lock: registration elsewhere goes on meanwhile.
		if _, derr := e.buffers.Unregister(ctx, b.ID); derr != nil {
			if errors.Is(derr, segtable.ErrNotFound) {
				derr = ErrNotRegistered // another call unregistered it meanwhile
			}
			err = fmt.Errorf("moonring: unregister memory %#x: %w", addr, derr)
			break
		}
		e.mu.Lock()
		for slot, t := range e.transports {
			if terr := e.unregisterFromContext(ctx, t, slot, b); terr != nil {
				err = errors.Join(err, fmt.Errorf("moonring: unregister memory from %s: %w", t.Name(), terr))
				// Peers may still be moving its bytes: Free must not unmap
				// the memory under them before Close has cut them off.
				e.retiring = append(e.retiring, span{b.Addr, b.Length})
			}
		}
		e.undescribed(b)
		e.mu.Unlock()
		remote = remote || b.Remote
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if remote && !e.closed.Load() {
		// Within the caller's deadline too (serve's grace), give or take a
		// second for the store: a slow store must not hold the caller long
		// past it, and a deadline just missed still publishes.
		budget := e.cfg.Timeout
		if d, ok := ctx.Deadline(); ok {
			budget = min(budget, max(time.Until(d), time.Second))
		}
		pctx := newDeadlineCtx(budget)
		err = errors.Join(err, e.publishCtx(pctx))
		pctx.cancel()
	}
	return err
}

// Alloc returns size bytes of memory for RegisterLocalMemory. On a GPU
// ("cuda:N") it comes from the installed transport that serves it (nvlink),
// a view of device addresses that the CPU must not touch. On a CPU node it
// is page-aligned memory outside the Go heap, bound to the NUMA node of loc
// when the machine has several and advised for huge pages when large. With
// the shm transport installed it is a sealed memfd, which the transport
// hands to peers of this host that then copy into and out of it directly
// (such memory gets transparent huge pages only where the kernel's
// shmem_enabled allows; Config.HugeTLB takes reserved ones). Register it
// to use it; release it with Free.
func (e *Engine) Alloc(size int, loc Location) ([]byte, error) {
	kind, idx, err := loc.Parse()
	if err != nil {
		return nil, fmt.Errorf("moonring: alloc: %w", err)
	}
	if kind != "cpu" {
		for _, t := range e.installed() {
			if d, ok := t.(transport.DeviceMemory); ok && d.Accepts(loc) {
				b, err := d.AllocDevice(size, loc)
				if err != nil {
					return nil, fmt.Errorf("moonring: alloc on %s: %w", loc, err)
				}
				return b, nil
			}
		}
		return nil, fmt.Errorf("moonring: alloc on %s: no installed transport serves it: %w", loc, transport.ErrNotSupported)
	}
	shared := e.Transport(shm.Name) != nil
	if e.cfg.HugeTLB {
		b, err := mem.AllocHugeTLB(size, idx, shared)
		if err == nil {
			return b, nil
		}
		if !errors.Is(err, mem.ErrNoHugeTLB) {
			return nil, fmt.Errorf("moonring: alloc: %w", err)
		}
	}
	alloc := mem.Alloc
	if shared {
		alloc = mem.AllocShared
	}
	b, err := alloc(size, idx)
	if err != nil {
		return nil, fmt.Errorf("moonring: alloc: %w", err)
	}
	return b, nil
}

// Free releases memory from Alloc. It refuses memory still registered
// (ErrRegistered), and memory of a buffer whose unregister gave up on its
// context while peers still moved its bytes (ErrBusy: free it after
// Close).
func (e *Engine) Free(b []byte) error {
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	hi := lo + uintptr(cap(b))
	if x := e.buffers.Overlapping(lo, uint64(hi-lo)); x != nil {
		return fmt.Errorf("moonring: free: buffer %d lies in this memory (unregister it first): %w", x.ID, ErrRegistered)
	}
	e.mu.Lock()
	for _, s := range e.retiring {
		if s.addr < hi && lo < s.addr+uintptr(s.length) && !e.closed.Load() {
			e.mu.Unlock()
			return fmt.Errorf("moonring: free: peers may still move the bytes of a buffer in this memory (its unregister gave up on its context): free it after Close: %w", ErrBusy)
		}
	}
	e.mu.Unlock()
	for _, t := range e.installed() {
		d, ok := t.(transport.DeviceMemory)
		if !ok {
			continue
		}
		switch err := d.FreeDevice(b); {
		case err == nil:
			return nil
		case !errors.Is(err, segtable.ErrNotFound): // its memory, but freeing failed
			return fmt.Errorf("moonring: free: %w", err)
		}
	}
	if err := mem.Free(b); err != nil {
		return fmt.Errorf("moonring: free: %w", err)
	}
	return nil
}

// deadlineCtx is the context of a publish: context.WithTimeout of
// context.Background, but its channel and timer are made only when Done
// is first called. A store that only checks Err (the in-process one)
// then costs one small allocation, where WithTimeout's context and timer
// were four and a timer started and stopped for each registration and
// unregistration. Safe for concurrent use.
type deadlineCtx struct {
	deadline time.Time
	mu       sync.Mutex
	done     chan struct{} // made by Done
	timer    *time.Timer   // started by Done or AfterFunc
	afters   []*func()     // AfterFunc's, called when the context ends
	err      error
}

var _ context.Context = (*deadlineCtx)(nil)

// newDeadlineCtx returns a context that ends after d, or when cancel is
// called.
func newDeadlineCtx(d time.Duration) *deadlineCtx {
	return &deadlineCtx{deadline: time.Now().Add(d)}
}

// Deadline returns when the context ends.
func (c *deadlineCtx) Deadline() (time.Time, bool) { return c.deadline, true }

// Value returns nil: the context carries no values.
func (c *deadlineCtx) Value(any) any { return nil }

// Done returns a channel closed when the context ends.
func (c *deadlineCtx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		c.expireLocked()
		if c.err != nil {
			close(c.done)
		} else {
			c.startTimerLocked()
		}
	}
	return c.done
}

// startTimerLocked starts the timer that ends the context at its
// deadline, unless it runs. mu must be held.
func (c *deadlineCtx) startTimerLocked() {
	if c.timer == nil {
		c.timer = time.AfterFunc(time.Until(c.deadline), func() { c.end(context.DeadlineExceeded) })
	}
}

// AfterFunc calls f in a goroutine of its own once the context ends, as
// context.AfterFunc does; stop keeps f from being called and reports
// whether it did. The context package takes it for the contexts derived
// from this one (WithCancel, WithTimeout: a store's calls), which then
// start no goroutine to follow it, as they would for a context without
// it.
func (c *deadlineCtx) AfterFunc(f func()) (stop func() bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.expireLocked()
	if c.err != nil {
		go f()
		return func() bool { return false }
	}
	p := &f
	c.afters = append(c.afters, p)
	c.startTimerLocked()
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for i, q := range c.afters {
			if q == p {
				c.afters = append(c.afters[:i], c.afters[i+1:]...)
				return true
			}
		}
		return false
	}
}

// Err returns nil until the context ends, then why: DeadlineExceeded or
// Canceled. Once it is not nil, Done is closed.
func (c *deadlineCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.expireLocked()
	return c.err
}

// expireLocked ends the context if its deadline has passed. mu must be
// held.
func (c *deadlineCtx) expireLocked() {
	if c.err == nil && !time.Now().Before(c.deadline) {
		c.endLocked(context.DeadlineExceeded)
	}
}

// cancel ends the context, if it has not ended, and releases its timer.
func (c *deadlineCtx) cancel() { c.end(context.Canceled) }

// end ends the context with err unless it has ended.
func (c *deadlineCtx) end(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.endLocked(err)
}

// endLocked is end with mu held.
func (c *deadlineCtx) endLocked(err error) {
	if c.timer != nil {
		c.timer.Stop()
	}
	if c.err == nil {
		c.err = err
		if c.done != nil {
			close(c.done)
		}
		for _, f := range c.afters {
			go (*f)()
		}
		c.afters = nil
	}
}
