package nvlink

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"
)

// Stager is a pool of pinned host buffers through which GPU memory is the
// local side of host-memory transports (TCP, shared memory): a WRITE from
// GPU memory first copies the bytes into a staging buffer (CopyFromDevice),
// then the transport sends them from it; a READ into GPU memory lands in a
// staging buffer and is copied on (CopyToDevice). Copies are asynchronous
// on the stager's own stream, and Done polls their event, so no goroutine
// waits on a synchronous copy per chunk.
//
// The staging memory is one pinned arena (Arena), to be registered once
// with the engine as host memory, so the other transports reach every
// staging buffer through one registration.
//
// A Stager is safe for concurrent use; each Staging it hands out is used
// by one goroutine at a time. It lives until Close or its transport's
// Close.
type Stager struct {
	t      *Transport
	dev    *device
	arena  []byte
	chunk  int
	stream uintptr

	mu     sync.Mutex // guards free and orders copy + event on the stream
	free   []*Staging
	all    []*Staging
	closed bool
}

// Staging is one pinned buffer of a Stager, between Get and Put.
type Staging struct {
	s     *Stager
	buf   []byte
	event uintptr
	busy  bool // a copy was queued and Done has not seen it end; under s.mu
}

// Errors of staging.
var (
	// ErrStagingBusy: the staging buffer has a copy in flight; poll Done.
	ErrStagingBusy = errors.New("nvlink: staging buffer has a copy in flight")
)

// NewStager makes count pinned host buffers of chunk bytes for moving
// memory of GPU gpu (cuMemHostAlloc, portable). It fails with an error
// wrapping ErrOutOfMemory when the host cannot pin that much.
func (t *Transport) NewStager(gpu, chunk, count int) (*Stager, error) {
	if chunk <= 0 || count <= 0 || int64(chunk)*int64(count) > 1<<40 || int64(chunk)*int64(count) > int64(^uint(0)>>1) {
		return nil, fmt.Errorf("nvlink: stager of %d buffers of %d bytes: bad size", count, chunk)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed.Load() {
		return nil, fmt.Errorf("nvlink: stager: transport closed")
	}
	d, err := t.device(gpu)
	if err != nil {
		return nil, err
	}
	lockThread()
	defer unlockThread()
	if err := t.drv.setCurrent(d.ctx); err != nil {
		return nil, fmt.Errorf("nvlink: stager: %w", err)
	}
	p, err := t.drv.hostAlloc(uint64(chunk) * uint64(count))
	if err != nil {
		return nil, fmt.Errorf("nvlink: stager: pin %d bytes: %w", chunk*count, err)
	}
	s := &Stager{t: t, dev: d, chunk: chunk, arena: unsafe.Slice((*byte)(p), chunk*count)}
	if s.stream, err = t.drv.streamCreate(); err != nil {
		s.destroy()
		return nil, fmt.Errorf("nvlink: stager: %w", err)
	}
	for i := 0; i < count; i++ {
		ev, err := t.drv.eventCreate()
		if err != nil {
			s.destroy()
			return nil, fmt.Errorf("nvlink: stager: %w", err)
		}
		b := &Staging{s: s, buf: s.arena[i*chunk : (i+1)*chunk : (i+1)*chunk], event: ev}
		s.all = append(s.all, b)
	}
	for i := len(s.all) - 1; i >= 0; i-- {
		s.free = append(s.free, s.all[i])
	}
	t.stagers[s] = struct{}{}
	return s, nil
}

// destroy frees what NewStager made. The device context is current.
func (s *Stager) destroy() {
	d := s.t.drv
	if s.stream != 0 {
		d.streamSync(s.stream)
	}
	for _, b := range s.all {
		d.eventDestroy(b.event)
	}
	if s.stream != 0 {
		d.streamDestroy(s.stream)
	}
	d.hostFree(unsafe.Pointer(unsafe.SliceData(s.arena)))
}

// Arena returns all the stager's pinned memory, to register once with the
// engine (location cpu). Valid until Close.
func (s *Stager) Arena() []byte { return s.arena }

// Chunk returns the size of each staging buffer.
func (s *Stager) Chunk() int { return s.chunk }

// Get returns a free staging buffer, or nil when all are in use (the
// caller retries after a Put). It does not block or allocate.
func (s *Stager) Get() *Staging {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || len(s.free) == 0 {
		return nil
	}
	b := s.free[len(s.free)-1]
	s.free = s.free[:len(s.free)-1]
	return b
}

// Put returns b to the pool. It fails with ErrStagingBusy while a copy is
// in flight: poll Done until it reports true first.
func (s *Stager) Put(b *Staging) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if b.busy {
		return ErrStagingBusy
	}
	s.free = append(s.free, b)
	return nil
}

// Bytes returns the staging buffer's memory: pinned host memory that the
// CPU and the host-memory transports may use while no copy is in flight.
func (b *Staging) Bytes() []byte { return b.buf }

// CopyFromDevice queues an asynchronous copy of n bytes from device
// address src (memory of the stager's GPU, e.g. inside a buffer from
// Alloc) into the start of the buffer. Poll Done before using the bytes.
func (b *Staging) CopyFromDevice(src unsafe.Pointer, n int) error {
	return b.start(src, n, false)
}

// CopyToDevice queues an asynchronous copy of the first n bytes of the
// buffer to device address dst. Poll Done before reusing the buffer.
func (b *Staging) CopyToDevice(dst unsafe.Pointer, n int) error {
	return b.start(dst, n, true)
}

func (b *Staging) start(dev unsafe.Pointer, n int, toDevice bool) error {
	if n <= 0 || n > len(b.buf) {
		return fmt.Errorf("nvlink: staging copy of %d bytes into a %d-byte buffer: bad size", n, len(b.buf))
	}
	s := b.s
	d := s.t.drv
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("nvlink: staging: stager closed")
	}
	if b.busy {
		return ErrStagingBusy
	}
	lockThread()
	defer unlockThread()
	err := d.setCurrent(s.dev.ctx)
	if err == nil {
		if toDevice {
			err = d.copyHtoD(uintptr(dev), unsafe.Pointer(unsafe.SliceData(b.buf)), uint64(n), s.stream)
		} else {
			err = d.copyDtoH(unsafe.Pointer(unsafe.SliceData(b.buf)), uintptr(dev), uint64(n), s.stream)
		}
	}
	if err == nil {
		if err = d.eventRecord(b.event, s.stream); err != nil {
			d.streamSync(s.stream) // the copy is queued without an event
		}
	}
	if err != nil {
		return fmt.Errorf("nvlink: staging copy: %w", err)
	}
	b.busy = true
	return nil
}

// Done reports whether the buffer's last copy finished, and its error. It
// does not block.
func (b *Staging) Done() (bool, error) {
	s := b.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if !b.busy {
		return true, nil
	}
	if s.closed {
		b.busy = false
		return true, fmt.Errorf("nvlink: staging: stager closed")
	}
	lockThread()
	defer unlockThread()
	if err := s.t.drv.setCurrent(s.dev.ctx); err != nil {
		return false, fmt.Errorf("nvlink: staging: %w", err)
	}
	done, err := s.t.drv.eventQuery(b.event)
	if !done {
		return false, nil
	}
	b.busy = false
	if err != nil {
		return true, fmt.Errorf("nvlink: staging copy: %w", err)
	}
	return true, nil
}

// Close waits for the copies in flight, then frees the pinned memory.
// Buffers handed out must not be used afterwards. Idempotent.
func (s *Stager) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	lockThread()
	err := s.t.drv.setCurrent(s.dev.ctx)
	if err == nil {
		s.destroy()
	}
	unlockThread()
	s.mu.Unlock()
	s.t.mu.Lock()
	delete(s.t.stagers, s)
	s.t.mu.Unlock()
	if err != nil {
		return fmt.Errorf("nvlink: close stager: %w", err)
	}
	return nil
}
