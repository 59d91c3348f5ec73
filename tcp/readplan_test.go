//go:build linux

package tcp

// Tests of the read plan (readplan.go): the readv of a payload takes the
// answers queued behind it. Against a scripted target (readahead_test.go)
// the test picks each answer's status and id and delivers the stream in
// pieces of its choice: a Driven run is read by the test's own driver,
// each piece is wholly in the initiator's socket before the driver reads
// it, and wholly read before the next is written, so every read system
// call sees one piece (or less), whatever the machine's speed. Against a
// real target, long runs of assorted READs and WRITEs are read by the
// receiver goroutine as the bytes come.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/rails"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
	"golang.org/x/sys/unix"
)

// planOp is one slice of a run: a READ (or a WRITE) of size bytes, and the
// status the target answers it with.
type planOp struct {
	write  bool
	size   int
	status byte
	// alias is 1 + the index of an earlier slice whose place in the
	// local buffer this one shares (its first size bytes, size at most
	// the earlier one's); 0: a place its own.
	alias int
}

func rd(size int, status byte) planOp { return planOp{size: size, status: status} }
func wr(size int, status byte) planOp { return planOp{write: true, size: size, status: status} }

// planGap is the canary bytes before and after each slice's place in the
// local buffer: no read may touch them.
const planGap = 13

// planRun is a run of Driven slices posted at once on a scripted rail,
// each at its own place in the local buffer, and the stream of answers.
type planRun struct {
	ops    []planOp
	offs   []int
	pays   [][]byte // a READ's payload (status OK), a WRITE's source
	stream []byte
	ends   []int // where each answer ends in stream
	u      *countUntil
}

// owe gets the scripted rail idle, so that the Driven slices posted next
// are read by their poster's Drive, and by nothing else.
func (s *scripted) owe(t *testing.T) {
	t.Helper()
	c := rail0(t, s.ep)
	u := &countUntil{ch: make(chanCompleter, 1)}
	u.want.Store(1)
	dst := s.local[len(s.local)-64:]
	if k, err := s.ep.Post(u, []transport.Slice{driven(localSlice(transport.Read, dst, s.remote.addr, 99))}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	ids, _ := s.frames(t, 1)
	if _, err := s.c.Write(append(resp(nil, ids[0], stOK), make([]byte, 64)...)); err != nil {
		t.Fatal(err)
	}
	for _, err := range u.ch.await(t, 1) {
		if err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the rail idle", func() bool { return c.rd.Load() == rdIdle })
}

// postRun posts ops as Driven slices, reads their frames and builds the
// stream that answers them, the id of answer bad (when in range) replaced
// by one that is not the next expected.
func (s *scripted) postRun(t *testing.T, seed int, ops []planOp, bad int) *planRun {
	t.Helper()
	pr := &planRun{ops: ops, u: &countUntil{ch: make(chanCompleter, len(ops))}}
	pr.u.want.Store(int32(len(ops)))
	var sl []transport.Slice
	off := planGap
	for i, op := range ops {
		if op.alias > 0 {
			pr.offs = append(pr.offs, pr.offs[op.alias-1])
			pr.pays = append(pr.pays, pattern(seed, i, op.size))
			sl = append(sl, driven(localSlice(transport.Read, s.local[pr.offs[i]:pr.offs[i]+op.size], s.remote.addr, uint64(i))))
			continue
		}
		pr.offs = append(pr.offs, off)
		b := s.local[off : off+op.size]
		pay := pattern(seed, i, op.size)
		pr.pays = append(pr.pays, pay)
		o := transport.Read
		if op.write {
			o = transport.Write
			copy(b, pay)
		}
		sl = append(sl, driven(localSlice(o, b, s.remote.addr, uint64(i))))
		off += op.size + planGap
	}
	if k, err := s.ep.Post(pr.u, sl); k != len(sl) || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	for i, op := range ops {
		var h [specReqLen]byte
		if _, err := io.ReadFull(s.c, h[:]); err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		id, n := binary.BigEndian.Uint32(h[4:]), int(binary.BigEndian.Uint32(h[12:]))
		if want := byte(specRead); op.write {
			want = specWrite
			p := make([]byte, n)
			if _, err := io.ReadFull(s.c, p); err != nil || !bytes.Equal(p, pr.pays[i]) {
				t.Fatalf("frame %d: WRITE payload wrong (%v)", i, err)
			}
			if h[0] != want {
				t.Fatalf("frame %d: op %d, want %d", i, h[0], want)
			}
		} else if h[0] != want || n != op.size {
			t.Fatalf("frame %d: op %d length %d, want %d %d", i, h[0], n, want, op.size)
		}
		if i == bad {
			id += 2
		}
		pr.stream = resp(pr.stream, id, op.status)
		if !op.write && op.status == stOK {
			pr.stream = append(pr.stream, pr.pays[i]...)
		}
		pr.ends = append(pr.ends, len(pr.stream))
	}
	return pr
}

// inq is how many bytes wait in the initiator's end of the rail.
func inq(c *conn) int {
	n := 0
	c.src.(*nbReader).rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	return n
}

// deliver writes the stream in pieces, each at its cut (the ends of the
// pieces but the last), with a driver reading the run: the first piece is
// wholly in the socket before the driver starts, and each next one is
// written once the socket is empty. It returns the completions in their
// order.
func (s *scripted) deliver(t *testing.T, pr *planRun, cuts []int) []completion {
	t.Helper()
	c := rail0(t, s.ep)
	prev := 0
	piece := func(end int) {
		s.c.Write(pr.stream[prev:end]) // a broken rail refuses the rest
		prev = end
	}
	cuts = append(cuts, len(pr.stream))
	done := make(chan struct{})
	drive := func() {
		defer close(done)
		s.ep.(*Endpoint).Drive(pr.u, 0)
	}
	started := false
	defer func() {
		if !started {
			go drive() // the rail is owed to a driver: Close waits for one
		}
	}()
	piece(cuts[0])
	waitFor(t, "the first piece in the socket", func() bool { return c.failed.Load() || inq(c) == cuts[0] })
	started = true
	go drive()
	for _, end := range cuts[1:] {
		waitFor(t, "the socket read", func() bool { return c.failed.Load() || inq(c) == 0 })
		if c.failed.Load() {
			break
		}
		piece(end)
	}
	select {
	case <-done:
	case <-time.After(hang):
		t.Fatal("hang: the driver")
	}
	var got []completion
	timer := time.NewTimer(hang)
	defer timer.Stop()
	for len(got) < len(pr.ops) {
		select {
		case x := <-pr.u.ch:
			got = append(got, x)
		case <-timer.C:
			t.Fatalf("hang: %d of %d completions", len(got), len(pr.ops))
		}
	}
	return got
}

// check checks a run's completions: in order, each with the error its
// status gives (ErrProtocol from bad on), every READ done with exactly
// its payload, every WRITE's source as it was, and no byte outside the
// READs' destinations changed. A READ that failed may hold anything.
func (s *scripted) check(t *testing.T, pr *planRun, got []completion, bad int, what string) {
	t.Helper()
	for i, x := range got {
		op := pr.ops[i]
		if x.token != uint64(i) {
			t.Fatalf("%s: completion %d is slice %d's", what, i, x.token)
		}
		want := map[byte]error{stOK: nil, stDenied: transport.ErrDenied, stRange: transport.ErrRange, stBusy: transport.ErrNotifyFull}[op.status]
		if bad >= 0 && i >= bad {
			want = ErrProtocol
		}
		if !errors.Is(x.err, want) || (want == nil && x.err != nil) {
			t.Fatalf("%s: slice %d (%+v): %v, want %v", what, i, op, x.err, want)
		}
		later := false // a later READ done in the same place
		for j := i + 1; j < len(pr.ops); j++ {
			later = later || pr.ops[j].alias == i+1 && got[j].err == nil
		}
		b := s.local[pr.offs[i] : pr.offs[i]+op.size]
		if (op.write || x.err == nil) && !later && !bytes.Equal(b, pr.pays[i]) {
			t.Fatalf("%s: slice %d (%+v): bytes wrong at %d", what, i, op, testpattern.FirstDiff(b, pr.pays[i]))
		}
	}
	for i, op := range pr.ops {
		if op.alias > 0 {
			continue // in another slice's place: that one's canaries are its
		}
		at := pr.offs[i] + op.size
		for j, b := range s.local[at-op.size-planGap : at-op.size] {
			if b != canaryByte {
				t.Fatalf("%s: canary byte %d before slice %d changed", what, j, i)
			}
		}
		for j, b := range s.local[at : at+planGap] {
			if b != canaryByte {
				t.Fatalf("%s: canary byte %d after slice %d changed", what, j, i)
			}
		}
	}
	last := len(pr.ops) - 1
	for i := range s.local[:pr.offs[last]+pr.ops[last].size+planGap] {
		s.local[i] = canaryByte
	}
}

// planStats is the rail's plan counters and read system calls.
func planStats(t *testing.T, ep transport.Endpoint) (taken, unplans, calls uint64) {
	c := rail0(t, ep)
	return c.plan.taken, c.plan.unplans, c.src.(*nbReader).calls
}

// planRunOps is a run longer than a plan: a large READ first (its
// payload is read straight from the socket, with the plan), then READs
// below and at directMin and WRITEs. The whole run's answers, under 48
// KiB, fit in a loopback socket that nobody reads (a window of 64 KiB).
func planRunOps() []planOp {
	return []planOp{
		rd(directMin+100, stOK), rd(100, stOK), rd(1, stOK), rd(4096, stOK), wr(700, stOK),
		rd(33, stOK), rd(directMin, stOK), rd(2000, stOK), wr(5, stOK), rd(1500, stOK),
		rd(900, stOK), rd(7, stOK), wr(300, stOK), rd(64, stOK), rd(4000, stOK),
		rd(250, stOK), wr(1, stOK), rd(3, stOK), rd(1000, stOK), rd(128, stOK),
		wr(50, stOK), rd(600, stOK),
	}
}

// A run all in the socket at once: the first payload's readv takes the
// next planMax answers (READ payloads straight into their destinations),
// which complete with no read of their own, and the rest come after.
// Then the same with a READ that fails in the middle of the plan (denied,
// out of range, busy: no payload), at each place: the bytes that came
// after its header are the next answers', and every later READ completes
// with exactly its bytes; a WRITE that fails changes nothing.
func TestReadPlanStatuses(t *testing.T) {
	s := newScripted(t, Config{})
	s.owe(t)
	base := planRunOps()

	// All OK: two reads for the first planMax+1 answers.
	taken0, _, calls0 := planStats(t, s.ep)
	pr := s.postRun(t, 1, base[:planMax+1], -1)
	s.check(t, pr, s.deliver(t, pr, nil), -1, "all OK")
	taken, _, calls := planStats(t, s.ep)
	if taken-taken0 != planMax {
		t.Errorf("%d answers taken from the plan, want %d", taken-taken0, planMax)
	}
	if calls-calls0 > 2 {
		t.Errorf("%d read calls for %d answers, want 2 (a header, a readv)", calls-calls0, planMax+1)
	}

	statuses := []byte{stDenied, stRange, stBusy}
	for at := 1; at < len(base); at++ {
		for _, write := range []bool{false, true} {
			ops := append([]planOp(nil), base...)
			st := statuses[at%len(statuses)]
			ops[at] = planOp{write: write, size: ops[at].size, status: st}
			what := fmt.Sprintf("slice %d (write %v) status %d", at, write, st)
			_, unplans0, _ := planStats(t, s.ep)
			pr := s.postRun(t, at, ops, -1)
			s.check(t, pr, s.deliver(t, pr, nil), -1, what)
			_, unplans, _ := planStats(t, s.ep)
			// A READ planned that fails gives the plan back; a WRITE
			// was planned with no payload, as it came.
			if wantBack := !write && at <= planMax; (unplans > unplans0) != wantBack {
				t.Errorf("%s: plan given back %d times", what, unplans-unplans0)
			}
		}
	}
}

// Two failed READs in one plan, one right after the other and one at the
// plan's end, and one whose header alone came with the readv.
func TestReadPlanFailuresTogether(t *testing.T) {
	s := newScripted(t, Config{})
	s.owe(t)
	base := planRunOps()
	for ci, fails := range [][]int{{1, 2}, {2, 5, 6}, {planMax - 1, planMax}, {planMax, planMax + 1}, {1, planMax + 2}} {
		ops := append([]planOp(nil), base...)
		for k, at := range fails {
			ops[at] = rd(ops[at].size, []byte{stDenied, stRange, stBusy}[k%3])
		}
		for _, cut := range []string{"whole", "after header"} {
			pr := s.postRun(t, ci, ops, -1)
			var cuts []int
			if cut == "after header" {
				// The readv ends right after the first failure's
				// header: what follows comes by the next read.
				cuts = []int{pr.ends[fails[0]-1] + respSize}
			}
			s.check(t, pr, s.deliver(t, pr, cuts), -1, fmt.Sprintf("fails %v, %s", fails, cut))
		}
	}
}

// READs in flight whose destinations overlap: a plan never holds two of
// them, so that a failed READ's give-back finds the bytes the readv put
// after it as they came, and the READs after it complete with exactly
// their bytes.
func TestReadPlanOverlap(t *testing.T) {
	s := newScripted(t, Config{})
	s.owe(t)
	for ci, c := range []struct{ fail, alias, of int }{
		{1, 3, 1}, // the failed READ's own place, taken again later
		{1, 4, 2}, // a READ after it shares a place with one before
	} {
		ops := planRunOps()
		ops[c.fail] = rd(500, stDenied)
		ops[c.of] = rd(500, ops[c.of].status)
		ops[c.alias] = planOp{size: 500, status: stOK, alias: c.of + 1}
		pr := s.postRun(t, ci, ops, -1)
		s.check(t, pr, s.deliver(t, pr, nil), -1, fmt.Sprintf("case %d", ci))
	}
}

// A READ queued behind a large one whose destination is the first bytes
// of the large one's, read already when the rest of its payload is read
// with a plan: the plan must not take it, or the readv puts its bytes over
// the head's before the head completes. The run's first piece ends 1000
// bytes into the head's payload (those bytes come through the buffer);
// the head's destination is looked at as the head completes.
func TestReadPlanHeadAlias(t *testing.T) {
	s := newScripted(t, Config{})
	s.owe(t)
	for ci, alias := range []planOp{
		{size: 500, status: stOK, alias: 1},  // within the bytes read already
		{size: 1500, status: stOK, alias: 1}, // from them into the rest
	} {
		ops := []planOp{rd(directMin+4000, stOK), alias, rd(100, stOK), rd(3000, stOK)}
		pr := s.postRun(t, 40+ci, ops, -1)
		var atHead []byte
		pr.u.at = func(tok uint64, err error) {
			if tok == 0 {
				atHead = bytes.Clone(s.local[pr.offs[0] : pr.offs[0]+ops[0].size])
			}
		}
		_, _, calls0 := planStats(t, s.ep)
		got := s.deliver(t, pr, []int{respSize + 1000})
		if got[0].err != nil {
			t.Fatalf("case %d: the head: %v", ci, got[0].err)
		}
		if d := testpattern.FirstDiff(atHead, pr.pays[0]); d >= 0 {
			t.Fatalf("case %d: the head completed with byte %d not its own (a READ behind it landed first)", ci, d)
		}
		s.check(t, pr, got, -1, fmt.Sprintf("case %d", ci))
		if _, _, calls := planStats(t, s.ep); calls-calls0 < 3 {
			t.Fatalf("case %d: %d read calls: the run did not come in two pieces", ci, calls-calls0)
		}
	}
}

// An answer whose id is not the next one's, in the middle of a plan, at
// its end or past it, breaks the connection with ErrProtocol: the answers
// before it complete with their bytes, it and every slice queued after it
// end with ErrProtocol, and no byte outside the READs' destinations
// changed. So does one read from the bytes a failed READ gave back.
func TestReadPlanWrongID(t *testing.T) {
	for _, bad := range []int{1, 2, 7, planMax, planMax + 1, planMax + 3} {
		for _, after := range []bool{false, true} {
			if after && bad < 2 {
				continue
			}
			t.Run(fmt.Sprintf("%d/after-failure-%v", bad, after), func(t *testing.T) {
				s := newScripted(t, Config{})
				s.owe(t)
				ops := planRunOps()
				if after {
					ops[bad-1].status = stDenied // the plan given back first
				}
				pr := s.postRun(t, 3, ops, bad)
				got := s.deliver(t, pr, nil)
				s.check(t, pr, got, bad, fmt.Sprintf("bad id at %d", bad))
			})
		}
	}
}

// A run delivered in small pieces: a byte at a time around the first
// answers' ends and a failure, and in odd pieces elsewhere, and cut in
// two inside a header. Each readv ends wherever a piece does, so plans
// end inside headers and payloads, and every answer still lands exactly.
func TestReadPlanPieces(t *testing.T) {
	s := newScripted(t, Config{})
	s.owe(t)
	ops := planRunOps()
	ops[6] = rd(ops[6].size, stRange)
	ops[10] = rd(ops[10].size, stDenied)
	odd := []int{1, 2, 3, 5, 7, 11, 13, 4093, 8, 9, 16385, 17}
	for _, mode := range []string{"bytes", "odd", "odd from 3"} {
		pr := s.postRun(t, 7, ops, -1)
		var cuts []int
		at, k := 0, 0
		if mode == "odd from 3" {
			k = 3
		}
		for at < len(pr.stream) {
			step := odd[k%len(odd)]
			k++
			// A byte at a time from a little before the first
			// payload's end to past the first failure's header.
			if mode == "bytes" && at >= pr.ends[0]-5 && at < pr.ends[6]+30 {
				step = 1
			}
			at += step
			if at < len(pr.stream) {
				cuts = append(cuts, at)
			}
		}
		s.check(t, pr, s.deliver(t, pr, cuts), -1, mode)
	}
	// The first readv ends inside a planned answer's header, or right
	// after it: the header's bytes wait with the stream's next ones.
	for _, j := range []int{1, 2, 5, 9} {
		for _, h := range []int{1, 4, 7, 8} {
			pr := s.postRun(t, 8, ops, -1)
			s.check(t, pr, s.deliver(t, pr, []int{pr.ends[j] + h}), -1, fmt.Sprintf("cut %d into answer %d", h, j+1))
		}
	}
}

// Long runs of READs of assorted sizes, below and above directMin, mixed
// with WRITEs, over a real loopback target and read by the receiver
// goroutine as the bytes come: every slice completes in order, each READ
// with exactly its bytes, no byte around a destination changes, and plans
// took answers.
func TestReadPlanLoopback(t *testing.T) {
	const remoteSize, writeArea = 4 << 20, 2 << 20
	targ := newSide(t, Config{})
	rmem := targ.alloc(t, remoteSize, 0)
	testpattern.Fill(rmem[:remoteSize-writeArea], 11)
	remote := targ.register(t, rmem, true)
	init := newSide(t, Config{Rails: 1})
	ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep.Close() })
	local := init.alloc(t, 8<<20, canaryByte)
	rng := rand.New(rand.NewPCG(5, 6))
	sizes := []int{1, 100, 4095, 4096, directMin - 1, directMin, directMin + 1, 32 << 10, 50000, 128 << 10, 300000}
	rounds := 40
	if testing.Short() {
		rounds = 10
	}
	for round := range rounds {
		n := 20 + rng.IntN(100)
		comp := make(chanCompleter, n)
		var sl []transport.Slice
		var offs []int
		off := planGap
		woff := 0
		for i := range n {
			size := sizes[rng.IntN(len(sizes))]
			if off+size+planGap > len(local) {
				n = i
				break
			}
			offs = append(offs, off)
			b := local[off : off+size]
			if rng.IntN(4) == 0 {
				testpattern.FillAt(b, uint64(round), uint64(i))
				waddr := remote.addr + uint64(remoteSize-writeArea+woff%(writeArea-size))
				woff += size
				sl = append(sl, localSlice(transport.Write, b, waddr, uint64(i)))
			} else {
				at := uint64(rng.IntN(remoteSize - writeArea - size))
				sl = append(sl, localSlice(transport.Read, b, remote.addr+at, uint64(i)))
			}
			off += size + planGap
		}
		postAll(t, ep, comp, sl)
		for i := range n {
			select {
			case x := <-comp:
				if x.token != uint64(i) || x.err != nil {
					t.Fatalf("round %d: completion %d: slice %d, %v", round, i, x.token, x.err)
				}
			case <-time.After(hang):
				t.Fatalf("hang: round %d, slice %d", round, i)
			}
		}
		for i, s := range sl {
			b := local[offs[i] : offs[i]+int(s.Length)]
			var err error
			if s.Op == transport.Read {
				err = testpattern.Check(b, 11, s.Remote-remote.addr)
			} else {
				err = testpattern.Check(b, uint64(round), uint64(i))
			}
			if err != nil {
				t.Fatalf("round %d, slice %d (op %d, %d bytes): %v", round, i, s.Op, s.Length, err)
			}
			for j, c := range local[offs[i]-planGap : offs[i]] {
				if c != canaryByte {
					t.Fatalf("round %d: canary byte %d before slice %d changed", round, j, i)
				}
			}
		}
		if c := local[off]; c != canaryByte {
			t.Fatalf("round %d: the byte after the last slice changed", round)
		}
		for i := range local[:off] {
			local[i] = canaryByte
		}
	}
	// The plan's counters only: the receiver is reading again (calls).
	if taken := rail0(t, ep).plan.taken; taken == 0 {
		t.Error("no answer was taken from a plan")
	}
}

// A run of answers that come in one read (WRITEs' and small READs', all in
// the socket before the driver reads) reads the clocks once for the run,
// not once per answer: each answer's time, for the response deadline and
// the rails picker's Done, is the time its bytes came.
func TestAnswersClockPerRead(t *testing.T) {
	var calls atomic.Int64
	start := time.Now()
	s := newScripted(t, Config{railConfig: rails.Config{Now: func() int64 {
		calls.Add(1)
		return int64(time.Since(start))
	}}})
	s.owe(t)
	var ops []planOp
	for i := range 32 {
		if i%2 == 0 {
			ops = append(ops, wr(4096, stOK))
		} else {
			ops = append(ops, rd(200, stOK))
		}
	}
	pr := s.postRun(t, 50, ops, -1)
	calls.Store(0)
	got := s.deliver(t, pr, nil)
	s.check(t, pr, got, -1, "the run")
	if n := calls.Load(); n > 2 {
		t.Fatalf("the picker's clock read %d times for %d answers that came in one read", n, len(ops))
	}
}
