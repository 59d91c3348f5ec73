package uring

import (
	"errors"
	"os"
)

// Sentinel errors. Errors from the kernel are wrapped with the call that
// returned them and keep their [golang.org/x/sys/unix.Errno], so
// errors.Is(err, unix.EBUSY) works as well as the sentinels below.
var (
	// ErrUnsupported is errors.ErrUnsupported. [New] and [Available] wrap
	// it, with the reason, when this kernel or this process cannot use
	// io_uring at all: the syscall is missing (ENOSYS), refused by the
	// kernel.io_uring_disabled sysctl, a seccomp profile or an LSM (EPERM,
	// EACCES), or the kernel predates an opcode or call this package
	// needs (EINVAL). A retry does not help; fall back to plain syscalls.
	ErrUnsupported = errors.ErrUnsupported

	// ErrClosed is os.ErrClosed: the [Ring] was closed. A retry does not
	// help.
	ErrClosed = os.ErrClosed

	// ErrNothingInFlight reports a wait for more completions than there
	// are operations submitted and not yet reaped, a wait that could
	// never end. Submit operations first.
	ErrNothingInFlight = errors.New("uring: wait for more completions than operations in flight")
)
