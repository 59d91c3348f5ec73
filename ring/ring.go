package ring

import (
	"errors"
	"fmt"
	"log/slog"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/cpu"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/internal/mpsc"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// Errors returned by Ring methods.
var (
	// ErrSQFull: the submission queue is full; reap completions, then retry.
	ErrSQFull = cq.ErrQueueFull
	// ErrClosed: the ring is closed.
	ErrClosed = cq.ErrClosed
)

// Defaults of Config.
const (
	DefaultEntries    = 256
	DefaultSliceSize  = 64 << 10
	DefaultRetryLimit = 3
	DefaultTimeout    = 30 * time.Second
	DefaultMaxLength  = 1 << 40
)

// Config sizes a Ring. Zero fields take the defaults.
type Config struct {
	// Entries is the SQ size, a power of two (default 256).
	Entries int
	// CQEntries is the CQ size, a power of two (default 2*Entries).
	CQEntries int
	// MaxInFlight is the in-flight table size: requests taken from the SQ
	// and not yet complete (default Entries).
	MaxInFlight int
	// MaxSlices bounds the slices posted and not yet completed, a power of
	// two (default 4096).
	MaxSlices int
	// SliceSize is used for transports that name none (default 64 KiB).
	SliceSize uint64
	// RetryLimit is how many failed slices a request may retry (default 3;
	// negative: none).
	RetryLimit int
	// Timeout is the deadline of entries with Timeout 0 (default 30 s).
	Timeout time.Duration
	// MaxLength is the longest request accepted (default 1 TiB).
	MaxLength uint64
	// Sink, when set, receives completions instead of the CQ.
	Sink Sink
	// Logger, when set, hears of slice retries and of requests that time
	// out or fail (failure paths only: nothing is logged per request that
	// goes well).
	Logger *slog.Logger
}

// Sink receives a ring's completions instead of its CQ; the engine uses one
// to store batch task status. Its methods run on the goroutine that holds
// the poller's token (the poller, or a transport goroutine completing a
// slice while the poller is parked; once the poller has stopped, the
// goroutine closing the ring) and must not block.
type Sink interface {
	// Started says the request with userData passed its checks and its
	// slices are being posted.
	Started(userData uint64)
	// Complete delivers the request's completion.
	Complete(c *cq.Completion)
}

func (c *Config) fill() error {
	if c.Entries == 0 {
		c.Entries = DefaultEntries
	}
	if c.CQEntries == 0 {
		c.CQEntries = 2 * c.Entries
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = c.Entries
	}
	if c.MaxSlices == 0 {
		c.MaxSlices = 4096
	}
	if c.SliceSize == 0 {
		c.SliceSize = DefaultSliceSize
	}
	if c.RetryLimit == 0 {
		c.RetryLimit = DefaultRetryLimit
	} else if c.RetryLimit < 0 {
		c.RetryLimit = 0
	}
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	}
	if c.MaxLength == 0 {
		c.MaxLength = DefaultMaxLength
	}
	if c.MaxInFlight < 1 || c.MaxInFlight > 1<<idxBits || c.RetryLimit < 0 || c.Timeout < 0 {
		return fmt.Errorf("ring: bad config: MaxInFlight %d, RetryLimit %d, Timeout %v", c.MaxInFlight, c.RetryLimit, c.Timeout)
	}
	return nil
}

// Tables are the engine's buffer and segment tables that rings resolve
// entries against.
type Tables struct {
	Buffers  *segtable.Buffers
	Segments *segtable.Segments[transport.Endpoint]
}

// Ring is one submission queue, completion queue and in-flight table,
// drained by one Poller. Use Engine.NewRing (or New). Safe for concurrent
// use as documented per method.
type Ring struct {
	// The fields up to the pad are read by callers and transports; the
	// pads keep the poller's writes to its own state off their line.
	_      cpu.CacheLinePad
	sq     *sq.Queue
	cq     *cq.Ring
	done   *mpsc.Queue[sliceDone] // slice completions from transports
	poller *Poller
	closed atomic.Bool
	// shut is closed once the ring's requests were completed with
	// ErrClosed (shutdown): a second Close, or one racing the poller's
	// Stop, waits for it as the first does.
	shut     chan struct{}
	shutOnce sync.Once
	_        cpu.CacheLinePad

	// Poller-owned state below: only the holder of the poller's token (its
	// goroutine, or a goroutine it lent its rings to while parked) touches it.
	cfg         Config
	tables      *Tables
	reqs        []request
	free        []int32  // free slots (stack)
	postq       []uint64 // ref of requests with slices left to post (FIFO)
	postHead    int
	redo        []uint64 // slice tokens to post again
	spare       []uint64 // redo's other buffer
	batch       []transport.Slice
	errs        []error // results of a BatchCopier, as long as batch's capacity
	batchEP     transport.Endpoint
	cqes        []cq.Completion
	sinkCQE     cq.Completion
	inline      transport.Slice // copyInline's slice (a field: it would escape)
	inlineBytes uint64          // bytes copyInline moved this round
	holds       transport.Holds // references copyInline's copies hold until the round ends or a flush
	more        bool            // take has more entries this round after the one it starts
	taking      bool            // take has entries in hand that the SQ still holds: cqes waits
	outstanding int             // slices posted and not yet completed
	active      int             // requests in slots, including zombies
	nextCheck   int64
	// latency counts completed requests by duration, from when the poller
	// took them to their last slice, in power-of-two buckets of 1.024 µs
	// and up (bucket i: below 2^(i+10) ns); latencySum is their total.
	latency    [LatencyBuckets]uint64
	latencySum int64
	now        int64 // the clock of the round in progress
	// perSeg holds per-segment, per-op counters (see countSegment).
	perSeg []SegmentStats
	// lent is set while a borrowing goroutine steps the ring; deferred
	// reports that it left synchronous copies for the poller.
	lent, deferred bool
	// blockedSince is when the ring last found no free slot for the entry
	// at the head of its SQ; 0 while it is not blocked.
	blockedSince int64
	rail         uint16
	detached     bool

	stats Stats
	_     cpu.CacheLinePad
}

// Stats are a ring's counters, kept by its poller without atomics and read
// with Ring.Stats.
type Stats struct {
	Requests uint64 // entries COMPLETED (Nops included)
	Bytes    uint64 // bytes moved by completed requests
	Retries  uint64 // slices posted again after a failure
	Timeouts uint64
	Canceled uint64
	Failed   uint64 // entries that ended FAILED, bad entries included
	Stale    uint64 // slice completions for a slot's earlier use
	InFlight uint64 // requests in the in-flight table now (a gauge)
	// Codes counts every ended entry by its completion code (index: the
	// cq.Code), so errors can be told apart by kind.
	Codes [32]uint64
}

type sliceDone struct {
	token uint64
	code  cq.Code
}

const (
	idxBits   = 20
	genBits   = 12
	sliceBits = 28
	// attemptOne is 1 in a token's top 4 bits, which count the posts of
	// the slice so that each retry goes to the next rail.
	attemptOne = 1 << (32 + sliceBits)
)

// A token names one slice: slot index, slot generation, slice index, and
// in the top bits how often the slice failed (modulo 16).
func token(idx int32, gen uint16, slice uint32) uint64 {
	return uint64(idx) | uint64(gen)<<idxBits | uint64(slice)<<32
}

func splitToken(t uint64) (idx int32, gen uint16, slice uint32) {
	return int32(t & (1<<idxBits - 1)), uint16(t >> idxBits & (1<<genBits - 1)), uint32(t >> 32 & (1<<sliceBits - 1))
}

// attempt returns how often the slice of t failed, modulo 16.
func attempt(t uint64) uint64 { return t / attemptOne }

type reqState uint8

const (
	stFree reqState = iota
	stActive
	stZombie // finished, waiting for its slices to come back
)

type request struct {
	userData    uint64
	buf         *segtable.Buffer
	seg         *segtable.Segment[transport.Endpoint]
	local       uint64
	remote      uint64
	length      uint64
	sliceSize   uint64
	deadline    int64
	bytes       uint64
	handle      uint64
	nslices     uint32
	posted      uint32 // next slice to post
	done        uint32 // slices completed
	outstanding uint32 // slices posted and not completed
	retries     uint16
	gen         uint16
	rail        uint16
	op          transport.Op
	state       reqState
	started     int64  // the poller's clock when it took the request
	notify      bool   // post a Notify slice (index nslices) after the data
	staged      bool   // the local buffer goes through seg.Staged (a staged registration)
	tag         uint64 // the notification's tag
}

// New returns a ring drained by p. The engine uses it through NewRing.
func New(cfg Config, tables *Tables, p *Poller) (*Ring, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	s, err := sq.New(cfg.Entries, p.bell)
	if err != nil {
		return nil, err
	}
	c, err := cq.New(cfg.CQEntries)
	if err != nil {
		return nil, err
	}
	d, err := mpsc.New[sliceDone](cfg.MaxSlices)
	if err != nil {
		return nil, fmt.Errorf("ring: MaxSlices: %w", err)
	}
	r := &Ring{
		sq: s, cq: c, done: d, poller: p, cfg: cfg, tables: tables, shut: make(chan struct{}),
		reqs:  make([]request, cfg.MaxInFlight),
		free:  make([]int32, cfg.MaxInFlight),
		postq: make([]uint64, 0, cfg.MaxInFlight),
		batch: make([]transport.Slice, 0, 64),
		errs:  make([]error, 64),
		cqes:  make([]cq.Completion, 0, 64),
	}
	for i := range r.free {
		r.free[i] = int32(cfg.MaxInFlight - 1 - i)
		r.reqs[i].gen = 1
	}
	if err := p.attach(r); err != nil {
		return nil, err
	}
	return r, nil
}

// Submit copies entries into the SQ, in order, and returns how many it took.
// When fewer than len(es) fit it returns ErrSQFull: reap completions, then
// submit the rest. It makes no syscall while the poller is awake and does
// not allocate. Safe for concurrent use.
func (r *Ring) Submit(es []sq.Entry) (int, error) {
	if r.closed.Load() {
		return 0, ErrClosed
	}
	n := r.sq.Push(es) // rings the poller's doorbell if it is parked
	if r.closed.Load() {
		// Close came between the check above and the push, and its
		// shutdown may have emptied the SQ before these arrived: complete
		// what it left, as it would have.
		r.poller.drainClosed(r)
	}
	if n < len(es) {
		return n, ErrSQFull
	}
	return n, nil
}

// SubmitOne submits one entry. Safe for concurrent use.
func (r *Ring) SubmitOne(e *sq.Entry) error {
	_, err := r.Submit(unsafe.Slice(e, 1))
	return err
}

// Cancel asks the poller to cancel the in-flight request whose UserData is
// userData. It completes with CANCELED unless it completes first. Safe for
// concurrent use.
func (r *Ring) Cancel(userData uint64) error {
	return r.SubmitOne(&sq.Entry{Op: sq.Cancel, Remote: userData})
}

// Peek returns the oldest completion, valid until Advance, or nil. It never
// enters the kernel. One reader at a time.
func (r *Ring) Peek() *cq.Completion { return r.cq.Peek() }

// PeekBatch copies up to len(dst) completions into dst without removing
// them and returns how many. One reader at a time.
func (r *Ring) PeekBatch(dst []cq.Completion) int { return r.cq.PeekBatch(dst) }

// Advance removes n completions that Peek or PeekBatch returned.
func (r *Ring) Advance(n int) { r.cq.Advance(n) }

// CQ returns the ring's completion queue (Wait, EventFD, Overflowed).
func (r *Ring) CQ() *cq.Ring { return r.cq }

// Closed reports whether Close was called. Safe for concurrent use.
func (r *Ring) Closed() bool { return r.closed.Load() }

// Stats returns a snapshot of the ring's counters, taken on its poller's
// goroutine (a round trip to it). Safe for concurrent use.
func (r *Ring) Stats() Stats {
	var st Stats
	if r.poller.do(func() { st = r.stats; st.InFlight = uint64(r.active) }) != nil {
		st = r.stats // the poller is gone: nothing writes the counters any more
	}
	return st
}

// Close stops the ring: Submit fails from now on, requests not yet
// complete (also those still in the SQ) complete with ErrClosed, and then
// the CQ's Wait returns ErrClosed once drained. Close returns after the
// poller has done so. Completions stay readable.
func (r *Ring) Close() error {
	if r.closed.Swap(true) {
		<-r.shut // closing already: return once it has, as the first does
		return nil
	}
	r.poller.detach(r)
	return r.cq.Close()
}

// now is the poller's clock: nanoseconds since process start, monotonic.
var epoch = time.Now()

func now() int64 { return int64(time.Since(epoch)) }

// step does one round of work and reports whether it did any. Poller only.
func (r *Ring) step(t int64) bool {
	r.now = t
	work := r.reap()
	if len(r.redo) > 0 {
		work = r.postRedo() || work
	}
	if r.postHead < len(r.postq) {
		work = r.postPending() || work
	}
	work = r.take(t) || work
	r.flush()
	if r.active > 0 && t >= r.nextCheck {
		r.expire(t)
	}
	r.holds.Release()
	if r.inlineBytes >= 256<<10 {
		r.poller.slow = true // the round took long: read the clock again
	}
	r.inlineBytes = 0
	r.flushCQ()
	return work
}

// stepLent is step for a goroutine borrowing a parked poller's rings (see
// Ring.wake): a transport goroutine that just completed a slice. It does
// everything step does but synchronous copies, which could be large: their
// slices are left for the poller, and stepLent reports that it must wake
// (as it does for any work left).
func (r *Ring) stepLent(t int64) (wake bool) {
	r.lent = true
	r.step(t)
	r.lent = false
	deferred := r.deferred
	r.deferred = false
	return deferred || r.ready()
}

// ready reports whether step would find work that needs no other event.
func (r *Ring) ready() bool {
	if !r.done.Empty() {
		return true
	}
	if r.sq.Empty() {
		return false
	}
	if len(r.free) > 0 || r.blockedSince == 0 {
		return true // take starts entries, or starts the blocked ring's clock
	}
	// Blocked: the head entry goes only if it needs no slot (a Nop, a
	// Cancel); entries behind it wait their turn.
	pos, n := r.sq.Peek(1)
	if n != 1 {
		return false
	}
	op := r.sq.Entry(pos).Op
	return op != sq.Read && op != sq.Write
}

// wakeAt returns when the ring next needs its poller without any event: a
// deadline of a request in flight, the timeout of the entry blocked at the
// head of the SQ, or soon when slices wait for an endpoint that refused
// them (room there may come from another poller's rings, whose completions
// do not wake this one). Poller only.
func (r *Ring) wakeAt(t int64) int64 {
	at := int64(1<<63 - 1)
	if len(r.redo) > 0 || r.postHead < len(r.postq) {
		at = t + int64(100*time.Microsecond)
	}
	if r.active > 0 {
		at = min(at, r.nextCheck)
	}
	if r.blockedSince != 0 {
		if pos, n := r.sq.Peek(1); n == 1 {
			if d := r.blockedSince + int64(r.sq.Entry(pos).Deadline(r.cfg.Timeout)); d > r.blockedSince {
				at = min(at, d) // else it overflowed: no deadline worth the name
			}
		}
	}
	return at
}

// take pops new entries while slots are free.
//
// While every slot is taken the ring is blocked: a request at the head of
// the SQ then times out once the ring has been blocked for longer than the
// request's timeout, without a slot, so that no request waits past its
// deadline for one (slots come back only when transports return slices).
func (r *Ring) take(t int64) bool {
	// Completions from before go out first: the copies below may take a
	// while. From here to Advance no completion is published to the CQ
	// (see complete): the caller must not see one for an entry still in
	// the SQ, or a caller keeping Entries requests in flight could find it
	// full. (A Sink, the batch API's, gets each completion at once; its
	// submitter waits for room.)
	r.flushCQ()
	r.taking = true
	if len(r.free) > 0 {
		r.blockedSince = 0 // a slot came back: blocked again, the clock starts again
	}
	max := min(64, len(r.free)+1) // +1: Nops and Cancels need no slot
	pos, n := r.sq.Peek(max)
	i := 0
	for ; i < n; i++ {
		e := r.sq.Entry(pos + uint64(i))
		if (e.Op == sq.Read || e.Op == sq.Write) && len(r.free) == 0 {
			if r.blockedSince == 0 {
				r.blockedSince = t
			}
			if t-r.blockedSince < int64(e.Deadline(r.cfg.Timeout)) {
				break
			}
			r.complete(e.UserData, cq.CodeTimeout, 0)
			continue
		}
		r.more = i < n-1
		r.start(e, t)
	}
	r.more = false
	if len(r.free) > 0 {
		r.blockedSince = 0
	}
	r.sq.Advance(i)
	r.taking = false
	return i > 0
}

// reserved reports whether e has non-zero reserved bytes.
func reserved(e *sq.Entry) bool {
	// Entry is 64 bytes of 8-byte-aligned fields, so viewing it as eight
	// words is sound; the words hold the reserved bytes at fixed places.
	w := (*[8]uint64)(unsafe.Pointer(e))
	return w[0]>>16&0xffff != 0 || w[1]>>32 != 0
}

func (r *Ring) start(e *sq.Entry, t int64) {
	if e.Flags&^sq.FlagsMask != 0 || reserved(e) || !e.Op.Valid() || (e.Flags&sq.FlagNotify != 0 && e.Op != sq.Write) {
		r.complete(e.UserData, cq.CodeInvalid, 0)
		return
	}
	switch e.Op {
	case sq.Nop:
		r.complete(e.UserData, cq.CodeOK, 0)
		return
	case sq.Cancel:
		r.cancel(e.Remote)
		return
	}
	if e.Length == 0 || e.Length > r.cfg.MaxLength {
		r.complete(e.UserData, cq.CodeLength, 0)
		return
	}
	buf := r.tables.Buffers.Get(e.Buffer)
	if buf == nil {
		r.complete(e.UserData, cq.CodeBadBuffer, 0)
		return
	}
	if !buf.Contains(e.Local, e.Length) {
		r.complete(e.UserData, cq.CodeLocalRange, 0)
		return
	}
	seg := r.tables.Segments.Get(e.Segment)
	if seg == nil {
		r.complete(e.UserData, cq.CodeBadSegment, 0)
		return
	}
	if seg.Resolve(e.Remote, e.Length) < 0 {
		r.complete(e.UserData, cq.CodeRemoteRange, 0)
		return
	}
	reg := buf.Regs[seg.Transport].Load()
	if reg == nil || (reg.Staged && seg.Staged == nil) {
		r.complete(e.UserData, cq.CodeNoTransport, 0)
		return
	}
	// No reference is taken: the request's slot in the in-flight table is
	// the reference, and Uses reports it to an unregistering caller. A
	// buffer or segment that began closing before this point is refused;
	// one that begins after finds the slot when it asks the poller.
	if buf.Closing() {
		r.complete(e.UserData, cq.CodeBadBuffer, 0)
		return
	}
	if seg.Closing() {
		r.complete(e.UserData, cq.CodeBadSegment, 0)
		return
	}
	size := seg.SliceSize
	if size == 0 {
		size = r.cfg.SliceSize
	}
	first := uint64(0) // the token of the first slice's first post
	if e.Flags&sq.FlagNotify == 0 && !r.lent && e.Length <= size && !reg.Staged {
		switch r.copyInline(e, buf, seg, reg.Handle) {
		case inlineDone:
			return
		case inlineRetry:
			first = attemptOne
		}
	}
	idx := r.free[len(r.free)-1]
	r.free = r.free[:len(r.free)-1]
	q := &r.reqs[idx]
	deadline := t + int64(e.Deadline(r.cfg.Timeout))
	if deadline < t { // overflow: no deadline worth the name
		deadline = 1<<63 - 1
	}
	// Field by field: a composite literal with pointers would be built
	// aside and copied with write barriers.
	q.userData, q.buf, q.seg = e.UserData, buf, seg
	q.local, q.remote, q.length = e.Local, e.Remote, e.Length
	q.sliceSize, q.deadline, q.handle = size, deadline, reg.Handle
	q.started = t
	q.nslices, q.rail, q.state, q.op = sliceCount(e.Length, size), r.rail, stActive, transport.Read
	if e.Op == sq.Write {
		q.op = transport.Write
	}
	q.notify, q.tag, q.staged = e.Flags&sq.FlagNotify != 0, e.Tag, reg.Staged
	r.rail++
	r.active++
	if deadline < r.nextCheck || r.active == 1 {
		r.nextCheck = deadline
	}
	if r.cfg.Sink != nil {
		r.cfg.Sink.Started(e.UserData)
	}
	if first != 0 {
		// The inline copy failed: its retry goes to the next rail.
		q.retries++
		r.stats.Retries++
		r.logRetry(q, cq.CodeTransport)
		q.posted = 1
		r.redo = append(r.redo, token(idx, q.gen, 0)+first)
		return
	}
	r.postq = append(r.postq, token(idx, q.gen, 0))
	r.postPending()
}

// Results of copyInline.
const (
	inlineNot   = iota // not tried: the request takes the normal way
	inlineDone         // completed (or failed for good)
	inlineRetry        // the copy failed and is worth a retry on another rail
)

// copyInline moves a one-slice request on a synchronous endpoint at once,
// without a slot: nothing between its checks and its completion lets go of
// the poller's goroutine, so no Uses can come in between, and the request
// needs no reference. It tries nothing when the endpoint is not
// synchronous, or batches (a BatchCopier) and more entries wait to join
// the batch, unless it can say per slice that batching gains nothing (an
// InlineCopier). An endpoint that can (HoldingCopier, InlineCopier) leaves
// its reference on the target's memory in r.holds, which step gives back
// at the end of the round and flush before it calls into any endpoint.
func (r *Ring) copyInline(e *sq.Entry, buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint], handle uint64) int {
	ep := seg.Endpoint
	if len(r.batch) > 0 && r.batchEP == ep {
		// Slices of earlier requests to this endpoint wait in the batch:
		// this one goes after them, as it would have.
		return inlineNot
	}
	op := transport.Read
	if e.Op == sq.Write {
		op = transport.Write
	}
	s := &r.inline
	fill := func() {
		s.Op, s.Rail, s.LocalHandle, s.Token = op, uint16(uint64(r.rail)%uint64(ep.Rails())), handle, 0
		s.Local, s.Remote, s.Length = buf.Pointer(e.Local), e.Remote, e.Length
	}
	var err error
	switch cp := ep.(type) {
	case transport.InlineCopier:
		fill()
		done := false
		done, err = cp.CopyNow(s, &r.holds)
		if !done {
			s.Local = nil
			return inlineNot
		}
	case transport.BatchCopier:
		if len(r.batch) > 0 || r.more {
			return inlineNot // it may join a batch
		}
		fill()
		err = cp.Copy(s)
	case transport.HoldingCopier:
		fill()
		err = cp.CopyHold(s, &r.holds)
	case transport.Copier:
		fill()
		err = cp.Copy(s)
	default:
		return inlineNot
	}
	s.Local = nil // no pointer into the buffer outlives the copy
	code := codeOf(err)
	if code == cq.CodeTransport && r.cfg.RetryLimit > 0 {
		return inlineRetry
	}
	r.rail++
	r.inlineBytes += e.Length
	if r.cfg.Sink != nil {
		r.cfg.Sink.Started(e.UserData)
	}
	bytes := e.Length
	if code != cq.CodeOK {
		bytes = 0
	}
	r.ended(seg, op, e.UserData, code, bytes, 0)
	return inlineDone
}

// sliceCount returns how many slices a request of length n is cut into: a
// tail shorter than a quarter slice joins the slice before it.
func sliceCount(n, size uint64) uint32 {
	c := (n + size - 1) / size
	if c > 1 && n-(c-1)*size < size/4 {
		c--
	}
	if c > 1<<sliceBits-2 {
		// MaxLength keeps this out of reach; stay in range anyway, with
		// index c free for a notification.
		c = 1<<sliceBits - 2
	}
	return uint32(c)
}

// MaxSlice returns the longest slice a ring posts with slice size size:
// a tail shorter than a quarter slice joins the slice before it. (Requests
// of more than 2^28-2 slices would get a longer last slice; MaxLength
// keeps them out of reach.)
func MaxSlice(size uint64) uint64 {
	if size < 4 {
		return size
	}
	return size + size/4 - 1
}

// sliceRange returns the offset and length of slice i of a request.
func sliceRange(n, size uint64, count, i uint32) (off, length uint64) {
	off = uint64(i) * size
	if i == count-1 {
		return off, n - off
	}
	return off, size
}

// live returns the active request a token names, or nil.
func (r *Ring) live(tok uint64) *request {
	idx, gen, _ := splitToken(tok)
	if int(idx) >= len(r.reqs) {
		return nil
	}
	q := &r.reqs[idx]
	if q.gen != gen || q.state != stActive {
		return nil
	}
	return q
}

// postPending appends the unposted slices of queued requests to the batch.
func (r *Ring) postPending() bool {
	if r.postHead > 0 {
		// Keep postq within MaxInFlight entries (its capacity): a request
		// appears in it once, and a refused round must not make it grow.
		r.postq = r.postq[:copy(r.postq, r.postq[r.postHead:])]
		r.postHead = 0
	}
	work := false
	for r.postHead < len(r.postq) {
		tok := r.postq[r.postHead]
		q := r.live(tok)
		for q != nil && q.posted < q.nslices {
			if r.outstanding+len(r.batch) >= r.done.Cap() {
				return work
			}
			idx, gen, _ := splitToken(tok)
			if !r.add(q, token(idx, gen, q.posted)) {
				return work
			}
			work = true
			if r.live(tok) == nil {
				break // a flush ended the request: its slot is free, or reused
			}
			q.posted++
		}
		r.postHead++
	}
	r.postq = r.postq[:0]
	r.postHead = 0
	return work
}

// postRedo posts again the slices that failed or were not accepted. The
// tokens are processed from one buffer while refusals (and retries that a
// synchronous flush produces) gather in the other: no allocation per round.
func (r *Ring) postRedo() bool {
	redo := r.redo
	r.redo = r.spare[:0]
	work := false
	for i, tok := range redo {
		q := r.live(tok)
		if q == nil {
			continue
		}
		if r.outstanding+len(r.batch) >= r.done.Cap() || !r.add(q, tok) {
			r.redo = append(r.redo, redo[i:]...)
			break
		}
		work = true
	}
	r.spare = redo[:0]
	return work
}

// add appends one slice to the batch, flushing first when the batch is full
// or bound to another endpoint. It reports false when the endpoint refused
// slices of the batch (flush queued them for redo) and tok was not added:
// the caller keeps tok and stops for this round. A flush may also end q
// (a synchronous copy failed): then tok is dropped, and add reports true;
// callers check r.live(tok) before touching q again.
func (r *Ring) add(q *request, tok uint64) bool {
	ep := q.seg.Endpoint
	if q.staged {
		ep = q.seg.Staged
	}
	if len(r.batch) == cap(r.batch) || (len(r.batch) > 0 && r.batchEP != ep) {
		if !r.flush() {
			return false
		}
		if r.live(tok) == nil {
			return true
		}
	}
	_, _, i := splitToken(tok)
	rails := ep.Rails()
	r.batchEP = ep
	r.batch = r.batch[:len(r.batch)+1]
	sl := &r.batch[len(r.batch)-1]
	sl.Rail = uint16((uint64(q.rail) + uint64(i) + attempt(tok)) % uint64(rails))
	sl.LocalHandle = q.handle
	sl.Token = tok
	if i == q.nslices { // the notification, after every data slice
		msg := r.message(q.userData)
		sl.Op, sl.Remote, sl.Length = transport.Notify, q.tag, uint64(len(msg))
		sl.Local = unsafe.Pointer(unsafe.SliceData(msg))
		return true
	}
	off, n := sliceRange(q.length, q.sliceSize, q.nslices, i)
	sl.Op = q.op
	sl.Local = q.buf.Pointer(q.local + off)
	sl.Remote, sl.Length = q.remote+off, n
	return true
}

// Messenger is implemented by Sinks that attach a message to the
// notification of a request with FlagNotify.
type Messenger interface {
	// Message returns the message of userData's notification (at most
	// transport.MaxNotifyMessage bytes), valid until the request completes.
	Message(userData uint64) []byte
}

func (r *Ring) message(userData uint64) []byte {
	if m, ok := r.cfg.Sink.(Messenger); ok {
		return m.Message(userData)
	}
	return nil
}

// flush posts the batch and reports whether the endpoint took all of it.
func (r *Ring) flush() bool {
	if len(r.batch) == 0 {
		return true
	}
	// No reference is held across a call into an endpoint: one may wait
	// on a goroutine (shm's control socket reader) that waits for the
	// reference to go.
	r.holds.Release()
	if cp, ok := r.batchEP.(transport.Copier); ok {
		if r.lent {
			// Not on a borrowed goroutine: the poller copies these.
			for i := range r.batch {
				r.redo = append(r.redo, r.batch[i].Token)
			}
			clear(r.batch)
			r.batch = r.batch[:0]
			r.batchEP = nil
			r.deferred = true
			return true
		}
		r.copyBatch(cp)
		return true
	}
	// Count the slices as outstanding before posting: a transport may
	// complete them inside Post.
	for _, s := range r.batch {
		r.reqs[s.Token&(1<<idxBits-1)].outstanding++
	}
	r.outstanding += len(r.batch)
	n, err := r.batchEP.Post(r, r.batch)
	n = min(max(n, 0), len(r.batch)) // slices before n were accepted, error or not
	rest := r.batch[n:]
	for _, s := range rest {
		r.reqs[s.Token&(1<<idxBits-1)].outstanding--
		r.outstanding--
	}
	for _, s := range rest {
		switch {
		case err == nil:
			r.redo = append(r.redo, s.Token)
		case r.live(s.Token) != nil:
			r.fail(s.Token, err)
		}
	}
	all := n == len(r.batch)
	clear(r.batch) // drop pointers into buffers
	r.batch = r.batch[:0]
	r.batchEP = nil
	return all
}

// copyBatch runs the batch on a synchronous endpoint. Each slice is checked
// live just before its copy: an earlier slice of the batch may have ended
// its request, whose buffer must then no longer be touched.
func (r *Ring) copyBatch(cp transport.Copier) {
	var copied uint64
	if bc, ok := cp.(transport.BatchCopier); ok {
		// Every slice moves before any result is applied: no request of
		// the batch can end (and its buffer go back to its owner) while a
		// slice of it is still being copied.
		k := 0
		for i := range r.batch {
			if q := r.live(r.batch[i].Token); q != nil {
				q.outstanding++
				r.outstanding++
				r.batch[k] = r.batch[i]
				k++
			}
		}
		errs := r.errs[:k]
		bc.CopyBatch(r.batch[:k], errs)
		for i := range k {
			r.applySlice(r.batch[i].Token, codeOf(errs[i]))
			copied += r.batch[i].Length
		}
		clear(errs)
	} else {
		r.copyEach(cp, &copied)
	}
	if copied >= 256<<10 {
		r.poller.slow = true
	}
	clear(r.batch)
	r.batch = r.batch[:0]
	r.batchEP = nil
}

// copyEach moves the batch one slice at a time, each checked live just
// before its copy.
func (r *Ring) copyEach(cp transport.Copier, copied *uint64) {
	for i := range r.batch {
		s := &r.batch[i]
		q := r.live(s.Token)
		if q == nil {
			continue
		}
		q.outstanding++
		r.outstanding++
		r.applySlice(s.Token, codeOf(cp.Copy(s)))
		*copied += s.Length
	}
}

// Complete implements transport.Completer: it queues the slice's result for
// the poller. Safe for concurrent use; it never blocks.
func (r *Ring) Complete(tok uint64, err error) {
	d := sliceDone{token: tok, code: codeOf(err)}
	if !r.done.PushOne(&d) {
		// Cannot happen: the poller posts at most done.Cap() slices at once.
		panic("ring: slice completion queue overrun")
	}
	r.wake()
}

// wake gets a slice completion seen to. A parked poller lends its rings: the
// transport goroutine that completed the slice steps them itself rather
// than wake it, one wakeup less between a response and its CQE. An awake
// poller costs one atomic load. (Submit does not borrow: measured, a caller
// stepping the rings, writes included, cost more throughput than the
// wakeup it saved.)
func (r *Ring) wake() {
	p := r.poller
	if p.bell.Armed() && p.token.CompareAndSwap(false, true) {
		more := p.stepLent()
		p.token.Store(false)
		if !more {
			return
		}
	}
	p.bell.Ring()
}

func codeOf(err error) cq.Code {
	switch {
	case err == nil:
		return cq.CodeOK
	case errors.Is(err, transport.ErrDenied):
		return cq.CodeDenied
	case errors.Is(err, transport.ErrRange):
		return cq.CodeRemoteRange
	case errors.Is(err, transport.ErrClosed):
		return cq.CodeClosed
	case errors.Is(err, transport.ErrNotSupported):
		return cq.CodeNoTransport // the transport cannot do this at all (a notification over nvlink)
	}
	return cq.CodeTransport
}

// reap applies slice completions.
func (r *Ring) reap() bool {
	pos, n := r.done.Readable(256)
	for i := 0; i < n; i++ {
		d := r.done.Slot(pos + uint64(i))
		r.applySlice(d.token, d.code)
	}
	r.done.Release(n)
	return n > 0
}

func (r *Ring) applySlice(tok uint64, code cq.Code) {
	idx, gen, i := splitToken(tok)
	if int(idx) >= len(r.reqs) || r.reqs[idx].gen != gen || r.reqs[idx].state == stFree {
		r.stats.Stale++
		return
	}
	q := &r.reqs[idx]
	q.outstanding--
	r.outstanding--
	switch {
	case q.state == stZombie:
		if q.outstanding == 0 {
			r.release(idx)
		}
	case code == cq.CodeOK && i == q.nslices: // the notification was taken
		r.finish(idx, cq.CodeOK)
	case code == cq.CodeOK:
		_, n := sliceRange(q.length, q.sliceSize, q.nslices, i)
		q.bytes += n
		q.done++
		if q.done == q.nslices {
			if q.notify {
				// Every byte is in place: now the notification.
				r.redo = append(r.redo, token(idx, gen, q.nslices))
			} else {
				r.finish(idx, cq.CodeOK)
			}
		}
	case code == cq.CodeTransport && int(q.retries) < r.cfg.RetryLimit:
		q.retries++
		r.stats.Retries++
		r.logRetry(q, code)
		r.redo = append(r.redo, tok+attemptOne)
	default:
		r.finish(idx, code)
	}
}

// fail handles a slice that Post refused with an error.
func (r *Ring) fail(tok uint64, err error) {
	idx, _, _ := splitToken(tok)
	q := &r.reqs[idx]
	code := codeOf(err)
	if code == cq.CodeTransport && int(q.retries) < r.cfg.RetryLimit {
		q.retries++
		r.stats.Retries++
		r.logRetry(q, code)
		r.redo = append(r.redo, tok+attemptOne)
		return
	}
	r.finish(idx, code)
}

// finish completes a request; its slot is released when no slice is out.
func (r *Ring) finish(idx int32, code cq.Code) {
	q := &r.reqs[idx]
	if q.state != stActive {
		return
	}
	bytes := q.bytes
	if code != cq.CodeOK {
		bytes = 0 // a request that did not complete moved no bytes it can rely on
	}
	r.ended(q.seg, q.op, q.userData, code, bytes, max(r.now-q.started, 0))
	q.state = stZombie
	if q.outstanding == 0 {
		r.release(idx)
	}
}

// ended counts a finished request (took d ns, on the poller's clock) and
// queues its completion.
func (r *Ring) ended(seg *segtable.Segment[transport.Endpoint], op transport.Op, userData uint64, code cq.Code, bytes uint64, d int64) {
	if code != cq.CodeOK && r.cfg.Logger != nil {
		r.cfg.Logger.Info("moonring: request ended", "segment", seg.Name, "userdata", userData, "status", code.Status(), "err", code.Err())
	}
	r.countSegment(seg, op, code, bytes)
	if code == cq.CodeOK {
		// The poller's clock of this round: no clock read per request.
		r.latency[min(bits.Len64(uint64(d)>>10), len(r.latency)-1)]++
		r.latencySum += d
	}
	r.complete(userData, code, bytes)
}

// LatencyBuckets is the number of buckets of Ring.Latency: bucket i counts
// requests that took less than 2^(i+10) ns (about 1 µs to 9 min).
const LatencyBuckets = 30

// Latency returns the ring's histogram of completed requests' durations,
// from when the poller took them to their last slice (see LatencyBuckets),
// and the sum of those durations, read on the poller's goroutine (a round
// trip). The poller measures with the clock it reads every few rounds, so
// durations are within a few rounds' time.
func (r *Ring) Latency() (buckets [LatencyBuckets]uint64, sum time.Duration) {
	read := func() { buckets, sum = r.latency, time.Duration(r.latencySum) }
	if r.poller.do(read) != nil {
		read()
	}
	return buckets, sum
}

// SegmentStats are a ring's counters for one segment and op.
type SegmentStats struct {
	Segment   *segtable.Segment[transport.Endpoint]
	Op        transport.Op
	Completed uint64 // requests COMPLETED
	Failed    uint64 // requests that ended otherwise (FAILED, TIMEOUT, CANCELED)
	Bytes     uint64 // bytes moved by completed requests
}

// countSegment adds a finished request to its segment's counters: a slice
// indexed by the segment's table index, grown when a new index first
// appears and reset when another segment takes the index (no allocation
// in the steady state, no atomics).
func (r *Ring) countSegment(seg *segtable.Segment[transport.Endpoint], op transport.Op, code cq.Code, bytes uint64) {
	i := 2*int(uint32(seg.ID)&segtable.MaxEntries) + int(op-transport.Read)&1
	if i >= len(r.perSeg) {
		r.perSeg = append(r.perSeg, make([]SegmentStats, i+1-len(r.perSeg))...)
	}
	st := &r.perSeg[i]
	if st.Segment != seg {
		*st = SegmentStats{Segment: seg, Op: op}
	}
	if code == cq.CodeOK {
		st.Completed++
		st.Bytes += bytes
	} else {
		st.Failed++
	}
}

// SegmentStats calls fn with the ring's counters of every segment and op
// it has finished requests for, on the poller's goroutine (a round trip):
// fn must not block or call back into the ring.
func (r *Ring) SegmentStats(fn func(SegmentStats)) {
	each := func() {
		for _, st := range r.perSeg {
			if st.Segment != nil {
				fn(st)
			}
		}
	}
	if r.poller.do(each) != nil {
		each() // the poller is gone: nothing writes the counters any more
	}
}

func (r *Ring) logRetry(q *request, code cq.Code) {
	if r.cfg.Logger != nil {
		r.cfg.Logger.Info("moonring: slice retried on another rail", "segment", q.seg.Name, "userdata", q.userData, "retry", q.retries, "err", code.Err())
	}
}

func (r *Ring) release(idx int32) {
	q := &r.reqs[idx]
	gen := (q.gen + 1) & (1<<genBits - 1)
	if gen == 0 {
		gen = 1
	}
	q.buf, q.seg = nil, nil
	q.bytes, q.posted, q.done, q.outstanding, q.retries = 0, 0, 0, 0, 0
	q.notify, q.tag = false, 0
	q.gen, q.state = gen, stFree
	r.free = append(r.free, idx)
	r.active--
}

// complete queues a completion for the CQ (or the sink).
func (r *Ring) complete(userData uint64, code cq.Code, bytes uint64) {
	r.stats.Codes[code]++
	switch code {
	case cq.CodeOK:
		r.stats.Requests++
		r.stats.Bytes += bytes
	case cq.CodeTimeout:
		r.stats.Timeouts++
	case cq.CodeCanceled:
		r.stats.Canceled++
	default:
		r.stats.Failed++
	}
	if r.cfg.Sink != nil {
		// A field, not a local: a local passed to an interface method
		// would escape to the heap on every completion.
		r.sinkCQE = cq.Completion{UserData: userData, Bytes: bytes, Status: code.Status(), Code: code}
		r.cfg.Sink.Complete(&r.sinkCQE)
		return
	}
	r.cqes = append(r.cqes, cq.Completion{UserData: userData, Bytes: bytes, Status: code.Status(), Code: code})
	// While taking, cqes may grow past its capacity: take pops at most 64
	// entries, but posting one can end earlier requests too (a failed
	// post), so up to 64+MaxInFlight; rare, and the capacity is kept.
	if len(r.cqes) >= cap(r.cqes) && !r.taking {
		r.flushCQ()
	}
}

func (r *Ring) flushCQ() {
	if len(r.cqes) > 0 {
		r.cq.PostBatch(r.cqes)
		r.cqes = r.cqes[:0]
	}
}

// cancel finishes the active request with userData.
//
// A request taken in this round may have slices cut and not yet posted:
// they leave the batch first, since once the request's slot is released
// (at once, with no slice out) nothing may reach the transport in its name.
func (r *Ring) cancel(userData uint64) {
	for i := range r.reqs {
		if q := &r.reqs[i]; q.state == stActive && q.userData == userData {
			r.batch = slices.DeleteFunc(r.batch, func(s transport.Slice) bool { return s.Token&(1<<idxBits-1) == uint64(i) })
			r.finish(int32(i), cq.CodeCanceled)
			return
		}
	}
}

// expire times out overdue requests and computes the next deadline.
func (r *Ring) expire(t int64) {
	next := int64(1<<63 - 1)
	for i := range r.reqs {
		q := &r.reqs[i]
		if q.state != stActive {
			continue
		}
		if q.deadline <= t {
			r.finish(int32(i), cq.CodeTimeout)
		} else if q.deadline < next {
			next = q.deadline
		}
	}
	r.nextCheck = next
}

// shutdown completes everything with ErrClosed: entries left in the SQ and
// active requests. Poller only.
func (r *Ring) shutdown() {
	r.drainSQ()
	for i := range r.reqs {
		r.finish(int32(i), cq.CodeClosed)
	}
	r.flushCQ()
	r.detached = true
	r.shutOnce.Do(func() { close(r.shut) })
}

// drainSQ completes the entries left in the SQ with ErrClosed. Poller only.
func (r *Ring) drainSQ() {
	for {
		pos, n := r.sq.Peek(64)
		if n == 0 {
			break
		}
		for i := 0; i < n; i++ {
			if e := r.sq.Entry(pos + uint64(i)); e.Op != sq.Cancel {
				r.complete(e.UserData, cq.CodeClosed, 0)
			}
		}
		r.sq.Advance(n)
	}
	r.flushCQ()
}

// uses reports whether a request in the table (active or waiting for its
// slices) names buf or seg. Poller only.
func (r *Ring) uses(buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint]) bool {
	if r.active == 0 {
		return false
	}
	for i := range r.reqs {
		q := &r.reqs[i]
		if q.state != stFree && ((buf != nil && q.buf == buf) || (seg != nil && q.seg == seg)) {
			return true
		}
	}
	return false
}

// draining reports whether a detached ring still has slices out.
func (r *Ring) draining() bool { return r.active > 0 }
