//go:build efa && cgo

package efa

/*
#include <rdma/fi_errno.h>
*/
import "C"

import (
	"fmt"
	"syscall"

	"github.com/moonring/moonring/transport"
)

func fiStrerror(rc int) string {
	if rc < 0 {
		rc = -rc
	}
	return C.GoString(C.fi_strerror(C.int(rc)))
}

// fiError is a libfabric error of one operation: its code says what the
// engine may do, through the transport error it wraps.
type fiError struct {
	what string
	code int // positive FI_E*
	prov int // the provider's own number, 0 when none
	kind error
}

func (e *fiError) Error() string {
	if e.prov != 0 {
		return fmt.Sprintf("efa: %s: %s (provider error %d): %v", e.what, fiStrerror(e.code), e.prov, e.kind)
	}
	return fmt.Sprintf("efa: %s: %s: %v", e.what, fiStrerror(e.code), e.kind)
}

func (e *fiError) Unwrap() error { return e.kind }

// kindOf maps a libfabric error code to what the engine must know: the
// peer refused the access or the range (final), or anything else, which
// another try may cure. A canceled operation counts as the latter: the
// provider cancels what was in flight on a connection that broke; when it
// was this side that closed, Poll reports ErrClosed itself.
func kindOf(code int) error {
	switch code {
	case int(syscall.EACCES), int(syscall.EPERM), int(syscall.EKEYREJECTED), C.FI_ENOKEY:
		return transport.ErrDenied
	case int(syscall.EFAULT), int(syscall.ERANGE), int(syscall.EMSGSIZE), C.FI_ETRUNC, C.FI_ETOOSMALL:
		return transport.ErrRange
	}
	return transport.ErrPeer
}

// cqError is the error of a failed completion.
func cqError(code, prov int) error {
	return &fiError{what: "completion", code: code, prov: prov, kind: kindOf(code)}
}

// postError is the error of an operation the provider refused to post.
func postError(rc int) error {
	return &fiError{what: "post", code: -rc, kind: kindOf(-rc)}
}
