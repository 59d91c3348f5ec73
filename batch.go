package moonring

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/ring"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// BatchID names a batch of transfer tasks from AllocateBatchID until
// FreeBatchID. It packs a slot and a generation, so a freed ID is refused
// even after its slot is reused.
type BatchID uint64

// Opcode is the direction of a TransferRequest: the Op of a ring Entry,
// one type for both APIs.
//
// Deprecated: use Op.
type Opcode = Op

// The directions of a TransferRequest, as Mooncake names them: OpRead and
// OpWrite. The zero Op (OpNop) is not a transfer and is refused.
const (
	// Read moves bytes from the target segment into the local memory.
	Read = OpRead
	// Write moves bytes from the local memory into the target segment.
	Write = OpWrite
)

// TransferRequest is one task of a batch, as in Mooncake's transfer engine.
// Its local memory is named either by address (Source) or, as a ring Entry
// names it, by registered buffer and offset (Buffer and Local).
type TransferRequest struct {
	// Opcode is Read or Write.
	Opcode Op
	// Source is the address of the local memory: it must lie, with Length
	// bytes after it, inside one registered buffer. See AddressOf. It must
	// be 0 when Buffer is set.
	Source uintptr
	// Buffer, when not 0, names the local buffer (as RegisterLocalMemory
	// returned it) and Local the offset in it, instead of Source.
	Buffer BufferID
	Local  uint64
	// TargetID is the segment (LocalSegmentID for the engine's own memory).
	TargetID SegmentID
	// TargetOffset is the address in the target segment, as Mooncake
	// has it, or with TargetBuffer the offset in that buffer.
	TargetOffset uint64
	// TargetBuffer, when not 0, names the remote buffer by its place in
	// the segment's buffers (Engine.Segment(TargetID).Buffers), counted
	// from 1: TargetBuffer 1 is Buffers[0]. The buffers are as the engine
	// last saw the segment's descriptor; a peer that registers or
	// unregisters buffers changes their places, so an address is the
	// steadier name across republishes.
	TargetBuffer int
	// Length is the number of bytes to move.
	Length uint64
	// Timeout bounds the task from SubmitTransfer (not from when a poller
	// takes it): a task not done by then ends TIMEOUT. 0 means the
	// engine's Config.Timeout. A task that timed out may still have slices
	// out at its transport (TransferStatus says when that matters); they
	// end by the transport's own deadline (tcp.Config.ResponseTimeout, 30
	// s by default), which an UnregisterLocalMemory of its buffer waits
	// for.
	Timeout time.Duration
	// Notify, on a Write, delivers a notification to the target engine
	// once the bytes are in its memory; the task completes only after.
	// Msg (at most 4096 bytes) must stay unchanged until the task ends.
	Notify *Notify
	// Transport, when set, names the transport the task prefers ("tcp",
	// "shm", ...): it takes the segment's path through it while that path
	// is up, else the segment's current path (and fails over as any
	// task). A name no installed transport has is refused
	// (ErrNoSuchTransport).
	Transport string
	// TransportOnly makes Transport the only transport the task may take:
	// it FAILs at once with ErrTransportDown when the segment's path
	// through it is down or not open, and never fails over.
	TransportOnly bool
	// Class is the task's priority class (default ClassNormal): the batch
	// API keeps a ring per NUMA node and class. See Class.
	Class Class
	// List, when not 0, makes the task a run of a prepared list
	// (PrepareList): Count of its blocks from First on, each between
	// Buffer (which must be set) at the block's offset and TargetID at
	// the block's address. Source, Local, TargetOffset, TargetBuffer and
	// Length must then be 0. The task's Bytes once COMPLETED are the
	// run's; a block outside the buffer or the segment fails the task
	// before any of them moves.
	List         ListID
	First, Count int
}

// Notify is the notification a TransferRequest delivers.
type Notify struct {
	Tag uint64
	Msg []byte
}

// AddressOf returns the address of b's first byte, for TransferRequest.Source
// and for the TargetOffset of memory a peer registered.
func AddressOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// TransferStatus is a task's status and the bytes it moved. A task that
// ended TIMEOUT or CANCELED (or FAILED on a transport error) may still have
// slices out at the transport, as with any transfer engine: the READ's
// local range can still change until its buffer's UnregisterLocalMemory
// returns, which waits for them.
type TransferStatus struct {
	Status Status
	// Bytes is the number of bytes moved: Length once COMPLETED (a list
	// task's: the sum of its run's blocks), else 0.
	Bytes uint64
	// Code says why a task did not complete.
	Code Code
}

// Err returns the task's error: nil unless it FAILED, timed out or was
// canceled. It never allocates.
func (s TransferStatus) Err() error { return s.Code.Err() }

type task struct {
	// state is the cq.Status in its low byte and the cq.Code above it,
	// one word so that a completion stores it at once. A terminal state is
	// stored after bytes, and publishes them.
	state atomic.Uint32
	// bytes is written by whoever makes the task terminal (and only then:
	// AllocateBatchID does not reset it), before state.
	bytes atomic.Uint64
	ring  atomic.Int32 // the ring that runs it, node<<2 | class; stored before submit
	msg   []byte       // the notification's message; written before submit
}

// packState packs a task's state word.
func packState(s cq.Status, c cq.Code) uint32 { return uint32(s) | uint32(c)<<8 }

// status returns the task's status.
func (t *task) status() Status { return Status(t.state.Load() & 0xff) }

type batch struct {
	// mu is held by SubmitTransfer and FreeBatchID (before the table's
	// lock): a batch is not freed, and its slot reused, under a submit.
	mu  sync.Mutex
	gen atomic.Uint32 // the generation in the low 16 bits; batchFree set while free
	// tasks holds every task the slot has room for; it only grows, so a
	// reader with a stale ID indexes memory that is still a task array.
	// The batch's tasks are the first size.
	tasks      atomic.Pointer[[]task]
	size       atomic.Int64
	submitted  atomic.Int64  // tasks submitted; written by the one filling goroutine
	unfinished atomic.Int64  // submitted and not terminal
	done       chan struct{} // signaled when unfinished reaches 0 and waiting is set
	waiting    atomic.Bool
	// room times a submit's wait for room in a full SQ (see push); made
	// at the slot's first such wait, kept for its later batches, used
	// under mu.
	room *time.Timer
}

// task returns task i, or nil when i is not one of the batch's. A reader
// that may hold a stale ID checks the generation again after reading.
func (b *batch) task(i int) *task {
	ts := b.tasks.Load()
	if ts == nil || i < 0 || int64(i) >= b.size.Load() || i >= len(*ts) {
		return nil
	}
	return &(*ts)[i]
}

// finish counts k submitted tasks off as terminal and wakes a WaitBatch
// when none is left.
func (b *batch) finish(k int64) {
	if b.unfinished.Add(-k) == 0 && b.waiting.Load() {
		select {
		case b.done <- struct{}{}:
		default:
		}
	}
}

// Done reports whether every submitted task of the batch is terminal: the
// condition Transfer drives its answers until (transport.Until).
func (b *batch) Done() bool { return b.unfinished.Load() <= 0 }

// MaxBatchTasks bounds the tasks of one batch (AllocateBatchID).
const MaxBatchTasks = 1 << 20

// batchTable holds the engine's batches and the rings that serve them.
type batchTable struct {
	e     *Engine
	mu    sync.Mutex // guards free, rings and the allocation of slots
	slots []batch
	free  []int
	rings map[ringKey]*ring.Ring // per NUMA node and class, made on first use
	// fast mirrors rings for nodes below 64, read without the lock on
	// every SubmitTransfer.
	fast [transport.NumClasses][64]atomic.Pointer[ring.Ring]
}

// ringKey names a batch ring.
type ringKey struct {
	node  int
	class Class
}

func (bt *batchTable) init(e *Engine, n int) {
	bt.e = e
	bt.slots = make([]batch, n)
	bt.free = make([]int, n)
	for i := range bt.slots {
		bt.free[i] = n - 1 - i
		bt.slots[i].done = make(chan struct{}, 1)
	}
	bt.rings = map[ringKey]*ring.Ring{}
}

func (bt *batchTable) close() {
	bt.mu.Lock()
	rings := bt.rings
	bt.rings = nil
	bt.mu.Unlock()
	for _, r := range rings {
		r.Close()
	}
}

// ring returns the batch ring of a node and class.
func (bt *batchTable) ring(node int, class Class) (*ring.Ring, error) {
	if class >= transport.NumClasses {
		return nil, fmt.Errorf("class %d: %w", class, ErrInvalid)
	}
	if node >= 0 && node < len(bt.fast[class]) {
		if r := bt.fast[class][node].Load(); r != nil && !r.Closed() {
			return r, nil
		}
	}
	bt.mu.Lock()
	defer bt.mu.Unlock()
	if r := bt.rings[ringKey{node, class}]; r != nil {
		return r, nil
	}
	if bt.rings == nil {
		return nil, ErrClosed
	}
	e := bt.e
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return nil, ErrClosed
	}
	n := e.cfg.BatchEntries
	r, err := ring.New(ring.Config{
		Entries: n, MaxInFlight: n, SliceSize: e.cfg.SliceSize, RetryLimit: e.cfg.RetryLimit,
		Timeout: e.cfg.Timeout, Sink: (*batchSink)(bt), Logger: e.cfg.Logger, Class: class,
	}, &e.tables, e.poller(node))
	if err != nil {
		return nil, fmt.Errorf("moonring: batch ring: %w", err)
	}
	bt.rings[ringKey{node, class}] = r
	if node >= 0 && node < len(bt.fast[class]) {
		bt.fast[class][node].Store(r)
	}
	return r, nil
}

// userData packs a task's address: slot, generation, task index.
func userData(slot int, gen uint32, task int) uint64 {
	return uint64(slot) | uint64(gen&0xffff)<<16 | uint64(task)<<32
}

func (bt *batchTable) lookup(id BatchID) (*batch, error) {
	slot, gen := int(id&0xffff), id.gen()
	if id>>32 != 0 || slot >= len(bt.slots) || gen == 0 || bt.slots[slot].gen.Load() != gen {
		return nil, fmt.Errorf("moonring: batch %#x: %w", uint64(id), ErrBadBatch)
	}
	return &bt.slots[slot], nil
}

// gen returns the generation the ID names.
func (id BatchID) gen() uint32 { return uint32(id >> 16 & 0xffff) }

// stale returns ErrBadBatch, wrapped, when b no longer is the batch id
// names (freed, perhaps reused, since lookup).
func (b *batch) stale(id BatchID) error {
	if b.gen.Load() != id.gen() {
		return fmt.Errorf("moonring: batch %#x: freed: %w", uint64(id), ErrBadBatch)
	}
	return nil
}

// batchSink stores completions of the batch rings into task status.
type batchSink batchTable

func (s *batchSink) task(ud uint64) (*batch, *task) {
	slot, gen, t := int(ud&0xffff), uint32(ud>>16&0xffff), int(ud>>32)
	if slot >= len(s.slots) {
		return nil, nil
	}
	b := &s.slots[slot]
	if b.gen.Load() != gen {
		return nil, nil
	}
	return b, b.task(t)
}

// Started marks the task PENDING.
func (s *batchSink) Started(ud uint64) {
	if _, t := s.task(ud); t != nil {
		t.state.Store(packState(cq.Pending, 0))
	}
}

// Message returns the message of a task's notification.
func (s *batchSink) Message(ud uint64) []byte {
	if _, t := s.task(ud); t != nil {
		return t.msg
	}
	return nil
}

// Complete stores the task's terminal status.
func (s *batchSink) Complete(c *cq.Completion) {
	b, t := s.task(c.UserData)
	if t == nil {
		return
	}
	t.bytes.Store(c.Bytes)
	t.state.Store(packState(c.Status, c.Code))
	b.finish(1)
}

// AllocateBatchID reserves a batch of up to n tasks. Free it with
// FreeBatchID once its tasks are terminal.
func (e *Engine) AllocateBatchID(n int) (BatchID, error) {
	if e.closed.Load() {
		return 0, ErrClosed
	}
	if n <= 0 || n > MaxBatchTasks {
		return 0, fmt.Errorf("moonring: allocate batch of %d tasks (1..%d): %w", n, MaxBatchTasks, ErrBadBatch)
	}
	bt := &e.batches
	bt.mu.Lock()
	defer bt.mu.Unlock()
	if len(bt.free) == 0 {
		return 0, fmt.Errorf("moonring: allocate batch: %w (%d)", ErrTooManyBatches, len(bt.slots))
	}
	slot := bt.free[len(bt.free)-1]
	bt.free = bt.free[:len(bt.free)-1]
	b := &bt.slots[slot]
	ts := b.tasks.Load()
	if ts == nil || len(*ts) < n {
		grown := make([]task, n)
		ts = &grown
		b.tasks.Store(ts)
	}
	for i := range (*ts)[:n] {
		t := &(*ts)[i]
		t.state.Store(packState(cq.Waiting, 0))
	}
	b.size.Store(int64(n))
	b.submitted.Store(0)
	b.unfinished.Store(0)
	gen := (b.gen.Load() + 1) & 0xffff
	if gen == 0 {
		gen = 1
	}
	// Advance the stored generation past the free marker; a later store of
	// gen publishes the reset tasks to the sink.
	b.gen.Store(gen)
	return BatchID(uint64(slot) | uint64(gen)<<16), nil
}

// FreeBatchID releases a batch. It fails with ErrBusy while tasks are not
// terminal; the batch stays allocated then.
func (e *Engine) FreeBatchID(id BatchID) error {
	bt := &e.batches
	b, err := bt.lookup(id)
	if err != nil {
		return err
	}
	b.mu.Lock() // not under a SubmitTransfer
	defer b.mu.Unlock()
	bt.mu.Lock()
	defer bt.mu.Unlock()
	if err := b.stale(id); err != nil {
		return err // freed by another call meanwhile
	}
	if n := b.unfinished.Load(); n > 0 {
		for i := 0; i < int(b.submitted.Load()); i++ {
			if !b.task(i).status().Terminal() {
				return fmt.Errorf("moonring: free batch %#x: %d tasks unfinished: %w", uint64(id), n, ErrBusy)
			}
		}
		// Every task is terminal: the sink stored the last status and has
		// yet to count it off, a few instructions away. A caller that saw
		// the status may free the batch; wait for the count.
		for b.unfinished.Load() > 0 {
			runtime.Gosched()
		}
	}
	// Keep the generation: a freed ID must not come back to life when the
	// slot is allocated again.
	b.gen.Store(b.gen.Load() | batchFree)
	bt.free = append(bt.free, int(id&0xffff))
	return nil
}

// batchFree marks a batch's generation while the batch is free.
const batchFree = 1 << 16

// SubmitTransfer checks reqs and appends them to the batch as tasks
// (numbered from the number already submitted). It submits none when a
// request is bad (an unregistered source range, an unknown segment, a
// zero length) or the batch is too small. Without allocating (but for a
// timer made once per batch slot), it waits, parked, for room in the
// submission queue up to half the engine's Timeout; tasks it
// could not submit by then are FAILED and ErrSQFull is returned (the
// tasks it did submit run, and all of reqs count as submitted). One
// goroutine at a time should submit to a given batch.
func (e *Engine) SubmitTransfer(id BatchID, reqs []TransferRequest) error {
	return e.submitTransfer(id, reqs, false, 0)
}

// submitTransfer is SubmitTransfer. With drive, a caller about to wait for
// the batch (Transfer) reads the answers to its last push itself when it
// posts them itself (ring.SubmitDriven), until the batch is done or
// deadline (UnixNano; 0: none).
func (e *Engine) submitTransfer(id BatchID, reqs []TransferRequest, drive bool, deadline int64) error {
	b, err := e.batches.lookup(id)
	if err != nil {
		return err
	}
	b.mu.Lock() // no FreeBatchID meanwhile
	defer b.mu.Unlock()
	if err := b.stale(id); err != nil {
		return err
	}
	if done, size := int(b.submitted.Load()), int(b.size.Load()); done+len(reqs) > size {
		return fmt.Errorf("moonring: submit %d tasks to batch of %d with %d submitted: %w", len(reqs), size, done, ErrBatchFull)
	}
	var last *segtable.Buffer // the buffer of the request before: a batch's tasks mostly share one
	for i := range reqs {
		buf, err := e.check(&reqs[i], last)
		if err != nil {
			return fmt.Errorf("moonring: submit task %d: %w", int(b.submitted.Load())+i, err)
		}
		last = buf
	}
	slot, gen := int(id&0xffff), id.gen()
	base := int(b.submitted.Load())
	var es [32]sq.Entry
	submitted := ring.Now() // tasks' deadlines count from here
	lastNode := 0
	last = nil
	for next := 0; next < len(reqs); {
		node, class, n := -1, Class(0), 0
		for next < len(reqs) && n < len(es) {
			req := &reqs[next]
			task := base + next
			// Checked above: only the buffer is looked up again (a
			// buffer unregistered since, or one its ID names no more,
			// fails the task when the poller takes it).
			buf := e.localBuffer(req, last)
			if buf == nil {
				// Unregistered by another goroutine since: this task
				// fails on its own.
				gone := ErrNotRegistered
				if req.Buffer != 0 {
					gone = ErrBadBuffer
				}
				e.failTasks(b, task, 1, cq.CodeOf(gone))
				next++
				continue
			}
			if buf != last {
				last, lastNode = buf, nodeOf(buf.Location)
			}
			tn := lastNode
			if node >= 0 && (tn != node || req.Class != class) {
				break // one ring per push
			}
			node, class = tn, req.Class
			t := b.task(task)
			t.ring.Store(int32(node)<<2 | int32(class))
			local := req.Local
			if req.Buffer == 0 {
				local = uint64(req.Source - buf.Addr)
			}
			timeout := req.Timeout
			if timeout <= 0 {
				timeout = e.cfg.Timeout
			}
			deadline := submitted + int64(timeout)
			if deadline < submitted {
				deadline = 1<<63 - 1
			}
			remote, err := e.remote(req)
			if err != nil { // checked above; the peer republished since
				e.failTasks(b, task, 1, cq.CodeOf(err))
				next++
				continue
			}
			es[n] = sq.Entry{Op: req.Opcode, Flags: sq.FlagDeadline, Segment: req.TargetID, Buffer: buf.ID, Local: local,
				Remote: remote, Length: req.Length, UserData: userData(slot, gen, task), Timeout: uint64(deadline)}
			if req.List != 0 {
				es[n].Flags |= sq.FlagList
				es[n].Local, es[n].Remote, es[n].Length = uint64(req.List), uint64(req.First), uint64(req.Count)
			}
			if req.Transport != "" {
				ts, err := e.TransportSlot(req.Transport)
				if err != nil { // checked above; uninstalled since
					e.failTasks(b, task, 1, cq.CodeTransportDown)
					next++
					continue
				}
				es[n].Transport, es[n].Flags = ts, es[n].Flags|sq.FlagTransportPrefer
				if req.TransportOnly {
					es[n].Flags ^= sq.FlagTransportPrefer | sq.FlagTransportOnly
				}
			}
			t.msg = nil
			if req.Notify != nil {
				es[n].Flags, es[n].Tag = es[n].Flags|sq.FlagNotify, req.Notify.Tag
				t.msg = req.Notify.Msg
			}
			n++
			next++
		}
		if n == 0 {
			continue
		}
		r, err := e.batches.ring(node, class)
		if err == nil {
			b.unfinished.Add(int64(n))
			var pushed int
			if drive && next == len(reqs) {
				pushed, err = r.SubmitDriven(es[:n], b, deadline)
				if err == ring.ErrSQFull {
					var more int
					more, err = e.push(r, es[pushed:n], b)
					pushed += more
				}
			} else {
				pushed, err = e.push(r, es[:n], b)
			}
			if err != nil {
				// Those pushed may all have ended meanwhile: a waiter
				// must hear of the count reaching 0 here too.
				b.finish(int64(n - pushed))
				es[0] = es[pushed] // the first entry not pushed
			}
		}
		if err != nil {
			// Tasks pushed before the error run and end as usual; the rest
			// fail here. All count as submitted, so no later call reuses
			// their numbers.
			first := int(es[0].UserData >> 32)
			e.failTasks(b, first, base+len(reqs)-first, cq.CodeOf(err))
			b.submitted.Store(int64(base + len(reqs)))
			return fmt.Errorf("moonring: submit to batch %#x: %w", uint64(id), err)
		}
	}
	b.submitted.Store(int64(base + len(reqs)))
	return nil
}

// check resolves a request's local side to its buffer and checks its
// length and segment. hint, if not nil, is a buffer registered a moment
// ago (the request before's), tried before the lookup by address.
func (e *Engine) check(req *TransferRequest, hint *segtable.Buffer) (*segtable.Buffer, error) {
	if req.Opcode != Read && req.Opcode != Write {
		return nil, fmt.Errorf("opcode %s (want Read or Write): %w", req.Opcode, ErrInvalid)
	}
	switch {
	case req.List != 0:
		if err := e.checkListTask(req); err != nil {
			return nil, err
		}
	case req.First != 0 || req.Count != 0:
		return nil, fmt.Errorf("First and Count without a List: %w", ErrInvalid)
	case req.Length == 0:
		return nil, ErrLength
	}
	if req.Class >= transport.NumClasses {
		return nil, fmt.Errorf("class %d: %w", req.Class, ErrInvalid)
	}
	if req.Notify != nil && (req.Opcode != Write || len(req.Notify.Msg) > transport.MaxNotifyMessage) {
		return nil, fmt.Errorf("notify on a %s of %d message bytes: %w", req.Opcode, len(req.Notify.Msg), ErrInvalid)
	}
	var buf *segtable.Buffer
	switch {
	case req.Buffer != 0 && req.Source != 0:
		return nil, fmt.Errorf("both Source and Buffer set: %w", ErrInvalid)
	case req.Buffer != 0:
		if buf = e.buffers.Get(req.Buffer); buf == nil {
			return nil, fmt.Errorf("buffer %d: %w", req.Buffer, ErrBadBuffer)
		}
		if req.List == 0 && !buf.Contains(req.Local, req.Length) {
			return nil, fmt.Errorf("buffer %d [%d, +%d): %w", req.Buffer, req.Local, req.Length, ErrLocalRange)
		}
	default:
		if buf = e.localBuffer(req, hint); buf == nil {
			return nil, fmt.Errorf("source [%#x, +%d): %w", req.Source, req.Length, ErrNotRegistered)
		}
	}
	if e.segments.Get(req.TargetID) == nil {
		return nil, fmt.Errorf("segment %d: %w", req.TargetID, ErrBadSegment)
	}
	if req.Transport != "" {
		if _, err := e.TransportSlot(req.Transport); err != nil {
			return nil, fmt.Errorf("transport %q: %w", req.Transport, err)
		}
	} else if req.TransportOnly {
		return nil, fmt.Errorf("TransportOnly without a Transport: %w", ErrInvalid)
	}
	if _, err := e.remote(req); err != nil {
		return nil, err
	}
	return buf, nil
}

// checkListTask checks the fields of a task that moves a run of a
// prepared list (TransferRequest.List); its blocks are the poller's to
// check.
func (e *Engine) checkListTask(req *TransferRequest) error {
	if req.Buffer == 0 || req.Source != 0 || req.Local != 0 || req.TargetOffset != 0 || req.TargetBuffer != 0 || req.Length != 0 {
		return fmt.Errorf("a list's task sets Buffer, and no Source, Local, TargetOffset, TargetBuffer or Length: %w", ErrInvalid)
	}
	n := e.lists.Blocks(req.List)
	if n == 0 {
		return fmt.Errorf("list %d: not prepared, or freed: %w", req.List, ErrInvalid)
	}
	if req.First < 0 || req.Count < 1 || req.Count > n-req.First {
		return fmt.Errorf("blocks [%d, +%d) of a list of %d: %w", req.First, req.Count, n, ErrInvalid)
	}
	return nil
}

// localBuffer returns the registered buffer of a request's local side, or
// nil: the one Buffer names, or the one that holds [Source, +Length),
// hint when it does (no lookup), else the one the address index finds.
func (e *Engine) localBuffer(req *TransferRequest, hint *segtable.Buffer) *segtable.Buffer {
	if req.Buffer != 0 {
		return e.buffers.Get(req.Buffer)
	}
	if hint != nil && req.Source >= hint.Addr && hint.Contains(uint64(req.Source-hint.Addr), req.Length) {
		return hint
	}
	return e.buffers.Find(req.Source, req.Length)
}

// remote returns a request's remote address: TargetOffset, or the offset
// TargetOffset in the remote buffer TargetBuffer names.
func (e *Engine) remote(req *TransferRequest) (uint64, error) {
	if req.TargetBuffer == 0 {
		return req.TargetOffset, nil
	}
	s := e.segments.Get(req.TargetID)
	if s == nil {
		return 0, fmt.Errorf("segment %d: %w", req.TargetID, ErrBadSegment)
	}
	b, ok := s.Buffer(req.TargetBuffer - 1)
	if !ok {
		return 0, fmt.Errorf("remote buffer %d of the %d segment %q offers: %w", req.TargetBuffer, s.NumBuffers(), s.Name, ErrRemoteRange)
	}
	if req.TargetOffset > b.Length || req.Length > b.Length-req.TargetOffset {
		return 0, fmt.Errorf("remote buffer %d [%d, +%d) of %d bytes: %w", req.TargetBuffer, req.TargetOffset, req.Length, b.Length, ErrRemoteRange)
	}
	return b.Addr + req.TargetOffset, nil
}

// push submits es, waiting for room up to half the engine's timeout, and
// returns how many it pushed. On error the entries not pushed are counted
// off by the caller; those pushed run. With a batch (its mu held: the
// batch's timer is the caller's) it parks until the poller takes entries
// (ring.WaitRoom), its deadline on the batch's timer, made once per
// batch slot; without one (a cancel, which may run beside a submit) it
// polls, yielding, then sleeping.
func (e *Engine) push(r *ring.Ring, es []sq.Entry, b *batch) (int, error) {
	var deadline time.Time
	pushed := 0
	for spins := 0; ; spins++ {
		n, err := r.Submit(es[pushed:])
		pushed += n
		if err == nil {
			return pushed, nil
		}
		if err != ring.ErrSQFull {
			return pushed, err
		}
		if deadline.IsZero() {
			// Half the timeout: a ring blocked longer than the timeout
			// starts timing out what waits in its SQ, and giving up here
			// first keeps "pushed" and "failed here" apart.
			deadline = time.Now().Add(e.cfg.Timeout / 2)
		}
		left := time.Until(deadline)
		if left <= 0 {
			return pushed, err
		}
		switch {
		case b != nil:
			if b.room == nil {
				b.room = time.NewTimer(left)
			} else {
				b.room.Reset(left)
			}
			err = r.WaitRoom(b.room.C)
			b.room.Stop()
			if err != nil {
				return pushed, err
			}
		case spins < 64:
			runtime.Gosched()
		default:
			time.Sleep(50 * time.Microsecond)
		}
	}
}

// failTasks marks n tasks from first FAILED with code (they were never
// pushed).
func (e *Engine) failTasks(b *batch, first, n int, code cq.Code) {
	for i := first; i < first+n; i++ {
		t := b.task(i)
		if t == nil {
			break
		}
		if t.status().Terminal() {
			continue // failed on its own already: its code stays
		}
		t.bytes.Store(0)
		t.state.Store(packState(cq.Failed, code))
	}
}

// GetTransferStatus returns the status of one task (WAITING for one of
// the batch's tasks not yet submitted). It takes no lock and does not
// allocate.
func (e *Engine) GetTransferStatus(id BatchID, taskID int) (TransferStatus, error) {
	b, err := e.batches.lookup(id)
	if err != nil {
		return TransferStatus{}, err
	}
	t := b.task(taskID)
	if t == nil {
		if err := b.stale(id); err != nil {
			return TransferStatus{}, err
		}
		return TransferStatus{}, fmt.Errorf("moonring: task %d of batch of %d: %w", taskID, b.size.Load(), ErrBadBatch)
	}
	st := t.read()
	if err := b.stale(id); err != nil {
		return TransferStatus{}, err // what was read may be another batch's
	}
	return st, nil
}

// read returns the task's status: bytes and code only once it is
// terminal (bytes are stored before the state word, and read before it
// they could pair PENDING with the result of the completion that follows).
func (t *task) read() TransferStatus {
	s := t.state.Load()
	st := TransferStatus{Status: Status(s & 0xff)}
	if st.Status.Terminal() {
		st.Bytes, st.Code = t.bytes.Load(), Code(s>>8)
	}
	return st
}

// GetBatchTransferStatus fills dst with the status of the batch's first
// len(dst) tasks (at most the batch's size) and returns how many it filled.
func (e *Engine) GetBatchTransferStatus(id BatchID, dst []TransferStatus) (int, error) {
	b, err := e.batches.lookup(id)
	if err != nil {
		return 0, err
	}
	n := 0
	for ; n < len(dst); n++ {
		t := b.task(n)
		if t == nil {
			break
		}
		dst[n] = t.read()
	}
	if err := b.stale(id); err != nil {
		return 0, err
	}
	return n, nil
}

// CancelTransfer cancels a task that is not yet complete; it then ends
// CANCELED. A task already terminal is left alone.
func (e *Engine) CancelTransfer(id BatchID, taskID int) error {
	b, err := e.batches.lookup(id)
	if err != nil {
		return err
	}
	t := b.task(taskID)
	if t == nil || taskID >= int(b.submitted.Load()) {
		return fmt.Errorf("moonring: cancel task %d: %w", taskID, ErrBadBatch)
	}
	if t.status().Terminal() {
		return nil
	}
	k := t.ring.Load()
	r, err := e.batches.ring(int(k>>2), Class(k&3))
	if err != nil {
		return err
	}
	// The ID's generation, not the slot's: were the batch freed and its
	// slot reused meanwhile, this cancels nothing of the new batch.
	_, err = e.push(r, []sq.Entry{{Op: sq.Cancel, Remote: userData(int(id&0xffff), id.gen(), taskID)}}, nil)
	return err
}

// WaitBatch blocks until every submitted task of the batch is terminal or
// ctx is done. One goroutine at a time may wait on a given batch.
func (e *Engine) WaitBatch(ctx context.Context, id BatchID) error {
	b, err := e.batches.lookup(id)
	if err != nil {
		return err
	}
	b.waiting.Store(true)
	defer b.waiting.Store(false)
	for b.unfinished.Load() > 0 {
		select {
		case <-b.done:
		case <-ctx.Done():
			return fmt.Errorf("moonring: wait batch %#x: %w", uint64(id), ctx.Err())
		}
	}
	select { // drop a signal left from a race with the last completion
	case <-b.done:
	default:
	}
	return nil
}

// SubmitTransferAndWait is SubmitTransfer then WaitBatch(ctx, id), for a
// caller that waits for what it submits. When the engine's poller is idle
// and ctx can never be canceled (context.Background,
// context.WithoutCancel), it posts the requests on the caller's goroutine
// and, over tcp, reads their answers there too instead of sleeping until a
// transport goroutine wakes it: one goroutine hand-off less per answer,
// which at one request in flight is most of the time above the network's
// (see ring.SubmitAndWait); the wait then ends with the tasks, each of
// which has its deadline (Timeout). A ctx that can end is waited on
// without reading the answers (a read on the socket would not see it end). The
// error is SubmitTransfer's, or WaitBatch's (wrapping ctx's error). The
// rules of both apply: one goroutine at a time submits to and waits on a
// given batch.
func (e *Engine) SubmitTransferAndWait(ctx context.Context, id BatchID, reqs []TransferRequest) error {
	if err := e.submitDriven(ctx, id, reqs); err != nil {
		return err
	}
	return e.WaitBatch(ctx, id)
}

// submitDriven is SubmitTransferAndWait's submit: driven when ctx can
// never end.
func (e *Engine) submitDriven(ctx context.Context, id BatchID, reqs []TransferRequest) error {
	return e.submitTransfer(id, reqs, ctx.Done() == nil, 0)
}

// Transfer runs reqs as one batch and waits for all of them. It returns
// nil when every request completed, else the first task's error with its
// index. When ctx ends first the unfinished requests are canceled, and the
// error of one that did not complete matches ErrCanceled and the context's
// error (context.Canceled or context.DeadlineExceeded), so a caller tells
// its own deadline from a CancelTransfer. With ctx already done it submits
// nothing and returns such an error.
func (e *Engine) Transfer(ctx context.Context, reqs ...TransferRequest) error {
	if err := ctx.Err(); err != nil {
		// Not submitted: the requests could otherwise complete before
		// their cancellation reached the poller, and a caller whose
		// deadline had passed would see them done.
		return fmt.Errorf("moonring: transfer: %w (%w)", ErrCanceled, err)
	}
	id, err := e.AllocateBatchID(len(reqs))
	if err != nil {
		return err
	}
	if err := e.submitDriven(ctx, id, reqs); err != nil {
		e.WaitBatch(context.Background(), id)
		e.FreeBatchID(id)
		return err
	}
	werr := e.WaitBatch(ctx, id)
	if werr != nil {
		for i := range reqs {
			e.CancelTransfer(id, i)
		}
		e.WaitBatch(context.Background(), id)
	}
	defer e.FreeBatchID(id)
	for i := range reqs {
		st, _ := e.GetTransferStatus(id, i)
		if st.Status != COMPLETED {
			if werr != nil {
				return fmt.Errorf("moonring: transfer %d: %s: %w (%w)", i, st.Status, st.Err(), ctx.Err())
			}
			return fmt.Errorf("moonring: transfer %d: %s: %w", i, st.Status, st.Err())
		}
	}
	return nil
}
