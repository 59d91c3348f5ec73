package nvlink

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/moonring/moonring/transport"
)

// Errors of the CUDA driver layer. Every failed driver call returns an
// error wrapping ErrDriver; the few codes the transport acts on also wrap a
// more precise sentinel.
var (
	// ErrDriver: a CUDA driver call failed. Whether a retry helps depends
	// on the code the message names.
	ErrDriver = errors.New("nvlink: CUDA driver call failed")
	// ErrNoDevice: no such GPU (or none at all). A retry does not help.
	ErrNoDevice = errors.New("nvlink: no such GPU")
	// ErrOutOfMemory: the GPU or pinned host memory is exhausted; freeing
	// some may help.
	ErrOutOfMemory = errors.New("nvlink: out of memory")
)

// CUresult codes the transport names or acts on (cuda.h).
const (
	cuSuccess            = 0
	cuErrInvalidValue    = 1
	cuErrOutOfMemory     = 2
	cuErrNotInitialized  = 3
	cuErrDeinitialized   = 4
	cuErrInsufficient    = 35
	cuErrNoDevice        = 100
	cuErrInvalidDevice   = 101
	cuErrInvalidContext  = 201
	cuErrMapFailed       = 205
	cuErrAlreadyMapped   = 208
	cuErrPeerUnsupported = 217
	cuErrInvalidHandle   = 400
	cuErrNotFound        = 500
	cuErrNotReady        = 600
	cuErrIllegalAddress  = 700
	cuErrNotPermitted    = 800
	cuErrNotSupported    = 801
	cuErrUnknown         = 999
)

var codeNames = map[int32]string{
	cuErrInvalidValue:    "CUDA_ERROR_INVALID_VALUE",
	cuErrOutOfMemory:     "CUDA_ERROR_OUT_OF_MEMORY",
	cuErrNotInitialized:  "CUDA_ERROR_NOT_INITIALIZED",
	cuErrDeinitialized:   "CUDA_ERROR_DEINITIALIZED",
	cuErrInsufficient:    "CUDA_ERROR_INSUFFICIENT_DRIVER",
	cuErrNoDevice:        "CUDA_ERROR_NO_DEVICE",
	cuErrInvalidDevice:   "CUDA_ERROR_INVALID_DEVICE",
	cuErrInvalidContext:  "CUDA_ERROR_INVALID_CONTEXT",
	cuErrMapFailed:       "CUDA_ERROR_MAP_FAILED",
	cuErrAlreadyMapped:   "CUDA_ERROR_ALREADY_MAPPED",
	cuErrPeerUnsupported: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
	cuErrInvalidHandle:   "CUDA_ERROR_INVALID_HANDLE",
	cuErrNotFound:        "CUDA_ERROR_NOT_FOUND",
	cuErrNotReady:        "CUDA_ERROR_NOT_READY",
	cuErrIllegalAddress:  "CUDA_ERROR_ILLEGAL_ADDRESS",
	cuErrNotPermitted:    "CUDA_ERROR_NOT_PERMITTED",
	cuErrNotSupported:    "CUDA_ERROR_NOT_SUPPORTED",
	cuErrUnknown:         "CUDA_ERROR_UNKNOWN",
}

// cudaError is a failed driver call: the function, its CUresult and the
// driver's own description when it gave one. Built only on failure.
type cudaError struct {
	fn   string
	code int32
	desc string
}

func (e *cudaError) Error() string {
	name := codeNames[e.code]
	if name == "" {
		name = fmt.Sprintf("CUresult %d", e.code)
	}
	if e.desc != "" {
		return fmt.Sprintf("%s: %s (%s)", e.fn, name, e.desc)
	}
	return fmt.Sprintf("%s: %s", e.fn, name)
}

// Is maps codes to the package's sentinels.
func (e *cudaError) Is(target error) bool {
	switch target {
	case ErrDriver:
		return true
	case ErrNoDevice:
		return e.code == cuErrNoDevice || e.code == cuErrInvalidDevice
	case ErrOutOfMemory:
		return e.code == cuErrOutOfMemory
	case transport.ErrNotSupported:
		return e.code == cuErrNotSupported || e.code == cuErrInsufficient || e.code == cuErrPeerUnsupported
	}
	return false
}

// ipcHandle is a CUipcMemHandle: 64 opaque bytes that name an allocation of
// device memory to other processes of the host.
type ipcHandle struct {
	Reserved [64]byte
}

// ipcHandleSize is the size of a CUipcMemHandle (CU_IPC_HANDLE_SIZE).
const ipcHandleSize = 64

var _ [ipcHandleSize - unsafe.Sizeof(ipcHandle{})]byte
var _ [unsafe.Sizeof(ipcHandle{}) - ipcHandleSize]byte

// driver is the part of the CUDA driver API the transport uses. The real
// one (cudaDriver) calls libcuda.so.1 through purego; the tests' fake keeps
// "device memory" in Go memory and runs streams in software, so the
// transport's logic is tested everywhere while the real path needs a GPU.
//
// Device pointers are uintptrs: they are addresses in the process's unified
// address space that Go code never dereferences. Calls that depend on the
// current context are made by a goroutine that locked its OS thread and
// called setCurrent. A driver is safe for concurrent use.
type driver interface {
	// deviceCount returns how many GPUs the process sees.
	deviceCount() (int, error)
	// pciBusID names GPU ordinal the same way in every process of the
	// host, whatever CUDA_VISIBLE_DEVICES renumbered.
	pciBusID(ordinal int) (string, error)
	// retain returns GPU ordinal's primary context, retaining it.
	retain(ordinal int) (ctx uintptr, err error)
	// release undoes retain.
	release(ordinal int) error
	// setCurrent binds ctx to the calling OS thread.
	setCurrent(ctx uintptr) error
	// memAlloc allocates device memory in the current context.
	memAlloc(n uint64) (unsafe.Pointer, error)
	// memFree frees memory from memAlloc.
	memFree(p unsafe.Pointer) error
	// memoryDevice reports whether [p, p+n) is device memory and of which
	// GPU (its ordinal in this process).
	memoryDevice(p unsafe.Pointer, n uint64) (ordinal int, ok bool)
	// addressRange returns the allocation that holds device address p.
	addressRange(p uintptr) (base uintptr, size uint64, err error)
	// ipcGetHandle exports the allocation that holds p.
	ipcGetHandle(p uintptr) (ipcHandle, error)
	// ipcOpen maps an exported allocation into the current context.
	ipcOpen(h ipcHandle) (uintptr, error)
	// ipcClose unmaps what ipcOpen mapped.
	ipcClose(p uintptr) error
	// ipcSameProcess reports whether a handle may be opened by the process
	// that exported it (CUDA refuses; the fake allows it).
	ipcSameProcess() bool
	streamCreate() (uintptr, error)
	streamDestroy(s uintptr) error
	// streamSync waits for everything queued on s. Only Close and error
	// paths call it, never the hot path.
	streamSync(s uintptr) error
	eventCreate() (uintptr, error)
	eventRecord(e, s uintptr) error
	// eventQuery reports whether the work before e's record is done; an
	// error means the work failed.
	eventQuery(e uintptr) (done bool, err error)
	eventDestroy(e uintptr) error
	copyDtoD(dst, src uintptr, n uint64, s uintptr) error
	// copyBatch queues len(dsts) device-to-device copies in one call
	// (cuMemcpyBatchAsync), in no order among themselves, all before
	// anything queued on s after it. The arrays may be reused once it
	// returns. Only when canBatch.
	copyBatch(dsts, srcs []uintptr, sizes []uint64, s uintptr) error
	// canBatch reports whether the driver has copyBatch.
	canBatch() bool
	copyHtoD(dst uintptr, src unsafe.Pointer, n uint64, s uintptr) error
	copyDtoH(dst unsafe.Pointer, src uintptr, n uint64, s uintptr) error
	// hostAlloc allocates pinned, portable host memory.
	hostAlloc(n uint64) (unsafe.Pointer, error)
	// hostAllocMapped allocates pinned, portable host memory that
	// kernels read at the device address it also returns; hostFree frees it.
	hostAllocMapped(n uint64) (unsafe.Pointer, uintptr, error)
	// loadGather loads the gather kernel (gatherPTX) into the current
	// context: its function, and the module for unloadGather.
	loadGather() (fn, mod uintptr, err error)
	unloadGather(mod uintptr) error
	// launchGather queues fn on s over n descriptors from a.start (see
	// gatherArgs); a is read during the call only.
	launchGather(fn uintptr, a *gatherArgs, n uint32, s uintptr) error
	hostFree(p unsafe.Pointer) error
}
