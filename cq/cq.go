// Package cq defines the completion entry and the lock-free completion ring
// that pollers fill and the caller reads without entering the kernel.
//
// # Concurrency
//
// Post may be called from any number of goroutines at once. Peek, PeekBatch,
// Advance, Wait and EventFD belong to one reader at a time.
//
// # Lifetimes
//
// The pointer Peek returns stays valid until the next Advance. The eventfd
// returned by EventFD belongs to the Ring and is closed by Close.
//
// # Overflow
//
// A full ring never drops a completion: Post keeps it on an overflow list,
// Overflowed reports that this happened, and Advance moves held completions
// into the ring, in order, as room appears (io_uring's overflow semantics).
// Posting to the overflow list allocates; the steady state does not.
package cq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/mpsc"
)

// Status says whether a request's bytes moved. Only the last four are
// terminal; Waiting and Pending appear in batch task status.
type Status uint8

const (
	// Waiting: submitted, not yet taken by a poller.
	Waiting Status = iota
	// Pending: taken; slices are in flight.
	Pending
	// Completed: every byte moved.
	Completed
	// Timeout: the deadline passed first.
	Timeout
	// Failed: an error code says why.
	Failed
	// Canceled: canceled before it completed.
	Canceled
)

var statusNames = [...]string{"WAITING", "PENDING", "COMPLETED", "TIMEOUT", "FAILED", "CANCELED"}

// String returns the Mooncake status word.
func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("STATUS(%d)", uint8(s))
}

// Terminal reports whether s is final.
func (s Status) Terminal() bool { return s >= Completed && s <= Canceled }

// Code is the error code of a completion; CodeOK is success.
type Code uint8

// Error codes carried by completions. Each maps to one sentinel error.
const (
	CodeOK Code = iota
	CodeInvalid
	CodeBadBuffer
	CodeLocalRange
	CodeBadSegment
	CodeRemoteRange
	CodeLength
	CodeTimeout
	CodeCanceled
	CodeTransport
	CodeDenied
	CodeClosed
	CodeNoTransport
	CodeQueueFull
	// CodeTransportDown: the request named a transport it must go through
	// (sq.FlagTransportOnly) and the segment has no healthy path through it.
	CodeTransportDown
	codeCount
)

// Sentinel errors that completion codes map to. Retrying the same request
// helps only after ErrTimeout, ErrTransport and (once the cause is fixed)
// ErrNoTransport; the others describe the request itself.
var (
	// ErrInvalid: unknown op, unknown flags or non-zero reserved bytes.
	ErrInvalid = errors.New("moonring: invalid request")
	// ErrBadBuffer: the BufferID names no registered buffer (or one being
	// unregistered).
	ErrBadBuffer = errors.New("moonring: unknown local buffer")
	// ErrLocalRange: the local range lies outside its buffer.
	ErrLocalRange = errors.New("moonring: local range outside buffer")
	// ErrBadSegment: the SegmentID names no open segment.
	ErrBadSegment = errors.New("moonring: unknown segment")
	// ErrRemoteRange: the remote range lies outside every buffer of the
	// segment that the engine may access.
	ErrRemoteRange = errors.New("moonring: remote range outside segment")
	// ErrLength: zero length, or longer than the engine allows.
	ErrLength = errors.New("moonring: bad length")
	// ErrTimeout: the request's deadline passed before it completed.
	ErrTimeout = errors.New("moonring: request timed out")
	// ErrCanceled: the request was canceled.
	ErrCanceled = errors.New("moonring: request canceled")
	// ErrTransport: the transport failed the request after all retries.
	ErrTransport = errors.New("moonring: transport failed")
	// ErrDenied: the peer refused access (wrong key, range not granted).
	ErrDenied = errors.New("moonring: access denied by peer")
	// ErrClosed: the ring or engine closed before the request completed.
	ErrClosed = os.ErrClosed
	// ErrNoTransport: no installed transport reaches the segment.
	ErrNoTransport = errors.New("moonring: no transport for segment")
	// ErrQueueFull: the submission queue stayed full; the request was not
	// submitted. Reap completions, then retry.
	ErrQueueFull = errors.New("moonring: submission queue full")
	// ErrTransportDown: the request must go through one transport
	// (sq.FlagTransportOnly, TransferRequest.Transport with
	// TransportOnly), and the segment's path through it is down or was
	// never opened. Retry once that path is back, or without the hint.
	ErrTransportDown = errors.New("moonring: required transport down or not open for segment")
)

var codeErrs = [codeCount]error{
	CodeOK: nil, CodeInvalid: ErrInvalid, CodeBadBuffer: ErrBadBuffer,
	CodeLocalRange: ErrLocalRange, CodeBadSegment: ErrBadSegment,
	CodeRemoteRange: ErrRemoteRange, CodeLength: ErrLength, CodeTimeout: ErrTimeout,
	CodeCanceled: ErrCanceled, CodeTransport: ErrTransport, CodeDenied: ErrDenied,
	CodeClosed: ErrClosed, CodeNoTransport: ErrNoTransport, CodeQueueFull: ErrQueueFull,
	CodeTransportDown: ErrTransportDown,
}

var errUnknownCode = errors.New("moonring: unknown error code")

// Err returns the sentinel for c: nil for CodeOK. It never allocates.
func (c Code) Err() error {
	if int(c) < len(codeErrs) {
		return codeErrs[c]
	}
	return errUnknownCode
}

// CodeOf returns the code of a sentinel error (searched with errors.Is), and
// CodeTransport for any other non-nil error.
func CodeOf(err error) Code {
	if err == nil {
		return CodeOK
	}
	for c := Code(1); c < codeCount; c++ {
		if errors.Is(err, codeErrs[c]) {
			return c
		}
	}
	return CodeTransport
}

// Status returns the terminal status that code c ends a request with.
func (c Code) Status() Status {
	switch c {
	case CodeOK:
		return Completed
	case CodeTimeout:
		return Timeout
	case CodeCanceled:
		return Canceled
	}
	return Failed
}

// Completion is one completion entry: 24 bytes, no pointers.
type Completion struct {
	UserData uint64 // echoed from the submission
	Bytes    uint64 // bytes moved; equals the request's Length on success
	Status   Status
	Code     Code
	_        [6]byte // reserved, zero
}

// CompletionSize is the size of a Completion in bytes.
const CompletionSize = 24

var _ [CompletionSize - unsafe.Sizeof(Completion{})]byte
var _ [unsafe.Sizeof(Completion{}) - CompletionSize]byte

// Err returns the completion's error: nil on success, a sentinel otherwise.
// It never allocates.
func (c *Completion) Err() error { return c.Code.Err() }

// ErrEncoding reports a malformed encoded completion.
var ErrEncoding = errors.New("cq: malformed encoded completion")

// MarshalTo encodes c into b (24 bytes, little endian).
func (c *Completion) MarshalTo(b []byte) error {
	if len(b) != CompletionSize {
		return ErrEncoding
	}
	clear(b)
	binary.LittleEndian.PutUint64(b[0:], c.UserData)
	binary.LittleEndian.PutUint64(b[8:], c.Bytes)
	b[16] = byte(c.Status)
	b[17] = byte(c.Code)
	return nil
}

// UnmarshalFrom decodes b into c; it refuses unknown statuses and codes and
// non-zero reserved bytes.
func (c *Completion) UnmarshalFrom(b []byte) error {
	if len(b) != CompletionSize || b[16] > byte(Canceled) || b[17] >= byte(codeCount) {
		return ErrEncoding
	}
	for _, x := range b[18:] {
		if x != 0 {
			return ErrEncoding
		}
	}
	*c = Completion{
		UserData: binary.LittleEndian.Uint64(b[0:]),
		Bytes:    binary.LittleEndian.Uint64(b[8:]),
		Status:   Status(b[16]),
		Code:     Code(b[17]),
	}
	return nil
}

// Ring is the completion ring. Its zero value is not usable; use New.
type Ring struct {
	q *mpsc.Queue[Completion]

	// overflowing is set while completions wait on the overflow list; Post
	// then appends there too, so order is kept.
	overflowing atomic.Bool
	overflowed  atomic.Uint64 // count of completions that ever overflowed
	mu          sync.Mutex    // guards over
	over        []Completion

	// waiting is set by Wait before it sleeps; a Post that leaves want
	// completions ready then signals wake. (A Post that leaves fewer does
	// not: a Wait for 32 woke once per Post, a round of the poller, and
	// slept again.)
	waiting atomic.Bool
	want    atomic.Int64
	wake    chan struct{}
	// woke is set when a Post woke a waiter; Woke reads and clears it.
	woke   atomic.Bool
	closed atomic.Bool

	// efd is the eventfd, -1 until EventFD is first called. signal says
	// whether a count is pending on it: sigClear, then sigWriting while the
	// one Post that found it clear writes the count, then sigSet. Only the
	// reader clears it, with one read, when the ring is empty. A count is
	// never pending while signal is sigClear. Close moves it to sigClosed,
	// from which nothing writes, once no Post is writing, and only then
	// closes the descriptor.
	efd    atomic.Int32
	signal atomic.Uint32
}

// States of Ring.signal.
const (
	sigClear uint32 = iota
	sigWriting
	sigSet
	sigClosed
)

// New returns a ring of size completions (a power of two).
func New(size int) (*Ring, error) {
	q, err := mpsc.New[Completion](size)
	if err != nil {
		return nil, fmt.Errorf("cq: %w", err)
	}
	r := &Ring{q: q, wake: make(chan struct{}, 1)}
	r.efd.Store(-1)
	return r, nil
}

// Post adds a completion. It never drops one and never blocks on the reader.
// Safe for concurrent use.
func (r *Ring) Post(c *Completion) {
	if r.overflowing.Load() || !r.q.PushOne(c) {
		r.mu.Lock()
		// Between the failed push and the lock the reader may have drained
		// the overflow list and made room: try the ring again.
		if len(r.over) > 0 || !r.q.PushOne(c) {
			r.over = append(r.over, *c)
			r.overflowing.Store(true)
			r.overflowed.Add(1)
			r.flushLocked()
		}
		r.mu.Unlock()
	}
	r.notify()
}

// PostBatch adds completions in order, like Post for each, with one
// reservation when they fit. Safe for concurrent use.
func (r *Ring) PostBatch(cs []Completion) {
	if len(cs) == 0 {
		return
	}
	n := 0
	if !r.overflowing.Load() {
		n = r.q.Push(cs)
	}
	if n < len(cs) {
		r.mu.Lock()
		for _, c := range cs[n:] {
			if len(r.over) > 0 || !r.q.PushOne(&c) {
				r.over = append(r.over, c)
				r.overflowing.Store(true)
				r.overflowed.Add(1)
			}
		}
		if len(r.over) > 0 {
			r.flushLocked()
		}
		r.mu.Unlock()
	}
	r.notify()
}

// Woke reports whether a Post woke a goroutine in Wait since the last
// call, and clears the mark. A producer that keeps its thread busy (a
// poller) yields it after waking one, so that the waiter runs at once
// rather than when another thread steals it. Safe for concurrent use.
func (r *Ring) Woke() bool { return r.woke.Load() && r.woke.Swap(false) }

func (r *Ring) notify() {
	// The count as a producer sees it: committed and not yet released by
	// the reader. Commits land in order, so the Post whose commit makes
	// the count the waiter wants sees all of it.
	if r.waiting.Load() && r.q.Committed()-r.q.Released() >= uint64(r.want.Load()) {
		select {
		case r.wake <- struct{}{}:
			r.woke.Store(true)
		default:
		}
	}
	if fd := r.efd.Load(); fd >= 0 && r.signal.Load() == sigClear && r.signal.CompareAndSwap(sigClear, sigWriting) {
		var one = [8]byte{1}
		unix.Write(int(fd), one[:])
		r.signal.Store(sigSet)
	}
}

// Overflowed returns how many completions found the ring full and waited on
// the overflow list. A growing count means the reader reaps too slowly or
// the ring is too small.
func (r *Ring) Overflowed() uint64 { return r.overflowed.Load() }

// Peek returns the oldest completion without removing it, valid until the
// next Advance, or nil. It enters the kernel only when it finds the ring
// empty and the eventfd still signaled (a Post raced with the Advance that
// emptied the ring), to reset the eventfd.
func (r *Ring) Peek() *Completion {
	pos, n := r.q.Readable(1)
	if n == 0 {
		if r.signal.Load() != sigClear {
			r.reset()
		}
		return nil
	}
	return r.q.Slot(pos)
}

// PeekBatch copies up to len(dst) of the oldest completions into dst without
// removing them and returns how many. Like Peek, it enters the kernel only
// to reset an eventfd left signaled on an empty ring.
func (r *Ring) PeekBatch(dst []Completion) int {
	pos, n := r.q.Readable(len(dst))
	if n == 0 && r.signal.Load() != sigClear {
		r.reset()
	}
	for i := 0; i < n; i++ {
		dst[i] = *r.q.Slot(pos + uint64(i))
	}
	return n
}

// Ready returns how many completions are ready to read.
func (r *Ring) Ready() int {
	_, n := r.q.Readable(r.q.Cap())
	return n
}

// Advance removes n completions that Peek or PeekBatch returned. It enters
// the kernel only to reset the eventfd when the ring becomes empty.
func (r *Ring) Advance(n int) {
	if n <= 0 {
		return
	}
	r.q.Release(n)
	if r.overflowing.Load() {
		r.flush()
	}
	if r.signal.Load() != sigClear {
		r.reset()
	}
}

// reset clears the eventfd's count if the ring is empty. Reader only.
//
// It waits out a Post that is writing its count, and reads the count before
// it clears signal, not after, so that no write lands between its read and
// its store: a Post that finds signal clear writes after the read, and its
// count stays. (Cleared first, a Post could write between the store and the
// read, the read would take its count, and the notify below would find
// signal taken by that Post and write nothing: the eventfd would stay quiet
// while the completion waits, and an epoll loop would sleep on it. Read
// while a Post is still writing, the count would land after the store on a
// ring the reader may already have emptied, and stay there with signal
// clear, so no reset would remove it: an epoll loop would spin.)
//
// A Post whose completion the reader takes before the Post's write still
// leaves a count on an empty ring, with signal set; Peek and PeekBatch call
// reset when they find the ring empty and signal set, so such a count lasts
// only until the reader looks again.
func (r *Ring) reset() {
	if !r.q.Empty() {
		return
	}
	for r.signal.Load() == sigWriting {
		runtime.Gosched() // a Post is between its CompareAndSwap and its Store
	}
	if !r.signal.CompareAndSwap(sigSet, sigWriting) {
		return // clear already, or closed
	}
	var b [8]byte
	unix.Read(int(r.efd.Load()), b[:])
	r.signal.Store(sigClear)
	// A Post that saw signal taken before the store above left no count
	// behind; if its completion is already here, signal again.
	if !r.q.Empty() {
		r.notify()
	}
}

func (r *Ring) flush() {
	r.mu.Lock()
	r.flushLocked()
	r.mu.Unlock()
}

// flushLocked moves overflowed completions into the ring while room lasts;
// r.mu must be held.
//
// Post and PostBatch call it right after they overflow, once overflowing
// is set: the reader may have emptied the ring between their failed push
// and that store, and seen overflowing still false in Advance, so no
// Advance would come to flush, and Peek would find an empty ring with
// completions held back for good. Either the reader's load of overflowing
// follows the store, and its Advance flushes, or its release of room
// precedes the push here, which then succeeds.
func (r *Ring) flushLocked() {
	n := r.q.Push(r.over)
	r.over = r.over[n:] // no shifting: a long overflow drains in linear time
	if len(r.over) == 0 {
		r.over = nil
		r.overflowing.Store(false)
	}
}

// Wait blocks until at least n completions are ready, ctx is done, or the
// ring is closed. It returns ctx's error or ErrClosed in the latter cases.
// It is woken once, by the Post that makes n ready, not by each Post before.
// One waiter at a time.
func (r *Ring) Wait(ctx context.Context, n int) error {
	if n > r.q.Cap() {
		n = r.q.Cap()
	}
	for {
		if r.Ready() >= n {
			return nil
		}
		if r.overflowing.Load() {
			r.flush()
			continue
		}
		if r.closed.Load() {
			return ErrClosed
		}
		r.want.Store(int64(n))
		r.waiting.Store(true)
		if r.Ready() >= n || r.closed.Load() {
			r.waiting.Store(false)
			continue
		}
		select {
		case <-r.wake:
		case <-ctx.Done():
			r.waiting.Store(false)
			return ctx.Err()
		}
		r.waiting.Store(false)
	}
}

// EventFD returns an eventfd that is readable while completions wait in the
// ring, for epoll loops. The first call creates it; from then on Post writes
// to it when the ring turns non-empty and Advance reads it when the ring
// turns empty. A Post racing with that Advance can leave it readable on an
// empty ring until the reader's next Peek or PeekBatch, which resets it. The
// ring owns the descriptor; Close closes it.
func (r *Ring) EventFD() (int, error) {
	if fd := r.efd.Load(); fd >= 0 {
		return int(fd), nil
	}
	if r.closed.Load() {
		// Close has run: nothing would close a new descriptor.
		return -1, fmt.Errorf("cq: eventfd: %w", ErrClosed)
	}
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("cq: eventfd: %w", err)
	}
	r.efd.Store(int32(fd))
	if r.closed.Load() {
		// Close ran meanwhile; whichever of the two takes fd back closes
		// it, once no Post can be writing to it (as Close does).
		r.seal()
		if r.efd.CompareAndSwap(int32(fd), -1) {
			unix.Close(fd)
		}
		return -1, fmt.Errorf("cq: eventfd: %w", ErrClosed)
	}
	if !r.q.Empty() {
		r.notify()
	}
	return fd, nil
}

// Close wakes a blocked Wait, which then returns ErrClosed once the ring is
// drained of what it can read, and closes the eventfd. Completions already
// posted stay readable.
func (r *Ring) Close() error {
	if r.closed.Swap(true) {
		return nil
	}
	select {
	case r.wake <- struct{}{}:
	default:
	}
	r.seal()
	if fd := r.efd.Swap(-1); fd >= 0 {
		return unix.Close(int(fd))
	}
	return nil
}

// seal waits out a Post writing to the eventfd and keeps any other from
// starting: the descriptor may then close (its number could be reused at
// once). Idempotent.
func (r *Ring) seal() {
	for {
		st := r.signal.Load()
		if st == sigWriting {
			runtime.Gosched()
			continue
		}
		if st == sigClosed || r.signal.CompareAndSwap(st, sigClosed) {
			return
		}
	}
}

// Cap returns the ring's size.
func (r *Ring) Cap() int { return r.q.Cap() }
