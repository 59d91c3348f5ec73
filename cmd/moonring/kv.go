// kv.go holds bench's KV-cache workload (--pattern kv): a paged pool on
// each side (layers, K and V, blocks), requests of scattered blocks with
// several in flight to one or more targets, the same bytes moved as
// contiguous 1 MiB transfers in the same run, and the checks of the bytes.

package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/proccpu"
)

// kvLayout is the paged pool of one side: for each layer a K and a V
// tensor of blocks blocks of block bytes each (one block: blockTokens
// tokens of one layer's K or V).
type kvLayout struct {
	layers      int
	block       int // bytes per block per layer per K or V
	blockTokens int
	tokens      int // tokens per request
	pool        int // bytes per side, as asked
	blocks      int // blocks per layer per K or V in the pool
	perReq      int // blocks per request: tokens / blockTokens, rounded up
	inflight    int
	chunk       int // the contiguous baseline's transfer: 1 MiB, or the largest multiple of block under it
}

// newKVLayout checks the layout flags and derives the pool's blocks.
func newKVLayout(layers, block, blockTokens, tokens, pool, inflight int) (kvLayout, error) {
	l := kvLayout{layers: layers, block: block, blockTokens: blockTokens, tokens: tokens, pool: pool, inflight: inflight}
	switch {
	case layers < 1 || layers > 1024:
		return l, fmt.Errorf("--layers %d: want 1 to 1024", layers)
	case block < 64 || block%64 != 0:
		return l, fmt.Errorf("--block-size %s: a KV block is at least 64 bytes and a multiple of 64", fmtSize(block))
	case blockTokens < 1:
		return l, fmt.Errorf("--block-tokens %d: want at least 1", blockTokens)
	case tokens < 1:
		return l, fmt.Errorf("--tokens %d: want at least 1", tokens)
	case inflight < 1 || inflight > 1024:
		return l, fmt.Errorf("--inflight %d: want 1 to 1024", inflight)
	}
	l.perReq = (tokens + blockTokens - 1) / blockTokens
	l.blocks = pool / (layers * 2 * block)
	if need := l.perReq * inflight; l.blocks < need {
		return l, fmt.Errorf("--pool %s holds %d blocks of %s per layer per K or V (%d layers); %d requests in flight of %d tokens (%d blocks each) need %d, a pool of %s: grow --pool or lower --inflight, --tokens or --layers",
			fmtSize(pool), l.blocks, fmtSize(block), layers, inflight, tokens, l.perReq, need, fmtSize(need*layers*2*block))
	}
	l.chunk = max(block, (1<<20)/block*block)
	return l, nil
}

func (l kvLayout) slots() int     { return l.layers * 2 * l.blocks }
func (l kvLayout) bytes() int     { return l.slots() * l.block }
func (l kvLayout) reqBytes() int  { return l.perReq * l.layers * 2 * l.block }
func (l kvLayout) transfers() int { return l.perReq * l.layers * 2 }

// slot is the index of block blk of layer's K (kv 0) or V (kv 1).
func (l kvLayout) slot(layer, kv, blk int) int { return (layer*2+kv)*l.blocks + blk }

func (l kvLayout) String() string {
	return fmt.Sprintf("%d layers x K,V x %d blocks of %s (%d tokens each) per side, %s; a request: %d tokens = %d blocks x %d layers x 2 = %d transfers of %s, %s",
		l.layers, l.blocks, fmtSize(l.block), l.blockTokens, fmtSize(l.bytes()), l.tokens, l.perReq, l.layers, l.transfers(), fmtSize(l.block), fmtSize(l.reqBytes()))
}

// A block's bytes are words of its stamp: word k is stamp + k*kvMul.
const kvMul = 0x9e3779b97f4a7c15

func fillSlot(b []byte, stamp uint64) {
	for k := 0; k+8 <= len(b); k += 8 {
		binary.LittleEndian.PutUint64(b[k:], stamp+uint64(k>>3)*kvMul)
	}
}

// slotHolds reports whether b holds the words of stamp. It compares 64
// bytes at a time with one branch: the checks run beside the transfers
// they check, on the same CPUs, and a word-at-a-time loop ran at about a
// copy's speed, so the bench measured its own checks as much as the
// engine (kvcheck_bench_test.go).
func slotHolds(b []byte, stamp uint64) bool {
	le := binary.LittleEndian
	var m1 uint64 = kvMul // the steps, wrapping as fillSlot's products do
	m2, m3, m4 := 2*m1, 3*m1, 4*m1
	m5, m6, m7, m8 := 5*m1, 6*m1, 7*m1, 8*m1
	v := stamp
	k := 0
	for ; k+64 <= len(b); k += 64 {
		w := b[k : k+64 : k+64]
		d := (le.Uint64(w[0:]) ^ v) | (le.Uint64(w[8:]) ^ (v + m1)) |
			(le.Uint64(w[16:]) ^ (v + m2)) | (le.Uint64(w[24:]) ^ (v + m3)) |
			(le.Uint64(w[32:]) ^ (v + m4)) | (le.Uint64(w[40:]) ^ (v + m5)) |
			(le.Uint64(w[48:]) ^ (v + m6)) | (le.Uint64(w[56:]) ^ (v + m7))
		if d != 0 {
			return false
		}
		v += m8
	}
	for ; k+8 <= len(b); k += 8 {
		if le.Uint64(b[k:]) != v {
			return false
		}
		v += kvMul
	}
	return true
}

// kvRun is count consecutive slots moved from src to dst.
type kvRun struct{ src, dst, count int }

// freeList hands out the destination units (blocks, or regions for the
// baseline) of one pool: a request in flight owns its destinations.
type freeList struct {
	mu    sync.Mutex
	units []int
}

func (f *freeList) reset(n int) {
	f.units = f.units[:0]
	for i := range n {
		f.units = append(f.units, i)
	}
}

// take hands out n units at random, or nil when fewer are free: under
// --keep-going the destinations of requests that did not complete are
// not given back.
func (f *freeList) take(rng *rand.Rand, n int) []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.units) < n {
		return nil
	}
	out := make([]int, n)
	for i := range out {
		j := rng.IntN(len(f.units))
		out[i] = f.units[j]
		f.units[j] = f.units[len(f.units)-1]
		f.units = f.units[:len(f.units)-1]
	}
	return out
}

func (f *freeList) give(u []int) {
	f.mu.Lock()
	f.units = append(f.units, u...)
	f.mu.Unlock()
}

// kvPool is one side's pool: its memory when this process can see it, its
// address and what each slot holds.
type kvPool struct {
	mem    []byte // nil for a remote target's pool
	base   uint64
	seg    moonring.SegmentID
	stamps []uint64
	free   freeList
	pid    int // the process that holds it, when this command started it
}

// kvBench is the KV workload against t's targets.
type kvBench struct {
	t       *target
	l       kvLayout
	local   *kvPool
	remote  []*kvPool
	sample  int // check 1 in sample transfers (0: every READ, a WRITE 1 in 64 read back, every one in-process)
	useRing bool
	lists   int // --lists: blocks an entry of a prepared list (0: none)
	cpu     bool
	// keepGoing (--keep-going): a transfer that does not complete does
	// not end the step. Its destination slot's stamp becomes 0 (not
	// known: not checked), and its request's destinations are not used
	// again in the step (slices of it may still land).
	keepGoing bool
	localID   moonring.BufferID
	scratch   [][]byte // per worker: read-back space
	next      atomic.Uint64
	// closersMu orders the workers' checks adding the release of their
	// read-back space to t.closers (two may grow theirs at once).
	closersMu sync.Mutex
}

// kvSampleRemoteWrite is the share of a remote WRITE's transfers read back
// and checked after each request when --kv-sample is not given.
const kvSampleRemoteWrite = 64

// newKVBench allocates and fills the pools: the local one, and each
// target's through WRITEs of the local one filled with the target's stamps.
func newKVBench(ctx context.Context, t *target, l kvLayout, sample int, useRing, cpu, keepGoing bool) (*kvBench, error) {
	k := &kvBench{t: t, l: l, sample: sample, useRing: useRing, cpu: cpu, keepGoing: keepGoing}
	mem, err := t.ini.Alloc(l.bytes(), "cpu:0")
	if err != nil {
		return nil, fmt.Errorf("the local pool of %s: %w", fmtSize(l.bytes()), err)
	}
	t.closers = append(t.closers, func() { t.ini.Free(mem) })
	if k.localID, err = t.ini.RegisterLocalMemory(mem, "cpu:0", false); err != nil {
		return nil, err
	}
	t.closers = append(t.closers, func() { t.ini.UnregisterLocalMemory(context.Background(), mem) })
	k.local = &kvPool{mem: mem, base: uint64(moonring.AddressOf(mem)), stamps: make([]uint64, l.slots())}
	for i, p := range t.peers {
		rp := &kvPool{mem: p.mem, base: p.base, seg: p.seg, stamps: make([]uint64, l.slots()), pid: p.pid}
		for s := range rp.stamps {
			rp.stamps[s] = uint64(i+1)<<48 | uint64(s)<<8 | 0x5a
			fillSlot(mem[s*l.block:(s+1)*l.block], rp.stamps[s])
		}
		sts, err := k.copyPool(ctx, rp, moonring.Write, mem, &statusCounts{})
		if err == nil {
			err = firstFailure(sts)
		}
		if err != nil {
			return nil, fmt.Errorf("filling the pool of target %s: %w", p.name, err)
		}
		k.remote = append(k.remote, rp)
	}
	for s := range k.local.stamps {
		k.local.stamps[s] = uint64(s)<<8 | 0xa5
		fillSlot(mem[s*l.block:(s+1)*l.block], k.local.stamps[s])
	}
	k.scratch = make([][]byte, l.inflight)
	return k, nil
}

// copyPool moves the first len(mem) bytes of rp from or to mem (a
// registered buffer) in 16 MiB transfers, counted in c (see transfer).
func (k *kvBench) copyPool(ctx context.Context, rp *kvPool, op moonring.Op, mem []byte, c *statusCounts) ([]moonring.TransferStatus, error) {
	var reqs []moonring.TransferRequest
	for off := 0; off < len(mem); off += 16 << 20 {
		n := min(16<<20, len(mem)-off)
		reqs = append(reqs, moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(mem) + uintptr(off), TargetID: rp.seg, TargetOffset: rp.base + uint64(off), Length: uint64(n)})
	}
	return transfer(ctx, k.t.ini, reqs, c)
}

// kvRequest is one request: its runs, its target and the destination
// units it owns; once moved, its transfers' statuses (a run each).
type kvRequest struct {
	runs  []kvRun
	rp    *kvPool
	units []int
	dst   *kvPool
	sts   []moonring.TransferStatus
}

// failed reports whether a transfer of the request did not complete.
func (r *kvRequest) failed() bool { return firstFailure(r.sts) != nil }

// newRequest draws a request: random source blocks (kv) or region
// (contig), destinations taken from the destination pool's free list; nil
// when too few are free in every pool it may take them from (--keep-going
// set aside those of failed requests).
func (k *kvBench) newRequest(rng *rand.Rand, op moonring.Op, contig bool) *kvRequest {
	l := k.l
	need := l.perReq
	if contig {
		need = 1
	}
	// The targets in turn; one whose pool has too few free destinations
	// left (a WRITE's) gives its turn to the next.
	var r *kvRequest
	for range k.remote {
		rp := k.remote[int(k.next.Add(1)-1)%len(k.remote)]
		dst := k.local
		if op == moonring.OpWrite {
			dst = rp
		}
		if units := dst.free.take(rng, need); units != nil {
			r = &kvRequest{rp: rp, dst: dst, units: units}
			break
		}
	}
	if r == nil {
		return nil
	}
	if contig {
		regions := l.slots() / (l.perReq * l.layers * 2)
		per := l.perReq * l.layers * 2
		s0, d0 := rng.IntN(regions)*per, r.units[0]*per
		step := l.chunk / l.block
		for i := 0; i < per; i += step {
			n := min(step, per-i)
			r.runs = append(r.runs, kvRun{s0 + i, d0 + i, n})
		}
		return r
	}
	srcBlocks := make([]int, l.perReq)
	perm := rng.Perm(l.blocks)
	copy(srcBlocks, perm[:l.perReq])
	r.runs = make([]kvRun, 0, l.transfers())
	for layer := range l.layers {
		for kv := range 2 {
			for i := range l.perReq {
				r.runs = append(r.runs, kvRun{l.slot(layer, kv, srcBlocks[i]), l.slot(layer, kv, r.units[i]), 1})
			}
		}
	}
	return r
}

// kvResult is what a worker measured of one request.
type kvDone struct {
	start, end time.Time
	bytes      int
}

// kvStep runs op with the KV pattern, or its contiguous baseline, for d
// after a warm-up of d/5, inflight requests in flight; then for a WRITE
// it reads every target's pool back and checks it. Every transfer's end
// (with --lists, every run's) is counted in the result's Statuses. A
// transfer that does not complete ends the step with its error; under
// --keep-going the step runs to its end and returns its result with a
// *requestsError.
func (k *kvBench) step(ctx context.Context, op moonring.Op, contig bool, d time.Duration) (result, error) {
	l := k.l
	res := result{Transport: k.t.transport, Op: op.String(), Pattern: "kv", BlockSize: l.block, Block: fmtSize(l.block), Batch: l.inflight, BatchAsked: l.inflight,
		Threads: l.inflight, API: "batch", Transfers: l.transfers(), RequestBytes: l.reqBytes()}
	if contig {
		c := min(l.chunk, l.reqBytes())
		res.Pattern, res.BlockSize, res.Block = "contig", c, fmtSize(c)
		res.Transfers = (l.reqBytes() + l.chunk - 1) / l.chunk
	}
	if k.useRing {
		res.API = "ring"
	}
	if k.lists > 0 {
		res.API += "+lists"
	}
	res.Check = k.checkText(op)
	units := l.blocks
	if contig {
		units = l.slots() / (l.perReq * l.layers * 2)
	}
	k.local.free.reset(units)
	for _, rp := range k.remote {
		rp.free.reset(units)
	}
	var rings []*moonring.Ring
	if k.useRing {
		for range l.inflight {
			r, err := k.t.ini.NewRing(moonring.RingConfig{Entries: 4096})
			if err != nil {
				return res, err
			}
			defer r.Close()
			rings = append(rings, r)
		}
	}
	if k.t.progress != nil {
		stop := k.t.progress(res, d)
		defer stop()
	}
	t0 := time.Now()
	ws, we := t0.Add(d/5), t0.Add(d/5+d)
	var win *cpuWindow
	if k.cpu {
		win = startCPUWindow(k.t, ws, we)
	}
	// With room for two requests' destinations per worker, a request is
	// checked while the worker's next one is in flight.
	overlap := units >= 2*l.inflight*map[bool]int{true: 1, false: l.perReq}[contig]
	var checkCPU atomic.Int64 // nanoseconds of checks that ended inside the window
	dones := make([][]kvDone, l.inflight)
	errs := make([]error, l.inflight)
	// Each worker's requests' ends, and its checks' (which run beside its
	// next request); starved: it found no free destinations.
	moves, checks := make([]endings, l.inflight), make([]endings, l.inflight)
	starved := make([]bool, l.inflight)
	var wg sync.WaitGroup
	for w := range l.inflight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w)+1, uint64(t0.UnixNano())))
			crng := rand.New(rand.NewPCG(uint64(w)+1<<32, uint64(t0.UnixNano())))
			var pending chan error
			// Every way out waits for the check still running on the
			// request before: it reads the pools and the scratch memory,
			// which the step's caller frees once the workers are done.
			defer func() {
				if pending != nil {
					if err := <-pending; errs[w] == nil {
						errs[w] = err
					}
				}
			}()
			for time.Now().Before(we) {
				if ctx.Err() != nil {
					errs[w] = ctx.Err()
					return
				}
				r := k.newRequest(rng, op, contig)
				if r == nil {
					starved[w] = true
					return
				}
				var ring *moonring.Ring
				if rings != nil {
					ring = rings[w]
				}
				start := time.Now()
				var err error
				r.sts, err = k.move(ctx, ring, op, r, &moves[w].counts)
				end := time.Now()
				if err == nil {
					if err = firstFailure(r.sts); err != nil && k.keepGoing {
						moves[w].note(k.t.stepError(err))
						err = nil
					}
				}
				if err != nil {
					errs[w] = k.t.stepError(err)
					return
				}
				if !r.failed() {
					dones[w] = append(dones[w], kvDone{start, end, l.reqBytes()})
					moved.Add(int64(l.reqBytes()))
				}
				// The check of the request before this one ends first: a
				// worker holds at most two requests' destinations.
				if pending != nil {
					err := <-pending
					pending = nil
					if err != nil {
						errs[w] = err
						return
					}
				}
				ch := make(chan error, 1)
				check := func() {
					runtime.LockOSThread()
					c0 := proccpu.Thread()
					err := k.check(ctx, w, op, r, crng, &checks[w])
					c1 := proccpu.Thread()
					runtime.UnlockOSThread()
					if e := time.Now(); e.After(ws) && e.Before(we) {
						checkCPU.Add(int64(c1 - c0))
					}
					if !r.failed() {
						r.dst.free.give(r.units)
					}
					ch <- err
				}
				if overlap {
					// The next request goes out while this one is checked.
					go check()
					pending = ch
				} else {
					check()
					if err := <-ch; err != nil {
						errs[w] = err
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return res, err
	}
	ends := endings{keepGoing: k.keepGoing}
	for w := range moves {
		ends.counts.add(moves[w].counts)
		ends.counts.add(checks[w].counts)
		ends.note(moves[w].first)
		ends.note(checks[w].first)
		if starved[w] && res.Note == "" {
			res.Note = "the pool ran out of free destinations before the step's end: those of requests that did not complete are set aside (slices of theirs may still land)"
		}
	}
	// Bandwidth: each request's bytes spread over its time, the part
	// inside the window counted.
	var inWin float64
	var lat []time.Duration
	for _, ds := range dones {
		for _, dn := range ds {
			a, b := maxTime(dn.start, ws), minTime(dn.end, we)
			if b.After(a) {
				inWin += float64(dn.bytes) * float64(b.Sub(a)) / float64(dn.end.Sub(dn.start))
			}
			if !dn.start.Before(ws) {
				lat = append(lat, dn.end.Sub(dn.start))
			}
		}
	}
	res.GBps = inWin / d.Seconds() / 1e9
	res.Requests = len(lat)
	res.ReqPerSec = inWin / float64(l.reqBytes()) / d.Seconds()
	if len(lat) > 0 {
		res.setLatency(lat)
	} else {
		res.Note = "no request began inside the measured window: lengthen --duration"
	}
	if win != nil {
		win.wait()
		win.fill(&res, inWin, time.Duration(checkCPU.Load()))
	}
	if op == moonring.OpWrite {
		n, err := k.checkPools(ctx, &ends)
		if err != nil {
			return res, err
		}
		res.Unchecked += n
	}
	// Slots a transfer that did not complete was to fill hold what is not
	// known.
	dsts := []*kvPool{k.local}
	if op == moonring.OpWrite {
		dsts = k.remote
	}
	for _, p := range dsts {
		for _, st := range p.stamps {
			if st == 0 {
				res.Unchecked++
			}
		}
	}
	res.Statuses = ends.counts
	res.Verified = true
	if ends.first != nil {
		return res, &requestsError{counts: ends.counts, first: ends.first}
	}
	return res, nil
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// move runs one request: a batch of its transfers (AllocateBatchID,
// SubmitTransfer, WaitBatch), or with a ring, its entries kept flowing
// through the ring. It counts their ends in c and returns their statuses;
// an error is one of the batch or ring themselves (or ctx's).
func (k *kvBench) move(ctx context.Context, ring *moonring.Ring, op moonring.Op, r *kvRequest, c *statusCounts) ([]moonring.TransferStatus, error) {
	l, e := k.l, k.t.ini
	if k.lists > 0 {
		return k.listMove(ctx, ring, op, r, c)
	}
	if ring != nil {
		es := make([]moonring.Entry, len(r.runs))
		for i, run := range r.runs {
			lo, ro := run.src, run.dst
			if op == moonring.OpRead {
				lo, ro = run.dst, run.src
			}
			es[i] = moonring.Entry{Op: op, Segment: r.rp.seg, Buffer: 0, Local: uint64(lo * l.block), Remote: r.rp.base + uint64(ro*l.block), Length: uint64(run.count * l.block), UserData: uint64(i)}
		}
		return k.ringMove(ctx, ring, es, c)
	}
	reqs := make([]moonring.TransferRequest, len(r.runs))
	for i, run := range r.runs {
		lo, ro := run.src, run.dst
		if op == moonring.OpRead {
			lo, ro = run.dst, run.src
		}
		reqs[i] = moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(k.local.mem) + uintptr(lo*l.block), TargetID: r.rp.seg, TargetOffset: r.rp.base + uint64(ro*l.block), Length: uint64(run.count * l.block)}
	}
	return transfer(ctx, e, reqs, c) // one batch, every status checked
}

// listMove runs one request as a prepared list of its transfers
// (--lists): PrepareList, runs of k.lists blocks as entries through ring
// (ringMove) or, without one, as tasks of a batch, FreeList. A
// transfer's status is its run's.
func (k *kvBench) listMove(ctx context.Context, ring *moonring.Ring, op moonring.Op, r *kvRequest, c *statusCounts) ([]moonring.TransferStatus, error) {
	l, e := k.l, k.t.ini
	blocks := make([]moonring.Block, len(r.runs))
	for i, run := range r.runs {
		lo, ro := run.src, run.dst
		if op == moonring.OpRead {
			lo, ro = run.dst, run.src
		}
		blocks[i] = moonring.Block{Local: uint64(lo * l.block), Remote: r.rp.base + uint64(ro*l.block), Length: uint64(run.count * l.block)}
	}
	id, err := e.PrepareList(blocks)
	if err != nil {
		return nil, err
	}
	defer e.FreeList(id)
	var (
		es   []moonring.Entry
		reqs []moonring.TransferRequest
		ests []moonring.TransferStatus
	)
	for first := 0; first < len(blocks); first += k.lists {
		n := min(k.lists, len(blocks)-first)
		if ring != nil {
			es = append(es, moonring.ListEntry(op, k.localID, r.rp.seg, id, first, n, uint64(len(es))))
		} else {
			reqs = append(reqs, moonring.TransferRequest{Opcode: op, Buffer: k.localID, TargetID: r.rp.seg, List: id, First: first, Count: n})
		}
	}
	if ring != nil {
		ests, err = k.ringMove(ctx, ring, es, c)
	} else {
		ests, err = transfer(ctx, e, reqs, c)
	}
	if ests == nil {
		return nil, err // the batch itself failed
	}
	sts := make([]moonring.TransferStatus, len(blocks))
	for i := range sts {
		st := ests[i/k.lists]
		if st.Status == moonring.COMPLETED {
			st.Bytes = blocks[i].Length
		}
		sts[i] = st
	}
	return sts, err
}

// ringMove keeps up to 4,096 of es (UserData: their index) in flight on
// ring until they have ended, counting their ends in c, and returns their
// statuses. Without keepGoing it submits no more after one that did not
// complete, and waits for those in flight before it returns (the pool is
// touched only then); those never submitted keep the status WAITING.
func (k *kvBench) ringMove(ctx context.Context, ring *moonring.Ring, es []moonring.Entry, c *statusCounts) ([]moonring.TransferStatus, error) {
	for i := range es {
		es[i].Buffer = k.localID // a list's entries name it already
	}
	const window = 4096
	sts := make([]moonring.TransferStatus, len(es))
	cqes := make([]moonring.Completion, 256)
	next, done, stop := 0, 0, len(es) // stop: none at or past it is submitted
	for done < next || next < stop {
		if lim := min(stop, done+window); next < lim {
			n, err := ring.Submit(es[next:lim])
			next += n
			c.submitted(n)
			if err != nil && !errors.Is(err, moonring.ErrSQFull) {
				return sts, err
			}
		}
		n := ring.PeekBatch(cqes)
		if n == 0 {
			if done == next {
				continue
			}
			wctx := ctx
			if stop < len(es) {
				wctx = context.Background() // what is in flight ends before the pool is touched
			}
			if err := ring.CQ().Wait(wctx, 1); err != nil {
				return sts, err
			}
			continue
		}
		for _, e := range cqes[:n] {
			sts[e.UserData] = moonring.TransferStatus{Status: e.Status, Bytes: e.Bytes, Code: e.Code}
			c.ended(e.Status, e.Code)
			if e.Status != moonring.COMPLETED && !k.keepGoing {
				stop = next
			}
		}
		ring.Advance(n)
		done += n
	}
	return sts, nil
}

// sampleOf is the share of transfers checked after a request of op: 1 in
// the value returned.
func (k *kvBench) sampleOf(op moonring.Op) int {
	if k.sample > 0 {
		return k.sample
	}
	if op == moonring.OpWrite && k.remote[0].mem == nil {
		return kvSampleRemoteWrite
	}
	return 1
}

func (k *kvBench) checkText(op moonring.Op) string {
	n := k.sampleOf(op)
	where := "at the destination"
	if op == moonring.OpWrite && k.remote[0].mem == nil {
		where = "read back from the target"
	}
	what := "every transfer"
	if n > 1 {
		what = fmt.Sprintf("1 in %d transfers (random)", n)
	}
	s := fmt.Sprintf("%s checked %s after each request", what, where)
	if op == moonring.OpWrite {
		if k.remote[0].mem == nil {
			s += "; every target's whole pool read back and checked after the step"
		} else {
			s += "; every target's whole pool checked after the step"
		}
	}
	return s
}

// check checks a request's destinations (all, or a random sample) against
// the stamps of their sources, then records the stamps they now hold. A
// destination whose transfer did not complete gets stamp 0 (not known)
// and is not checked, nor is one whose source's stamp is 0. Its
// read-backs are counted in ends; one that does not complete fails the
// check, or under --keep-going leaves what it was to read unchecked.
func (k *kvBench) check(ctx context.Context, w int, op moonring.Op, r *kvRequest, rng *rand.Rand, ends *endings) error {
	l := k.l
	src := r.rp
	if op == moonring.OpWrite {
		src = k.local
	}
	n := k.sampleOf(op)
	var picked []kvRun
	for i, run := range r.runs {
		if r.sts[i].Status == moonring.COMPLETED && (n == 1 || rng.IntN(n) == 0) {
			picked = append(picked, run)
		}
	}
	mem := r.dst.mem
	off := func(run kvRun) int { return run.dst * l.block }
	if mem == nil && len(picked) > 0 {
		// Read the picked destinations back into this worker's scratch.
		need := 0
		for _, run := range picked {
			need += run.count * l.block
		}
		if len(k.scratch[w]) < need {
			if k.scratch[w] != nil {
				k.t.ini.UnregisterLocalMemory(context.Background(), k.scratch[w])
				k.t.ini.Free(k.scratch[w])
			}
			b, err := k.t.ini.Alloc(need, "cpu:0")
			if err != nil {
				return err
			}
			if _, err := k.t.ini.RegisterLocalMemory(b, "cpu:0", false); err != nil {
				k.t.ini.Free(b)
				return err
			}
			k.scratch[w] = b
			buf := b
			k.closersMu.Lock()
			k.t.closers = append(k.t.closers, func() {
				k.t.ini.UnregisterLocalMemory(context.Background(), buf)
				k.t.ini.Free(buf)
			})
			k.closersMu.Unlock()
		}
		mem = k.scratch[w]
		clear(mem[:need])
		reqs := make([]moonring.TransferRequest, len(picked))
		at := map[kvRun]int{}
		pos := 0
		for i, run := range picked {
			reqs[i] = moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(mem) + uintptr(pos), TargetID: r.rp.seg, TargetOffset: r.rp.base + uint64(run.dst*l.block), Length: uint64(run.count * l.block)}
			at[run] = pos
			pos += run.count * l.block
		}
		sts, err := transfer(ctx, k.t.ini, reqs, &ends.counts)
		if err != nil {
			return fmt.Errorf("reading back what a request wrote: %w", k.t.stepError(err))
		}
		if err := firstFailure(sts); err != nil {
			err = fmt.Errorf("reading back what a request wrote: %w", k.t.stepError(err))
			if !k.keepGoing {
				return err
			}
			ends.note(err)
			read := picked[:0]
			for i, run := range picked {
				if sts[i].Status == moonring.COMPLETED {
					read = append(read, run)
				}
			}
			picked = read
		}
		off = func(run kvRun) int { return at[run] }
	}
	for _, run := range picked {
		base := off(run)
		for i := range run.count {
			b := mem[base+i*l.block : base+(i+1)*l.block]
			if want := src.stamps[run.src+i]; want != 0 && !slotHolds(b, want) {
				return fmt.Errorf("%s: slot %d of the destination pool does not hold what slot %d of the source held (stamp %#x)", op, run.dst+i, run.src+i, want)
			}
		}
	}
	for i, run := range r.runs {
		d := r.dst.stamps[run.dst : run.dst+run.count]
		if r.sts[i].Status == moonring.COMPLETED {
			copy(d, src.stamps[run.src:run.src+run.count])
		} else {
			clear(d)
		}
	}
	return nil
}

// checkPools reads every target's pool back, 64 MiB at a time, and checks
// every slot against its stamp, but those of stamp 0 (not known). Its
// read-backs are counted in ends; one that does not complete fails the
// check, or under --keep-going leaves the slots it was to read unchecked:
// it returns how many.
func (k *kvBench) checkPools(ctx context.Context, ends *endings) (unread int, err error) {
	l := k.l
	for ti, rp := range k.remote {
		if rp.mem != nil {
			for s, st := range rp.stamps {
				if st != 0 && !slotHolds(rp.mem[s*l.block:(s+1)*l.block], st) {
					return unread, fmt.Errorf("target %d's pool: slot %d does not hold stamp %#x", ti, s, st)
				}
			}
			continue
		}
		span := min(l.bytes(), (64<<20)/l.block*l.block)
		buf, err := k.t.ini.Alloc(span, "cpu:0")
		if err != nil {
			return unread, err
		}
		if _, err := k.t.ini.RegisterLocalMemory(buf, "cpu:0", false); err != nil {
			k.t.ini.Free(buf)
			return unread, err
		}
		for off := 0; off < l.bytes(); off += span {
			n := min(span, l.bytes()-off)
			clear(buf[:n])
			sub := &kvPool{seg: rp.seg, base: rp.base + uint64(off)}
			var sts []moonring.TransferStatus
			if sts, err = k.copyPool(ctx, sub, moonring.Read, buf[:n], &ends.counts); err != nil {
				err = fmt.Errorf("reading target %d's pool back: %w", ti, k.t.stepError(err))
				break
			}
			if ferr := firstFailure(sts); ferr != nil {
				ferr = fmt.Errorf("reading target %d's pool back: %w", ti, k.t.stepError(ferr))
				if !k.keepGoing {
					err = ferr
					break
				}
				ends.note(ferr)
			}
			// read says whether the bytes [a, b) of the chunk came back:
			// every copyPool transfer (16 MiB) over them completed.
			read := func(a, b int) bool {
				return sts[a>>24].Status == moonring.COMPLETED && sts[(b-1)>>24].Status == moonring.COMPLETED
			}
			for s := off / l.block; s < (off+n)/l.block; s++ {
				a := s*l.block - off
				switch {
				case rp.stamps[s] == 0:
				case !read(a, a+l.block):
					unread++
				case !slotHolds(buf[a:a+l.block], rp.stamps[s]):
					err = fmt.Errorf("target %d's pool: slot %d does not hold stamp %#x", ti, s, rp.stamps[s])
				}
				if err != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		k.t.ini.UnregisterLocalMemory(context.Background(), buf)
		k.t.ini.Free(buf)
		if err != nil {
			return unread, err
		}
	}
	return unread, nil
}
