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

func slotHolds(b []byte, stamp uint64) bool {
	for k := 0; k+8 <= len(b); k += 8 {
		if binary.LittleEndian.Uint64(b[k:]) != stamp+uint64(k>>3)*kvMul {
			return false
		}
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

func (f *freeList) take(rng *rand.Rand, n int) []int {
	f.mu.Lock()
	defer f.mu.Unlock()
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
	cpu     bool
	localID moonring.BufferID
	scratch [][]byte // per worker: read-back space
	next    atomic.Uint64
	// closersMu orders the workers' checks adding the release of their
	// read-back space to t.closers (two may grow theirs at once).
	closersMu sync.Mutex
}

// kvSampleRemoteWrite is the share of a remote WRITE's transfers read back
// and checked after each request when --kv-sample is not given.
const kvSampleRemoteWrite = 64

// newKVBench allocates and fills the pools: the local one, and each
// target's through WRITEs of the local one filled with the target's stamps.
func newKVBench(ctx context.Context, t *target, l kvLayout, sample int, useRing, cpu bool) (*kvBench, error) {
	k := &kvBench{t: t, l: l, sample: sample, useRing: useRing, cpu: cpu}
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
		if err := k.copyPool(ctx, rp, moonring.Write, mem); err != nil {
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
// registered buffer) in 16 MiB transfers.
func (k *kvBench) copyPool(ctx context.Context, rp *kvPool, op moonring.Op, mem []byte) error {
	var reqs []moonring.TransferRequest
	for off := 0; off < len(mem); off += 16 << 20 {
		n := min(16<<20, len(mem)-off)
		reqs = append(reqs, moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(mem) + uintptr(off), TargetID: rp.seg, TargetOffset: rp.base + uint64(off), Length: uint64(n)})
	}
	return k.t.ini.Transfer(ctx, reqs...)
}

// kvRequest is one request: its runs, its target and the destination
// units it owns.
type kvRequest struct {
	runs  []kvRun
	rp    *kvPool
	units []int
	dst   *kvPool
}

// newRequest draws a request: random source blocks (kv) or region
// (contig), destinations taken from the destination pool's free list.
func (k *kvBench) newRequest(rng *rand.Rand, op moonring.Op, contig bool) *kvRequest {
	l := k.l
	rp := k.remote[int(k.next.Add(1)-1)%len(k.remote)]
	src, dst := rp, k.local
	if op == moonring.OpWrite {
		src, dst = k.local, rp
	}
	_ = src
	r := &kvRequest{rp: rp, dst: dst}
	if contig {
		regions := l.slots() / (l.perReq * l.layers * 2)
		per := l.perReq * l.layers * 2
		r.units = dst.free.take(rng, 1)
		s0, d0 := rng.IntN(regions)*per, r.units[0]*per
		step := l.chunk / l.block
		for i := 0; i < per; i += step {
			n := min(step, per-i)
			r.runs = append(r.runs, kvRun{s0 + i, d0 + i, n})
		}
		return r
	}
	r.units = dst.free.take(rng, l.perReq)
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
// it reads every target's pool back and checks it.
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
				var ring *moonring.Ring
				if rings != nil {
					ring = rings[w]
				}
				start := time.Now()
				err := k.move(ctx, ring, op, r)
				end := time.Now()
				if err != nil {
					errs[w] = k.t.stepError(err)
					return
				}
				dones[w] = append(dones[w], kvDone{start, end, l.reqBytes()})
				moved.Add(int64(l.reqBytes()))
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
					c0 := threadCPU()
					err := k.check(ctx, w, op, r, crng)
					c1 := threadCPU()
					runtime.UnlockOSThread()
					if e := time.Now(); e.After(ws) && e.Before(we) {
						checkCPU.Add(int64(c1 - c0))
					}
					r.dst.free.give(r.units)
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
		if err := k.checkPools(ctx); err != nil {
			return res, err
		}
	}
	res.Verified = true
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
// through the ring.
func (k *kvBench) move(ctx context.Context, ring *moonring.Ring, op moonring.Op, r *kvRequest) error {
	l, e := k.l, k.t.ini
	if ring != nil {
		es := make([]moonring.Entry, len(r.runs))
		for i, run := range r.runs {
			lo, ro := run.src, run.dst
			if op == moonring.OpRead {
				lo, ro = run.dst, run.src
			}
			es[i] = moonring.Entry{Op: op, Segment: r.rp.seg, Buffer: 0, Local: uint64(lo * l.block), Remote: r.rp.base + uint64(ro*l.block), Length: uint64(run.count * l.block), UserData: uint64(i)}
		}
		return k.ringMove(ctx, ring, es)
	}
	reqs := make([]moonring.TransferRequest, len(r.runs))
	for i, run := range r.runs {
		lo, ro := run.src, run.dst
		if op == moonring.OpRead {
			lo, ro = run.dst, run.src
		}
		reqs[i] = moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(k.local.mem) + uintptr(lo*l.block), TargetID: r.rp.seg, TargetOffset: r.rp.base + uint64(ro*l.block), Length: uint64(run.count * l.block)}
	}
	return e.Transfer(ctx, reqs...) // one batch, every status checked
}

// ringMove keeps up to 4,096 of es in flight on ring until all complete.
func (k *kvBench) ringMove(ctx context.Context, ring *moonring.Ring, es []moonring.Entry) error {
	for i := range es {
		es[i].Buffer = k.localID
	}
	const window = 4096
	cqes := make([]moonring.Completion, 256)
	next, done := 0, 0
	for done < len(es) {
		if lim := min(len(es), done+window); next < lim {
			n, err := ring.Submit(es[next:lim])
			next += n
			if err != nil && !errors.Is(err, moonring.ErrSQFull) {
				return err
			}
		}
		n := ring.PeekBatch(cqes)
		if n == 0 {
			if err := ring.CQ().Wait(ctx, 1); err != nil {
				return err
			}
			continue
		}
		for _, c := range cqes[:n] {
			if err := c.Err(); err != nil {
				ring.Advance(n)
				// Let what is in flight end before the pool is touched.
				for done += n; done < next; {
					if ring.CQ().Wait(context.Background(), 1) != nil {
						break
					}
					m := ring.PeekBatch(cqes)
					ring.Advance(m)
					done += m
				}
				return err
			}
		}
		ring.Advance(n)
		done += n
	}
	return nil
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
// the stamps of their sources, then records the stamps they now hold.
func (k *kvBench) check(ctx context.Context, w int, op moonring.Op, r *kvRequest, rng *rand.Rand) error {
	l := k.l
	src := r.rp
	if op == moonring.OpWrite {
		src = k.local
	}
	n := k.sampleOf(op)
	var picked []kvRun
	for _, run := range r.runs {
		if n == 1 || rng.IntN(n) == 0 {
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
		if err := k.t.ini.Transfer(ctx, reqs...); err != nil {
			return fmt.Errorf("reading back what a request wrote: %w", k.t.stepError(err))
		}
		off = func(run kvRun) int { return at[run] }
	}
	for _, run := range picked {
		base := off(run)
		for i := range run.count {
			b := mem[base+i*l.block : base+(i+1)*l.block]
			if want := src.stamps[run.src+i]; !slotHolds(b, want) {
				return fmt.Errorf("%s: slot %d of the destination pool does not hold what slot %d of the source held (stamp %#x)", op, run.dst+i, run.src+i, want)
			}
		}
	}
	for _, run := range r.runs {
		copy(r.dst.stamps[run.dst:run.dst+run.count], src.stamps[run.src:run.src+run.count])
	}
	return nil
}

// checkPools reads every target's pool back, 64 MiB at a time, and checks
// every slot against its stamp.
func (k *kvBench) checkPools(ctx context.Context) error {
	l := k.l
	for ti, rp := range k.remote {
		if rp.mem != nil {
			for s, st := range rp.stamps {
				if !slotHolds(rp.mem[s*l.block:(s+1)*l.block], st) {
					return fmt.Errorf("target %d's pool: slot %d does not hold stamp %#x", ti, s, st)
				}
			}
			continue
		}
		span := min(l.bytes(), (64<<20)/l.block*l.block)
		buf, err := k.t.ini.Alloc(span, "cpu:0")
		if err != nil {
			return err
		}
		if _, err := k.t.ini.RegisterLocalMemory(buf, "cpu:0", false); err != nil {
			k.t.ini.Free(buf)
			return err
		}
		for off := 0; off < l.bytes(); off += span {
			n := min(span, l.bytes()-off)
			clear(buf[:n])
			sub := &kvPool{seg: rp.seg, base: rp.base + uint64(off)}
			if err = k.copyPool(ctx, sub, moonring.Read, buf[:n]); err != nil {
				err = fmt.Errorf("reading target %d's pool back: %w", ti, k.t.stepError(err))
				break
			}
			for s := off / l.block; s < (off+n)/l.block; s++ {
				b := buf[s*l.block-off : (s+1)*l.block-off]
				if !slotHolds(b, rp.stamps[s]) {
					err = fmt.Errorf("target %d's pool: slot %d does not hold stamp %#x", ti, s, rp.stamps[s])
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
			return err
		}
	}
	return nil
}
