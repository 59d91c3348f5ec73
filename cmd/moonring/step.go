// step.go holds one step of a bench sweep (an op and a block size for a
// duration): the goroutines that drive requests through the batch API or
// the Ring API, their latencies, and the check of the bytes after.

package main

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/moonring/moonring"
)

// opMix asks step for WRITEs on even blocks and READs on odd ones.
const opMix = moonring.Op(0xff)

// step runs one op and block size for d: threads goroutines, each with
// batches batches of depth requests in flight (with the Ring API, its own
// Ring and depth*batches entries in flight), each request on its own block
// of both buffers; then it checks the bytes. Every request's end is
// counted in the result's Statuses. A request that does not complete ends
// the step with its error; with keepGoing it is counted and its block
// used again, the step runs to its end, checks the blocks whose last
// request completed (the others are Unchecked) and returns its result
// with a *requestsError.
func (t *target) step(ctx context.Context, op moonring.Op, size, depth, batches, threads int, d time.Duration, verify, useRing, cpu, keepGoing bool) (result, error) {
	askedThreads, askedDepth, askedBatches := threads, depth, batches
	blocks := len(t.model) / size
	threads = max(1, min(threads, blocks))
	depth = max(1, min(depth, blocks/threads))
	batches = max(1, min(batches, blocks/(threads*depth)))
	perThread := depth * batches // blocks of each thread's own
	total := perThread * threads
	res := result{Transport: t.transport, Op: op.String(), BlockSize: size, Block: fmtSize(size), Batch: depth, BatchAsked: askedDepth, Batches: batches, Threads: threads, API: "batch"}
	switch {
	case batches < askedBatches && depth == askedDepth && threads == askedThreads:
		res.Note = fmt.Sprintf("%d batch(es) in flight (asked %d): the %s buffer holds %d blocks of %s", batches, askedBatches, fmtSize(len(t.model)), blocks, res.Block)
	case threads < askedThreads:
		res.Note = fmt.Sprintf("threads %d, batch %d (asked %d of %d): the %s buffer holds %d blocks of %s", threads, depth, askedThreads, askedDepth, fmtSize(len(t.model)), blocks, res.Block)
	case depth < askedDepth:
		res.Note = fmt.Sprintf("batch %d (asked %d): the %s buffer holds %d blocks of %s", depth, askedDepth, fmtSize(len(t.model)), blocks, res.Block)
		if threads > 1 {
			res.Note += fmt.Sprintf(", %d per thread", blocks/threads)
		}
	}
	if useRing {
		res.API = "ring"
	}
	opOf := func(slot int) moonring.Op {
		switch {
		case op != opMix:
			return op
		case slot%2 == 0:
			return moonring.OpWrite
		}
		return moonring.OpRead
	}
	if op == opMix {
		res.Op = "mix"
	}
	span := size * total
	local, err := t.ini.Alloc(span, "cpu:0")
	if err != nil {
		return res, err
	}
	defer t.ini.Free(local)
	for i := range local {
		local[i] = byte(i*13 + size) // distinct from pattern: a READ that moves nothing shows
	}
	lid, err := t.ini.RegisterLocalMemory(local, "cpu:0", false)
	if err != nil {
		return res, err
	}
	defer t.ini.UnregisterLocalMemory(context.Background(), local)
	rings := make([]*moonring.Ring, threads)
	for k := range rings {
		if rings[k], err = t.ini.NewRing(moonring.RingConfig{Entries: 1024}); err != nil {
			return res, err
		}
		defer rings[k].Close()
	}
	entry := func(slot int, op moonring.Op) *moonring.Entry {
		off := uint64(slot * size)
		return &moonring.Entry{Op: op, Segment: t.seg, Buffer: lid, Local: off, Remote: t.base + off, Length: uint64(size), UserData: uint64(slot)}
	}
	type outcome struct {
		requests int
		elapsed  time.Duration
		lat      []time.Duration
		err      error
		ends     endings
	}
	outs := make([]outcome, threads)
	failed := make([]bool, total) // by slot: its last request did not complete
	for k := range outs {
		outs[k].ends = endings{keepGoing: keepGoing, failed: failed}
	}
	if t.progress != nil {
		stop := t.progress(res, d)
		defer stop()
	}
	var win *cpuWindow
	if cpu {
		// The window each thread measures: after its warm-up of d/5, d long.
		t0 := time.Now()
		win = startCPUWindow(t, t0.Add(d/5), t0.Add(d/5+d))
	}
	var wg sync.WaitGroup
	for k := range threads {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := &outs[k]
			if useRing {
				o.requests, o.elapsed, o.lat, o.err = drive(ctx, rings[k], k*perThread, perThread, d, &o.ends, func(slot int) *moonring.Entry { return entry(slot, opOf(slot)) })
				return
			}
			o.requests, o.elapsed, o.lat, o.err = driveBatches(ctx, t.ini, k*perThread, depth, batches, d, &o.ends, func(slot int) moonring.TransferRequest {
				en := entry(slot, opOf(slot))
				op := moonring.Read
				if en.Op == moonring.OpWrite {
					op = moonring.Write
				}
				return moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(local) + uintptr(en.Local), TargetID: t.seg, TargetOffset: en.Remote, Length: en.Length}
			})
		}()
	}
	wg.Wait()
	if win != nil {
		win.wait()
		win.fill(&res, 0, 0)
	}
	var lat []time.Duration
	ends := endings{keepGoing: keepGoing, failed: failed}
	for _, o := range outs {
		if o.err != nil {
			return res, t.stepError(o.err)
		}
		res.Requests += o.requests
		if o.requests > 0 {
			res.GBps += float64(o.requests) * float64(size) / o.elapsed.Seconds() / 1e9
			res.ReqPerSec += float64(o.requests) / o.elapsed.Seconds()
		}
		lat = append(lat, o.lat...)
		ends.counts.add(o.ends.counts)
		if ends.first == nil {
			ends.first = o.ends.first
		}
	}
	if len(lat) > 0 {
		res.setLatency(lat)
	}
	// done returns the result as it stands: with a *requestsError when a
	// request did not complete (keepGoing; else a goroutine's error ended
	// the step above).
	done := func() (result, error) {
		res.Statuses = ends.counts
		if ends.first != nil {
			return res, &requestsError{counts: ends.counts, first: t.stepError(ends.first)}
		}
		return res, nil
	}
	// Every written block was written with the same bytes each time, but
	// one whose last WRITE did not complete holds what it held before, or
	// part of it (a WRITE's bytes land as its slices do).
	written := 0
	for slot := range total {
		if opOf(slot) == moonring.OpWrite && !failed[slot] {
			b := slot * size
			copy(t.model[b:b+size], local[b:b+size])
			written++
		}
	}
	if !verify {
		return done()
	}
	if written > 0 {
		// Read the written blocks back into the local buffer, cleared first.
		r := rings[0]
		for slot := range total {
			if opOf(slot) != moonring.OpWrite || failed[slot] {
				continue
			}
			clear(local[slot*size : (slot+1)*size])
			if err := r.SubmitOne(entry(slot, moonring.OpRead)); err != nil {
				return res, err
			}
			ends.counts.submitted(1)
		}
		cqes := make([]moonring.Completion, written)
		for got := 0; got < written; {
			if err := r.CQ().Wait(ctx, 1); err != nil {
				return res, err
			}
			n := r.PeekBatch(cqes)
			for _, c := range cqes[:n] {
				if err := ends.ended(int(c.UserData), c.Status, c.Code); err != nil {
					return res, fmt.Errorf("reading the written blocks back: %w", t.stepError(err))
				}
			}
			r.Advance(n)
			got += n
		}
	}
	// A block whose last request did not complete (or, written, whose
	// read-back did not) is not checked: what it holds is not known.
	for slot := range total {
		b := slot * size
		switch {
		case failed[slot]:
			res.Unchecked++
		case !bytes.Equal(local[b:b+size], t.model[b:b+size]):
			return res, fmt.Errorf("the data differs from what the step wrote or the target held (block %d of %s at offset %d)", slot, res.Block, b)
		}
	}
	res.Verified = true
	return done()
}

// driveBatches is drive through the batch API, as Mooncake's bench does
// with one batch: rounds of a batch of depth requests (AllocateBatchID,
// SubmitTransfer, WaitBatch, every status checked, FreeBatchID) for d after
// a warm-up of d/5, with batches such rounds in flight, each over depth
// blocks of its own from first: while the caller checks one batch the
// others keep the pipeline full. A request's latency is its batch's; only
// completed requests are measured. Every request's end goes to ends.
func driveBatches(ctx context.Context, e *moonring.Engine, first, depth, batches int, d time.Duration, ends *endings, req func(slot int) moonring.TransferRequest) (int, time.Duration, []time.Duration, error) {
	type round struct {
		reqs    []moonring.TransferRequest
		id      moonring.BatchID
		started time.Time
		live    bool // submitted, not yet freed
	}
	rounds := make([]round, batches)
	for b := range rounds {
		rounds[b].reqs = make([]moonring.TransferRequest, depth)
		for i := range depth {
			rounds[b].reqs[i] = req(first + b*depth + i)
		}
	}
	// abandon ends what is in flight after an error: canceled tasks end
	// at once, and the batches are freed.
	abandon := func() {
		for b := range rounds {
			r := &rounds[b]
			if !r.live {
				continue
			}
			for i := range r.reqs {
				e.CancelTransfer(r.id, i)
			}
			e.WaitBatch(context.Background(), r.id)
			e.FreeBatchID(r.id)
			r.live = false
		}
	}
	// With one batch in flight each round is waited for as soon as it is
	// submitted: SubmitTransferAndWait does both, and reads the answers
	// on this goroutine where the transport allows it (tcp). It drives
	// only under a ctx that cannot end: an interrupt of the command is
	// seen when the round ends (the tasks' own deadlines bound it).
	one := batches == 1
	wctx := context.WithoutCancel(ctx)
	submit := func(r *round) error {
		id, err := e.AllocateBatchID(depth)
		if err != nil {
			return err
		}
		r.id, r.started, r.live = id, time.Now(), true
		if one {
			err = e.SubmitTransferAndWait(wctx, id, r.reqs)
		} else {
			err = e.SubmitTransfer(id, r.reqs)
		}
		if err != nil {
			return err // abandon waits out what was pushed
		}
		ends.counts.submitted(depth)
		return nil
	}
	st := make([]moonring.TransferStatus, depth)
	lat := make([]time.Duration, 0, 1<<16)
	requests := 0
	t0 := time.Now()
	warm, warmed := d/5, false
	for b := range rounds {
		if err := submit(&rounds[b]); err != nil {
			abandon()
			return 0, 0, nil, err
		}
	}
	for b, live := 0, batches; live > 0; b = (b + 1) % batches {
		r := &rounds[b]
		if !r.live {
			continue
		}
		if !one { // else submit waited
			if err := e.WaitBatch(ctx, r.id); err != nil {
				abandon()
				return 0, 0, nil, err
			}
		}
		now := time.Now()
		took := now.Sub(r.started)
		n, err := e.GetBatchTransferStatus(r.id, st)
		completed := 0
		if err == nil {
			for i := range st[:n] {
				if err = ends.ended(first+b*depth+i, st[i].Status, st[i].Code); err != nil {
					break
				}
				if st[i].Status == moonring.COMPLETED {
					completed++
				}
			}
		}
		e.FreeBatchID(r.id)
		r.live = false
		if err != nil {
			abandon()
			return 0, 0, nil, err
		}
		requests += completed
		moved.Add(int64(completed) * int64(r.reqs[0].Length))
		for range completed {
			lat = append(lat, took)
		}
		if !warmed && now.Sub(t0) >= warm {
			warmed, t0 = true, now
			requests, lat = 0, lat[:0]
		}
		if warmed && now.Sub(t0) >= d {
			live-- // this round ends; the others drain
			continue
		}
		if err := submit(r); err != nil {
			abandon()
			return 0, 0, nil, err
		}
	}
	return requests, time.Since(t0), lat, nil
}

// drive keeps depth requests in flight on r over the blocks first ..
// first+depth-1 for d after a warm-up of d/5 (run and then forgotten: the
// first requests pay for cold caches and connections). It returns the
// requests measured (completed ones), the time they took and their
// latencies. Every request's end goes to ends.
func drive(ctx context.Context, r *moonring.Ring, first, depth int, d time.Duration, ends *endings, entry func(slot int) *moonring.Entry) (int, time.Duration, []time.Duration, error) {
	if depth == 1 {
		return driveOne(ctx, r, first, d, ends, entry)
	}
	started := make([]time.Time, first+depth)
	lat := make([]time.Duration, 0, 1<<16)
	cqes := make([]moonring.Completion, depth)
	submit := func(slot int) error {
		started[slot] = time.Now()
		if err := r.SubmitOne(entry(slot)); err != nil {
			return err
		}
		ends.counts.submitted(1)
		return nil
	}
	requests := 0
	t0 := time.Now()
	warm, warmed := d/5, false
	for slot := first; slot < first+depth; slot++ {
		if err := submit(slot); err != nil {
			return 0, 0, nil, err
		}
	}
	for inflight := depth; inflight > 0; {
		n := r.PeekBatch(cqes)
		if n == 0 {
			if err := r.CQ().Wait(ctx, 1); err != nil {
				return 0, 0, nil, err
			}
			continue
		}
		now := time.Now()
		for _, c := range cqes[:n] {
			slot := int(c.UserData)
			if err := ends.ended(slot, c.Status, c.Code); err != nil {
				return 0, 0, nil, err
			}
			if c.Status == moonring.COMPLETED {
				lat = append(lat, now.Sub(started[slot]))
				requests++
				moved.Add(int64(c.Bytes))
			}
			inflight--
			if !warmed && now.Sub(t0) >= warm {
				warmed, t0 = true, now
				requests, lat = 0, lat[:0]
			}
			if !warmed || now.Sub(t0) < d {
				if err := submit(slot); err != nil {
					return 0, 0, nil, err
				}
				inflight++
			}
		}
		r.Advance(n)
	}
	return requests, time.Since(t0), lat, nil
}

// driveOne is drive with one request in flight: each is submitted and
// waited for by Ring.SubmitAndWait, which reads its answer on this
// goroutine where the transport allows it (tcp). It drives only under a
// ctx that cannot end: an interrupt of the command is seen when the
// request ends (its own deadline bounds it).
func driveOne(ctx context.Context, r *moonring.Ring, slot int, d time.Duration, ends *endings, entry func(slot int) *moonring.Entry) (int, time.Duration, []time.Duration, error) {
	wctx := context.WithoutCancel(ctx)
	lat := make([]time.Duration, 0, 1<<16)
	requests := 0
	t0 := time.Now()
	warm, warmed := d/5, false
	for {
		start := time.Now()
		if _, err := r.SubmitAndWait(wctx, unsafe.Slice(entry(slot), 1), 1); err != nil {
			return 0, 0, nil, err
		}
		ends.counts.submitted(1)
		now := time.Now()
		c := r.Peek()
		if err := ends.ended(slot, c.Status, c.Code); err != nil {
			return 0, 0, nil, err
		}
		if c.Status == moonring.COMPLETED {
			lat = append(lat, now.Sub(start))
			requests++
			moved.Add(int64(c.Bytes))
		}
		r.Advance(1)
		if !warmed && now.Sub(t0) >= warm {
			warmed, t0 = true, now
			requests, lat = 0, lat[:0]
		}
		if warmed && now.Sub(t0) >= d {
			return requests, time.Since(t0), lat, nil
		}
	}
}
