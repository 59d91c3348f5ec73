package nvlink

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"unsafe"
)

// fakeDriver stands in for libcuda in tests: "device memory" is Go memory,
// an opened IPC handle is an alias at a made-up address (above user space,
// so it can never be confused with real memory and any use of the
// exporter's address instead of the mapping fails), and a stream is a queue
// of copies that runs only when an event behind it is queried or the
// stream synchronized: the first query of an event runs the copies before
// it and reports not ready, a later one reports done. Every copy checks
// that both ranges lie inside memory the fake knows of.
type fakeDriver struct {
	mu        sync.Mutex
	ndev      int
	allDevice bool // every registered memory is GPU 0's (for transporttest)
	mems      []*fakeMem
	handles   map[ipcHandle]*fakeMem
	next      uintptr // the next made-up address, for aliases
	ids       uintptr // streams and events
	streams   map[uintptr]*fakeStream
	events    map[uintptr]*fakeEvent
	hostMem   map[unsafe.Pointer][]byte
	retained  map[int]int
	opens     int                // ipcOpen calls
	closes    int                // ipcClose calls
	copies    int                // copies run
	batches   int                // copyBatch calls
	records   int                // eventRecord calls
	noBatch   bool               // canBatch says no: a driver before CUDA 12.8
	noKernel  bool               // loadGather fails: a driver that cannot load PTX
	launchErr error              // launchGather fails with it
	launches  int                // gather kernels launched
	parts     []uint32           // each launch's blocks a slice
	modules   int                // gather modules loaded and not unloaded
	mapped    map[uintptr][]byte // hostAllocMapped's memory by device address
	failLen   uint64             // a copy of this length fails when queued
	asyncLen  uint64             // a copy of this length fails when it runs
	ctxErr    error              // setCurrent fails with it
	openErr   error              // ipcOpen fails with it
	memDevErr bool               // memoryDevice says no for everything
	cur       int                // the GPU of the last setCurrent: one "thread" is enough for a fake
}

type fakeMem struct {
	base  uintptr
	buf   []byte
	dev   int
	alias *fakeMem // for an opened handle: the memory it maps
}

type fakeStream struct {
	ops  []func() error
	done int   // ops run
	err  error // the first failure, sticky like CUDA's
}

type fakeEvent struct {
	s       *fakeStream
	pos     int // ops before the record
	queried bool
}

var errFake = errors.New("fake driver: injected failure")

func newFake(ndev int) *fakeDriver {
	return &fakeDriver{
		ndev: ndev, handles: map[ipcHandle]*fakeMem{}, next: (^uintptr(0) / 4 * 3) &^ 0xffff,
		streams: map[uintptr]*fakeStream{}, events: map[uintptr]*fakeEvent{},
		hostMem: map[unsafe.Pointer][]byte{}, retained: map[int]int{},
	}
}

func fakeErr(fn string, code int32) error { return &cudaError{fn: fn, code: code} }

func (f *fakeDriver) deviceCount() (int, error) { return f.ndev, nil }

func (f *fakeDriver) pciBusID(o int) (string, error) {
	if o < 0 || o >= f.ndev {
		return "", fakeErr("cuDeviceGetPCIBusId", cuErrInvalidDevice)
	}
	return fmt.Sprintf("0000:%02x:00.0", 0x10+o), nil
}

func (f *fakeDriver) retain(o int) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if o < 0 || o >= f.ndev {
		return 0, fakeErr("cuDevicePrimaryCtxRetain", cuErrInvalidDevice)
	}
	f.retained[o]++
	return uintptr(0x1000 + o), nil
}

func (f *fakeDriver) release(o int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.retained[o] == 0 {
		return fakeErr("cuDevicePrimaryCtxRelease", cuErrInvalidContext)
	}
	f.retained[o]--
	return nil
}

func (f *fakeDriver) setCurrent(ctx uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.ctxErr != nil {
		return f.ctxErr
	}
	if ctx < 0x1000 || ctx >= 0x1000+uintptr(f.ndev) {
		return fakeErr("cuCtxSetCurrent", cuErrInvalidContext)
	}
	f.cur = int(ctx - 0x1000)
	return nil
}

func (f *fakeDriver) memAlloc(n uint64) (unsafe.Pointer, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	buf := make([]byte, n)
	p := unsafe.Pointer(unsafe.SliceData(buf))
	f.mems = append(f.mems, &fakeMem{base: uintptr(p), buf: buf, dev: f.cur})
	return p, nil
}

func (f *fakeDriver) memFree(p unsafe.Pointer) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, m := range f.mems {
		if m.base == uintptr(p) && m.alias == nil {
			f.mems = append(f.mems[:i], f.mems[i+1:]...)
			return nil
		}
	}
	return fakeErr("cuMemFree", cuErrInvalidValue)
}

// find returns the memory holding [p, p+n). mu is held.
func (f *fakeDriver) find(p uintptr, n uint64) *fakeMem {
	for _, m := range f.mems {
		if p >= m.base && p-m.base <= uintptr(len(m.buf)) && n <= uint64(len(m.buf))-uint64(p-m.base) {
			return m
		}
	}
	return nil
}

func (f *fakeDriver) memoryDevice(p unsafe.Pointer, n uint64) (int, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.memDevErr {
		return 0, false
	}
	if m := f.find(uintptr(p), n); m != nil && m.alias == nil {
		return m.dev, true
	}
	if f.allDevice {
		f.mems = append(f.mems, &fakeMem{base: uintptr(p), buf: unsafe.Slice((*byte)(p), n)})
		return 0, true
	}
	return 0, false
}

func (f *fakeDriver) addressRange(p uintptr) (uintptr, uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := f.find(p, 1)
	if m == nil {
		return 0, 0, fakeErr("cuMemGetAddressRange", cuErrNotFound)
	}
	return m.base, uint64(len(m.buf)), nil
}

func (f *fakeDriver) ipcGetHandle(p uintptr) (ipcHandle, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := f.find(p, 1)
	if m == nil || m.base != p || m.alias != nil {
		return ipcHandle{}, fakeErr("cuIpcGetMemHandle", cuErrInvalidValue)
	}
	var h ipcHandle
	copy(h.Reserved[:], "fake")
	binary.LittleEndian.PutUint64(h.Reserved[8:], uint64(m.base))
	f.handles[h] = m
	return h, nil
}

func (f *fakeDriver) ipcOpen(h ipcHandle) (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.openErr != nil {
		return 0, f.openErr
	}
	m := f.handles[h]
	if m == nil {
		return 0, fakeErr("cuIpcOpenMemHandle", cuErrInvalidHandle)
	}
	f.opens++
	a := &fakeMem{base: f.next, buf: m.buf, dev: m.dev, alias: m}
	f.next += (uintptr(len(m.buf)) + 0xffff) &^ 0xffff
	f.mems = append(f.mems, a)
	return a.base, nil
}

func (f *fakeDriver) ipcClose(p uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, m := range f.mems {
		if m.base == p && m.alias != nil {
			f.mems = append(f.mems[:i], f.mems[i+1:]...)
			f.closes++
			return nil
		}
	}
	return fakeErr("cuIpcCloseMemHandle", cuErrInvalidValue)
}

func (f *fakeDriver) ipcSameProcess() bool { return true }

func (f *fakeDriver) id() uintptr { f.ids++; return f.ids }

func (f *fakeDriver) streamCreate() (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := f.id()
	f.streams[id] = &fakeStream{}
	return id, nil
}

func (f *fakeDriver) streamDestroy(s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.streams[s]
	if st == nil {
		return fakeErr("cuStreamDestroy", cuErrInvalidHandle)
	}
	if st.done != len(st.ops) {
		return fmt.Errorf("fake: stream destroyed with %d copies queued", len(st.ops)-st.done)
	}
	delete(f.streams, s)
	return nil
}

// run runs the stream's ops up to pos. mu is held.
func (f *fakeDriver) run(st *fakeStream, pos int) {
	for ; st.done < pos; st.done++ {
		if err := st.ops[st.done](); err != nil && st.err == nil {
			st.err = err
		}
		f.copies++
	}
}

func (f *fakeDriver) streamSync(s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.streams[s]
	if st == nil {
		return fakeErr("cuStreamSynchronize", cuErrInvalidHandle)
	}
	f.run(st, len(st.ops))
	return st.err
}

func (f *fakeDriver) eventCreate() (uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := f.id()
	f.events[id] = &fakeEvent{}
	return id, nil
}

func (f *fakeDriver) eventRecord(e, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	ev, st := f.events[e], f.streams[s]
	if ev == nil || st == nil {
		return fakeErr("cuEventRecord", cuErrInvalidHandle)
	}
	*ev = fakeEvent{s: st, pos: len(st.ops)}
	f.records++
	return nil
}

func (f *fakeDriver) eventQuery(e uintptr) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	ev := f.events[e]
	if ev == nil {
		return true, fakeErr("cuEventQuery", cuErrInvalidHandle)
	}
	if ev.s == nil {
		return true, nil // never recorded: CUDA reports success
	}
	if ev.s.done < ev.pos || !ev.queried {
		f.run(ev.s, ev.pos)
		ev.queried = true
		return false, nil
	}
	return true, ev.s.err
}

func (f *fakeDriver) eventDestroy(e uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.events[e] == nil {
		return fakeErr("cuEventDestroy", cuErrInvalidHandle)
	}
	delete(f.events, e)
	return nil
}

// enqueue queues a copy between two resolved ranges. mu is held.
func (f *fakeDriver) enqueue(fn string, s uintptr, n uint64, dst, src func() ([]byte, error)) error {
	st := f.streams[s]
	if st == nil {
		return fakeErr(fn, cuErrInvalidHandle)
	}
	if n == f.failLen {
		return fakeErr(fn, cuErrInvalidValue)
	}
	fail := n == f.asyncLen
	st.ops = append(st.ops, func() error {
		if fail {
			return fakeErr(fn, cuErrIllegalAddress)
		}
		d, err := dst()
		if err != nil {
			return err
		}
		s, err := src()
		if err != nil {
			return err
		}
		copy(d, s)
		return nil
	})
	return nil
}

func (f *fakeDriver) dev(fn string, p uintptr, n uint64) func() ([]byte, error) {
	return func() ([]byte, error) {
		m := f.find(p, n)
		if m == nil {
			return nil, fmt.Errorf("%s: [%#x, +%d) is no device memory the fake knows: %w", fn, p, n, fakeErr(fn, cuErrIllegalAddress))
		}
		off := p - m.base
		return m.buf[off : uint64(off)+n], nil
	}
}

func host(p unsafe.Pointer, n uint64) func() ([]byte, error) {
	return func() ([]byte, error) { return unsafe.Slice((*byte)(p), n), nil }
}

func (f *fakeDriver) copyDtoD(dst, src uintptr, n uint64, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.enqueue("cuMemcpyDtoDAsync", s, n, f.dev("dst", dst, n), f.dev("src", src, n))
}

func (f *fakeDriver) canBatch() bool { return !f.noBatch }

func (f *fakeDriver) hostAllocMapped(n uint64) (unsafe.Pointer, uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b := make([]byte, n)
	p := unsafe.Pointer(unsafe.SliceData(b))
	f.hostMem[p] = b
	if f.mapped == nil {
		f.mapped = map[uintptr][]byte{}
	}
	f.mapped[uintptr(p)] = b
	return p, uintptr(p), nil
}

func (f *fakeDriver) loadGather() (uintptr, uintptr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.noKernel {
		return 0, 0, fakeErr("cuModuleLoadData", cuErrNotSupported)
	}
	f.modules++
	return f.id(), f.id(), nil
}

func (f *fakeDriver) unloadGather(mod uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.modules--
	return nil
}

// launchGather queues the kernel's work as the GPU would run it: when the
// stream reaches it, each of the n descriptors from a.start is read from
// the mapped ring and copied, both ranges checked like any copy's.
func (f *fakeDriver) launchGather(fn uintptr, a *gatherArgs, n uint32, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.launchErr != nil {
		return f.launchErr
	}
	if t := a.blockThreads(); t > 1024 || t%32 != 0 || a.gridParts() > 65535 {
		return fakeErr("cuLaunchKernel", cuErrInvalidValue)
	}
	st := f.streams[s]
	ring := f.mapped[uintptr(a.desc)]
	if st == nil || fn == 0 || ring == nil {
		return fakeErr("cuLaunchKernel", cuErrInvalidHandle)
	}
	f.launches++
	f.parts = append(f.parts, a.gridParts())
	start, mask := a.start, a.mask
	st.ops = append(st.ops, func() error {
		for b := range n {
			i := (start + b) & mask
			d := ring[i*24 : i*24+24]
			dst, src, m := binary.LittleEndian.Uint64(d), binary.LittleEndian.Uint64(d[8:]), binary.LittleEndian.Uint64(d[16:])
			if m == 0 {
				continue
			}
			db, err := f.dev("dst", uintptr(dst), m)()
			if err != nil {
				return err
			}
			sb, err := f.dev("src", uintptr(src), m)()
			if err != nil {
				return err
			}
			copy(db, sb)
		}
		return nil
	})
	return nil
}

// copyBatch checks every copy before queuing any: a batch with a copy of
// failLen fails whole, as the driver validates the batch in the call.
func (f *fakeDriver) copyBatch(dsts, srcs []uintptr, sizes []uint64, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.noBatch || len(dsts) == 0 || len(srcs) != len(dsts) || len(sizes) != len(dsts) {
		return fakeErr("cuMemcpyBatchAsync", cuErrInvalidValue)
	}
	if f.streams[s] == nil {
		return fakeErr("cuMemcpyBatchAsync", cuErrInvalidHandle)
	}
	for _, n := range sizes {
		if n == f.failLen {
			return fakeErr("cuMemcpyBatchAsync", cuErrInvalidValue)
		}
	}
	f.batches++
	for i := range dsts {
		if err := f.enqueue("cuMemcpyBatchAsync", s, sizes[i], f.dev("dst", dsts[i], sizes[i]), f.dev("src", srcs[i], sizes[i])); err != nil {
			return err
		}
	}
	return nil
}

func (f *fakeDriver) copyHtoD(dst uintptr, src unsafe.Pointer, n uint64, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.enqueue("cuMemcpyHtoDAsync", s, n, f.dev("dst", dst, n), host(src, n))
}

func (f *fakeDriver) copyDtoH(dst unsafe.Pointer, src uintptr, n uint64, s uintptr) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.enqueue("cuMemcpyDtoHAsync", s, n, host(dst, n), f.dev("src", src, n))
}

func (f *fakeDriver) hostAlloc(n uint64) (unsafe.Pointer, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b := make([]byte, n)
	p := unsafe.Pointer(unsafe.SliceData(b))
	f.hostMem[p] = b
	return p, nil
}

func (f *fakeDriver) hostFree(p unsafe.Pointer) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.hostMem[p] == nil {
		return fakeErr("cuMemFreeHost", cuErrInvalidValue)
	}
	delete(f.hostMem, p)
	delete(f.mapped, uintptr(p))
	return nil
}

// leaks reports streams, events, pinned memory and contexts left behind.
func (f *fakeDriver) leaks() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	var errs []error
	if len(f.streams) > 0 {
		errs = append(errs, fmt.Errorf("%d streams left", len(f.streams)))
	}
	if len(f.events) > 0 {
		errs = append(errs, fmt.Errorf("%d events left", len(f.events)))
	}
	if len(f.hostMem) > 0 {
		errs = append(errs, fmt.Errorf("%d pinned host allocations left", len(f.hostMem)))
	}
	if f.modules != 0 {
		errs = append(errs, fmt.Errorf("%d gather modules left loaded", f.modules))
	}
	for o, n := range f.retained {
		if n != 0 {
			errs = append(errs, fmt.Errorf("GPU %d's context retained %d times", o, n))
		}
	}
	for _, m := range f.mems {
		if m.alias != nil {
			errs = append(errs, fmt.Errorf("IPC mapping at %#x left open", m.base))
		}
	}
	return errors.Join(errs...)
}

var _ driver = (*fakeDriver)(nil)
