package uring

import (
	"errors"
	"fmt"
	"math"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Ring is one io_uring instance: a submission queue (SQ), a completion queue
// (CQ) and the SQE array, all shared with the kernel through mmap.
//
// A Ring is not safe for concurrent use: one goroutine at a time submits,
// reaps and closes it (see the package documentation). The zero value is not
// usable; call [New].
//
// The shared memory, as mapped by [New] (one mapping for both rings when the
// kernel offers IORING_FEAT_SINGLE_MMAP):
//
//	SQ ring                                   SQE array (own mapping)
//	+------+------+------+-------+---------+  +-------+-------+-----+
//	| head | tail | mask | flags | array[] |  | sqe 0 | sqe 1 | ... |  64 B each
//	+------+------+------+-------+---------+  +-------+-------+-----+
//	 kernel  us                    us, once     us, between SQE() and Submit
//
//	CQ ring
//	+------+------+------+----------+--------+--------+-----+
//	| head | tail | mask | overflow | cqe 0  | cqe 1  | ... |  16 B each
//	+------+------+------+----------+--------+--------+-----+
//	 us      kernel                   kernel, below tail; ours until head passes
//
// array[] maps SQ ring positions to SQE indices; New fills it with the
// identity once, so the SQE at position p is sqes[p&mask].
type Ring struct {
	// fd is the ring's file descriptor, -1 once closed. Every method that
	// would touch the mappings checks it first.
	fd int

	// Submission queue.

	// sqHead is written by the kernel when it has consumed (copied) SQEs:
	// slots below it may be refilled. Loaded only when the SQ looks full
	// and once per enter.
	sqHead *atomic.Uint32
	// sqTail is written by us, once per Submit: the store publishes the
	// plain writes of every SQE below it.
	sqTail *atomic.Uint32
	// sqMask and sqEntries are constant after New.
	sqMask, sqEntries uint32
	// sqes is the SQE array. An SQE is written by us with plain stores
	// between SQE() and the sqTail store that publishes it.
	sqes []sqe
	// handles holds the Go-side [SQE] of each SQE index; its raw pointer
	// is nil except between SQE() and Submit.
	handles []SQE
	// sqLocalHead is the last value loaded from sqHead.
	sqLocalHead uint32
	// sqLocalTail counts SQEs handed out by SQE(); sqPublished the value
	// last stored to sqTail. Unpublished SQEs are sqPublished..sqLocalTail.
	sqLocalTail, sqPublished uint32

	// Completion queue.

	// cqHead is written by us: CQEs below it are consumed and the kernel
	// may reuse their slots. CQEAdvance moves cqLocalHead only; the store
	// happens before every io_uring_enter (see publishHead for why that is
	// soon enough).
	cqHead *atomic.Uint32
	// cqTail is written by the kernel after it fills CQEs: the store
	// publishes every CQE below it. Loaded once per PeekCQE that finds no
	// CQE below the last value loaded (cqLocalTail).
	cqTail *atomic.Uint32
	// cqMask is constant after New.
	cqMask uint32
	// cqes is the CQE array, written by the kernel only.
	cqes []cqe
	// cqLocalHead counts CQEs reaped; cqLocalTail is the last value loaded
	// from cqTail.
	cqLocalHead, cqLocalTail uint32

	// Operation slots. Every SQE handed out holds one slot until its CQE is
	// reaped: the CQE's user_data is the slot index, never a pointer, and
	// the slot holds the caller's user data and the Go memory the kernel
	// may still read or write, so the garbage collector keeps it alive.
	// There are as many slots as CQ entries, so the CQ never overflows.
	ops []op
	// free is a stack of free slot indices.
	free []uint32

	// The mappings; cqRing is sqRing under IORING_FEAT_SINGLE_MMAP.
	sqRing, cqRing, sqeMem []byte

	// features is the IORING_FEAT_* mask from io_uring_setup.
	features uint32
	// eintr counts io_uring_enter calls retried after EINTR, for tests.
	eintr int
}

// op is an operation slot; see Ring.ops.
type op struct {
	user uint64       // the caller's user data, returned by PeekCQE
	iov  []unix.Iovec // the iovec array of a readv/writev, kept alive; it in turn keeps its buffers alive
	buf  []byte       // the buffer of a send/recv, kept alive
	busy bool         // held by an SQE handed out and not yet reaped
}

// SQE is a submission queue entry handed out by [Ring.SQE], to be filled by
// one of the Prep functions before the next [Ring.Submit]. It is opaque: the
// kernel layout stays inside this package.
//
// An *SQE is valid from [Ring.SQE] until the next Submit, SubmitAndWait,
// WaitCQE or Close of its ring; a Prep call after that panics. An SQE that is
// handed out and never prepared is submitted as a NOP with user data 0. Like
// its Ring, an SQE is not safe for concurrent use.
type SQE struct {
	raw *sqe // the SQE in the shared array; nil once published
	op  *op  // its operation slot
}

// cancelUserData marks the CQE of the cancellation that Close submits; it is
// no slot index.
const cancelUserData = math.MaxUint64

// New creates a ring with room for entries submissions (rounded up to a power
// of two by the kernel; 1 to 32768) and twice as many completions.
//
// When the kernel or the process cannot use io_uring, the error wraps
// [ErrUnsupported] and says why; callers fall back to plain syscalls.
func New(entries uint32) (*Ring, error) {
	if entries == 0 || entries > maxEntries {
		return nil, fmt.Errorf("uring: setup: %d entries, want 1..%d: %w", entries, maxEntries, unix.EINVAL)
	}
	var p params
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, setupError(errno)
	}
	r := &Ring{fd: int(fd), features: p.features}
	if err := r.mapRings(&p); err != nil {
		r.unmap()
		unix.Close(r.fd)
		return nil, err
	}
	if err := probeOps(r.fd); err != nil {
		r.unmap()
		unix.Close(r.fd)
		return nil, err
	}
	usage.rings.Add(1)
	return r, nil
}

// mapRings maps the rings and the SQE array and points the Ring at them.
func (r *Ring) mapRings(p *params) error {
	const prot, flags = unix.PROT_READ | unix.PROT_WRITE, unix.MAP_SHARED | unix.MAP_POPULATE
	sqSize := int(p.sqOff.array) + int(p.sqEntries)*4
	cqSize := int(p.cqOff.cqes) + int(p.cqEntries)*cqeSize
	single := p.features&featSingleMmap != 0
	if single {
		sqSize = max(sqSize, cqSize)
	}
	var err error
	if r.sqRing, err = unix.Mmap(r.fd, offSQRing, sqSize, prot, flags); err != nil {
		return fmt.Errorf("uring: mmap SQ ring: %w", err)
	}
	if single {
		r.cqRing = r.sqRing
	} else if r.cqRing, err = unix.Mmap(r.fd, offCQRing, cqSize, prot, flags); err != nil {
		return fmt.Errorf("uring: mmap CQ ring: %w", err)
	}
	if r.sqeMem, err = unix.Mmap(r.fd, offSQEs, int(p.sqEntries)*sqeSize, prot, flags); err != nil {
		return fmt.Errorf("uring: mmap SQEs: %w", err)
	}
	// The kernel aligns these offsets (struct io_rings); check rather than
	// trust, since a misaligned atomic would fault or tear.
	for _, off := range []uint32{p.sqOff.head, p.sqOff.tail, p.sqOff.ringMask, p.sqOff.array,
		p.cqOff.head, p.cqOff.tail, p.cqOff.ringMask} {
		if off%4 != 0 {
			return fmt.Errorf("uring: ring offset %d misaligned", off)
		}
	}
	if p.cqOff.cqes%8 != 0 {
		return fmt.Errorf("uring: CQE offset %d misaligned", p.cqOff.cqes)
	}

	// Each conversion below points into a live MAP_SHARED mapping at an
	// offset the kernel gave and that was checked for alignment; the
	// mapping is outside the Go heap, so the pointers are never moved or
	// scanned, and Close drops them before unmapping.
	r.sqHead = (*atomic.Uint32)(unsafe.Pointer(&r.sqRing[p.sqOff.head]))
	r.sqTail = (*atomic.Uint32)(unsafe.Pointer(&r.sqRing[p.sqOff.tail]))
	r.sqMask = *(*uint32)(unsafe.Pointer(&r.sqRing[p.sqOff.ringMask]))
	r.sqEntries = p.sqEntries
	array := unsafe.Slice((*uint32)(unsafe.Pointer(&r.sqRing[p.sqOff.array])), p.sqEntries)
	for i := range array {
		array[i] = uint32(i) // published to the kernel by the first sqTail store
	}
	r.sqes = unsafe.Slice((*sqe)(unsafe.Pointer(&r.sqeMem[0])), p.sqEntries)
	r.handles = make([]SQE, p.sqEntries)

	r.cqHead = (*atomic.Uint32)(unsafe.Pointer(&r.cqRing[p.cqOff.head]))
	r.cqTail = (*atomic.Uint32)(unsafe.Pointer(&r.cqRing[p.cqOff.tail]))
	r.cqMask = *(*uint32)(unsafe.Pointer(&r.cqRing[p.cqOff.ringMask]))
	r.cqes = unsafe.Slice((*cqe)(unsafe.Pointer(&r.cqRing[p.cqOff.cqes])), p.cqEntries)

	// Both indices start at 0 on a new ring, but read them anyway.
	r.sqLocalHead = r.sqHead.Load()
	r.sqLocalTail = r.sqTail.Load()
	r.sqPublished = r.sqLocalTail
	r.cqLocalHead = r.cqHead.Load()
	r.cqLocalTail = r.cqTail.Load()

	r.ops = make([]op, p.cqEntries)
	r.free = make([]uint32, p.cqEntries)
	for i := range r.free {
		r.free[i] = p.cqEntries - 1 - uint32(i) // slot 0 on top
	}
	return nil
}

// unmap releases whatever mapRings mapped.
func (r *Ring) unmap() {
	if r.sqeMem != nil {
		unix.Munmap(r.sqeMem)
	}
	if r.cqRing != nil && unsafe.SliceData(r.cqRing) != unsafe.SliceData(r.sqRing) {
		unix.Munmap(r.cqRing)
	}
	if r.sqRing != nil {
		unix.Munmap(r.sqRing)
	}
	r.sqRing, r.cqRing, r.sqeMem = nil, nil, nil
	r.sqHead, r.sqTail, r.cqHead, r.cqTail = nil, nil, nil, nil
	r.sqes, r.cqes, r.handles = nil, nil, nil
}

// setupError turns an io_uring_setup errno into an error, wrapping
// ErrUnsupported when the reason is one that no retry fixes.
func setupError(errno unix.Errno) error {
	var reason string
	switch errno {
	case unix.ENOSYS:
		reason = "syscall not implemented (kernel without CONFIG_IO_URING, or a seccomp filter answering ENOSYS)"
	case unix.EPERM:
		reason = "not permitted: " + disabledReason()
	case unix.EACCES:
		reason = "access denied (an LSM such as SELinux refuses io_uring)"
	case unix.EINVAL:
		reason = "parameters refused (kernel older than 5.1, or io_uring restricted)"
	default:
		return fmt.Errorf("uring: io_uring_setup: %w", errno)
	}
	return fmt.Errorf("uring: io_uring_setup: %s: %w (%w)", reason, ErrUnsupported, errno)
}

// disabledReason says why io_uring_setup answered EPERM, as far as the
// sysctl tells.
func disabledReason() string {
	b, err := os.ReadFile("/proc/sys/kernel/io_uring_disabled")
	switch v := strings.TrimSpace(string(b)); {
	case err != nil:
		return "seccomp profile (a container runtime's default denies io_uring) or kernel.io_uring_disabled"
	case v == "2":
		return "kernel.io_uring_disabled=2 disables io_uring for every process"
	case v == "1":
		return "kernel.io_uring_disabled=1 allows io_uring only to CAP_SYS_ADMIN and kernel.io_uring_group"
	default:
		return "kernel.io_uring_disabled=" + v + ", so a seccomp profile (a container runtime's default denies io_uring)"
	}
}

// probeOps checks with IORING_REGISTER_PROBE (5.6) that the kernel knows
// every opcode this package submits.
func probeOps(fd int) error {
	var pr probe
	_, _, errno := unix.Syscall6(unix.SYS_IO_URING_REGISTER, uintptr(fd), registerProbe,
		uintptr(unsafe.Pointer(&pr)), uintptr(len(pr.ops)), 0, 0)
	switch errno {
	case 0:
	case unix.EINVAL:
		return fmt.Errorf("uring: register probe: kernel older than 5.6: %w (%w)", ErrUnsupported, errno)
	case unix.EPERM, unix.EACCES, unix.ENOSYS:
		return fmt.Errorf("uring: register probe: refused (seccomp or LSM): %w (%w)", ErrUnsupported, errno)
	default:
		return fmt.Errorf("uring: register probe: %w", errno)
	}
	for _, o := range [...]struct {
		op   uint8
		name string
	}{{opNop, "NOP"}, {opReadv, "READV"}, {opWritev, "WRITEV"}, {opAsyncCancel, "ASYNC_CANCEL"}, {opSend, "SEND"}, {opRecv, "RECV"}} {
		if int(o.op) >= int(pr.opsLen) || pr.ops[o.op].flags&opSupported == 0 {
			return fmt.Errorf("uring: kernel lacks IORING_OP_%s: %w", o.name, ErrUnsupported)
		}
	}
	return nil
}

// available caches the first probe.
var available = sync.OnceValue(func() error {
	r, err := New(1)
	if err != nil {
		return err
	}
	return r.Close()
})

// Available reports whether io_uring works here: nil, or the error of a
// probe [New], which wraps [ErrUnsupported] when a fallback is in order. The
// probe runs once per process; later calls return the cached answer. It is
// safe for concurrent use.
func Available() error { return available() }

// SQE hands out the next submission queue entry, or nil when there is none:
// the SQ is full (call Submit) or as many operations are in flight as the CQ
// holds (reap completions). Fill the entry with a Prep function; it goes to
// the kernel with the next Submit, SubmitAndWait or WaitCQE.
func (r *Ring) SQE() *SQE {
	if len(r.free) == 0 {
		return nil // also after Close, which empties free
	}
	if r.sqLocalTail-r.sqLocalHead == r.sqEntries {
		r.sqLocalHead = r.sqHead.Load()
		if r.sqLocalTail-r.sqLocalHead == r.sqEntries {
			return nil
		}
	}
	id := r.free[len(r.free)-1]
	r.free = r.free[:len(r.free)-1]
	o := &r.ops[id]
	*o = op{busy: true}
	i := r.sqLocalTail & r.sqMask
	s := &r.sqes[i]
	*s = sqe{opcode: opNop, userData: uint64(id)}
	r.sqLocalTail++
	h := &r.handles[i]
	h.raw, h.op = s, o
	return h
}

// prep resets an SQE for a new operation, keeping its slot, and records the
// caller's user data.
func (s *SQE) prep(userData uint64) *sqe {
	if s == nil || s.raw == nil {
		panic("uring: Prep on a nil SQE or one already submitted")
	}
	*s.op = op{user: userData, busy: true}
	*s.raw = sqe{userData: s.raw.userData}
	return s.raw
}

// PrepNop makes sqe a NOP, which completes with res 0.
func PrepNop(sqe *SQE, userData uint64) {
	sqe.prep(userData).opcode = opNop
}

// PrepWritev makes sqe a writev(2) of iovecs to fd at offset (-1: the
// current file position; sockets and pipes ignore it). The CQE's res is the
// byte count or -errno.
//
// The ring keeps iovecs, and through it the buffers it points to, referenced
// until the CQE is reaped. The caller must not modify iovecs or the buffers
// before then, and must pin them (see Lifetimes in the package
// documentation).
func PrepWritev(sqe *SQE, fd int, iovecs []unix.Iovec, offset int64, userData uint64) {
	prepRW(sqe, opWritev, fd, iovecs, offset, userData)
}

// PrepReadv makes sqe a readv(2) from fd into iovecs at offset (-1: the
// current file position). The CQE's res is the byte count, 0 at end of file,
// or -errno. The rules of [PrepWritev] apply; the buffers are written until
// the CQE.
func PrepReadv(sqe *SQE, fd int, iovecs []unix.Iovec, offset int64, userData uint64) {
	prepRW(sqe, opReadv, fd, iovecs, offset, userData)
}

func prepRW(s *SQE, opcode uint8, fd int, iovecs []unix.Iovec, offset int64, userData uint64) {
	raw := s.prep(userData)
	raw.opcode = opcode
	raw.fd = int32(fd)
	raw.off = uint64(offset)
	// The address of the iovec array goes to the kernel as a number; the
	// slot's reference below keeps the array (and its buffers) alive, and
	// as that reference lives on the heap, escape analysis never leaves the
	// array on a goroutine stack.
	raw.addr = uint64(uintptr(unsafe.Pointer(unsafe.SliceData(iovecs))))
	raw.len = uint32(len(iovecs))
	s.op.iov = iovecs
}

// PrepSend makes sqe a send(2) of buf on socket fd with MSG_* flags. The CQE's
// res is the byte count or -errno. The ring keeps buf referenced until the
// CQE is reaped; the caller must not modify it before then and must pin it.
func PrepSend(sqe *SQE, fd int, buf []byte, flags int, userData uint64) {
	prepBuf(sqe, opSend, fd, buf, flags, userData)
}

// PrepRecv makes sqe a recv(2) into buf from socket fd with MSG_* flags. The
// CQE's res is the byte count, 0 at end of stream, or -errno. The rules of
// [PrepSend] apply; buf is written until the CQE.
func PrepRecv(sqe *SQE, fd int, buf []byte, flags int, userData uint64) {
	prepBuf(sqe, opRecv, fd, buf, flags, userData)
}

func prepBuf(s *SQE, opcode uint8, fd int, buf []byte, flags int, userData uint64) {
	raw := s.prep(userData)
	raw.opcode = opcode
	raw.fd = int32(fd)
	// As in prepRW: the slot's reference keeps buf alive and off the stack.
	raw.addr = uint64(uintptr(unsafe.Pointer(unsafe.SliceData(buf))))
	// The kernel caps a single transfer at MAX_RW_COUNT anyway.
	raw.len = uint32(min(uint(len(buf)), math.MaxUint32))
	raw.opFlags = uint32(flags)
	s.op.buf = buf
}

// publish hands every prepared SQE to the kernel with one sqTail store and
// retires their handles.
func (r *Ring) publish() {
	for i := r.sqPublished; i != r.sqLocalTail; i++ {
		r.handles[i&r.sqMask].raw = nil
	}
	if r.sqPublished != r.sqLocalTail {
		// This store publishes the plain writes of the SQEs below it (and
		// of array[], written once in New).
		r.sqTail.Store(r.sqLocalTail)
		r.sqPublished = r.sqLocalTail
	}
}

// publishHead stores the local CQ head for the kernel. Deferring the store
// from CQEAdvance to here is safe: the kernel reads the head only to find
// room for CQEs and in a GETEVENTS wait, and operations reach the kernel
// only through io_uring_enter (no SQPOLL), right after this store; since at
// most len(ops) operations are in flight, the CQEs posted before the next
// enter always fit behind the head stored now.
func (r *Ring) publishHead() {
	r.cqHead.Store(r.cqLocalHead)
}

// enter calls io_uring_enter once, after publishing the CQ head.
func (r *Ring) enter(toSubmit, minComplete, flags uint32) (int, unix.Errno) {
	r.publishHead()
	n, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(toSubmit),
		uintptr(minComplete), uintptr(flags), 0, 0)
	return int(n), errno
}

// cqReady returns the number of CQEs waiting, after loading the kernel's
// tail.
func (r *Ring) cqReady() uint32 {
	r.cqLocalTail = r.cqTail.Load()
	return r.cqLocalTail - r.cqLocalHead
}

// inFlight returns the number of operations submitted and not yet reaped
// (their CQEs may be waiting).
func (r *Ring) inFlight() uint32 {
	return uint32(len(r.ops)-len(r.free)) - (r.sqLocalTail - r.sqPublished)
}

// Submit hands every SQE prepared since the last submission to the kernel
// with one io_uring_enter and returns how many the kernel consumed. Fewer
// than were prepared means the kernel stopped early; the rest stay queued
// and go with the next Submit. Submit does not wait for completions.
//
// Errors from the kernel wrap their errno: EAGAIN and EBUSY (out of
// resources, completions pending) ask to reap and retry.
func (r *Ring) Submit() (int, error) { return r.submit(0) }

// SubmitAndWait is [Ring.Submit] followed, in the same io_uring_enter, by a
// wait until at least n CQEs are ready to reap (counting those already
// waiting). It returns [ErrNothingInFlight] without submitting when n exceeds
// the operations in flight after the submission. When the kernel consumed
// fewer SQEs than prepared it returns at once, without waiting.
func (r *Ring) SubmitAndWait(n uint32) (int, error) { return r.submit(n) }

func (r *Ring) submit(wait uint32) (int, error) {
	if r.fd < 0 {
		return 0, ErrClosed
	}
	if wait > uint32(len(r.ops)-len(r.free)) {
		return 0, fmt.Errorf("uring: submit and wait for %d: %w", wait, ErrNothingInFlight)
	}
	r.publish()
	submitted := 0
	for {
		toSubmit := r.sqPublished - r.sqHead.Load()
		var minComplete, flags uint32
		if wait > 0 && r.cqReady() < wait {
			minComplete, flags = wait, enterGetEvents
		} else if toSubmit == 0 {
			return submitted, nil
		}
		n, errno := r.enter(toSubmit, minComplete, flags)
		switch errno {
		case 0:
		case unix.EINTR:
			// Nothing was consumed (the kernel reports a count instead
			// when it was); toSubmit is recomputed from the head anyway.
			r.eintr++
			continue
		default:
			return submitted, fmt.Errorf("uring: io_uring_enter: %w", errno)
		}
		submitted += n
		if n > 0 {
			usage.submitted.Add(uint64(n))
		}
		if uint32(n) < toSubmit {
			return submitted, nil
		}
		// A signal may have cut the wait short after the submission; the
		// kernel then reports the count, so the loop checks and waits
		// again.
	}
}

// PeekCQE returns the oldest completion without consuming it: the user data
// given to its Prep function and the result (see each Prep function; a
// negative res is -errno, see [ResultError]). ok is false when no completion
// is waiting, or after Close. Repeated calls return the same completion
// until [Ring.CQEAdvance].
func (r *Ring) PeekCQE() (userData uint64, res int32, ok bool) {
	if r.cqLocalHead == r.cqLocalTail {
		if r.fd < 0 {
			return 0, 0, false
		}
		// This load makes the kernel's plain writes of the CQEs below
		// the new tail visible.
		r.cqLocalTail = r.cqTail.Load()
		if r.cqLocalHead == r.cqLocalTail {
			return 0, 0, false
		}
	}
	c := &r.cqes[r.cqLocalHead&r.cqMask]
	return r.ops[c.userData].user, c.res, true
}

// CQEAdvance consumes the n oldest completions, which must be waiting
// (PeekCQE saw them); it panics when fewer are. Their operation slots, and
// the memory those kept alive, are released; the kernel learns of the new
// head at the next enter.
func (r *Ring) CQEAdvance(n uint32) {
	if n == 0 || r.fd < 0 {
		return
	}
	if r.cqLocalTail-r.cqLocalHead < n && r.cqReady() < n {
		panic("uring: CQEAdvance past the last completion")
	}
	for i := range n {
		r.release(r.cqes[(r.cqLocalHead+i)&r.cqMask].userData)
	}
	r.cqLocalHead += n
}

// release frees an operation slot and drops its references.
func (r *Ring) release(id uint64) {
	o := &r.ops[id]
	if !o.busy {
		panic("uring: completion for an operation slot not in flight")
	}
	*o = op{}
	r.free = append(r.free, uint32(id)) // within capacity: one push per pop
}

// WaitCQE returns the oldest completion like [Ring.PeekCQE], first waiting in
// io_uring_enter for one to arrive when none is waiting; the caller consumes
// it with CQEAdvance(1). SQEs already passed to Submit but not yet consumed by
// the kernel are submitted in the same call; prepared SQEs not yet passed to
// Submit are not. It returns [ErrNothingInFlight] when no operation could
// complete, and [ErrClosed] after Close.
func (r *Ring) WaitCQE() (userData uint64, res int32, err error) {
	for {
		if ud, res, ok := r.PeekCQE(); ok {
			return ud, res, nil
		}
		if r.fd < 0 {
			return 0, 0, ErrClosed
		}
		if r.inFlight() == 0 {
			return 0, 0, fmt.Errorf("uring: wait: %w", ErrNothingInFlight)
		}
		toSubmit := r.sqPublished - r.sqHead.Load()
		switch _, errno := r.enter(toSubmit, 1, enterGetEvents); errno {
		case 0:
		case unix.EINTR:
			r.eintr++
		default:
			return 0, 0, fmt.Errorf("uring: io_uring_enter: %w", errno)
		}
	}
}

// ResultError maps a CQE result to an error: nil for res >= 0, else the
// [unix.Errno] -res. It does not allocate.
func ResultError(res int32) error {
	if res >= 0 {
		return nil
	}
	return unix.Errno(-res)
}

// abandoned keeps the operation slots of rings closed while the kernel could
// still touch their memory, for the life of the process.
var abandoned struct {
	sync.Mutex
	ops [][]op
}

// Close cancels the operations in flight (IORING_OP_ASYNC_CANCEL, 5.19+),
// waits for their completions and discards them, then unmaps the rings and
// closes the ring's fd. SQEs handed out but not submitted are dropped. On a
// kernel that cannot cancel, or when waiting fails, the memory of the
// operations still in flight stays referenced until the process exits,
// since the kernel finishes them asynchronously. Close is idempotent: later
// calls return nil.
func (r *Ring) Close() error {
	if r.fd < 0 {
		return nil
	}
	var errs []error
	if err := r.drain(); err != nil {
		errs = append(errs, err)
		abandoned.Lock()
		abandoned.ops = append(abandoned.ops, r.ops)
		abandoned.Unlock()
	}
	r.unmap()
	if err := unix.Close(r.fd); err != nil {
		errs = append(errs, fmt.Errorf("uring: close: %w", err))
	}
	r.fd = -1
	r.ops, r.free = nil, nil
	r.sqLocalHead, r.sqLocalTail, r.sqPublished = 0, 0, 0
	r.cqLocalHead, r.cqLocalTail = 0, 0
	return errors.Join(errs...)
}

// drain drops unsubmitted SQEs, cancels everything in flight and reaps until
// no operation slot is busy.
func (r *Ring) drain() error {
	for i := r.sqPublished; i != r.sqLocalTail; i++ {
		r.release(r.sqes[i&r.sqMask].userData)
		r.handles[i&r.sqMask].raw = nil
	}
	r.sqLocalTail = r.sqPublished
	if r.inFlight() == 0 {
		return nil
	}
	// Room for the cancellation: the SQ may be full of published SQEs the
	// kernel has not consumed.
	for r.sqLocalTail-r.sqHead.Load() == r.sqEntries {
		n, errno := r.enter(r.sqPublished-r.sqHead.Load(), 0, 0)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return fmt.Errorf("uring: close: submit: %w", errno)
		}
		if n == 0 {
			return errors.New("uring: close: submit: the kernel consumed no SQE")
		}
	}
	r.sqes[r.sqLocalTail&r.sqMask] = sqe{opcode: opAsyncCancel, fd: -1, opFlags: asyncCancelAny, userData: cancelUserData}
	r.sqLocalTail++
	r.sqTail.Store(r.sqLocalTail) // publishes the cancellation SQE
	r.sqPublished = r.sqLocalTail
	cancelPending := true
	for {
		for r.cqReady() > 0 {
			c := r.cqes[r.cqLocalHead&r.cqMask]
			r.cqLocalHead++
			if c.userData == cancelUserData {
				cancelPending = false
				if c.res == -int32(unix.EINVAL) {
					return fmt.Errorf("uring: close: cancel: kernel older than 5.19: %w", unix.EINVAL)
				}
				continue
			}
			r.release(c.userData)
		}
		if r.inFlight() == 0 && !cancelPending {
			return nil
		}
		toSubmit := r.sqPublished - r.sqHead.Load()
		if _, errno := r.enter(toSubmit, 1, enterGetEvents); errno != 0 && errno != unix.EINTR {
			return fmt.Errorf("uring: close: wait: %w", errno)
		}
	}
}
