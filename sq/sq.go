// Package sq defines the 64-byte submission queue entry and the bounded
// submission queue that many goroutines fill and one poller drains.
//
// # Concurrency
//
// Push may be called from any number of goroutines at once. Pop, Peek and
// the Doorbell's Park belong to the single poller that drains the queue.
//
// # Wakeups
//
// A Queue shares a Doorbell with the other queues of its poller. The poller
// arms the doorbell before it parks and checks its queues once more; Push
// rings it only when armed. While the poller is awake, Push costs one CAS and
// a few plain stores: no syscall and no channel operation, as with
// io_uring's SQ_NEED_WAKEUP.
package sq

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/bell"
	"github.com/moonring/moonring/internal/mpsc"
	"github.com/moonring/moonring/segtable"
)

// Op is what an Entry asks for.
type Op uint8

const (
	// Nop completes at once; it measures the ring itself.
	Nop Op = iota
	// Read moves bytes from the segment into the local buffer.
	Read
	// Write moves bytes from the local buffer into the segment.
	Write
	// Cancel cancels the in-flight request whose UserData equals this
	// entry's Remote field. It posts no completion of its own; the canceled
	// request completes with the canceled status. A request not found (not
	// yet taken, or already done) is left alone.
	Cancel
	opCount
)

// String names the op.
func (o Op) String() string {
	switch o {
	case Nop:
		return "nop"
	case Read:
		return "read"
	case Write:
		return "write"
	case Cancel:
		return "cancel"
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Valid reports whether o is a known op.
func (o Op) Valid() bool { return o < opCount }

// Flags modify an Entry.
type Flags uint8

// Flags of an Entry.
const (
	// FlagNotify, on a Write, delivers a notification (Tag, and for the
	// batch API a short message) to the target engine once every byte of
	// the request is in its memory; the request completes only after the
	// target has taken the notification.
	FlagNotify Flags = 1 << iota
	// FlagDeadline makes Timeout the request's deadline on the ring's
	// clock (ring.Now, in nanoseconds) instead of a duration from when the
	// poller takes the entry: the time the entry waits in the SQ, or for
	// a free slot, counts too. 0 with the flag is a deadline already past.
	FlagDeadline
	// FlagTransportOnly makes the request go through the transport whose
	// engine slot is Transport and no other: it FAILs at once with
	// CodeTransportDown when the segment's path through that transport
	// is down or was never opened, and it does not fail over.
	FlagTransportOnly
	// FlagTransportPrefer makes the request go through the transport
	// whose engine slot is Transport while the segment's path through it
	// is up; otherwise (down, not open) it takes the segment's current
	// path, and fails over as any request does.
	FlagTransportPrefer
	// FlagList makes a Read or Write move the blocks of a prepared list
	// (ring.List, moonring.Engine.PrepareList) rather than one range:
	// Local is then the list's ID, Remote the index of its first block
	// and Length the number of its blocks, and each block moves its own
	// bytes between Buffer at the block's offset and Segment at the
	// block's address. The request completes once every block has moved,
	// its completion's Bytes their sum; any block outside its buffer or
	// segment fails it before one byte moves.
	FlagList
)

// FlagsMask holds the flags this version knows; others are refused, and
// so is an entry with both FlagTransportOnly and FlagTransportPrefer.
const FlagsMask = FlagNotify | FlagDeadline | FlagTransportOnly | FlagTransportPrefer | FlagList

// FlagsTransport are the flags that make Entry.Transport a hint.
const FlagsTransport = FlagTransportOnly | FlagTransportPrefer

// Entry is one submission slot: 64 bytes, one cache line, no pointers.
// Reserved bytes must be zero; an entry with non-zero reserved bytes, an
// unknown op or unknown flags completes with an error code.
type Entry struct {
	Op    Op    // 1B
	Flags Flags // 1B
	// Transport is the engine's slot of the transport that
	// FlagTransportOnly or FlagTransportPrefer names (see
	// moonring.Engine.TransportSlot); it must be 0 without them.
	Transport uint8              // 1B
	_         byte               // reserved, zero
	Segment   segtable.SegmentID // 4B target segment
	Buffer    segtable.BufferID  // 4B registered local buffer
	_         [4]byte            // reserved, zero
	// Local is the offset inside Buffer.
	Local uint64
	// Remote is the address inside Segment (for Cancel: the UserData to cancel).
	Remote uint64
	// Length is the number of bytes to move.
	Length uint64
	// UserData is echoed in the completion; never a Go pointer.
	UserData uint64
	// Timeout is the request's deadline in nanoseconds after the poller takes
	// it; 0 means the engine's default. With FlagDeadline it is the
	// deadline itself, on the ring's clock.
	Timeout uint64
	// Tag is the notification's tag when Flags has FlagNotify.
	Tag uint64
}

// EntrySize is the size of an Entry in bytes.
const EntrySize = 64

var _ [EntrySize - unsafe.Sizeof(Entry{})]byte // compile error if larger
var _ [unsafe.Sizeof(Entry{}) - EntrySize]byte // compile error if smaller

// Deadline returns Timeout as a duration, or def when Timeout is 0. A
// Timeout past what a Duration holds (2^63 ns and up) is the longest one,
// not a negative one that would end the request at once.
func (e *Entry) Deadline(def time.Duration) time.Duration {
	if e.Timeout == 0 {
		return def
	}
	return time.Duration(min(e.Timeout, math.MaxInt64))
}

// DeadlineAt returns the request's deadline on the ring's clock when the
// poller takes it at t: Timeout itself with FlagDeadline, else t plus
// Deadline(def), the latest time there is when that overflows.
func (e *Entry) DeadlineAt(t int64, def time.Duration) int64 {
	if e.Flags&FlagDeadline != 0 {
		return int64(min(e.Timeout, math.MaxInt64))
	}
	if d := t + int64(e.Deadline(def)); d >= t {
		return d
	}
	return math.MaxInt64
}

// ErrShort reports an encoded entry of the wrong length.
var ErrShort = errors.New("sq: encoded entry must be 64 bytes")

// ErrReserved reports an encoded entry with non-zero reserved bytes.
var ErrReserved = errors.New("sq: reserved bytes must be zero")

// MarshalTo encodes e into b (little endian, 64 bytes).
func (e *Entry) MarshalTo(b []byte) error {
	if len(b) != EntrySize {
		return ErrShort
	}
	clear(b)
	b[0] = byte(e.Op)
	b[1] = byte(e.Flags)
	b[2] = e.Transport
	binary.LittleEndian.PutUint32(b[4:], uint32(e.Segment))
	binary.LittleEndian.PutUint32(b[8:], uint32(e.Buffer))
	binary.LittleEndian.PutUint64(b[16:], e.Local)
	binary.LittleEndian.PutUint64(b[24:], e.Remote)
	binary.LittleEndian.PutUint64(b[32:], e.Length)
	binary.LittleEndian.PutUint64(b[40:], e.UserData)
	binary.LittleEndian.PutUint64(b[48:], e.Timeout)
	binary.LittleEndian.PutUint64(b[56:], e.Tag)
	return nil
}

// UnmarshalFrom decodes b into e. Bytes 3 and 12-15 are reserved and
// must be zero.
func (e *Entry) UnmarshalFrom(b []byte) error {
	if len(b) != EntrySize {
		return ErrShort
	}
	if b[3]|b[12]|b[13]|b[14]|b[15] != 0 {
		return ErrReserved
	}
	*e = Entry{
		Op:        Op(b[0]),
		Flags:     Flags(b[1]),
		Transport: b[2],
		Segment:   segtable.SegmentID(binary.LittleEndian.Uint32(b[4:])),
		Buffer:    segtable.BufferID(binary.LittleEndian.Uint32(b[8:])),
		Local:     binary.LittleEndian.Uint64(b[16:]),
		Remote:    binary.LittleEndian.Uint64(b[24:]),
		Length:    binary.LittleEndian.Uint64(b[32:]),
		UserData:  binary.LittleEndian.Uint64(b[40:]),
		Timeout:   binary.LittleEndian.Uint64(b[48:]),
		Tag:       binary.LittleEndian.Uint64(b[56:]),
	}
	return nil
}

// Doorbell wakes a parked poller; see bell.Doorbell. One Doorbell serves
// all the queues of one poller.
type Doorbell = bell.Doorbell

// NewDoorbell returns a disarmed doorbell.
func NewDoorbell() *Doorbell { return bell.New() }

// Queue is the bounded submission queue. Its zero value is not usable; use
// New.
type Queue struct {
	q    *mpsc.Queue[Entry]
	bell *Doorbell
}

// New returns a queue of size entries (a power of two) that rings bell after
// each Push that added entries.
func New(size int, bell *Doorbell) (*Queue, error) {
	q, err := mpsc.New[Entry](size)
	if err != nil {
		return nil, fmt.Errorf("sq: %w", err)
	}
	return &Queue{q: q, bell: bell}, nil
}

// Push copies as many entries as fit, in order, and returns how many; 0 means
// the queue is full (reap completions, then retry). Safe for concurrent use.
func (q *Queue) Push(es []Entry) int {
	n := q.q.Push(es)
	if n > 0 && q.bell != nil {
		q.bell.Ring()
	}
	return n
}

// PushQuiet is Push without ringing the doorbell: the caller sees to a
// parked poller itself (Ring.Submit steps its rings, or rings the bell).
// Safe for concurrent use.
func (q *Queue) PushQuiet(es []Entry) int { return q.q.Push(es) }

// Peek returns how many entries are ready, at most max, and the first's
// position; Entry(pos+i) reads them in place until Advance. Poller only.
func (q *Queue) Peek(max int) (pos uint64, n int) { return q.q.Readable(max) }

// Entry returns the entry at a position Peek reported. Poller only.
func (q *Queue) Entry(pos uint64) *Entry { return q.q.Slot(pos) }

// Advance releases n entries that Peek reported. Poller only.
func (q *Queue) Advance(n int) { q.q.Release(n) }

// Pop copies up to len(dst) entries out and releases them. Poller only.
func (q *Queue) Pop(dst []Entry) int { return q.q.Pop(dst) }

// Empty reports whether no entry is ready. Poller only.
func (q *Queue) Empty() bool { return q.q.Empty() }

// Len returns a snapshot of the number of queued entries.
func (q *Queue) Len() int { return q.q.Len() }

// Cap returns the queue's size.
func (q *Queue) Cap() int { return q.q.Cap() }
