// Package uring is a small io_uring binding in pure Go (golang.org/x/sys/unix,
// no cgo): one [Ring] per instance, a submission side ([Ring.SQE], the Prep
// functions, [Ring.Submit], [Ring.SubmitAndWait]) and a completion side
// ([Ring.PeekCQE], [Ring.CQEAdvance], [Ring.WaitCQE]).
//
// A typical round:
//
//	sqe := r.SQE() // nil: submit or reap first
//	uring.PrepWritev(sqe, fd, iovecs, -1, 7)
//	if _, err := r.SubmitAndWait(1); err != nil { ... }
//	ud, res, _ := r.PeekCQE() // ud == 7; res: bytes written or -errno
//	r.CQEAdvance(1)
//
// The kernel ABI (io_uring_params, the ring offsets, the 64-byte SQE and the
// 16-byte CQE) is mirrored in unexported structs whose sizes are asserted at
// compile time; no kernel layout is exported. Only the opcodes the package
// needs are wrapped: NOP, READV, WRITEV, SEND, RECV, and ASYNC_CANCEL inside
// Close. [New] requires Linux 5.6 (IORING_REGISTER_PROBE and SEND/RECV);
// Close cancels operations in flight from 5.19 on.
//
// The ring is created without SQPOLL, SINGLE_ISSUER or DEFER_TASKRUN: a
// goroutine moves between OS threads, and those modes tie a ring to the
// thread that created it or submits to it.
//
// # Concurrency
//
// A Ring is NOT safe for concurrent use. One goroutine at a time submits,
// reaps and closes it; the shared head and tail indices are written with
// plain single-producer, single-consumer rules (see the field comments of
// [Ring]), so two goroutines calling SQE, Submit or PeekCQE at once corrupt
// the ring. Hand a ring between goroutines only with a synchronising
// operation (a channel send, a mutex). [Available] is safe for concurrent
// use.
//
// # Lifetimes
//
// Memory that the kernel reads or writes for an operation (the iovec array of
// PrepWritev and PrepReadv, the buffers its entries point to, the buffer of
// PrepSend and PrepRecv) must stay alive, unmodified (for writes) or unread
// (for reads), and must not move from the Prep call until the operation's CQE
// is reaped with CQEAdvance (or Close returns):
//
//   - The ring keeps the slice it was given referenced in a per-operation
//     slot until CQEAdvance releases it, so the garbage collector cannot
//     free it, and since that reference lives on the heap, escape analysis
//     never leaves the memory on a goroutine stack. An iovec array keeps
//     its buffers alive in turn, as Iovec.Base is a Go pointer.
//   - The caller pins Go memory with [runtime.Pinner] for that span (or
//     uses memory outside the Go heap, such as an mmap'd region, which never
//     moves): today's collector moves no heap object, but the address sits
//     in the shared SQE as a number, and pinning is what the runtime
//     promises to honour.
//
// The user data of an operation is a number of the caller's choosing,
// returned with its completion; it need not be unique. Internally the SQE
// carries the slot index instead, never a Go pointer.
//
// An [SQE] is valid from [Ring.SQE] until the next submission or Close. The
// values PeekCQE returns are copies and stay valid; the CQE itself is
// released by CQEAdvance. Close cancels what is in flight and waits for it;
// see [Ring.Close] for kernels that cannot cancel.
//
// # Errors
//
// [New] and [Available] wrap [ErrUnsupported] (errors.ErrUnsupported) when
// io_uring cannot be used here at all: ENOSYS, EPERM (the
// kernel.io_uring_disabled sysctl, a container's seccomp profile), EACCES,
// EINVAL, or a kernel older than 5.6. The message says which; the errno is
// wrapped too. Callers fall back to plain syscalls; a retry does not help.
// Other setup errors (ENOMEM, EMFILE) may be transient.
//
// Methods of a closed ring return [ErrClosed] (os.ErrClosed), or nil / false
// where they return no error. [ErrNothingInFlight] reports a wait that could
// never end. io_uring_enter errors wrap their errno; EINTR is retried
// inside. A failed operation is not an error of the ring: its CQE carries
// -errno in res, which [ResultError] turns into a [unix.Errno] without
// allocating.
//
// Since a caller that falls back passes the same tests, [Used] counts the
// rings set up and the SQEs the kernel took in this process, for tests that
// must know io_uring did the work.
package uring
