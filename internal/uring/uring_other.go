//go:build !linux

package uring

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// Ring is an io_uring instance; only Linux has them, so elsewhere [New]
// fails and no Ring exists.
type Ring struct{}

// SQE is a submission queue entry; see the Linux documentation.
type SQE struct{}

// New fails outside Linux with an error wrapping [ErrUnsupported].
func New(entries uint32) (*Ring, error) {
	return nil, fmt.Errorf("uring: io_uring is Linux only: %w", ErrUnsupported)
}

// Available fails outside Linux with an error wrapping [ErrUnsupported].
func Available() error { return fmt.Errorf("uring: io_uring is Linux only: %w", ErrUnsupported) }

// SQE returns nil: there is no ring.
func (r *Ring) SQE() *SQE { return nil }

// Submit returns [ErrClosed]: there is no ring.
func (r *Ring) Submit() (int, error) { return 0, ErrClosed }

// SubmitAndWait returns [ErrClosed]: there is no ring.
func (r *Ring) SubmitAndWait(n uint32) (int, error) { return 0, ErrClosed }

// PeekCQE reports no completion.
func (r *Ring) PeekCQE() (userData uint64, res int32, ok bool) { return 0, 0, false }

// CQEAdvance does nothing.
func (r *Ring) CQEAdvance(n uint32) {}

// WaitCQE returns [ErrClosed]: there is no ring.
func (r *Ring) WaitCQE() (userData uint64, res int32, err error) { return 0, 0, ErrClosed }

// Close does nothing.
func (r *Ring) Close() error { return nil }

// ResultError maps a negative CQE result to its errno.
func ResultError(res int32) error {
	if res >= 0 {
		return nil
	}
	return unix.Errno(-res)
}

// PrepNop panics: there is no ring, so there are no SQEs.
func PrepNop(sqe *SQE, userData uint64) { panic("uring: no io_uring outside Linux") }

// PrepWritev panics: there is no ring, so there are no SQEs.
func PrepWritev(sqe *SQE, fd int, iovecs []unix.Iovec, offset int64, userData uint64) {
	panic("uring: no io_uring outside Linux")
}

// PrepReadv panics: there is no ring, so there are no SQEs.
func PrepReadv(sqe *SQE, fd int, iovecs []unix.Iovec, offset int64, userData uint64) {
	panic("uring: no io_uring outside Linux")
}

// PrepSend panics: there is no ring, so there are no SQEs.
func PrepSend(sqe *SQE, fd int, buf []byte, flags int, userData uint64) {
	panic("uring: no io_uring outside Linux")
}

// PrepRecv panics: there is no ring, so there are no SQEs.
func PrepRecv(sqe *SQE, fd int, buf []byte, flags int, userData uint64) {
	panic("uring: no io_uring outside Linux")
}
