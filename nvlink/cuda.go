//go:build linux && (amd64 || arm64)

package nvlink

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/moonring/moonring/transport"
)

// CUDA driver API constants the transport passes (cuda.h).
const (
	cuStreamNonBlocking     = 0x1 // CU_STREAM_NON_BLOCKING: no sync with the legacy stream
	cuEventDisableTiming    = 0x2 // CU_EVENT_DISABLE_TIMING: the cheapest event to record and query
	cuMemHostAllocPortable  = 0x1 // CU_MEMHOSTALLOC_PORTABLE: pinned for every context
	cuIpcLazyEnablePeer     = 0x1 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	cuPointerAttrMemoryType = 2   // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
	cuPointerAttrOrdinal    = 9   // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
	cuMemoryTypeDevice      = 2   // CU_MEMORYTYPE_DEVICE
)

// cudaDriver calls libcuda.so.1 through purego: hot-path functions
// (copies, events, setCurrent) through purego.SyscallN with their
// arguments in a pooled array (hot), which neither allocates nor uses
// reflection; the few calls with a struct argument or a C string through
// purego.RegisterFunc.
//
// It has run on an H200 (scripts/gpu-check.sh, BENCHMARKS.md) but for the
// gather kernel's calls (loadGather, launchGather, hostAllocMapped): the
// development machine has no GPU.
type cudaDriver struct {
	lib string
	fn  struct {
		init, deviceGetCount, deviceGet, deviceGetPCIBusID                uintptr
		primaryCtxRetain, primaryCtxRelease, ctxSetCurrent                uintptr
		memAlloc, memFree, memGetAddressRange, pointerGetAttribute        uintptr
		ipcGetMemHandle, ipcCloseMemHandle                                uintptr
		streamCreate, streamDestroy, streamSynchronize                    uintptr
		eventCreate, eventRecord, eventQuery, eventDestroy                uintptr
		memcpyDtoDAsync, memcpyHtoDAsync, memcpyDtoHAsync, memHostAllocFn uintptr
		memFreeHost                                                       uintptr
	}
	// memcpyBatchAsync is cuMemcpyBatchAsync_v2 (CUDA 13: no failIdx),
	// else cuMemcpyBatchAsync (CUDA 12.8: failIdx before the stream, when
	// batchFailIdx), else 0: the driver has neither.
	memcpyBatchAsync uintptr
	batchFailIdx     bool
	// The gather kernel's calls; 0 where the driver lacks one (then
	// loadGather fails and lanes stay on copy engines).
	moduleLoadData, moduleGetFunction, moduleUnload, launchKernel, hostGetDevicePointer uintptr

	failIdx uint64 // where a 12.8 driver writes a failed batch's index; never read

	ipcOpenMemHandle func(dptr *uint64, h ipcHandle, flags uint32) int32
	getErrorString   func(code int32, str **byte) int32

	mu   sync.Mutex
	devs map[int]int32 // ordinal -> CUdevice
}

var (
	loadMu sync.Mutex
	loaded = map[string]*cudaDriver{} // by library path: loaded and cuInit once
)

// loadCUDA opens lib (libcuda.so.1 by default), binds the functions the
// transport needs and calls cuInit. Its errors wrap
// transport.ErrNotSupported and say why: no library, a missing symbol (a
// driver too old), or cuInit failing (no GPU, driver and kernel module
// mismatch).
func loadCUDA(lib string) (driver, error) {
	loadMu.Lock()
	defer loadMu.Unlock()
	if d := loaded[lib]; d != nil {
		return d, nil
	}
	h, err := purego.Dlopen(lib, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, fmt.Errorf("nvlink: no %s: %v: %w", lib, err, transport.ErrNotSupported)
	}
	d := &cudaDriver{lib: lib, devs: map[int]int32{}}
	f := &d.fn
	binds := []struct {
		p     *uintptr
		names []string
	}{
		{&f.init, []string{"cuInit"}},
		{&f.deviceGetCount, []string{"cuDeviceGetCount"}},
		{&f.deviceGet, []string{"cuDeviceGet"}},
		{&f.deviceGetPCIBusID, []string{"cuDeviceGetPCIBusId"}},
		{&f.primaryCtxRetain, []string{"cuDevicePrimaryCtxRetain"}},
		{&f.primaryCtxRelease, []string{"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"}},
		{&f.ctxSetCurrent, []string{"cuCtxSetCurrent"}},
		{&f.memAlloc, []string{"cuMemAlloc_v2"}},
		{&f.memFree, []string{"cuMemFree_v2"}},
		{&f.memGetAddressRange, []string{"cuMemGetAddressRange_v2"}},
		{&f.pointerGetAttribute, []string{"cuPointerGetAttribute"}},
		{&f.ipcGetMemHandle, []string{"cuIpcGetMemHandle"}},
		{&f.ipcCloseMemHandle, []string{"cuIpcCloseMemHandle"}},
		{&f.streamCreate, []string{"cuStreamCreate"}},
		{&f.streamDestroy, []string{"cuStreamDestroy_v2", "cuStreamDestroy"}},
		{&f.streamSynchronize, []string{"cuStreamSynchronize"}},
		{&f.eventCreate, []string{"cuEventCreate"}},
		{&f.eventRecord, []string{"cuEventRecord"}},
		{&f.eventQuery, []string{"cuEventQuery"}},
		{&f.eventDestroy, []string{"cuEventDestroy_v2", "cuEventDestroy"}},
		{&f.memcpyDtoDAsync, []string{"cuMemcpyDtoDAsync_v2"}},
		{&f.memcpyHtoDAsync, []string{"cuMemcpyHtoDAsync_v2"}},
		{&f.memcpyDtoHAsync, []string{"cuMemcpyDtoHAsync_v2"}},
		{&f.memHostAllocFn, []string{"cuMemHostAlloc"}},
		{&f.memFreeHost, []string{"cuMemFreeHost"}},
	}
	for _, b := range binds {
		if *b.p, err = sym(h, b.names...); err != nil {
			return nil, fmt.Errorf("nvlink: %s: %v: %w", lib, err, transport.ErrNotSupported)
		}
	}
	ipcOpen, err := sym(h, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
	if err != nil {
		return nil, fmt.Errorf("nvlink: %s: %v: %w", lib, err, transport.ErrNotSupported)
	}
	errStr, err := sym(h, "cuGetErrorString")
	if err != nil {
		return nil, fmt.Errorf("nvlink: %s: %v: %w", lib, err, transport.ErrNotSupported)
	}
	if p, err := sym(h, "cuMemcpyBatchAsync_v2"); err == nil {
		d.memcpyBatchAsync = p
	} else if p, err := sym(h, "cuMemcpyBatchAsync"); err == nil {
		d.memcpyBatchAsync, d.batchFailIdx = p, true
	}
	d.moduleLoadData, _ = sym(h, "cuModuleLoadData")
	d.moduleGetFunction, _ = sym(h, "cuModuleGetFunction")
	d.moduleUnload, _ = sym(h, "cuModuleUnload")
	d.launchKernel, _ = sym(h, "cuLaunchKernel")
	d.hostGetDevicePointer, _ = sym(h, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
	// RegisterFunc passes the 64-byte handle by value as the C ABI wants
	// (on the stack on amd64); SyscallN has no way to say that.
	purego.RegisterFunc(&d.ipcOpenMemHandle, ipcOpen)
	purego.RegisterFunc(&d.getErrorString, errStr)
	if err := d.check("cuInit", d.call(f.init, 0)); err != nil {
		return nil, fmt.Errorf("nvlink: %w (%w)", err, transport.ErrNotSupported)
	}
	loaded[lib] = d
	return d, nil
}

func sym(h uintptr, names ...string) (uintptr, error) {
	var first error
	for _, n := range names {
		p, err := purego.Dlsym(h, n)
		if err == nil && p != 0 {
			return p, nil
		}
		if first == nil {
			first = fmt.Errorf("no symbol %s (driver too old?): %v", n, err)
		}
	}
	return 0, first
}

// call runs a driver function and returns its CUresult. The arguments are
// integers or addresses made with uintptr(unsafe.Pointer(&x)) in the call
// expression, which go:uintptrescapes keeps valid (as on SyscallN).
//
//go:uintptrescapes
func (d *cudaDriver) call(fn uintptr, args ...uintptr) int32 {
	r, _, _ := purego.SyscallN(fn, args...)
	return int32(r) // CUresult is a 32-bit enum; the upper half of RAX is undefined
}

// hotArgs holds the arguments of hot calls (see hot).
var hotArgs = sync.Pool{New: func() any { return new([maxHotArgs]uintptr) }}

// maxHotArgs is the most arguments a hot call takes (cuLaunchKernel).
const maxHotArgs = 11

// hot runs a driver function of the hot path (copies, events,
// setCurrent) without allocating. Its n arguments are integers, device
// addresses and addresses of memory that outlives the call (the lane's
// arrays, package variables). Through call, SyscallN's variadic slice
// escapes (go:uintptrescapes) and costs an allocation a call; here the
// arguments travel in a pooled array.
func (d *cudaDriver) hot(fn uintptr, n int, a [maxHotArgs]uintptr) int32 {
	p := hotArgs.Get().(*[maxHotArgs]uintptr)
	*p = a
	r, _, _ := purego.SyscallN(fn, p[:n]...)
	hotArgs.Put(p)
	return int32(r)
}

// check turns a CUresult into an error; nil on success without allocating.
func (d *cudaDriver) check(fn string, code int32) error {
	if code == cuSuccess {
		return nil
	}
	e := &cudaError{fn: fn, code: code}
	var s *byte
	if d.getErrorString != nil && d.getErrorString(code, &s) == cuSuccess && s != nil {
		var b strings.Builder
		for i := 0; i < 256; i++ {
			c := *(*byte)(unsafe.Add(unsafe.Pointer(s), i))
			if c == 0 {
				break
			}
			b.WriteByte(c)
		}
		e.desc = b.String()
	}
	return e
}

func (d *cudaDriver) device(ordinal int) (int32, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if dev, ok := d.devs[ordinal]; ok {
		return dev, nil
	}
	var dev int32
	if err := d.check("cuDeviceGet", d.call(d.fn.deviceGet, uintptr(unsafe.Pointer(&dev)), uintptr(ordinal))); err != nil {
		return 0, err
	}
	d.devs[ordinal] = dev
	return dev, nil
}

func (d *cudaDriver) deviceCount() (int, error) {
	var n int32
	if err := d.check("cuDeviceGetCount", d.call(d.fn.deviceGetCount, uintptr(unsafe.Pointer(&n)))); err != nil {
		return 0, err
	}
	return int(n), nil
}

func (d *cudaDriver) pciBusID(ordinal int) (string, error) {
	dev, err := d.device(ordinal)
	if err != nil {
		return "", err
	}
	var buf [32]byte
	if err := d.check("cuDeviceGetPCIBusId", d.call(d.fn.deviceGetPCIBusID, uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), uintptr(dev))); err != nil {
		return "", err
	}
	s := string(buf[:])
	if i := strings.IndexByte(s, 0); i >= 0 {
		s = s[:i]
	}
	return strings.ToLower(s), nil
}

func (d *cudaDriver) retain(ordinal int) (uintptr, error) {
	dev, err := d.device(ordinal)
	if err != nil {
		return 0, err
	}
	var ctx uintptr
	if err := d.check("cuDevicePrimaryCtxRetain", d.call(d.fn.primaryCtxRetain, uintptr(unsafe.Pointer(&ctx)), uintptr(dev))); err != nil {
		return 0, err
	}
	return ctx, nil
}

func (d *cudaDriver) release(ordinal int) error {
	dev, err := d.device(ordinal)
	if err != nil {
		return err
	}
	return d.check("cuDevicePrimaryCtxRelease", d.call(d.fn.primaryCtxRelease, uintptr(dev)))
}

func (d *cudaDriver) setCurrent(ctx uintptr) error {
	return d.check("cuCtxSetCurrent", d.hot(d.fn.ctxSetCurrent, 1, [maxHotArgs]uintptr{ctx}))
}

func (d *cudaDriver) memAlloc(n uint64) (unsafe.Pointer, error) {
	// The device address lands in an unsafe.Pointer: it is never
	// dereferenced by Go, and the collector ignores addresses outside its
	// heap, so keeping it typed spares a uintptr-to-pointer conversion.
	var p unsafe.Pointer
	if err := d.check("cuMemAlloc_v2", d.call(d.fn.memAlloc, uintptr(unsafe.Pointer(&p)), uintptr(n))); err != nil {
		return nil, err
	}
	return p, nil
}

func (d *cudaDriver) memFree(p unsafe.Pointer) error {
	return d.check("cuMemFree_v2", d.call(d.fn.memFree, uintptr(p)))
}

func (d *cudaDriver) memoryDevice(p unsafe.Pointer, n uint64) (int, bool) {
	var kind uint32
	if d.call(d.fn.pointerGetAttribute, uintptr(unsafe.Pointer(&kind)), cuPointerAttrMemoryType, uintptr(p)) != cuSuccess || kind != cuMemoryTypeDevice {
		return 0, false
	}
	var ord int32
	if d.call(d.fn.pointerGetAttribute, uintptr(unsafe.Pointer(&ord)), cuPointerAttrOrdinal, uintptr(p)) != cuSuccess {
		return 0, false
	}
	base, size, err := d.addressRange(uintptr(p))
	if err != nil || uintptr(p)-base > uintptr(size) || n > size-uint64(uintptr(p)-base) {
		return 0, false
	}
	return int(ord), true
}

func (d *cudaDriver) addressRange(p uintptr) (uintptr, uint64, error) {
	var base uintptr
	var size uint64
	if err := d.check("cuMemGetAddressRange_v2", d.call(d.fn.memGetAddressRange, uintptr(unsafe.Pointer(&base)), uintptr(unsafe.Pointer(&size)), p)); err != nil {
		return 0, 0, err
	}
	return base, size, nil
}

func (d *cudaDriver) ipcGetHandle(p uintptr) (ipcHandle, error) {
	var h ipcHandle
	err := d.check("cuIpcGetMemHandle", d.call(d.fn.ipcGetMemHandle, uintptr(unsafe.Pointer(&h)), p))
	return h, err
}

func (d *cudaDriver) ipcOpen(h ipcHandle) (uintptr, error) {
	var p uint64
	if err := d.check("cuIpcOpenMemHandle", d.ipcOpenMemHandle(&p, h, cuIpcLazyEnablePeer)); err != nil {
		return 0, err
	}
	return uintptr(p), nil
}

func (d *cudaDriver) ipcClose(p uintptr) error {
	return d.check("cuIpcCloseMemHandle", d.call(d.fn.ipcCloseMemHandle, p))
}

func (d *cudaDriver) ipcSameProcess() bool { return false }

func (d *cudaDriver) streamCreate() (uintptr, error) {
	var s uintptr
	if err := d.check("cuStreamCreate", d.call(d.fn.streamCreate, uintptr(unsafe.Pointer(&s)), cuStreamNonBlocking)); err != nil {
		return 0, err
	}
	return s, nil
}

func (d *cudaDriver) streamDestroy(s uintptr) error {
	return d.check("cuStreamDestroy", d.call(d.fn.streamDestroy, s))
}

func (d *cudaDriver) streamSync(s uintptr) error {
	return d.check("cuStreamSynchronize", d.call(d.fn.streamSynchronize, s))
}

func (d *cudaDriver) eventCreate() (uintptr, error) {
	var e uintptr
	if err := d.check("cuEventCreate", d.call(d.fn.eventCreate, uintptr(unsafe.Pointer(&e)), cuEventDisableTiming)); err != nil {
		return 0, err
	}
	return e, nil
}

func (d *cudaDriver) eventRecord(e, s uintptr) error {
	return d.check("cuEventRecord", d.hot(d.fn.eventRecord, 2, [maxHotArgs]uintptr{e, s}))
}

func (d *cudaDriver) eventQuery(e uintptr) (bool, error) {
	switch code := d.hot(d.fn.eventQuery, 1, [maxHotArgs]uintptr{e}); code {
	case cuSuccess:
		return true, nil
	case cuErrNotReady:
		return false, nil
	default:
		return true, d.check("cuEventQuery", code)
	}
}

func (d *cudaDriver) eventDestroy(e uintptr) error {
	return d.check("cuEventDestroy", d.call(d.fn.eventDestroy, e))
}

func (d *cudaDriver) copyDtoD(dst, src uintptr, n uint64, s uintptr) error {
	return d.check("cuMemcpyDtoDAsync_v2", d.hot(d.fn.memcpyDtoDAsync, 4, [maxHotArgs]uintptr{dst, src, uintptr(n), s}))
}

// memcpyAttributes is a CUmemcpyAttributes: the source's access order,
// the operands' location hints (for managed memory only; zero: none) and
// flags.
type memcpyAttributes struct {
	srcAccessOrder uint32
	srcLocType     uint32
	srcLocID       int32
	dstLocType     uint32
	dstLocID       int32
	flags          uint32
}

var _ [24 - unsafe.Sizeof(memcpyAttributes{})]byte
var _ [unsafe.Sizeof(memcpyAttributes{}) - 24]byte

// batchAttrs applies to every copy of a batch (batchAttrIdx: from index
// 0): sources are read in stream order (CU_MEMCPY_SRC_ACCESS_ORDER_STREAM),
// as an async copy's are. Read-only after init; the driver only reads them.
var (
	batchAttrs   = [1]memcpyAttributes{{srcAccessOrder: 1}}
	batchAttrIdx = [1]uintptr{0}
)

func (d *cudaDriver) canBatch() bool { return d.memcpyBatchAsync != 0 }

func (d *cudaDriver) copyBatch(dsts, srcs []uintptr, sizes []uint64, s uintptr) error {
	n := len(dsts)
	if n == 0 || len(srcs) != n || len(sizes) != n || d.memcpyBatchAsync == 0 {
		return &cudaError{fn: "cuMemcpyBatchAsync", code: cuErrInvalidValue}
	}
	args := [maxHotArgs]uintptr{uintptr(unsafe.Pointer(&dsts[0])), uintptr(unsafe.Pointer(&srcs[0])), uintptr(unsafe.Pointer(&sizes[0])), uintptr(n),
		uintptr(unsafe.Pointer(&batchAttrs[0])), uintptr(unsafe.Pointer(&batchAttrIdx[0])), 1, s}
	if d.batchFailIdx {
		args[7], args[8] = uintptr(unsafe.Pointer(&d.failIdx)), s
		return d.check("cuMemcpyBatchAsync", d.hot(d.memcpyBatchAsync, 9, args))
	}
	return d.check("cuMemcpyBatchAsync_v2", d.hot(d.memcpyBatchAsync, 8, args))
}

func (d *cudaDriver) copyHtoD(dst uintptr, src unsafe.Pointer, n uint64, s uintptr) error {
	return d.check("cuMemcpyHtoDAsync_v2", d.hot(d.fn.memcpyHtoDAsync, 4, [maxHotArgs]uintptr{dst, uintptr(src), uintptr(n), s}))
}

func (d *cudaDriver) copyDtoH(dst unsafe.Pointer, src uintptr, n uint64, s uintptr) error {
	return d.check("cuMemcpyDtoHAsync_v2", d.hot(d.fn.memcpyDtoHAsync, 4, [maxHotArgs]uintptr{uintptr(dst), src, uintptr(n), s}))
}

func (d *cudaDriver) hostAlloc(n uint64) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	if err := d.check("cuMemHostAlloc", d.call(d.fn.memHostAllocFn, uintptr(unsafe.Pointer(&p)), uintptr(n), cuMemHostAllocPortable)); err != nil {
		return nil, err
	}
	return p, nil
}

// cuMemHostAllocDeviceMap: CU_MEMHOSTALLOC_DEVICEMAP, pinned memory
// mapped into the GPUs' address space.
const cuMemHostAllocDeviceMap = 0x2

func (d *cudaDriver) hostAllocMapped(n uint64) (unsafe.Pointer, uintptr, error) {
	if d.hostGetDevicePointer == 0 {
		return nil, 0, &cudaError{fn: "cuMemHostGetDevicePointer", code: cuErrNotSupported}
	}
	var p unsafe.Pointer
	if err := d.check("cuMemHostAlloc", d.call(d.fn.memHostAllocFn, uintptr(unsafe.Pointer(&p)), uintptr(n), cuMemHostAllocPortable|cuMemHostAllocDeviceMap)); err != nil {
		return nil, 0, err
	}
	var dev uintptr
	if err := d.check("cuMemHostGetDevicePointer", d.call(d.hostGetDevicePointer, uintptr(unsafe.Pointer(&dev)), uintptr(p), 0)); err != nil {
		d.hostFree(p)
		return nil, 0, err
	}
	return p, dev, nil
}

// The kernel's image and name as C strings.
var (
	gatherImage = []byte(gatherPTX + "\x00")
	gatherCName = []byte(gatherName + "\x00")
)

func (d *cudaDriver) loadGather() (uintptr, uintptr, error) {
	if d.moduleLoadData == 0 || d.moduleGetFunction == 0 || d.moduleUnload == 0 || d.launchKernel == 0 {
		return 0, 0, &cudaError{fn: "cuModuleLoadData", code: cuErrNotSupported}
	}
	var mod, fn uintptr
	if err := d.check("cuModuleLoadData", d.call(d.moduleLoadData, uintptr(unsafe.Pointer(&mod)), uintptr(unsafe.Pointer(&gatherImage[0])))); err != nil {
		return 0, 0, err
	}
	if err := d.check("cuModuleGetFunction", d.call(d.moduleGetFunction, uintptr(unsafe.Pointer(&fn)), mod, uintptr(unsafe.Pointer(&gatherCName[0])))); err != nil {
		d.unloadGather(mod)
		return 0, 0, err
	}
	return fn, mod, nil
}

func (d *cudaDriver) unloadGather(mod uintptr) error {
	return d.check("cuModuleUnload", d.call(d.moduleUnload, mod))
}

func (d *cudaDriver) launchGather(fn uintptr, a *gatherArgs, n uint32, s uintptr) error {
	a.ptrs = [3]uintptr{uintptr(unsafe.Pointer(&a.desc)), uintptr(unsafe.Pointer(&a.start)), uintptr(unsafe.Pointer(&a.mask))}
	return d.check("cuLaunchKernel", d.hot(d.launchKernel, 11, [maxHotArgs]uintptr{fn, uintptr(n), uintptr(a.gridParts()), 1, uintptr(a.blockThreads()), 1, 1, 0, s, uintptr(unsafe.Pointer(&a.ptrs[0])), 0}))
}

func (d *cudaDriver) hostFree(p unsafe.Pointer) error {
	return d.check("cuMemFreeHost", d.call(d.fn.memFreeHost, uintptr(p)))
}

// lockThread pins the goroutine to its OS thread for a run of calls that
// depend on the current context.
func lockThread()   { runtime.LockOSThread() }
func unlockThread() { runtime.UnlockOSThread() }
