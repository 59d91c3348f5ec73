package uring

import "unsafe"

// The kernel ABI of io_uring, field by field from include/uapi/linux/io_uring.h.
// Nothing here is exported: callers see [Ring], [SQE] and the Prep functions,
// never the shared layout.

// Setup flags, features and enter flags that this binding reads or passes.
const (
	featSingleMmap = 1 << 0 // IORING_FEAT_SINGLE_MMAP: SQ and CQ rings share one mapping (5.4)

	enterGetEvents = 1 << 0 // IORING_ENTER_GETEVENTS

	offSQRing = 0          // IORING_OFF_SQ_RING
	offCQRing = 0x8000000  // IORING_OFF_CQ_RING
	offSQEs   = 0x10000000 // IORING_OFF_SQES

	maxEntries = 32768 // IORING_MAX_ENTRIES

	registerProbe = 8      // IORING_REGISTER_PROBE (5.6)
	opSupported   = 1 << 0 // IO_URING_OP_SUPPORTED

	asyncCancelAny = 1 << 2 // IORING_ASYNC_CANCEL_ANY (5.19)
)

// Opcodes (enum io_uring_op).
const (
	opNop         = 0
	opReadv       = 1
	opWritev      = 2
	opAsyncCancel = 14
	opSend        = 26
	opRecv        = 27
)

// sqringOffsets is struct io_sqring_offsets: byte offsets of the SQ ring's
// fields inside its mapping, filled by io_uring_setup.
type sqringOffsets struct {
	head        uint32
	tail        uint32
	ringMask    uint32
	ringEntries uint32
	flags       uint32
	dropped     uint32
	array       uint32
	resv1       uint32
	userAddr    uint64 // IORING_SETUP_NO_MMAP only; unused here
}

// cqringOffsets is struct io_cqring_offsets.
type cqringOffsets struct {
	head        uint32
	tail        uint32
	ringMask    uint32
	ringEntries uint32
	overflow    uint32
	cqes        uint32
	flags       uint32
	resv1       uint32
	userAddr    uint64 // IORING_SETUP_NO_MMAP only; unused here
}

// params is struct io_uring_params, passed to io_uring_setup and filled by it.
type params struct {
	sqEntries    uint32
	cqEntries    uint32
	flags        uint32
	sqThreadCPU  uint32
	sqThreadIdle uint32
	features     uint32
	wqFD         uint32
	resv         [3]uint32
	sqOff        sqringOffsets
	cqOff        cqringOffsets
}

// sqe is struct io_uring_sqe (64 bytes, without IORING_SETUP_SQE128). The
// unions are named after the member this binding uses.
type sqe struct {
	opcode      uint8
	flags       uint8  // IOSQE_*
	ioprio      uint16 //
	fd          int32  //
	off         uint64 // off / addr2
	addr        uint64 // buffer or iovec array: an address the kernel dereferences, see Ring.ops
	len         uint32 // bytes or number of iovecs
	opFlags     uint32 // rw_flags / msg_flags / cancel_flags / ...
	userData    uint64 // the op slot index, never a pointer; see Ring.ops
	bufIndex    uint16
	personality uint16
	spliceFDIn  int32
	addr3       uint64
	_           uint64 // __pad2
}

// cqe is struct io_uring_cqe (16 bytes, without IORING_SETUP_CQE32).
type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

// probeOp is struct io_uring_probe_op; probe is struct io_uring_probe with
// room for every opcode a byte can name.
type probeOp struct {
	op    uint8
	resv  uint8
	flags uint16
	resv2 uint32
}

type probe struct {
	lastOp uint8
	opsLen uint8
	resv   uint16
	resv2  [3]uint32
	ops    [256]probeOp
}

// Sizes of the shared structs; a mismatch is a compile error below.
const (
	sqringOffsetsSize = 40
	cqringOffsetsSize = 40
	paramsSize        = 120
	sqeSize           = 64
	cqeSize           = 16
	probeOpSize       = 8
	probeHeaderSize   = 16
)

var (
	_ [sqringOffsetsSize - unsafe.Sizeof(sqringOffsets{})]byte
	_ [unsafe.Sizeof(sqringOffsets{}) - sqringOffsetsSize]byte
	_ [cqringOffsetsSize - unsafe.Sizeof(cqringOffsets{})]byte
	_ [unsafe.Sizeof(cqringOffsets{}) - cqringOffsetsSize]byte
	_ [paramsSize - unsafe.Sizeof(params{})]byte
	_ [unsafe.Sizeof(params{}) - paramsSize]byte
	_ [sqeSize - unsafe.Sizeof(sqe{})]byte
	_ [unsafe.Sizeof(sqe{}) - sqeSize]byte
	_ [cqeSize - unsafe.Sizeof(cqe{})]byte
	_ [unsafe.Sizeof(cqe{}) - cqeSize]byte
	_ [probeOpSize - unsafe.Sizeof(probeOp{})]byte
	_ [unsafe.Sizeof(probeOp{}) - probeOpSize]byte
	_ [probeHeaderSize + 256*probeOpSize - unsafe.Sizeof(probe{})]byte
	_ [unsafe.Sizeof(probe{}) - probeHeaderSize - 256*probeOpSize]byte
)

// Field offsets the kernel relies on, asserted the same way: a wrong type
// upstream of them shifts every later field.
var (
	_ [32 - unsafe.Offsetof(sqe{}.userData)]byte
	_ [unsafe.Offsetof(sqe{}.userData) - 32]byte
	_ [40 - unsafe.Offsetof(params{}.sqOff)]byte
	_ [unsafe.Offsetof(params{}.sqOff) - 40]byte
	_ [80 - unsafe.Offsetof(params{}.cqOff)]byte
	_ [unsafe.Offsetof(params{}.cqOff) - 80]byte
)
