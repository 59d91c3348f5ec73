// ring.go holds the Ring's types and its caller's side: Config and its
// defaults, the Sink, the in-flight table's request slots and the tokens
// that name their slices, New, and the methods callers use (Submit,
// Cancel, Peek, Advance, Close). The poller's side is in intake.go,
// post.go, copy.go, retry.go and complete.go; counters in stats.go.

package ring

import (
	"fmt"
	"log/slog"
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
	// Class is the ring's priority class; its slices carry it to the
	// transports. Its poller steps rings of a higher class first, and while
	// one of them is busy (it took or completed a request within the last
	// 100 µs, or has one in flight and took or completed one within 10
	// ms), rings of a lower class start nothing new (they still reap
	// completions and time requests out); one that has waited
	// PollerConfig.Promote with work pending takes one entry and waits
	// again, so it is never starved. The hold is per poller: it covers a
	// lower-class ring's traffic to every peer. The default is
	// transport.ClassNormal.
	Class transport.Class
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
	// slices are being posted. A request that completes as it is taken (a
	// one-slice copy on the poller) goes straight to Complete.
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
	if c.MaxInFlight < 1 || c.MaxInFlight > 1<<idxBits || c.RetryLimit < 0 || c.Timeout < 0 || c.Class >= transport.NumClasses {
		return fmt.Errorf("ring: bad config: MaxInFlight %d, RetryLimit %d, Timeout %v, Class %v", c.MaxInFlight, c.RetryLimit, c.Timeout, c.Class)
	}
	return nil
}

// Tables are the engine's buffer and segment tables that rings resolve
// entries against.
type Tables struct {
	Buffers  *segtable.Buffers
	Segments *segtable.Segments[transport.Endpoint]
	// Lists holds the prepared lists that entries with sq.FlagList name
	// (nil: such entries complete with CodeInvalid).
	Lists *Lists
	// PathDown, when set before rings use the tables, hears of each path
	// a ring marked down (segtable.Segment.Fail): a request failed on it
	// for a reason of the path while another path of the segment was up,
	// and new requests take that one now. It runs on a poller (or a
	// goroutine it lent its rings to), once per path marked down, and
	// must not block (the engine queues it for its health manager).
	PathDown func(*segtable.Segment[transport.Endpoint], *segtable.Path[transport.Endpoint])
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
	// roomWaiters counts the submitters in WaitRoom; room carries the
	// poller's wakeup to one of them (room.go).
	roomWaiters atomic.Int32
	room        chan struct{}
	_           cpu.CacheLinePad

	// Poller-owned state below: only the holder of the poller's token (its
	// goroutine, or a goroutine it lent its rings to while parked) touches it.
	cfg    Config
	tables *Tables
	reqs   []request
	free   []int32 // free slots (stack)
	// queues hold the requests with slices left to post, a FIFO per
	// endpoint (postq.go); queueByEP finds them, lastQ is the last one
	// found, spareQ dropped ones kept for reuse, qturn the queue
	// postPending starts at, queued the requests in them all.
	queues      []*postQueue
	queueByEP   map[transport.Endpoint]*postQueue
	lastQ       *postQueue
	spareQ      []*postQueue
	qturn       int
	queued      int
	redo        []uint64 // slice tokens to post again
	spare       []uint64 // redo's other buffer
	qredo       int      // live requests' slice tokens in the queues' redo lists (postQueue.redo)
	qspare      []uint64 // a queue's redo list's other buffer
	batch       []transport.Slice
	errs        []error // results of a BatchCopier, as long as batch's capacity
	batchEP     transport.Endpoint
	batchMax    int // the batch's slices at most, for batchEP (postWidth)
	cqes        []cq.Completion
	sinkCQE     cq.Completion
	inline      transport.Slice // copyInline's slice (a field: it would escape)
	inlineMoved bool            // copyInline failed for a reason of its path, and another path is up
	inlineCode  cq.Code         // the code it failed with then
	inlineBytes uint64          // bytes copyInline moved this round
	postedBytes uint64          // bytes of the slices add batched this round
	holds       transport.Holds // references copyInline's copies hold until the round ends or a flush
	more        bool            // take has more entries this round after the one it starts
	taking      bool            // take has entries in hand that the SQ still holds: cqes waits
	outstanding int             // slices posted and not yet completed
	reaped      uint64          // slice completions applied, ever
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
	// took: the ring's last take started entries (the poller holds lower
	// classes back for the rest of the round); heldSince: when the ring
	// started waiting behind a higher class with work pending (0: it is
	// not waiting). See hold.
	took      bool
	heldSince int64
	// lastEnd is the round's clock when the ring last completed a
	// request (see noteBusy).
	lastEnd int64
	// takenAt is the round's clock when the ring last took entries.
	takenAt int64
	// yieldAt: the bytes of inline copies after which take stops for the
	// round (yieldBytes while the poller has a ring of a higher class;
	// else noYield).
	yieldAt uint64

	// driving is set while SubmitDriven steps the rings it borrowed: the
	// slices it posts to drivenEP (the first endpoint posted to that is a
	// transport.Driver) are marked Driven. interruptDue: the round ended
	// a request by timeout, cancel or close (see drive.go).
	driving      bool
	drivenEP     transport.Endpoint
	interruptDue bool
	// until is SubmitAndWait's condition (a field: a local would escape);
	// the CQ's one reader owns it.
	until cqUntil

	stats Stats
	_     cpu.CacheLinePad

	// drv are the Drivers SubmitDriven calls are driving, for Interrupt;
	// any goroutine, under drvMu.
	drvMu sync.Mutex
	drv   []transport.Driver
}

type sliceDone struct {
	token uint64
	code  cq.Code
	path  bool // the error was one of the path (isPath): another path may carry the slice
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
	path        *segtable.Path[transport.Endpoint] // the path its slices go to now
	local       uint64
	remote      uint64
	length      uint64
	sliceSize   uint64 // for a list's request: its longest block (see maxSlice)
	deadline    int64
	bytes       uint64
	handle      uint64
	rindex      uint32 // the remote buffer's position (a segtable.Pos), as Resolve found it (transport.Slice.RemoteIndex)
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
	staged      bool   // the local buffer goes through path.Staged (a staged registration)
	pinned      bool   // sq.FlagTransportOnly: it never leaves path
	forgive     uint32 // slices that were out on a path it left: their failures cost no retry
	tag         uint64 // the notification's tag
	// blocks are the list's blocks a request with sq.FlagList moves, one
	// a slice (nil for others), of list, which it holds until it
	// finishes; rvaries says they lie in several remote buffers, so that
	// rindex is only the first's.
	list    *List
	blocks  []Block
	rvaries bool
	// pq is the queue of its endpoint while it has slices left to post
	// (postq.go), qnext and qprev its neighbours there.
	pq           *postQueue
	qnext, qprev int32
	// qredo counts its slices in queues' redo lists (postQueue.redo),
	// which Ring.qredo sums over the live requests: finish takes them
	// off, so that the tokens an ended request leaves there (dropped
	// when their queue is next served) keep no poller awake.
	qredo int32
	// gone is set when the request ends with slices still out (a
	// zombie), cleared when its slot is released: a copy worker skips
	// the slices of a request that is gone (share.go). The only field a
	// goroutine other than the token holder reads.
	gone atomic.Bool
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
		sq: s, cq: c, done: d, poller: p, cfg: cfg, tables: tables, shut: make(chan struct{}), room: make(chan struct{}, 1), drv: make([]transport.Driver, 0, 4),
		reqs:      make([]request, cfg.MaxInFlight),
		free:      make([]int32, cfg.MaxInFlight),
		queueByEP: make(map[transport.Endpoint]*postQueue),
		batch:     make([]transport.Slice, 0, wideCap),
		errs:      make([]error, wideCap),
		cqes:      make([]cq.Completion, 0, 64),
		yieldAt:   noYield,
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
// not allocate. When the poller is parked and the ring has no request in
// flight, Submit steps the rings on the caller's goroutine instead of
// waking the poller: the entries are checked and posted to their
// transports (a TCP frame written) before it returns, and only
// synchronous copies (local, shm) are left to the poller, which it then
// wakes. Safe for concurrent use.
func (r *Ring) Submit(es []sq.Entry) (int, error) {
	if r.closed.Load() {
		return 0, ErrClosed
	}
	n := r.sq.PushQuiet(es)
	if n > 0 {
		r.poller.submitted(r) // a parked poller lends its rings: this goroutine may post the entries
	}
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
