package nvlink

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Staging moves GPU memory over transports that reach only host memory
// (TCP, shared memory): Transport implements transport.Stager. Its
// staging arena is one pinned, portable host allocation (cuMemHostAlloc)
// of Config.StagingUnits units of Config.StagingUnit bytes. A slice takes
// the run of units it needs (first fit), its chunk, and moves through
// these steps:
//
//	WRITE: device -> chunk (a copy on the GPU's lane), then the inner
//	       endpoint sends the chunk; done when it completes.
//	READ:  the inner endpoint lands the bytes in the chunk, then
//	       chunk -> device (a copy on the lane); done when its event fired.
//
// The copies are asynchronous on the GPU's stream and complete through the
// lane's events, which Poll queries: no goroutine waits on a copy. A step
// that finds the lane or the inner endpoint full waits in a retry list
// that Poll works through. With no room in the arena, Post takes fewer
// slices, and the engine posts the rest later. A chunk is named by its
// first unit.

// stager is the transport's staging arena and the state of each chunk.
type stager struct {
	t     *Transport
	arena []byte
	unit  uint64
	home  *device // the context the arena was pinned in, and is freed in

	mu    sync.Mutex
	used  []uint64          // a bit per unit: in a chunk
	ops   []stagedOp        // by a chunk's first unit
	ins   []transport.Slice // ins[i]: chunk i's slice as the inner endpoint takes it
	retry []int32           // chunks whose next step found no room; Poll retries them
	spare []int32           // retry's other buffer
	wait  atomic.Int32

	pollMu sync.Mutex // one goroutine works the retry list at a time
}

// stagedOp is the slice a chunk carries. Between steps it belongs to the
// goroutine that completed the last one, or to the retry list (whose
// reader may read step without mu: nothing else touches the chunk then);
// gen and step change under mu, and Complete checks them under mu against
// stale tokens.
type stagedOp struct {
	ep    *stagedEndpoint
	c     transport.Completer // the engine's, and its token
	token uint64
	dev   uintptr // the slice's local side: device memory
	lane  *lane
	units int // the chunk's length in units
	gen   uint32
	step  stagedStep
}

type stagedStep uint8

const (
	stepFree     stagedStep = iota
	stepToHost              // WRITE: the device-to-host copy is queued
	stepInner               // the inner endpoint has (or waits for) the slice
	stepToDevice            // READ: the host-to-device copy is queued (or waits)
)

// StagingArena returns the pinned host memory that staged slices pass
// through (transport.Stager), made on the first call:
// Config.StagingUnits units of Config.StagingUnit bytes, pinned in GPU 0's
// context and usable from every GPU's. The engine registers it, local
// only, with the transports it stages over. It lives until Close.
func (t *Transport) StagingArena() ([]byte, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed.Load() {
		return nil, fmt.Errorf("nvlink: staging arena: %w", transport.ErrClosed)
	}
	if s := t.stg.Load(); s != nil {
		return s.arena, nil
	}
	d, err := t.device(0)
	if err != nil {
		return nil, fmt.Errorf("nvlink: staging arena: %w", err)
	}
	lockThread()
	defer unlockThread()
	if err := t.drv.setCurrent(d.ctx); err != nil {
		return nil, fmt.Errorf("nvlink: staging arena: %w", err)
	}
	n := t.cfg.StagingUnits
	size := uint64(t.cfg.StagingUnit) * uint64(n)
	p, err := t.drv.hostAlloc(size)
	if err != nil {
		return nil, fmt.Errorf("nvlink: staging arena: pin %d bytes: %w", size, err)
	}
	s := &stager{t: t, arena: unsafe.Slice((*byte)(p), size), unit: uint64(t.cfg.StagingUnit), home: d,
		used: make([]uint64, (n+63)/64), ops: make([]stagedOp, n), ins: make([]transport.Slice, n),
		retry: make([]int32, 0, n), spare: make([]int32, 0, n)}
	t.stg.Store(s)
	return s.arena, nil
}

// Stage returns an endpoint that moves slices of GPU memory registered
// with this transport (their LocalHandle is its registration's Handle)
// over ep, through the staging arena (transport.Stager). arena is the
// arena's handle on ep's transport; maxSlice the largest slice the engine
// will post, which must fit the arena. Notify slices
// go to ep unchanged. Call StagingArena first.
//
// The endpoint is safe for concurrent use. It lives until its Close or
// the transport's; its Close does not close ep, and slices that ep holds
// complete when ep completes them, so close ep after it, and both before
// the transport (the arena goes with the transport).
func (t *Transport) Stage(ep transport.Endpoint, arena, maxSlice uint64) (transport.Endpoint, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed.Load() {
		return nil, fmt.Errorf("nvlink: stage: %w", transport.ErrClosed)
	}
	s := t.stg.Load()
	if s == nil {
		return nil, fmt.Errorf("nvlink: stage: no staging arena (call StagingArena first)")
	}
	if maxSlice == 0 || maxSlice > uint64(len(s.arena)) {
		return nil, fmt.Errorf("nvlink: stage: slices of %d bytes do not fit the staging arena's %d (Config.StagingUnits)", maxSlice, len(s.arena))
	}
	e := &stagedEndpoint{s: s, inner: ep, arena: arena}
	t.staged[e] = struct{}{}
	return e, nil
}

// stagedEndpoint is what Stage returns.
type stagedEndpoint struct {
	s      *stager
	inner  transport.Endpoint
	arena  uint64
	use    segtable.Ref // Post calls in progress; Close drains it
	closed atomic.Bool

	closeOnce sync.Once
	closeErr  error
}

var _ transport.Endpoint = (*stagedEndpoint)(nil)

// Rails returns the inner endpoint's.
func (e *stagedEndpoint) Rails() int { return e.inner.Rails() }

// Update does nothing: the engine updates the inner endpoint, which
// carries the remote side.
func (e *stagedEndpoint) Update(*segtable.SegmentDesc) {}

// Post starts each slice's first step: a READ goes to the inner endpoint
// at once, a WRITE's bytes are first copied off the GPU. It takes fewer
// slices when the arena has no room, the GPU's lane is full or the inner
// endpoint takes no more.
func (e *stagedEndpoint) Post(c transport.Completer, sl []transport.Slice) (int, error) {
	if !e.use.Acquire() {
		for i := range sl {
			c.Complete(sl[i].Token, transport.ErrClosed)
		}
		return len(sl), nil
	}
	defer e.use.Release()
	s := e.s
	for i := range sl {
		x := &sl[i]
		if x.Op == transport.Notify {
			// After every data slice of its request: nothing to stage.
			if n, err := e.inner.Post(c, sl[i:i+1]); n == 0 {
				return i, err
			}
			continue
		}
		r, err := e.check(x)
		if err != nil {
			c.Complete(x.Token, err)
			continue
		}
		s.mu.Lock()
		k := int((x.Length + s.unit - 1) / s.unit)
		idx := s.take(k)
		if idx < 0 {
			s.mu.Unlock()
			return i, nil
		}
		op := &s.ops[idx]
		op.ep, op.c, op.token, op.dev, op.lane, op.units = e, c, x.Token, uintptr(x.Local), r.dev.lane, k
		op.step = stepToHost
		if x.Op == transport.Read {
			op.step = stepInner
		}
		tok := uint64(op.gen)<<32 | uint64(idx)
		s.ins[idx] = transport.Slice{Op: x.Op, Rail: x.Rail, LocalHandle: e.arena, Local: s.chunkAt(idx),
			Remote: x.Remote, Length: x.Length, Token: tok}
		s.mu.Unlock()
		var full bool
		if x.Op == transport.Write {
			full, err = op.lane.stage(s.t, false, op.dev, s.chunkAt(idx), x.Length, s, tok, &e.closed)
		} else {
			var n int
			n, err = e.inner.Post(s, s.ins[idx:idx+1])
			full = n == 0 && err == nil
			if n == 1 {
				err = nil
			}
		}
		if full || err != nil {
			s.release(idx)
			if full {
				return i, nil
			}
			c.Complete(x.Token, err)
		}
	}
	return len(sl), nil
}

// check validates a slice's local side: GPU memory registered with the
// transport, within its buffer, no longer than the arena.
func (e *stagedEndpoint) check(x *transport.Slice) (*region, error) {
	if e.closed.Load() || e.s.t.closed.Load() {
		return nil, transport.ErrClosed
	}
	if x.Op != transport.Read && x.Op != transport.Write {
		return nil, fmt.Errorf("nvlink: staged op %d: %w", x.Op, transport.ErrNotSupported)
	}
	if x.Length == 0 {
		return nil, fmt.Errorf("nvlink: staged slice of 0 bytes: %w", transport.ErrRange)
	}
	r := e.s.t.regions()[x.LocalHandle]
	if r == nil || r.dev == nil {
		return nil, fmt.Errorf("nvlink: staged slice: local handle %d is no GPU memory registered here: %w", x.LocalHandle, transport.ErrDenied)
	}
	off := uint64(uintptr(x.Local) - r.addr)
	if uintptr(x.Local) < r.addr || x.Length > r.length || off > r.length-x.Length {
		return nil, fmt.Errorf("nvlink: staged slice: local range outside its buffer: %w", transport.ErrRange)
	}
	if x.Length > uint64(len(e.s.arena)) {
		return nil, fmt.Errorf("nvlink: staged slice of %d bytes, a staging arena of %d: %w", x.Length, len(e.s.arena), transport.ErrNotSupported)
	}
	return r, nil
}

// Close stops taking slices and completes with transport.ErrClosed those
// whose GPU copy is in flight (it waits for every GPU's stream: Close is
// not the hot path) or that wait on the retry list. Slices the inner
// endpoint holds complete when it completes them. Idempotent and safe for
// concurrent use: every call returns once the first has done its work.
func (e *stagedEndpoint) Close() error {
	e.closeOnce.Do(func() { e.closeErr = e.close() })
	return e.closeErr
}

func (e *stagedEndpoint) close() error {
	e.closed.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	err := e.use.Drain(ctx)
	cancel()
	s, t := e.s, e.s.t
	t.settle()
	s.pollMu.Lock()
	s.mu.Lock()
	var mine []int32
	k := 0
	for _, idx := range s.retry {
		if s.ops[idx].ep == e {
			mine = append(mine, idx)
		} else {
			s.retry[k] = idx
			k++
		}
	}
	s.retry = s.retry[:k]
	s.wait.Store(int32(k))
	s.mu.Unlock()
	s.pollMu.Unlock()
	for _, idx := range mine {
		s.finish(idx, transport.ErrClosed)
	}
	t.mu.Lock()
	delete(t.staged, e)
	t.mu.Unlock()
	if err != nil {
		return fmt.Errorf("nvlink: close staged endpoint: %w", err)
	}
	return nil
}

// chunkAt returns the first byte of chunk idx.
func (s *stager) chunkAt(idx int32) unsafe.Pointer {
	return unsafe.Pointer(&s.arena[uint64(idx)*s.unit])
}

// take marks the first run of k free units used and returns its first
// unit, or -1 when there is none. mu is held.
func (s *stager) take(k int) int32 {
	n := len(s.ops)
	for i := 0; i+k <= n; {
		if s.used[i/64] == ^uint64(0) && i%64 == 0 {
			i += 64 // a full word
			continue
		}
		j := 0
		for j < k && s.used[(i+j)/64]&(1<<((i+j)%64)) == 0 {
			j++
		}
		if j == k {
			s.mark(i, k, true)
			return int32(i)
		}
		i += j + 1 // past the used unit
	}
	return -1
}

// mark sets or clears units [i, i+k). mu is held.
func (s *stager) mark(i, k int, used bool) {
	for u := i; u < i+k; u++ {
		if used {
			s.used[u/64] |= 1 << (u % 64)
		} else {
			s.used[u/64] &^= 1 << (u % 64)
		}
	}
}

// Complete takes the end of a chunk's step, from the lane (a copy's event
// fired) or from the inner endpoint, and starts the next step.
func (s *stager) Complete(tok uint64, err error) {
	idx := int32(tok & 0xffffffff)
	if idx < 0 || int(idx) >= len(s.ops) {
		return
	}
	s.mu.Lock()
	op := &s.ops[idx]
	if op.gen != uint32(tok>>32) || op.step == stepFree {
		s.mu.Unlock()
		return // stale: the chunk has moved on
	}
	step, closed := op.step, op.ep.closed.Load()
	s.mu.Unlock()
	if err == nil && closed {
		err = transport.ErrClosed
	}
	if err != nil {
		s.finish(idx, err)
		return
	}
	switch {
	case step == stepToHost:
		// Sent from Poll, after the lanes are reaped: not here, under the
		// lane's poll lock, where an inner endpoint that copies in Post
		// (shm) would hold up every completion of this GPU.
		s.setStep(idx, stepInner)
		s.await(idx)
	case step == stepInner && s.ins[idx].Op == transport.Read:
		s.toDevice(idx)
	default: // the WRITE was sent, or the READ's bytes reached the GPU
		s.finish(idx, nil)
	}
}

// toInner hands the chunk's slice to the inner endpoint. It reports false
// when the chunk went back to the retry list.
func (s *stager) toInner(idx int32) bool {
	s.setStep(idx, stepInner)
	n, err := s.ops[idx].ep.inner.Post(s, s.ins[idx:idx+1])
	switch {
	case n == 1:
	case err != nil:
		s.finish(idx, err)
	default:
		s.await(idx)
		return false
	}
	return true
}

// toDevice queues the copy of a READ's bytes from the chunk to the GPU. It
// reports false when the chunk went back to the retry list.
func (s *stager) toDevice(idx int32) bool {
	s.setStep(idx, stepToDevice)
	op, in := &s.ops[idx], &s.ins[idx]
	full, err := op.lane.stage(s.t, true, op.dev, in.Local, in.Length, s, in.Token, &op.ep.closed)
	switch {
	case err != nil:
		s.finish(idx, err)
	case full:
		s.await(idx)
	}
	return !full
}

func (s *stager) setStep(idx int32, step stagedStep) {
	s.mu.Lock()
	s.ops[idx].step = step
	s.mu.Unlock()
}

// await puts a chunk whose next step found no room on the retry list.
func (s *stager) await(idx int32) {
	s.mu.Lock()
	s.retry = append(s.retry, idx)
	s.wait.Store(int32(len(s.retry)))
	s.mu.Unlock()
}

// poll takes the next step of the chunks on the retry list (WRITEs whose
// bytes are off the GPU, and steps that found no room) and reports how
// many moved on; Transport.Poll calls it after reaping the lanes.
func (s *stager) poll() int {
	if s.wait.Load() == 0 || !s.pollMu.TryLock() {
		return 0
	}
	defer s.pollMu.Unlock()
	s.mu.Lock()
	list := s.retry
	s.retry, s.spare = s.spare[:0], nil
	s.wait.Store(0)
	s.mu.Unlock()
	moved := 0
	for _, idx := range list {
		op := &s.ops[idx] // the list owns the chunk: its step is stable
		switch {
		case op.ep.closed.Load():
			s.finish(idx, transport.ErrClosed)
			moved++
		case op.step == stepInner:
			if s.toInner(idx) {
				moved++
			}
		default:
			if s.toDevice(idx) {
				moved++
			}
		}
	}
	s.mu.Lock()
	s.spare = list[:0]
	s.mu.Unlock()
	return moved
}

// finish ends a chunk's slice with err and frees the chunk.
func (s *stager) finish(idx int32, err error) {
	op := &s.ops[idx]
	c, tok := op.c, op.token
	s.release(idx)
	c.Complete(tok, err)
}

// release frees chunk idx; its tokens go stale.
func (s *stager) release(idx int32) {
	s.mu.Lock()
	op := &s.ops[idx]
	s.mark(int(idx), op.units, false)
	*op = stagedOp{gen: op.gen + 1}
	s.ins[idx] = transport.Slice{}
	s.mu.Unlock()
}

// destroy frees the arena. Every staged endpoint is closed, the lanes'
// copies are done; t.mu is held and the arena's context is current.
func (s *stager) destroy() error {
	return s.t.drv.hostFree(unsafe.Pointer(unsafe.SliceData(s.arena)))
}
