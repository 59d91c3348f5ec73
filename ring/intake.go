// intake.go holds the poller's round over one ring (step, and stepLent for
// a goroutine that borrows a parked poller's rings), when the ring next
// needs its poller, and the SQ intake: taking entries while slots are free,
// checking each against the buffer and segment tables, and starting it in
// a slot of the in-flight table.

package ring

import (
	"time"
	"unsafe"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// now is the poller's clock: nanoseconds since process start, monotonic.
var epoch = time.Now()

func now() int64 { return int64(time.Since(epoch)) }

// Now returns the time on the rings' clock, in nanoseconds: the clock of
// the deadlines of entries with sq.FlagDeadline. It never goes back.
func Now() int64 { return now() }

// headDeadline is when the entry at the head of the SQ of a ring blocked
// since blocked (no free slot) times out: its own deadline with
// sq.FlagDeadline, else blocked plus its timeout.
func (r *Ring) headDeadline(e *sq.Entry, blocked int64) int64 {
	return e.DeadlineAt(blocked, r.cfg.Timeout)
}

// step does one round of work and reports whether it did any. Poller only.
func (r *Ring) step(t int64, held bool) bool {
	r.now = t
	work := r.reap()
	r.took = false
	if limit := r.hold(t, held); limit > 0 {
		if len(r.redo) > 0 {
			work = r.postRedo() || work
		}
		if len(r.queues) > 0 {
			work = r.postPending() || work
		}
		work = r.take(t, limit) || work
	}
	r.flush()
	if r.inlineBytes >= 256<<10 || r.postedBytes >= 256<<10 {
		// The round may have taken long (a copy on the poller, or a
		// transport that writes in Post): the deadlines are checked at
		// the time it ends, else a request whose slices all complete
		// before the next round would be reaped there as done, however
		// late (reap comes before expire).
		t = now()
		r.now = t
		r.poller.slow = true // and the poller reads its clock again
	}
	if r.active > 0 && t >= r.nextCheck {
		r.expire(t)
	}
	r.holds.Release()
	r.inlineBytes, r.postedBytes = 0, 0
	r.flushCQ()
	return work
}

// stepLent is step for a goroutine borrowing a parked poller's rings (see
// Poller.lend): a transport goroutine that just completed a slice, or a
// submitter. It does everything step does but synchronous copies, which
// could be large: their slices are left for the poller, and stepLent
// reports that it must wake (as it does for any work left).
func (r *Ring) stepLent(t int64, held bool) (wake bool) {
	r.lent = true
	r.step(t, held)
	r.lent = false
	deferred := r.deferred
	r.deferred = false
	// A held ring's entries wait for the hold to end, which the poller's
	// timer sees (it parks for at most linger while one is held).
	return deferred || (r.ready() && !(held && r.done.Empty()))
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
	if len(r.redo) > 0 || r.queued > 0 || r.qredo > 0 {
		at = t + int64(100*time.Microsecond)
	}
	if r.active > 0 {
		at = min(at, r.nextCheck)
	}
	if r.blockedSince != 0 {
		if pos, n := r.sq.Peek(1); n == 1 {
			at = min(at, r.headDeadline(r.sq.Entry(pos), r.blockedSince))
		}
	}
	return at
}

// take pops new entries while slots are free: maxTake a round, or more
// while they fill the open batch of a transport.WidePoster (up to its
// width; it stops at the first entry past maxTake that does not join it).
//
// While every slot is taken the ring is blocked: a request at the head of
// the SQ then times out once the ring has been blocked for longer than the
// request's timeout, without a slot, so that no request waits past its
// deadline for one (slots come back only when transports return slices).
func (r *Ring) take(t int64, limit int) bool {
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
	max := min(limit, len(r.free)+1) // +1: Nops and Cancels need no slot
	if limit == maxTake {
		// Past maxTake only while a wide endpoint's batch has room.
		max = min(wideCap, len(r.free)+1)
	}
	pos, n := r.sq.Peek(max)
	i := 0
	for ; i < n; i++ {
		if i >= limit && !r.widening() {
			break
		}
		e := r.sq.Entry(pos + uint64(i))
		if (e.Op == sq.Read || e.Op == sq.Write) && len(r.free) == 0 {
			if r.blockedSince == 0 {
				r.blockedSince = t
			}
			if t < r.headDeadline(e, r.blockedSince) {
				break
			}
			r.complete(e.UserData, cq.CodeTimeout, 0)
			continue
		}
		r.more = i < min(n, limit)-1 || (i < n-1 && r.widening())
		had := len(r.batch)
		r.start(e, t)
		if r.inlineBytes >= r.yieldAt {
			i++
			break // a higher class may be waiting: see yieldBytes
		}
		if i >= limit && len(r.batch) <= had {
			i++
			break // past maxTake, and this entry did not join the wide batch
		}
	}
	r.more = false
	if len(r.free) > 0 {
		r.blockedSince = 0
	}
	r.sq.Advance(i)
	if i > 0 {
		r.wakeRoom()
	}
	r.taking = false
	r.took = i > 0
	if i > 0 {
		r.takenAt = t
	}
	return i > 0
}

// reserved reports whether e has non-zero reserved bytes.
func reserved(e *sq.Entry) bool {
	// Entry is 64 bytes of 8-byte-aligned fields, so viewing it as eight
	// words is sound; the words hold the reserved bytes at fixed places.
	w := (*[8]uint64)(unsafe.Pointer(e))
	return w[0]>>24&0xff != 0 || w[1]>>32 != 0
}

// badHint reports whether e's transport hint is malformed: both hint
// flags, a Transport without a hint flag, or a slot out of range.
func badHint(e *sq.Entry) bool {
	h := e.Flags & sq.FlagsTransport
	return h == sq.FlagsTransport || (h == 0 && e.Transport != 0) || int(e.Transport) >= segtable.MaxTransports
}

func (r *Ring) start(e *sq.Entry, t int64) {
	if e.Flags&^sq.FlagsMask != 0 || reserved(e) || badHint(e) || !e.Op.Valid() || (e.Flags&sq.FlagNotify != 0 && e.Op != sq.Write) {
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
	list := e.Flags&sq.FlagList != 0
	if !list && (e.Length == 0 || e.Length > r.cfg.MaxLength) {
		r.complete(e.UserData, cq.CodeLength, 0)
		return
	}
	if e.Flags&sq.FlagDeadline != 0 && int64(min(e.Timeout, 1<<63-1)) <= t {
		r.complete(e.UserData, cq.CodeTimeout, 0) // its deadline passed in the SQ
		return
	}
	buf := r.tables.Buffers.Get(e.Buffer)
	if buf == nil {
		r.complete(e.UserData, cq.CodeBadBuffer, 0)
		return
	}
	if !list && !buf.Contains(e.Local, e.Length) {
		r.complete(e.UserData, cq.CodeLocalRange, 0)
		return
	}
	seg := r.tables.Segments.Get(e.Segment)
	if seg == nil {
		r.complete(e.UserData, cq.CodeBadSegment, 0)
		return
	}
	var (
		run    listRun
		length = e.Length
		ri     int
	)
	if list {
		var code cq.Code
		if run, code = r.checkList(e, buf, seg); code != cq.CodeOK {
			r.complete(e.UserData, code, 0)
			return
		}
		length, ri = run.bytes, int(run.rindex)
	} else if ri = seg.Resolve(e.Remote, e.Length); ri < 0 {
		r.complete(e.UserData, cq.CodeRemoteRange, 0)
		return
	}
	path := seg.Path()
	if e.Flags&sq.FlagsTransport != 0 {
		// A hint: a scan of the segment's few paths, only for requests
		// that carry one.
		hp := seg.PathOf(int(e.Transport))
		switch {
		case e.Flags&sq.FlagTransportOnly != 0 && (hp == nil || hp.Down()):
			r.refuseRun(e.UserData, cq.CodeTransportDown, run.list)
			return
		case hp != nil && !hp.Down():
			path = hp
		}
	}
	reg := buf.Regs[path.Transport].Load()
	if reg == nil || (reg.Staged && path.Staged == nil) {
		r.refuseRun(e.UserData, cq.CodeNoTransport, run.list)
		return
	}
	// No reference is taken: the request's slot in the in-flight table is
	// the reference, and Uses reports it to an unregistering caller. A
	// buffer or segment that began closing before this point is refused;
	// one that begins after finds the slot when it asks the poller.
	if buf.Closing() {
		r.refuseRun(e.UserData, cq.CodeBadBuffer, run.list)
		return
	}
	if seg.Closing() {
		r.refuseRun(e.UserData, cq.CodeBadSegment, run.list)
		return
	}
	size := path.SliceSize
	if size == 0 {
		size = r.cfg.SliceSize
	}
	if list {
		if run.maxLen > MaxSlice(size) {
			// A block moves as one slice, and the path's transport
			// takes none longer than its slice size allows (a staged
			// buffer's bounce buffers, a provider's largest message).
			r.refuseRun(e.UserData, cq.CodeLength, run.list)
			return
		}
		size = run.maxLen // its longest slice, for a failover's check (request.maxSlice)
	}
	if !list && r.yieldAt != noYield && size > yieldBytes {
		// A ring of a higher class shares the poller: copies on the
		// poller go in slices of yieldBytes, so that its requests wait
		// for one such slice, not a whole large one. (A list's blocks
		// are not cut, and its size stays its longest block's.)
		if _, ok := path.Endpoint.(transport.Copier); ok && path.Staged == nil {
			size = yieldBytes
		}
	}
	first := uint64(0) // the token of the first slice's first post
	if !list && e.Flags&sq.FlagNotify == 0 && !r.lent && e.Length <= size && !reg.Staged && !r.sharing(e.Length, path.Endpoint) {
		switch r.copyInline(e, buf, seg, path, reg.Handle, uint32(ri)) {
		case inlineDone:
			return
		case inlineRetry:
			first = attemptOne
		}
	}
	idx := r.free[len(r.free)-1]
	r.free = r.free[:len(r.free)-1]
	q := &r.reqs[idx]
	deadline := e.DeadlineAt(t, r.cfg.Timeout)
	// Field by field: a composite literal with pointers would be built
	// aside and copied with write barriers.
	q.userData, q.buf, q.seg, q.path = e.UserData, buf, seg, path
	q.local, q.remote, q.length = e.Local, e.Remote, length
	q.sliceSize, q.deadline, q.handle, q.rindex = size, deadline, reg.Handle, uint32(ri)
	q.started = t
	q.rail, q.state, q.op = r.rail, stActive, transport.Read
	q.list, q.blocks, q.rvaries = run.list, run.blocks, run.varies // nil, nil, false but for a list's
	if list {
		q.nslices = uint32(len(run.blocks))
	} else {
		q.nslices = sliceCount(length, size)
	}
	if e.Op == sq.Write {
		q.op = transport.Write
	}
	q.notify, q.tag, q.staged = e.Flags&sq.FlagNotify != 0, e.Tag, reg.Staged
	q.pinned = e.Flags&sq.FlagTransportOnly != 0
	r.rail++
	r.active++
	if deadline < r.nextCheck || r.active == 1 {
		r.nextCheck = deadline
	}
	if r.cfg.Sink != nil {
		r.cfg.Sink.Started(e.UserData)
	}
	if first != 0 && r.inlineMoved {
		// The inline copy failed for a reason of its path, and another
		// path is up: the request moves there (or, pinned, ends).
		r.inlineMoved = false
		q.posted = 1
		r.pathFailed(idx, token(idx, q.gen, 0), r.inlineCode)
		return
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
	r.postQueue(r.enqueue(idx))
}

// widening reports whether the open batch is a wide endpoint's with room:
// take goes on past maxTake to fill it.
func (r *Ring) widening() bool {
	return len(r.batch) > 0 && r.batchMax > batchCap && len(r.batch) < r.batchMax
}
