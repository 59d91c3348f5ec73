package nvlink

import "unsafe"

// The gather kernel copies many small device-to-device slices in one
// launch, on the GPU's SMs: a column of thread blocks a slice (one block
// for a 32 KiB slice), each thread moving 16 bytes at a time. A copy
// engine spends about 5 µs on each copy whatever its size (an H200 moved a 4k-token request's 16,384 blocks of
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
// (up to gatherMaxParts thread blocks copy it); gatherThreads threads a
// block unless a launch says otherwise (gatherArgs.threads).
const (
	gatherAlign   = 16
	gatherMax     = 1 << 20
	gatherThreads = 1024
)

// gatherPTX is the kernel: the blocks of grid column x (ctaid.x) copy
// descriptor (start+x)&mask, its 16-byte words dealt out over the column's
// nctaid.y blocks of ntid threads: thread t of block y takes words
// y*ntid+t, then every ntid*nctaid.y-th after it. A group of 64 slices
// is a grid of 64 columns, too few blocks to keep a GPU's SMs busy with
// one block each: the rows (gatherArgs.parts) split each slice so that
// a thread moves one or a few words.
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
	.reg .b32 %r<16>;
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
	mov.u32 %r7, %ctaid.y;
	mov.u32 %r8, %nctaid.y;
	mad.lo.u32 %r9, %r7, %r6, %r5;
	mul.lo.u32 %r10, %r6, %r8;
	mul.wide.u32 %rd7, %r9, 16;
	mul.wide.u32 %rd8, %r10, 16;
LOOP:
	setp.ge.u64 %p1, %rd7, %rd6;
	@%p1 bra DONE;
	add.u64 %rd9, %rd5, %rd7;
	add.u64 %rd10, %rd4, %rd7;
	ld.global.v4.u32 {%r11, %r12, %r13, %r14}, [%rd9];
	st.global.v4.u32 [%rd10], {%r11, %r12, %r13, %r14};
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
	parts   uint32 // blocks a slice (the grid's rows), up to gatherMaxParts; 0: 1
	ptrs    [3]uintptr
}

// blockThreads is the launch's threads a block.
func (a *gatherArgs) blockThreads() uint32 {
	if a.threads == 0 {
		return gatherThreads
	}
	return a.threads
}

// gridParts is the launch's blocks a slice.
func (a *gatherArgs) gridParts() uint32 {
	return max(a.parts, 1)
}

// gatherWords is how many 16-byte words a thread of a launch moves at
// most, and gatherMaxParts the most blocks a slice: the grid's y
// dimension, whose limit is 65,535.
const (
	gatherWords    = 2
	gatherMaxParts = gatherMax / (gatherAlign * 32)
)

// partsFor returns how many blocks of threads threads each a launch
// gives a slice when its longest slice is n bytes: enough that no thread
// moves more than gatherWords words.
func partsFor(n uint64, threads uint32) uint32 {
	per := uint64(threads) * gatherAlign * gatherWords
	return uint32(min(max((n+per-1)/per, 1), gatherMaxParts))
}

// gatherable reports whether a device-to-device copy may go to the kernel.
func gatherable(dst, src uintptr, n uint64) bool {
	return n <= gatherMax && (uint64(dst)|uint64(src)|n)%gatherAlign == 0
}
