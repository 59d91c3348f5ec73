// Package transport defines what a transport is to the engine: the Transport
// and Endpoint interfaces, the Slice a transport moves, the Completer it
// reports to, and the choice of transport for a segment.
//
// A transport knows its hardware and nothing of rings or batches. The
// engine registers buffers with it, opens an Endpoint per remote segment,
// posts slices, and hears of each slice exactly once through the Completer.
//
// # Concurrency
//
// Register, Unregister, Open and Close may be called from any goroutine.
// Post may be called by several pollers at once (rings of every NUMA node
// share a segment's endpoint); Complete may be called from any goroutine,
// including from inside Post.
//
// # Lifetimes
//
// An Endpoint lives until its Close or its transport's Close. Every slice
// that Post accepted is completed exactly once, also when the endpoint or
// the transport closes with the slice in flight (with an error then).
//
// # Errors
//
// Completion errors tell the engine what to do: ErrDenied and ErrRange are
// final (the peer refused the request itself), and so is ErrClosed (the
// transport or endpoint is gone); any other error lets the engine retry the
// slice on another rail.
package transport

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"unsafe"

	"github.com/moonring/moonring/segtable"
)

// Errors that transports return or complete slices with.
var (
	// ErrNotSupported: this transport cannot work on this machine or build.
	ErrNotSupported = errors.ErrUnsupported
	// ErrUnreachable: this transport cannot reach the segment; another may.
	ErrUnreachable = errors.New("transport: segment unreachable on this transport")
	// ErrDenied: the peer refused the slice (wrong key, range not granted or
	// not remote-accessible). Final.
	ErrDenied = errors.New("transport: access denied")
	// ErrRange: the remote range is not inside one buffer of the segment. Final.
	ErrRange = errors.New("transport: remote range outside segment")
	// ErrClosed: the endpoint or transport closed with the slice in flight.
	ErrClosed = errors.New("transport: closed")
	// ErrPeer: the connection to the peer broke; another rail may work.
	ErrPeer = errors.New("transport: peer connection failed")
)

// Op is the direction of a slice.
type Op uint8

const (
	// Read moves Length bytes from Remote into Local.
	Read Op = 1
	// Write moves Length bytes from Local to Remote.
	Write Op = 2
	// Notify delivers a notification to the peer engine: Remote is the tag,
	// [Local, Local+Length) the message (Length may be 0). The engine posts
	// it only after the request's Write slices completed.
	Notify Op = 3
)

// MaxNotifyMessage bounds a notification's message.
const MaxNotifyMessage = 4096

// Notification is what a Notify slice delivers to the target engine.
type Notification struct {
	// From is the initiating engine's segment name.
	From string
	Tag  uint64
	// Msg is valid only during the delivery call.
	Msg []byte
}

// Notifier is implemented by transports that carry notifications. The
// engine calls SetNotify once, before any Open, with its own segment name
// (sent as From) and the function that takes delivered notifications. The
// function does not block; it fails (the engine's queue is full) with an
// error the transport passes back to the sender as a retryable failure.
type Notifier interface {
	SetNotify(self string, deliver func(*Notification) error)
}

// ErrNotifyFull reports a notification the target engine could not queue.
var ErrNotifyFull = errors.New("transport: target's notification queue is full")

// Slice is one piece of a request that a transport moves in one operation on
// one rail.
type Slice struct {
	Op Op
	// Class is the priority class of the slice's request. Transports with
	// queues of their own keep a ClassLow stream from delaying a ClassHigh
	// slice by more than one slice (tcp sends it on a lane of its own);
	// others may ignore it.
	Class Class
	// Driven marks a slice whose poster will read its answer itself
	// (see Driver): set only for endpoints that implement Driver, by a
	// caller that calls Drive on the endpoint right after the Post.
	Driven bool
	Rail   uint16
	// LocalHandle is the transport's handle for the local buffer (the
	// Handle of its Registration).
	LocalHandle uint64
	// Local is the first local byte: pinned Go memory or mmap'd memory,
	// valid until the slice completes.
	Local unsafe.Pointer
	// Remote is the address in the segment.
	Remote uint64
	Length uint64
	// RemoteIndex is the position, in the segment's descriptor's chunks
	// (a segtable.Pos: page, chunk, buffer; for the engine's own
	// segment, the index in its DescList), of the buffer that holds the
	// remote range, as the engine's check of the request found it
	// (segtable.Segment.Resolve), so that a transport that keeps its
	// table of the descriptor as a segtable.Mirror may take the buffer's
	// key without a search of its own (Mirror.At). Only a hint: the
	// descriptor may have been replaced since (an endpoint's Update and
	// the segment's may come apart for a moment), and a slice made
	// elsewhere leaves it zero; a transport that uses it checks that the
	// buffer at that position in its own copy of the descriptor holds the
	// range, and searches when not. Zero for a Notify slice.
	RemoteIndex uint32
	// Token is the engine's; the transport hands it back to the Completer.
	Token uint64
}

// Class is a request's priority class: a ring has one, and its slices
// carry it. The zero value is ClassNormal.
type Class uint8

const (
	// ClassNormal is the default class.
	ClassNormal Class = iota
	// ClassHigh is for small latency-critical requests: pollers take it
	// first, and transports keep bulk streams out of its way.
	ClassHigh
	// ClassLow is for bulk streams that may wait behind the other classes
	// (never for good: waiting low-class work is promoted).
	ClassLow
	// NumClasses counts the classes.
	NumClasses = 3
)

// Rank orders classes for scheduling: 0 for ClassHigh, 1 for ClassNormal,
// 2 for ClassLow (and for any value out of range).
func (c Class) Rank() int {
	switch c {
	case ClassHigh:
		return 0
	case ClassNormal:
		return 1
	}
	return 2
}

// String returns "high", "normal" or "low".
func (c Class) String() string {
	switch c {
	case ClassHigh:
		return "high"
	case ClassNormal:
		return "normal"
	case ClassLow:
		return "low"
	}
	return "class(" + strconv.Itoa(int(c)) + ")"
}

// Completer hears of every posted slice exactly once. Implementations are
// lock-free and safe for concurrent use; Complete must not block. Complete
// may call back into Post of the same endpoint (the engine posts retries
// and notifications from it), so a transport must not hold a lock across a
// call to Complete that its Post also takes.
type Completer interface {
	// Complete reports that the slice carrying token finished: err is nil
	// when every byte moved. A READ that fails may have changed its local
	// range (a connection broken mid-payload; over tcp, the bytes after a
	// refused answer read with the READs planned behind it): only a READ
	// that completes is defined, and nothing outside posted ranges changes.
	Complete(token uint64, err error)
}

// Transport moves bytes for one engine over one kind of link.
type Transport interface {
	// Name is the transport's name in SegmentDescs ("local", "tcp", ...).
	Name() string
	// Endpoint returns what peers need to reach this transport (an address),
	// published in the engine's SegmentDesc; "" when peers need nothing.
	Endpoint() string
	// SliceSize is the largest slice the engine should post; 0 means the
	// engine's default.
	SliceSize() uint64
	// Register makes b reachable through the transport and returns the
	// transport's handle and the key peers must present.
	Register(b *segtable.Buffer) (segtable.Registration, error)
	// Unregister forgets a registration. It waits for peers' operations on
	// the buffer in progress in this process to finish.
	Unregister(b *segtable.Buffer, r segtable.Registration) error
	// Open returns an Endpoint to the segment desc describes, or an error
	// wrapping ErrUnreachable when this transport cannot reach it.
	Open(ctx context.Context, desc *segtable.SegmentDesc) (Endpoint, error)
	// Close completes every slice in flight with ErrClosed, closes all
	// endpoints and releases the transport's resources.
	Close() error
}

// ContextUnregisterer is implemented by transports whose Unregister may
// wait on peers (for their copies of the buffer to end, for their answer
// to a revoke): UnregisterContext is Unregister with the wait bounded by
// ctx as well as by the transport's own limits, so that a caller with a
// deadline (a shutdown's grace) is not held past it by a peer that does
// not answer. When ctx ends first it returns an error wrapping ctx's
// error, and what is left of the registration is the transport's to
// settle: it may stay registered until Close (which ends every peer's use
// of the buffer before it returns), or the peers still holding it may be
// disconnected; either way the buffer's memory may be reused only after
// Close, as after any Unregister that failed. The engine calls it, when a
// transport has it, with the ctx of UnregisterLocalMemory. Safe for
// concurrent use as Unregister is.
type ContextUnregisterer interface {
	UnregisterContext(ctx context.Context, b *segtable.Buffer, r segtable.Registration) error
}

// Endpoint is one transport's way to one remote segment.
type Endpoint interface {
	// Rails is how many independent lanes (connections, QPs) the endpoint
	// spreads slices over; at least 1.
	Rails() int
	// Post starts the slices and returns how many it accepted, in order.
	// Fewer than len(s) means the endpoint is full: the caller retries the
	// rest later. An error means the endpoint cannot take the slices from
	// the n-th on. Rings of several pollers may call Post at once.
	Post(c Completer, s []Slice) (int, error)
	// Update gives the endpoint the segment's new descriptor (its peer
	// republished).
	Update(desc *segtable.SegmentDesc)
	// Close completes the endpoint's slices in flight with ErrClosed.
	Close() error
}

// WidePoster is implemented by endpoints whose cost is mostly per Post
// rather than per slice (nvlink: one kernel launch and one event for a
// Post's slices): the engine gathers up to PostWidth slices for one Post
// where it would stop at its default (64); a larger width than the
// engine's most (256) is cut to it, and a Copier gets the default
// whatever it asks. PostWidth must not change for an endpoint's life and
// must be safe for concurrent use.
type WidePoster interface {
	PostWidth() int
}

// Copier is implemented by endpoints that move a slice synchronously on
// the caller's goroutine (plain memory copies). The engine then calls Copy
// instead of Post and applies the result at once, skipping the completion
// queue. Copy must make the same checks as Post. Copy (and a
// BatchCopier's CopyBatch) must be safe for concurrent use: the rings of
// several pollers, and a poller's copy workers, call it at once.
type Copier interface {
	Copy(s *Slice) error
}

// BatchCopier is a Copier that moves several slices in one call (one
// system call for many small slices, say). The engine then hands it the
// slices of a batch for one endpoint at once and applies their results
// after it returns.
type BatchCopier interface {
	Copier
	// CopyBatch moves every slice of s, with Copy's checks, and sets
	// errs[i] to s[i]'s result; len(errs) == len(s).
	CopyBatch(s []Slice, errs []error)
}

// InlineCopier is a BatchCopier that can tell, slice by slice, whether
// a slice gains from joining a batch (one that takes a system call does;
// a plain memory copy does not), so the engine moves the others as it
// takes them.
type InlineCopier interface {
	BatchCopier
	// CopyNow moves s and reports true with its result, as Copy would,
	// when batching would gain nothing; else it does nothing and reports
	// false. With h not nil the copy's reference on the target memory is
	// left in h, as HoldingCopier's CopyHold leaves it.
	CopyNow(s *Slice, h *Holds) (bool, error)
}

// HoldingCopier is a Copier that can leave the reference it takes on the
// target's memory for a copy in a Holds, which the engine gives back at
// the end of the poller's round, and before it calls any endpoint's Post
// or CopyBatch (which may wait on something that waits for the
// reference): the copier then takes and drops its reference on a region
// about once a round rather than once a slice. (Each is
// an atomic read-modify-write, which waits for the stores of the copy
// before it to reach the cache: about a tenth of a 4 KiB copy.)
type HoldingCopier interface {
	Copier
	// CopyHold is Copy, holding the target region's reference in h.
	CopyHold(s *Slice, h *Holds) error
}

// Holds is a poller round's list of held references (see HoldingCopier).
// Its zero value is empty and ready; it is owned by one goroutine at a
// time, and what it holds lives until Release.
type Holds struct {
	refs [4]*segtable.Ref
	n    int
}

// Has reports whether r is held.
func (h *Holds) Has(r *segtable.Ref) bool {
	for _, x := range h.refs[:h.n] {
		if x == r {
			return true
		}
	}
	return false
}

// Add takes over r, which the caller acquired, and reports true; false
// when h is full, and the caller keeps r.
func (h *Holds) Add(r *segtable.Ref) bool {
	if h.n == len(h.refs) {
		return false
	}
	h.refs[h.n] = r
	h.n++
	return true
}

// Len returns how many references are held.
func (h *Holds) Len() int { return h.n }

// Take gets r for one copy: false when r refuses references (it is being
// drained). When r is held already nothing is taken; else r is acquired
// and h keeps it, unless h is nil or full: then release is true and the
// caller releases r after its copy. Safe on a nil h.
func (h *Holds) Take(r *segtable.Ref) (ok, release bool) {
	if h != nil && h.Has(r) {
		return true, false
	}
	if !r.Acquire() {
		return false, false
	}
	return true, h == nil || !h.Add(r)
}

// Release gives back every reference held.
func (h *Holds) Release() {
	for i, r := range h.refs[:h.n] {
		r.Release()
		h.refs[i] = nil
	}
	h.n = 0
}

// Poller is implemented by transports whose completions must be driven by
// the engine's pollers (a completion queue to poll, software progress).
type Poller interface {
	// Poll makes progress and reports how many completions it delivered.
	Poll() int
}

// InFlight is implemented by Pollers whose work in flight only a Poll
// sees finish, with nothing to wake a parked poller (a GPU's copy events).
// While InFlight reports true the engine's pollers keep polling instead
// of parking, as they would while waiting on a completion queue.
type InFlight interface {
	Poller
	// InFlight reports whether work is in flight; it must be cheap (a few
	// atomic loads) and safe for concurrent use.
	InFlight() bool
}

// Driver is implemented by endpoints whose answers a waiting caller may
// read on its own goroutine (io_uring's mode without a polling thread): a
// caller that posted Driven slices and is about to wait for them calls
// Drive instead of sleeping until a transport goroutine has read the
// answer and woken it. On a small machine that hand-off (a goroutine made
// ready, an idle thread woken for it) costs more than the network round
// trip.
type Driver interface {
	// Drive reads answers on the caller's goroutine, completing their
	// slices through their Completers as the endpoint's own goroutines
	// would, until w.Done() reports true, nothing is left in flight where
	// it reads, or deadline (UnixNano; 0: none) passes between two
	// answers (an answer begun is read whole). It must be called once after
	// every Post of Driven slices, by the goroutine that posted them, even
	// if it no longer waits (deadline already past): a slice marked Driven
	// may be left unread until then. Before it returns it hands what is
	// still in flight back to the endpoint's own goroutines. Safe for
	// concurrent use.
	Drive(w Until, deadline int64)
	// Interrupt makes any Drive in progress on the endpoint return once
	// no answer is being read, for a caller that ended a driven request
	// by other means (cancel, timeout, close). Safe for concurrent use;
	// cheap when no Drive is in progress.
	Interrupt()
}

// Until is the condition a Driver reads answers until (see Driver.Drive).
type Until interface {
	// Done reports whether the caller's wait is over. It is called on the
	// driving goroutine after each answer and must be cheap.
	Done() bool
}

// Waker is implemented by Pollers that may have work for Poll come up on
// a goroutine of their own (a copy queued from another transport's
// completion), which a parked poller would otherwise see only at its next
// timed look. The engine calls SetWake once, when it installs the
// transport, before any Post, with a function that wakes its parked
// pollers; it is safe for concurrent use and cheap when none is parked.
type Waker interface {
	Poller
	SetWake(wake func())
}

// DeviceMemory is implemented by transports that serve memory outside the
// CPU's NUMA nodes (GPU memory, "cuda:N"). The engine registers a buffer
// whose location is not "cpu:N" only with transports whose Accepts says
// yes (the others would copy through addresses the CPU cannot touch), and
// allocates and frees such memory through them.
type DeviceMemory interface {
	// Accepts reports whether the transport serves memory at loc.
	Accepts(loc segtable.Location) bool
	// AllocDevice returns size bytes of memory at loc: a view of device
	// addresses that the CPU must not read or write. It lives until
	// FreeDevice or the transport's Close.
	AllocDevice(size int, loc segtable.Location) ([]byte, error)
	// FreeDevice releases memory from AllocDevice; it fails wrapping
	// segtable.ErrNotFound for memory that is not.
	FreeDevice(b []byte) error
}

// Stager is implemented by DeviceMemory transports that can also move
// their memory through pinned host memory, so that it may be the local
// side of requests over transports that reach only host memory (TCP,
// shared memory). The engine registers the staging arena, local only,
// with the other transports, gives device buffers a Staged registration
// (segtable.Registration) carrying the stager's own Handle on each
// transport that does not serve them, and gives each segment opened
// through such a transport a Staged endpoint from Stage.
type Stager interface {
	// StagingArena returns the pinned host memory staged slices pass
	// through, made on the first call. It lives until the transport's
	// Close.
	StagingArena() ([]byte, error)
	// Stage returns an endpoint that moves slices whose local side is
	// device memory registered with the stager (LocalHandle is its
	// Handle) over ep, through the arena: a WRITE's bytes are copied off
	// the device, then posted to ep; a READ lands in the arena, then is
	// copied to the device. arena is the arena's handle on ep's
	// transport; maxSlice the largest slice the engine will post (Stage
	// fails when the stager cannot take such slices). The endpoint lives
	// until its Close, which does not close ep, or the transport's Close.
	// Close it, then ep, before the transport: the arena goes with the
	// transport, and ep may still hold slices in it.
	Stage(ep Endpoint, arena, maxSlice uint64) (Endpoint, error)
}

// Serves reports whether t may register memory at loc: every transport
// serves CPU memory, and only a DeviceMemory transport that accepts it
// serves any other.
func Serves(t Transport, loc segtable.Location) bool {
	kind, _, err := loc.Parse()
	if err == nil && kind == "cpu" {
		return true
	}
	d, ok := t.(DeviceMemory)
	return ok && d.Accepts(loc)
}

// Priority is the default order of preference among transports, best
// first: same process, then NVLink, shared memory, RDMA, EFA, TCP.
var Priority = []string{"local", "nvlink", "shm", "rdma", "efa", "tcp"}

// Candidates returns the names of installed that desc has an endpoint for,
// in order of preference: prefer first (when non-empty, only those it
// names), then Priority, then the rest by name.
func Candidates(installed []string, desc *segtable.SegmentDesc, prefer []string) []string {
	order := prefer
	if len(order) == 0 {
		order = append(slices.Clone(Priority), installed...)
		slices.Sort(order[len(Priority):])
	}
	var out []string
	for _, name := range order {
		if _, ok := desc.Endpoints[name]; ok && slices.Contains(installed, name) && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
}
