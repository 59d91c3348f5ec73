// share.go holds the poller's copy workers: goroutines that take part of a
// large batch of synchronous copies (transport.Copier: plain memory, local
// and shm) while the poller copies the rest, so that such a batch moves on
// more than one core.

package ring

import (
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/moonring/moonring/transport"
)

// Sharing thresholds. One memory copy stream does not use a machine's
// memory bandwidth when its blocks are scattered: the hardware prefetchers
// stop at every block, and a core has only so many misses in flight. On the
// development VM one goroutine moved scattered 32 KiB blocks at 0.55-0.68
// of the rate of 1 MiB sequential ones, and two goroutines at 0.80-0.82 of
// the (already saturated) sequential rate. A hand-off to a parked worker
// costs a wakeup (several µs here), so only batches that take much longer
// than that are shared.
const (
	// batchCap is how many slices a batch for one endpoint holds, and
	// wideCap how many for a transport.WidePoster at most.
	batchCap = 64
	wideCap  = 256
	// shareSlice is the smallest slice that skips the inline copy when
	// the poller has workers and more entries wait behind it, so that it
	// can join a batch that is shared.
	shareSlice = 16 << 10
	// shareBatch is the fewest bytes in a batch that is shared.
	shareBatch = 256 << 10
	// fullWeight is a worker's weight in a shared batch, and the
	// poller's at most (an equal share); minWeight the poller's least.
	fullWeight, minWeight = 64, 16
)

// copyJob is the part of a batch a worker copies: the slices (their
// requests hold them as outstanding, as for a transport's Post) of ring r,
// to endpoint cp, whose results go back through r's completion queue.
type copyJob struct {
	r    *Ring
	cp   transport.Copier
	s    []transport.Slice
	errs []error
	// done gathers results for the poller's queue, queued in one
	// reservation (one a slice had the worker and the poller contend for
	// the queue's counters: 4 % of a kv step's profile in process). Copied
	// one by one, the slices' results go as a group once the next slice is
	// another request's, the job ends, or a copy failed (a failure ends or
	// moves its request at once): no request's result is queued behind
	// another's copy, and a request's successful slices finish it only
	// with its later ones anyway. A BatchCopier's are queued after its
	// one call, those of requests that ended before it.
	done []sliceDone
	// holds are the references the job's copies keep on the target's
	// memory (copyOne), given back when the job is done.
	holds transport.Holds
}

// copiers are a poller's copy workers and the jobs they share: free holds
// the jobs not in use (the poller takes one without blocking, or copies
// the whole batch itself), jobs those handed out.
type copiers struct {
	n    int
	free chan *copyJob
	jobs chan *copyJob
	// pw is the poller's weight in a shared batch against a worker's 64
	// (see share); poller goroutine only.
	pw   int
	wg   sync.WaitGroup
	stop sync.Once
	// parks counts the workers' waits that went to sleep (PollerStats).
	parks atomic.Uint64
}

// jobsPerWorker is how many jobs a worker has room for: one to copy and
// the rest queued behind it. A poller that finds no job free copies the
// whole batch itself, and the worker then waits for the next one: with
// two a worker, the kv pattern in process (moonring bench --pattern kv
// --protocol local --lists 256, perf) had the worker wait for work 13 % of
// its time and the poller copy more than half the bytes; with four, under
// 2 %.
const jobsPerWorker = 4

// startCopiers starts n workers, each with jobsPerWorker jobs of room,
// pinned like the poller when it is.
func (p *Poller) startCopiers(n int) {
	c := &copiers{n: n, free: make(chan *copyJob, jobsPerWorker*n), jobs: make(chan *copyJob, jobsPerWorker*n), pw: fullWeight}
	for range jobsPerWorker * n {
		c.free <- &copyJob{s: make([]transport.Slice, 0, batchCap), errs: make([]error, batchCap), done: make([]sliceDone, 0, batchCap)}
	}
	c.wg.Add(n)
	for range n {
		go p.copyWorker(c)
	}
	p.copiers = c
}

// stopCopiers ends the workers once they have copied what they were
// given, and waits for them: the poller's goroutine, as it stops (nothing
// hands out jobs any more), before it closes done. Their last results go
// to rings that are shut by then; Stop returns only once no worker
// touches a buffer.
func (p *Poller) stopCopiers() {
	if c := p.copiers; c != nil {
		c.stop.Do(func() { close(c.jobs) })
		c.wg.Wait()
	}
}

func (p *Poller) copyWorker(c *copiers) {
	defer c.wg.Done()
	if len(p.cfg.CPUs) > 0 && p.cfg.Pin != nil {
		runtime.LockOSThread() // for good, as the poller's: see run
		if err := p.cfg.Pin(p.cfg.CPUs); err != nil {
			// Reported as the poller's own (PinError), unless that failed
			// first: the worker runs unpinned, as the poller then does.
			p.pinErr.CompareAndSwap(nil, &err)
		}
	}
	for {
		j, ok := p.nextJob(c)
		if !ok {
			return
		}
		j.copy()
		c.free <- j
	}
}

// nextJob returns the worker's next job, false once the workers are
// stopped. It polls for CopySpin before it parks: the poller shares a
// batch's bytes equally but copies its part beside its other work (the
// next entries, the completions), so a worker is often done first, and
// the next batch comes tens of µs after its last. Parked, it would wait
// that long again for a wakeup (a futex and an IPI; more in a VM) each
// batch: on the development VM the kv pattern in process (moonring bench
// --pattern kv --protocol local --kv-sample 64, 4 interleaved rounds)
// moved 11.3-13.4 GB/s with a worker that parked at once and 15.9-18.1
// with one that polled 100 µs. While it polls it yields (Gosched) to any
// other goroutine of its P now and then; with one P (GOMAXPROCS 1) it
// parks at once, as the poller does.
func (p *Poller) nextJob(c *copiers) (*copyJob, bool) {
	spin := int64(p.cfg.CopySpin)
	if spin > 0 && runtime.GOMAXPROCS(0) > 1 {
		start := now()
		lastYield := start
		for i := 1; ; i++ {
			select {
			case j, ok := <-c.jobs:
				return j, ok
			default:
			}
			// The clock every 256 polls (a poll of an empty channel is a
			// few ns), and a yield every yieldEvery as the busy poller's:
			// a Gosched takes the scheduler's lock, and one at every poll
			// had put the scheduler's functions at 8 % of a kv step's
			// profile.
			if i%256 == 0 {
				t := now()
				if t-start > spin {
					break
				}
				if t-lastYield > int64(yieldEvery) {
					runtime.Gosched()
					lastYield = t
				}
			}
		}
	}
	select {
	case j, ok := <-c.jobs:
		return j, ok
	default:
	}
	c.parks.Add(1)
	j, ok := <-c.jobs
	return j, ok
}

// copy moves the job's slices, queues their results for the ring's
// poller, and then gets them seen to once (lend) rather than per slice.
// The slice of a request that ended meanwhile (a failed slice of the
// poller's part, a cancel, a timeout, a close: its completion may be out,
// and its buffer back with its caller) is not copied: its result is
// ErrClosed, which a zombie ignores. One that ends while its slice is
// being copied still sees that copy land, as with a transport's slice in
// flight (see doc.go).
func (j *copyJob) copy() {
	r, s := j.r, j.s
	if bc, ok := j.cp.(transport.BatchCopier); ok {
		k := 0
		for i := range s {
			if r.gone(s[i].Token) {
				j.done = append(j.done, doneOf(s[i].Token, transport.ErrClosed))
				continue
			}
			s[k] = s[i]
			k++
		}
		j.flush() // their slots free before the copy
		errs := j.errs[:k]
		bc.CopyBatch(s[:k], errs)
		for i := range k {
			j.done = append(j.done, doneOf(s[i].Token, errs[i]))
		}
		clear(errs)
	} else {
		for i := range s {
			if n := len(j.done); n > 0 && !sameRequest(j.done[n-1].token, s[i].Token) {
				j.flush()
			}
			err := transport.ErrClosed
			if !r.gone(s[i].Token) {
				err = copyOne(j.cp, &s[i], &j.holds)
			}
			j.done = append(j.done, doneOf(s[i].Token, err))
			if err != nil {
				j.flush()
			}
		}
		j.holds.Release()
	}
	j.flush()
	clear(s) // no pointer into a buffer outlives the copy
	j.s, j.r, j.cp = s[:0], nil, nil
	r.poller.lend()
}

// flush queues the results gathered in done for the ring's poller.
func (j *copyJob) flush() {
	if len(j.done) > 0 {
		j.r.queueDones(j.done)
		j.done = j.done[:0]
	}
}

// sameRequest reports whether slice tokens a and b are of one request.
func sameRequest(a, b uint64) bool {
	ia, ga, _ := splitToken(a)
	ib, gb, _ := splitToken(b)
	return ia == ib && ga == gb
}

// gone reports whether the request of a slice a copy worker holds has
// ended. Any goroutine: the slot cannot be released, nor reused, while the
// worker holds the slice (it counts as outstanding).
func (r *Ring) gone(tok uint64) bool {
	idx, _, _ := splitToken(tok)
	return r.reqs[idx].gone.Load()
}

// share hands part of the batch, bound to the synchronous endpoint cp, to
// the poller's copy workers and leaves the rest in r.batch for the poller
// to copy: when the poller has workers, one has room, and the batch holds
// at least shareBatch bytes. Each worker that has room gets a share of the
// bytes, from the batch's tail: an equal one at first, more as weigh
// finds the workers waiting for the poller. The slices handed out count as
// outstanding, as those of a transport's Post: their requests stay in
// their slots (zombies, if they end meanwhile) until the worker's results
// come back through the completion queue. Poller goroutine only (not a
// lent step: its copies wait for the poller).
func (r *Ring) share(cp transport.Copier) {
	c := r.poller.copiers
	if c == nil || len(r.batch) < 2 {
		return
	}
	var total uint64
	for i := range r.batch {
		total += r.batch[i].Length
	}
	if total < shareBatch {
		return
	}
	per := total * fullWeight / uint64(c.n*fullWeight+c.weigh())
	end := len(r.batch)
	for range c.n {
		if end <= 1 {
			break
		}
		var j *copyJob
		select {
		case j = <-c.free:
		default:
		}
		if j == nil {
			break
		}
		start := end
		for part := uint64(0); start > 1 && part < per; {
			start--
			part += r.batch[start].Length
		}
		for i := start; i < end; i++ {
			s := &r.batch[i]
			q := r.live(s.Token)
			if q == nil {
				continue // an earlier copy ended its request: copyEach skips it too
			}
			q.outstanding++
			r.outstanding++
			j.s = append(j.s, *s)
		}
		end = start
		if len(j.s) == 0 {
			c.free <- j
			continue
		}
		j.r, j.cp = r, cp
		r.stats.Shared += uint64(len(j.s))
		c.jobs <- j // never blocks: jobs holds every job there is; j is the worker's now
	}
	clear(r.batch[end:])
	r.batch = r.batch[:end]
}

// weigh returns the poller's weight in the batch about to be shared,
// against a worker's fullWeight, after moving it a step towards the
// workers' pace. Every job free means every worker was done before this
// batch (it polled, idle, while the poller copied its part beside its
// other work: the next entries, the completions), so the poller takes
// less; fewer free than workers means the workers' queues are full
// (with one worker, three parts queued behind the one it copies), so it
// takes more, up to an equal share. In between it keeps its weight: a
// worker with parts queued has work until the poller's next batch. In a
// profile of the kv pattern in process with equal shares, the worker
// polled for its next part a quarter of its time.
func (c *copiers) weigh() int {
	switch free := len(c.free); {
	case free == cap(c.free) && c.pw > minWeight:
		c.pw--
	case free < c.n && c.pw < fullWeight:
		c.pw++
	}
	return c.pw
}

// sharing reports whether a one-slice request of n bytes to ep should
// skip the inline copy to join a batch that may be shared: the poller has
// workers, the slice is large, more entries wait behind it this round,
// and it joins the batch now: no slice of an earlier request waits to be
// posted (it would wait behind them, perhaps for an endpoint without room:
// an inline copy goes at once), the ring is not waiting for room
// (waiting), the completion queue has room, the batch is empty or
// bound to ep, a free slot is left for the entries behind it, and the
// ring is not yielding to a higher class after yieldBytes (its batches
// would never reach shareBatch).
func (r *Ring) sharing(n uint64, ep transport.Endpoint) bool {
	if r.poller.copiers == nil || !r.more || n < shareSlice {
		return false
	}
	pq := r.queueOf(ep, false) // ep's own slices waiting to go again, if any
	return r.queued == 0 && (pq == nil || (len(pq.redo) == 0 && !r.waiting(pq))) && r.yieldAt == noYield &&
		(len(r.batch) == 0 || r.batchEP == ep) && len(r.free) >= 2 &&
		r.outstanding+len(r.batch)+1 < r.done.Cap()
}
