package nvlink

import "unsafe"

// The gather kernel copies many small device-to-device slices in one
// launch, on the GPU's SMs: one thread block a slice, each thread moving
// 16 bytes at a time. A copy engine spends about 5 µs on each copy
// whatever its size (an H200 moved a 4k-token request's 16,384 blocks of
// 32 KiB at 6-7 GB/s, a call each or batched, against 1.5-2 TB/s for one
// 64 MiB copy), so scattered KV-cache blocks go through the kernel and
// large slices through the copy engine. The kernel runs on the remote
// buffer's GPU (the lane's), so it takes only slices whose local buffer
// is on that GPU too: another GPU's memory would need peer access, which
// copy engines do without.
//
// The kernel reads its slices from a ring of descriptors in mapped,
// pinned host memory: the lane's ring indices name them, so a launch
// covers a group's indices (start, count, the ring's mask) and a
// descriptor is rewritten only when its index is reused, after the event
// behind its launch fired. A descriptor of length 0 is a slice of the
// group that went another way.
//
// The kernel is PTX, compiled by the driver when the lane starts
// (cuModuleLoadData); a driver that cannot load it leaves the lane on copy
// engines.

// gatherName is the kernel's entry point in gatherPTX.
const gatherName = "moonring_gather"

// Gather kernel limits: a slice goes to the kernel when its addresses and
// length are multiples of gatherAlign and it is at most gatherMax bytes
// (one thread block copies it); gatherThreads threads a block unless a
// launch says otherwise (gatherArgs.threads).
const (
	gatherAlign   = 16
	gatherMax     = 1 << 20
	gatherThreads = 256
)

// gatherPTX is the kernel: block b copies descriptor (start+b)&mask,
// thread t the 16-byte words t, t+ntid, ... of it.
const gatherPTX = `.version 7.0
.target sm_70
.address_size 64

.visible .entry moonring_gather(
	.param .u64 p_desc,
	.param .u32 p_start,
	.param .u32 p_mask
)
{
	.reg .pred %p<2>;
	.reg .b32 %r<12>;
	.reg .b64 %rd<12>;

	ld.param.u64 %rd1, [p_desc];
	ld.param.u32 %r1, [p_start];
	ld.param.u32 %r2, [p_mask];
	mov.u32 %r3, %ctaid.x;
	add.u32 %r4, %r1, %r3;
	and.b32 %r4, %r4, %r2;
	mul.wide.u32 %rd2, %r4, 24;
	add.u64 %rd3, %rd1, %rd2;
	ld.global.u64 %rd4, [%rd3];
	ld.global.u64 %rd5, [%rd3+8];
	ld.global.u64 %rd6, [%rd3+16];
	mov.u32 %r5, %tid.x;
	mov.u32 %r6, %ntid.x;
	mul.wide.u32 %rd7, %r5, 16;
	mul.wide.u32 %rd8, %r6, 16;
LOOP:
	setp.ge.u64 %p1, %rd7, %rd6;
	@%p1 bra DONE;
	add.u64 %rd9, %rd5, %rd7;
	add.u64 %rd10, %rd4, %rd7;
	ld.global.v4.u32 {%r7, %r8, %r9, %r10}, [%rd9];
	st.global.v4.u32 [%rd10], {%r7, %r8, %r9, %r10};
	add.u64 %rd7, %rd7, %rd8;
	bra LOOP;
DONE:
	ret;
}
`

// gatherDesc is one slice for the kernel, as the PTX reads it.
type gatherDesc struct {
	dst, src, n uint64
}

var _ [24 - unsafe.Sizeof(gatherDesc{})]byte
var _ [unsafe.Sizeof(gatherDesc{}) - 24]byte

// gatherArgs are one launch's parameters, owned by the lane (under its
// posting lock): the driver passes the addresses of desc, start and mask
// as the launch's kernelParams, through ptrs.
type gatherArgs struct {
	desc    uint64 // device address of the descriptor ring
	start   uint32 // ring index of the launch's first descriptor
	mask    uint32 // the ring's size - 1
	threads uint32 // threads a block, a multiple of 32 up to 1024; 0: gatherThreads
	ptrs    [3]uintptr
}

// blockThreads is the launch's threads a block.
func (a *gatherArgs) blockThreads() uint32 {
	if a.threads == 0 {
		return gatherThreads
	}
	return a.threads
}

// gatherable reports whether a device-to-device copy may go to the kernel.
func gatherable(dst, src uintptr, n uint64) bool {
	return n <= gatherMax && (uint64(dst)|uint64(src)|n)%gatherAlign == 0
}
