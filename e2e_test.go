package moonring_test

// End-to-end tests over real TCP between two OS processes: the test binary
// re-executes itself as a target (child_test.go) and this process drives
// it through an engine, keeping a byte model of the target's buffer. The
// helpers here serve the network-namespace tests too (netns_test.go).

import (
	"bytes"
	"context"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/tcp"
)

// e2eHang bounds every wait of these tests beyond a request's own deadline:
// a hang detector, never a performance assertion.
const e2eHang = 30 * time.Second

// e2eFaultTimeout is the engine Timeout of the fault tests: the deadline
// within which a request to a dead or unreachable peer must end. Requests
// after a recovery must also complete within it, against a child built
// with -race on a loaded 2-core machine: 2 s left too little room there.
const e2eFaultTimeout = 4 * time.Second

// e2eLeaks is called first in a test: its check runs after every other
// cleanup (the engine's Close, the child's exit, the namespace's removal)
// and asserts that the goroutines and file descriptors of the process are
// back to what they were before the test.
func e2eLeaks(t *testing.T) {
	t.Helper()
	e2eWarmFDs()
	before, _ := e2eFDs()
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		if err := goleak.Find(ignore); err != nil {
			t.Errorf("goroutines leaked: %v", err)
		}
		// Closing a socket is done once its last user returns, which the
		// goroutine check above already waited for; the poll only covers
		// that last step. No slack: every descriptor the test opened (the
		// engine's listener and rails, the child's pipes, pidfds, the
		// output of ip) must be closed by now.
		deadline := time.Now().Add(e2eHang)
		for {
			n, list := e2eFDs()
			if n == before {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("open file descriptors: %d before the test, %d after:\n%s", before, n, list)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// e2eWarmFDs opens the descriptors the runtime keeps for good once it
// first needs them (the network poller's epoll and its wakeup), so that
// the first test to use the network does not count them as its leak.
func e2eWarmFDs() {
	if ln, err := net.Listen("tcp", "127.0.0.1:0"); err == nil {
		ln.Close()
	}
}

// e2eFDs counts the process's open descriptors and lists them.
func e2eFDs() (int, string) {
	fds := leakcheck.FDs()
	return len(fds), strings.Join(fds, "\n")
}

// e2eRig is an initiator engine, a target's segment and a byte model of
// the target's buffer.
type e2eRig struct {
	t       *testing.T
	e       *moonring.Engine
	seg     moonring.SegmentID
	remote  uint64 // the address of the target's buffer
	model   []byte // what the target's buffer holds
	local   []byte // the initiator's registered buffer
	localID moonring.BufferID
	ring    *moonring.Ring
	rng     *rand.Rand
	pool    []byte        // random bytes that WRITEs copy from
	ud      atomic.Uint64 // the next ring UserData: unique across runs
}

// newRig starts an initiator engine with cfg (its TCP key set to the
// child's) on the target child c, and registers a local buffer of
// localSize bytes. Its cleanup closes the engine, failing the test if
// Close hangs.
func newRig(t *testing.T, c *child, cfg moonring.Config, localSize int, seed uint64) *e2eRig {
	t.Helper()
	if cfg.TCP == nil {
		cfg.TCP = &tcp.Config{Key: childKey}
	}
	e, seg, d := remoteEngine(t, c, cfg)
	r := &e2eRig{t: t, e: e, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
	r.target(seg, d.Buffers[0].Addr, int(d.Buffers[0].Length))
	local, err := e.Alloc(localSize, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.close()
		if err := e.Free(local); err != nil {
			t.Errorf("Free: %v", err)
		}
	})
	if r.localID, err = e.RegisterLocalMemory(local, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	r.local = local
	if r.ring, err = e.NewRing(moonring.RingConfig{Entries: 256}); err != nil {
		t.Fatal(err)
	}
	r.pool = make([]byte, 2<<20)
	for i := 0; i+8 <= len(r.pool); i += 8 {
		v := r.rng.Uint64()
		for k := range 8 {
			r.pool[i+k] = byte(v >> (8 * k))
		}
	}
	return r
}

// target points the rig at a segment whose buffer holds the child
// target's initial pattern.
func (r *e2eRig) target(seg moonring.SegmentID, addr uint64, size int) {
	r.seg, r.remote = seg, addr
	r.model = make([]byte, size)
	for i := range r.model {
		r.model[i] = byte(i * 7)
	}
}

// close closes the engine; it must return within the hang limit.
func (r *e2eRig) close() {
	done := make(chan error, 1)
	go func() { done <- r.e.Close() }()
	select {
	case err := <-done:
		if err != nil {
			r.t.Errorf("Engine.Close: %v", err)
		}
	case <-time.After(e2eHang):
		r.t.Errorf("hang: Engine.Close did not return in %v", e2eHang)
		<-done
	}
}

// e2eReq is one request: Length n between the target's buffer at off
// and the local buffer at loc, through the batch API or the ring.
type e2eReq struct {
	op    moonring.Opcode
	off   int
	loc   int
	n     int
	batch bool
}

func (q e2eReq) String() string {
	op := "READ"
	if q.op == moonring.Write {
		op = "WRITE"
	}
	via := "ring"
	if q.batch {
		via = "batch"
	}
	return fmt.Sprintf("%s %d bytes remote+%d local+%d via %s", op, q.n, q.off, q.loc, via)
}

func (q e2eReq) overlaps(p e2eReq) bool { return q.off < p.off+p.n && p.off < q.off+q.n }

// e2eResult is a request's terminal status as its API reported it.
type e2eResult struct {
	st    moonring.Status
	bytes uint64
	code  moonring.Code
	seen  int // how many terminal completions arrived for it
}

// e2ePlan says where the requests of a run may go.
type e2ePlan struct {
	count            int
	remoteLo, remote int // [remoteLo, remoteLo+remote) of the target's buffer
	readLo, read     int // where READs may go; read 0: as for WRITEs
	localLo, local   int // [localLo, localLo+local) of the local buffer
	minN, maxN       int
	reads            float64 // the share of READs
}

// size draws a length in [minN, maxN], each power of two as likely.
func (r *e2eRig) size(minN, maxN int) int {
	lo, hi := bits.Len(uint(minN))-1, bits.Len(uint(maxN))-1
	b := lo + r.rng.IntN(hi-lo+1)
	n := 1<<b + r.rng.IntN(1<<b)
	return min(max(n, minN), maxN)
}

// plan draws up to p.count requests. No two share local bytes, and none
// overlaps the remote range of a WRITE of the same run: each request's
// outcome is then defined by the model as it stood before the run.
func (r *e2eRig) plan(p e2ePlan) []e2eReq {
	if p.read == 0 {
		p.readLo, p.read = p.remoteLo, p.remote
	}
	var reqs []e2eReq
	loc := p.localLo
	for len(reqs) < p.count {
		q := e2eReq{op: moonring.Write, n: r.size(p.minN, p.maxN), batch: r.rng.IntN(2) == 0}
		lo, span := p.remoteLo, p.remote
		if r.rng.Float64() < p.reads {
			q.op, lo, span = moonring.Read, p.readLo, p.read
		}
		q.n = min(q.n, span)
		if loc+q.n > p.localLo+p.local {
			break
		}
		placed := false
		for try := 0; try < 32 && !placed; try++ {
			q.off = lo + r.rng.IntN(span-q.n+1)
			placed = !slices.ContainsFunc(reqs, func(o e2eReq) bool {
				return (q.op == moonring.Write || o.op == moonring.Write) && q.overlaps(o)
			})
			if !placed && q.n > p.minN {
				q.n = max(q.n/2, p.minN)
			}
		}
		if !placed {
			continue
		}
		q.loc = loc
		loc += q.n
		reqs = append(reqs, q)
	}
	return reqs
}

// run fills the local bytes of the WRITEs, runs reqs, the batch ones
// through the batch API (submitted in a few calls) and the others through
// the ring at once, and returns each one's terminal status. It fails the
// test when a request is not terminal within limit (a hang detector), when
// one completes twice, or when a completion names no request of the run.
// started, when not nil, is closed at the first terminal completion.
func (r *e2eRig) run(reqs []e2eReq, limit time.Duration, started chan<- struct{}) []e2eResult {
	t := r.t
	t.Helper()
	for _, q := range reqs {
		if q.op == moonring.Write {
			off := r.rng.IntN(len(r.pool) - q.n + 1)
			copy(r.local[q.loc:q.loc+q.n], r.pool[off:])
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	res := make([]e2eResult, len(reqs))
	var once sync.Once
	var first func() // nil: nobody waits for the first completion
	if started != nil {
		first = func() { once.Do(func() { close(started) }) }
	}
	var wg sync.WaitGroup
	var batch []int
	for i, q := range reqs {
		if q.batch {
			batch = append(batch, i)
		}
	}
	if len(batch) > 0 {
		wg.Add(1)
		rng := rand.New(rand.NewPCG(r.rng.Uint64(), 0)) // r.rng is this goroutine's
		go func() {
			defer wg.Done()
			r.runBatch(ctx, rng, reqs, batch, res, first)
		}()
	}
	r.runRing(ctx, reqs, res, first)
	wg.Wait()
	for i, x := range res {
		if x.seen != 1 || !x.st.Terminal() {
			t.Errorf("request %d (%v): %d terminal completions, status %v: want exactly one within %v", i, reqs[i], x.seen, x.st, limit)
		}
	}
	return res
}

func (r *e2eRig) runBatch(ctx context.Context, rng *rand.Rand, reqs []e2eReq, idx []int, res []e2eResult, first func()) {
	t := r.t
	id, err := r.e.AllocateBatchID(len(idx))
	if err != nil {
		t.Errorf("AllocateBatchID(%d): %v", len(idx), err)
		return
	}
	trs := make([]moonring.TransferRequest, len(idx))
	for k, i := range idx {
		q := reqs[i]
		trs[k] = moonring.TransferRequest{Opcode: q.op, Source: moonring.AddressOf(r.local[q.loc:]), TargetID: r.seg,
			TargetOffset: r.remote + uint64(q.off), Length: uint64(q.n)}
	}
	// Submit in up to three calls, as a caller filling a batch would.
	for rest := trs; len(rest) > 0; {
		n := min(len(rest), 1+rng.IntN(len(rest)))
		if err := r.e.SubmitTransfer(id, rest[:n]); err != nil {
			// The tasks count as submitted and end FAILED; their status
			// below says so.
			t.Logf("SubmitTransfer: %v", err)
		}
		rest = rest[n:]
	}
	if first != nil {
		// Poll while waiting, to see the first task end.
		stop := make(chan struct{})
		polled := make(chan struct{})
		go func() {
			defer close(polled)
			var st [1]moonring.TransferStatus
			for {
				if n, _ := r.e.GetBatchTransferStatus(id, st[:]); n == 1 && st[0].Status.Terminal() {
					first()
					return
				}
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Microsecond):
				}
			}
		}()
		defer func() { close(stop); <-polled }()
	}
	if err := r.e.WaitBatch(ctx, id); err != nil {
		t.Errorf("hang: WaitBatch: %v", err)
	}
	got := make([]moonring.TransferStatus, len(idx))
	if n, err := r.e.GetBatchTransferStatus(id, got); err != nil || n != len(idx) {
		t.Errorf("GetBatchTransferStatus: %d of %d, %v", n, len(idx), err)
	}
	for k, i := range idx {
		res[i] = e2eResult{st: got[k].Status, bytes: got[k].Bytes, code: got[k].Code}
		if got[k].Status.Terminal() {
			res[i].seen = 1
		}
	}
	if err := r.e.FreeBatchID(id); err != nil && ctx.Err() == nil {
		t.Errorf("FreeBatchID after WaitBatch: %v", err)
	}
}

func (r *e2eRig) runRing(ctx context.Context, reqs []e2eReq, res []e2eResult, first func()) {
	t := r.t
	base := r.ud.Add(uint64(len(reqs))) - uint64(len(reqs))
	var es []moonring.Entry
	want := 0
	for i, q := range reqs {
		if q.batch {
			continue
		}
		op := moonring.OpRead
		if q.op == moonring.Write {
			op = moonring.OpWrite
		}
		es = append(es, moonring.Entry{Op: op, Segment: r.seg, Buffer: r.localID, Local: uint64(q.loc),
			Remote: r.remote + uint64(q.off), Length: uint64(q.n), UserData: base + uint64(i)})
		want++
	}
	if want == 0 {
		return
	}
	cqes := make([]moonring.Completion, 64)
	got := 0
	reap := func() {
		n := r.ring.PeekBatch(cqes)
		for _, c := range cqes[:n] {
			i := c.UserData - base
			if c.UserData < base || i >= uint64(len(reqs)) || reqs[i].batch {
				t.Errorf("completion for UserData %d, no request of this run (a duplicate or stale completion)", c.UserData)
				continue
			}
			res[i].seen++
			if res[i].seen == 1 {
				got++
			}
			res[i].st, res[i].bytes, res[i].code = c.Status, c.Bytes, c.Code
			if first != nil {
				first()
			}
		}
		r.ring.Advance(n)
	}
	for rest := es; len(rest) > 0; {
		n, err := r.ring.Submit(rest)
		rest = rest[n:]
		if err == moonring.ErrSQFull {
			reap()
			continue
		}
		if err != nil {
			t.Errorf("Submit: %v", err)
			return
		}
	}
	for got < want {
		if err := r.ring.CQ().Wait(ctx, 1); err != nil {
			t.Errorf("hang: ring: %d of %d requests terminal: %v", got, want, err)
			return
		}
		reap()
	}
	// A second completion for a request of this run that is already here
	// is caught now; one that comes later, by the next run.
	reap()
}

// check asserts that every request COMPLETED with all its bytes, compares
// each READ with the model and applies each WRITE to it.
func (r *e2eRig) check(reqs []e2eReq, res []e2eResult) {
	t := r.t
	t.Helper()
	for i, q := range reqs {
		x := res[i]
		if x.st != moonring.COMPLETED || x.bytes != uint64(q.n) {
			t.Errorf("request %d (%v): %v, %d bytes, %v: want COMPLETED with %d bytes", i, q, x.st, x.bytes, x.code.Err(), q.n)
			continue
		}
		if q.op == moonring.Read {
			r.compare(fmt.Sprintf("request %d (%v)", i, q), r.local[q.loc:q.loc+q.n], q.off)
		}
	}
	for i, q := range reqs {
		if q.op == moonring.Write && res[i].st == moonring.COMPLETED {
			copy(r.model[q.off:q.off+q.n], r.local[q.loc:q.loc+q.n])
		}
	}
}

// compare fails the test if got differs from the model at off.
func (r *e2eRig) compare(what string, got []byte, off int) bool {
	want := r.model[off : off+len(got)]
	if bytes.Equal(got, want) {
		return true
	}
	k := 0
	for got[k] == want[k] {
		k++
	}
	r.t.Errorf("%s: data differs from the model at remote+%d: got %#x, want %#x", what, off+k, got[k], want[k])
	return false
}

// rounds runs healthy rounds of random requests in [lo, lo+span) of the
// target's buffer until total requests ran, checking each.
func (r *e2eRig) rounds(total, lo, span, localLo, localSpan, maxN int) {
	t := r.t
	t.Helper()
	var moved, reads, runs int
	defer func() { t.Logf("%d runs: %d requests (%d READs), %d bytes", runs, total, reads, moved) }()
	for done := 0; done < total && !t.Failed(); runs++ {
		reqs := r.plan(e2ePlan{count: 1 + r.rng.IntN(48), remoteLo: lo, remote: span, localLo: localLo, local: localSpan,
			minN: 1, maxN: maxN, reads: 0.5})
		res := r.run(reqs, r.e.Config().Timeout+e2eHang, nil)
		r.check(reqs, res)
		done += len(reqs)
		for _, q := range reqs {
			moved += q.n
			if q.op == moonring.Read {
				reads++
			}
		}
	}
}

// readBack reads [lo, lo+span) of the target's buffer into the local
// buffer at localLo, in one batch of requests of at most 1 MiB, and
// compares it with the model.
func (r *e2eRig) readBack(lo, span, localLo int) {
	t := r.t
	t.Helper()
	var reqs []e2eReq
	for off := 0; off < span; off += 1 << 20 {
		reqs = append(reqs, e2eReq{op: moonring.Read, off: lo + off, loc: localLo + off, n: min(1<<20, span-off), batch: true})
	}
	if localLo+span > len(r.local) {
		t.Fatalf("readBack of %d bytes at local+%d: the local buffer has %d", span, localLo, len(r.local))
	}
	clear(r.local[localLo : localLo+span])
	res := r.run(reqs, r.e.Config().Timeout+e2eHang, nil)
	for i, q := range reqs {
		if res[i].st != moonring.COMPLETED {
			t.Errorf("read back %v: %v", q, res[i].st)
		}
	}
	if !t.Failed() {
		r.compare("read back", r.local[localLo:localLo+span], lo)
	}
}

// TestTCPTwoProcesses: thousands of random READs and WRITEs of 1 B to 1
// MiB between this process and a child target over loopback TCP, through
// the batch API and a ring at once, each READ checked against a byte model
// of the target's buffer, and the whole buffer read back at the end.
func TestTCPTwoProcesses(t *testing.T) {
	e2eLeaks(t)
	const size = 4 << 20
	total := 3000
	if testing.Short() {
		total = 500
	}
	c := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size))
	r := newRig(t, c, moonring.Config{TCP: &tcp.Config{Key: childKey, Rails: 3}}, 2*size, 1)
	start := time.Now()
	r.rounds(total, 0, size, 0, 2*size, 1<<20)
	r.readBack(0, size, 0)
	ctx, cancel := context.WithTimeout(context.Background(), e2eHang)
	defer cancel()
	if err := r.e.CloseSegment(ctx, r.seg); err != nil {
		t.Errorf("CloseSegment: %v", err)
	}
	t.Logf("%d requests and a read back in %v", total, time.Since(start))
}

// The end of the local buffer that the fault scenario's first wave leaves
// alone, as offsets from the end: the second wave's part, parts for probes
// and for filling a ring's slots after the fault, and the part for what
// runs after the fault. Each part is used once: late bytes of requests
// that timed out may still land in it.
const (
	e2eFaultTail    = 8 << 20 // [len-8 MiB, len-6 MiB): the second wave
	e2eProbeTail    = 6 << 20 // [len-6 MiB, len-5 MiB): probes
	e2eSlotsTail    = 5 << 20 // [len-5 MiB, len-4 MiB): slot filling
	e2eRecoveryTail = 4 << 20 // [len-4 MiB, len): after the fault
)

// e2eFault runs the fault tests' scenario on a rig whose target is
// [0, size) with the initial pattern: a wave of large requests (WRITEs to
// the first half, READs of the second, so that every READ that completes
// has defined contents), broken by fault once the first request of the
// wave has ended; then a second wave, started after the fault, of which
// no request may complete. Every request must end within its deadline, as
// a hang detector sees it. What runs afterwards uses only the second half
// of the target's buffer (WRITEs of the first half that did not complete
// may still land) and the local buffer's tail after e2eFaultTail.
func (r *e2eRig) e2eFault(size int, fault func()) {
	t := r.t
	t.Helper()
	half := size / 2
	limit := r.e.Config().Timeout + e2eHang
	wave := r.plan(e2ePlan{count: 400, remoteLo: 0, remote: half, readLo: half, read: half,
		localLo: 0, local: len(r.local) - e2eFaultTail, minN: 64 << 10, maxN: 1 << 20, reads: 0.8})
	for _, q := range wave {
		if q.op == moonring.Read {
			for k := range q.n {
				r.local[q.loc+k] = ^byte((q.off + k) * 7) // no READ finds its bytes here already
			}
		}
	}
	started := make(chan struct{})
	done := make(chan []e2eResult, 1)
	go func() { done <- r.run(wave, limit, started) }()
	select {
	case <-started:
	case <-time.After(limit):
		t.Fatalf("hang: no request of the first wave ended within %v", limit)
	}
	fault()
	res := <-done
	var completed, broken int
	for i, q := range wave {
		x := res[i]
		switch x.st {
		case moonring.COMPLETED:
			completed++
			if x.bytes != uint64(q.n) {
				t.Errorf("wave 1 request %d (%v) COMPLETED with %d bytes", i, q, x.bytes)
			}
			if q.op == moonring.Read {
				r.compare(fmt.Sprintf("wave 1 request %d (%v), COMPLETED", i, q), r.local[q.loc:q.loc+q.n], q.off)
			}
		case moonring.FAILED, moonring.TIMEOUT:
			broken++
			if x.bytes != 0 {
				t.Errorf("wave 1 request %d (%v): %v with %d bytes", i, q, x.st, x.bytes)
			}
		default:
			t.Errorf("wave 1 request %d (%v): %v (%v), want COMPLETED, FAILED or TIMEOUT", i, q, x.st, x.code.Err())
		}
	}
	t.Logf("wave 1: %d requests, %d COMPLETED before the fault, %d FAILED or TIMEOUT", len(wave), completed, broken)
	// The initiator hears of the fault a moment after it (the target's
	// socket closing): until then a WRITE into memory it mapped from the
	// dead target (shm) can still complete. Probes of one byte find when
	// it has heard, which must be within the limit.
	heard := time.Now().Add(limit)
	for probe := 0; ; probe++ {
		q := e2eReq{op: moonring.Write, off: 0, loc: len(r.local) - e2eProbeTail, n: 1}
		if x := r.run([]e2eReq{q}, limit, nil)[0]; x.st == moonring.FAILED || x.st == moonring.TIMEOUT {
			t.Logf("the initiator saw the fault at probe %d", probe)
			break
		}
		if time.Now().After(heard) {
			t.Fatalf("hang: requests still complete %v after the target was killed", limit)
		}
		time.Sleep(time.Millisecond)
	}
	// The second wave starts after the fault was seen: no byte can move,
	// so no request may complete.
	wave2 := r.plan(e2ePlan{count: 64, remoteLo: 0, remote: half, readLo: half, read: half,
		localLo: len(r.local) - e2eFaultTail, local: e2eFaultTail - e2eProbeTail, minN: 1, maxN: 256 << 10, reads: 0.5})
	res2 := r.run(wave2, limit, nil)
	counts := map[moonring.Status]int{}
	for i, q := range wave2 {
		x := res2[i]
		counts[x.st]++
		if x.st != moonring.FAILED && x.st != moonring.TIMEOUT {
			t.Errorf("wave 2 request %d (%v), started after the fault: %v (%v), want FAILED or TIMEOUT", i, q, x.st, x.code.Err())
		}
	}
	t.Logf("wave 2, after the fault: %d requests: %d FAILED, %d TIMEOUT", len(wave2), counts[moonring.FAILED], counts[moonring.TIMEOUT])
}

// TestTCPTargetKilled: the target process is killed with requests in
// flight. Every request ends FAILED or TIMEOUT within its deadline, except
// those that had completed (whose READ data is checked); the segment
// closes; a new target process is usable at once by the same initiator;
// the engine closes and nothing leaks.
func TestTCPTargetKilled(t *testing.T) {
	e2eLeaks(t)
	const size = 8 << 20
	c := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size))
	r := newRig(t, c, moonring.Config{Timeout: e2eFaultTimeout}, 40<<20, 2)
	r.e2eFault(size, c.KillWait)
	ctx, cancel := context.WithTimeout(context.Background(), e2eHang)
	defer cancel()
	if err := r.e.CloseSegment(ctx, r.seg); err != nil {
		t.Errorf("CloseSegment of the dead target: %v", err)
	}
	// A restarted peer is a new engine with a new name: the initiator
	// opens it and carries on.
	c2 := startChild(t, "target", "MOONRING_SIZE="+strconv.Itoa(size))
	d := c2.targetDesc(t)
	if err := r.e.Config().Metadata.Put(ctx, d); err != nil {
		t.Fatal(err)
	}
	seg, err := r.e.OpenSegment(ctx, d.Name)
	if err != nil {
		t.Fatalf("OpenSegment of the restarted target: %v", err)
	}
	r.target(seg, d.Buffers[0].Addr, int(d.Buffers[0].Length))
	r.rounds(200, 0, size, 0, len(r.local), 1<<20)
	r.readBack(0, size, 0)
}
