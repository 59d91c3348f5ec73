//go:build efa && cgo

package efa_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// TestFailoverEFAToTCP: two engines of this process, each with the efa
// transport (libfabric's tcp provider) and the TCP transport; the segment
// opens over efa, with a TCP standby. Batches of WRITEs and READs (4 KiB
// to 1 MiB+5, every byte checked) stream over efa; the target's efa
// transport goes away mid-stream (UninstallTransport: its fabric endpoint
// and MRs close, as a peer whose provider died). Every task completes,
// over TCP from the failure on, the segment says "tcp", one failover is
// counted (PathStats, metrics), and a task that must take efa fails with
// ErrTransportDown. The target installs a fresh efa transport
// (republished: a new fabric address), the probe finds it, and the
// segment fails back; tasks go over efa again.
//
// A prober beside the batches WRITEs 4 KiB at a time. Logged for
// BENCHMARKS.md: "failover efa->tcp: D", from the start of the target's
// UninstallTransport to the first of those WRITEs completed over TCP
// (the batch that was in flight comes after); "failback tcp->efa: D",
// from the start of the target's InstallTransport to the segment on efa
// again.
//
// It used to fail now and then: the target's republished descriptor,
// which lists no efa endpoint and no efa keys, could reach the
// initiator's efa endpoint (the engine's watch Updates every path) before
// a slice in flight had failed; Post then refused the slices for want of
// a key, with ErrDenied, which the engine takes for the request's fault,
// and the tasks FAILED instead of moving to TCP. TestUpdateWithdrawn
// holds the endpoint to failing them with ErrPeer.
func TestFailoverEFAToTCP(t *testing.T) {
	newEFA(t, testConfig("tcp")).Close() // skips loudly where libfabric is missing
	foLeaks(t)
	store := metadata.NewMemory()
	key := []byte("efa-failover-test")
	mk := func(name string, transports []string) *moonring.Engine {
		cfg := testConfig("tcp")
		e, err := moonring.New(moonring.Config{Name: name, Metadata: store, Key: key, Transports: transports, TCP: &tcp.Config{}, EFA: &cfg})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := e.Close(); err != nil {
				t.Errorf("Engine.Close: %v", err)
			}
		})
		for _, tn := range []string{efa.Name, tcp.Name} {
			if e.Transport(tn) == nil {
				t.Fatalf("engine %s has no %s transport", name, tn)
			}
		}
		return e
	}
	a := mk(t.Name()+"-a", []string{efa.Name, tcp.Name})
	b := mk(t.Name()+"-b", nil)
	s := newFOStream(t, a, b, efa.Name, tcp.Name)

	s.start(t)
	s.waitRounds(t, 3, "rounds over efa")
	s.checkNone(t)
	killed, uninstall, marked := s.kill(t, func() error { return b.UninstallTransport(efa.Name) })
	probe, batch := s.waitFirst(t, killed)
	t.Logf("failover efa->tcp: %v (from the target's UninstallTransport(efa), which took %v, to the first %d-byte WRITE completed over TCP; the path was marked down after %v, and the first batch of %d with a task over TCP came back after %v)",
		foRound(probe), foRound(uninstall), foProbeLen, foRound(marked), foTasks, foRound(batch))
	s.waitCompleted(t, tcp.Name, 3*foTasks)
	s.checkFailedOver(t)

	// efa comes back: a fresh transport (a new fabric address),
	// republished; the watch hears it and probes at once.
	tr := newEFA(t, testConfig("tcp"))
	back := time.Now()
	if err := b.InstallTransport(tr); err != nil {
		tr.Close()
		t.Fatal(err)
	}
	at := s.waitFailback(t)
	t.Logf("failback tcp->efa: %v (from the target's InstallTransport of a fresh efa transport to the segment on efa)", foRound(at.Sub(back)))
	s.finish(t)
}

// The stream's batches: foTasks tasks, WRITEs (even) and READs (odd), the
// k-th of each foSizes[k] bytes at its own stride of the buffers.
const (
	foTasks  = 8
	foStride = 1<<20 + 64<<10
)

var foSizes = [foTasks / 2]int{4096, 64<<10 + 3, 256 << 10, 1<<20 + 5}

// foProbeLen is the length of the prober's WRITEs.
const foProbeLen = 4096

// foStream moves data from engine a to b's segment until stopped,
// checking every byte, on two goroutines:
//
//   - the stream: batches (the batch API) of WRITEs from src to dst's
//     first half and READs from dst's second half (a fixed pattern) into
//     back, at an offset that moves each round;
//   - the prober: one 4 KiB WRITE at a time (a ring of its own), from
//     psrc to pdst, each a fresh pattern.
//
// Once watch is set (the primary path died), each notes when it first got
// back a request that completed over the standby: the engine's counters
// by ring, transport and outcome (moonring_peer_requests_total) say when
// one did, and each goroutine has one batch or request out at a time and
// a ring label of its own (batch/..., ring/...), so it is the one just
// reaped.
type foStream struct {
	a, b             *moonring.Engine
	seg              moonring.SegmentID
	primary, standby string
	src, back, dst   []byte
	half             int
	psrc, pdst       []byte
	psrcID           moonring.BufferID
	ring             *moonring.Ring
	ctx              context.Context

	rounds, probes atomic.Uint64
	watch          atomic.Bool  // the primary path died: look for the standby's first completions
	first          atomic.Int64 // UnixNano: the first batch with a task completed over the standby came back
	pfirst         atomic.Int64 // UnixNano: the first probe completed over the standby came back

	stop     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
	mu       sync.Mutex
	err      error         // the first error of the goroutines, under mu
	failed   chan struct{} // closed with err set

	primaryBeforeDown float64
	// hook, when set, is run once by the stream right after it submitted
	// a batch: what kills the primary path, with a batch in flight.
	hook atomic.Pointer[func()]
}

// newFOStream registers the buffers (a's local, b's remote-accessible),
// opens b's segment on a over primary and waits for its standby path.
func newFOStream(t *testing.T, a, b *moonring.Engine, primary, standby string) *foStream {
	t.Helper()
	half := foTasks / 2 * foStride
	s := &foStream{a: a, b: b, primary: primary, standby: standby, half: half, stop: make(chan struct{}), failed: make(chan struct{})}
	alloc := func(e *moonring.Engine, n int, remote bool) ([]byte, moonring.BufferID) {
		m, err := e.Alloc(n, "cpu:0")
		if err != nil {
			t.Fatal(err)
		}
		id, err := e.RegisterLocalMemory(m, "cpu:0", remote)
		if err != nil {
			e.Free(m)
			t.Fatal(err)
		}
		t.Cleanup(func() { // before the engine's Close (cleanups run last first): unregistered first
			ctx, cancel := context.WithTimeout(context.Background(), foHang)
			defer cancel()
			if err := e.UnregisterLocalMemory(ctx, m); err != nil {
				t.Errorf("UnregisterLocalMemory: %v", err)
			} else if err := e.Free(m); err != nil {
				t.Errorf("Free: %v", err)
			}
		})
		return m, id
	}
	s.src, _ = alloc(a, half, false)
	s.back, _ = alloc(a, half, false)
	s.psrc, s.psrcID = alloc(a, foProbeLen, false)
	s.dst, _ = alloc(b, 2*half, true)
	s.pdst, _ = alloc(b, foProbeLen, true)
	testpattern.Fill(s.dst[half:], 77)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	t.Cleanup(cancel)
	s.ctx = ctx
	var err error
	if s.seg, err = a.OpenSegment(ctx, b.Name()); err != nil {
		t.Fatal(err)
	}
	if got := foTransport(t, a, s.seg); got != primary {
		t.Fatalf("segment opened over %q, want %s", got, primary)
	}
	foWait(t, "the "+standby+" standby path opens", func() bool {
		info, err := a.Segment(s.seg)
		return err == nil && len(info.Paths) == 2 && info.Paths[1].Transport == standby && info.Paths[1].Up
	})
	if s.ring, err = a.NewRing(moonring.RingConfig{Entries: 8}); err != nil {
		t.Fatal(err)
	}
	return s
}

// start runs the stream and the prober; a cleanup stops them (before the
// engines close).
func (s *foStream) start(t *testing.T) {
	for _, run := range []func() error{s.run, s.probe} {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := run(); err != nil {
				s.mu.Lock()
				if s.err == nil {
					s.err = err
					close(s.failed)
				}
				s.mu.Unlock()
			}
		}()
	}
	t.Cleanup(func() {
		s.stopOnce.Do(func() { close(s.stop) })
		done := make(chan struct{})
		go func() { s.wg.Wait(); close(done) }()
		select {
		case <-done:
			s.ring.Close()
		case <-time.After(foHang):
			t.Errorf("hang: the stream did not stop")
		}
	})
}

// ended returns the first error of the goroutines, or nil.
func (s *foStream) ended() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// standbyDone says whether a request of the ring named ring (a prefix)
// completed over the standby.
func (s *foStream) standbyDone(ring string) (bool, error) {
	n, err := foMetric(s.a, "moonring_peer_requests_total", map[string]string{"ring": ring + "*", "transport": s.standby, "status": "completed"})
	return n > 0, err
}

func (s *foStream) run() error {
	a, half := s.a, s.half
	reqs := make([]moonring.TransferRequest, foTasks)
	offs := make([]int, foTasks)
	for round := uint64(0); ; round++ {
		select {
		case <-s.stop:
			return nil
		default:
		}
		for i := range reqs {
			k := i / 2
			n := foSizes[k]
			if i%2 == 0 {
				l := s.src[k*foStride : k*foStride+n]
				testpattern.Fill(l, round<<8|uint64(i))
				reqs[i] = moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(l), TargetID: s.seg,
					TargetOffset: uint64(moonring.AddressOf(s.dst[k*foStride:])), Length: uint64(n)}
			} else {
				offs[i] = int(round*4099+uint64(k)*131) % (foStride - n)
				l := s.back[k*foStride : k*foStride+n]
				clear(l)
				reqs[i] = moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(l), TargetID: s.seg,
					TargetOffset: uint64(moonring.AddressOf(s.dst[half+k*foStride+offs[i]:])), Length: uint64(n)}
			}
		}
		id, err := a.AllocateBatchID(foTasks)
		if err != nil {
			return err
		}
		if err := a.SubmitTransfer(id, reqs); err != nil {
			a.FreeBatchID(id)
			return fmt.Errorf("round %d: %w", round, err)
		}
		if f := s.hook.Swap(nil); f != nil {
			(*f)()
		}
		if err := a.WaitBatch(s.ctx, id); err != nil {
			a.FreeBatchID(id)
			return fmt.Errorf("round %d: %w", round, err)
		}
		done := time.Now()
		var bad error
		for i := range reqs {
			st, err := a.GetTransferStatus(id, i)
			if err != nil || st.Status != moonring.COMPLETED || st.Bytes != reqs[i].Length {
				bad = errors.Join(bad, fmt.Errorf("round %d, task %d (%v of %d bytes): %v, %d bytes, %v %v",
					round, i, reqs[i].Opcode, reqs[i].Length, st.Status, st.Bytes, st.Err(), err))
			}
		}
		if err := a.FreeBatchID(id); err != nil {
			bad = errors.Join(bad, err)
		}
		if bad != nil {
			return bad
		}
		for i := range reqs {
			k := i / 2
			n := foSizes[k]
			var got, want []byte
			if i%2 == 0 {
				got, want = s.dst[k*foStride:k*foStride+n], s.src[k*foStride:k*foStride+n]
			} else {
				got, want = s.back[k*foStride:k*foStride+n], s.dst[half+k*foStride+offs[i]:][:n]
			}
			if d := testpattern.FirstDiff(got, want); d >= 0 {
				return fmt.Errorf("round %d, task %d (%v of %d bytes): bytes differ from byte %d on", round, i, reqs[i].Opcode, n, d)
			}
		}
		if s.watch.Load() && s.first.Load() == 0 {
			if ok, err := s.standbyDone("batch/"); err != nil {
				return err
			} else if ok {
				s.first.Store(done.UnixNano())
			}
		}
		s.rounds.Add(1)
	}
}

// probe is the prober's loop.
func (s *foStream) probe() error {
	r := s.ring
	remote := uint64(moonring.AddressOf(s.pdst))
	for i := uint64(1); ; i++ {
		select {
		case <-s.stop:
			return nil
		default:
		}
		testpattern.Fill(s.psrc[:foProbeLen], 1<<40|i)
		e := moonring.Entry{Op: moonring.OpWrite, Segment: s.seg, Buffer: s.psrcID, Remote: remote, Length: foProbeLen, UserData: i}
		if err := r.SubmitOne(&e); err != nil {
			return fmt.Errorf("probe %d: %w", i, err)
		}
		if err := r.CQ().Wait(s.ctx, 1); err != nil {
			return fmt.Errorf("probe %d: %w", i, err)
		}
		done := time.Now()
		c := *r.Peek()
		r.Advance(1)
		if c.UserData != i || c.Err() != nil {
			return fmt.Errorf("probe %d: completion %+v: %v", i, c, c.Err())
		}
		if d := testpattern.FirstDiff(s.pdst[:foProbeLen], s.psrc[:foProbeLen]); d >= 0 {
			return fmt.Errorf("probe %d: bytes differ from byte %d on", i, d)
		}
		if s.watch.Load() && s.pfirst.Load() == 0 {
			if ok, err := s.standbyDone("ring/"); err != nil {
				return err
			} else if ok {
				s.pfirst.Store(done.UnixNano())
			}
		}
		s.probes.Add(1)
	}
}

// waitRounds waits for k more rounds of the stream.
func (s *foStream) waitRounds(t *testing.T, k uint64, what string) {
	t.Helper()
	want := s.rounds.Load() + k
	s.waitCond(t, what, func() bool { return s.rounds.Load() >= want })
}

// waitCond waits until cond holds; a goroutine that ended fails t.
func (s *foStream) waitCond(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(foHang)
	for !cond() {
		select {
		case <-s.failed:
			t.Fatalf("%s: the stream ended: %v", what, s.ended())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("hang: %s (%v; %d rounds, %d probes)", what, foHang, s.rounds.Load(), s.probes.Load())
		}
		time.Sleep(time.Millisecond)
	}
}

// foHang is the hang detector of the waits, far above what they take
// (the rdma test runs under an emulated CPU).
const foHang = 2 * time.Minute

// waitCompleted waits until at least n requests completed over tn in all.
func (s *foStream) waitCompleted(t *testing.T, tn string, n float64) {
	t.Helper()
	var last time.Time
	s.waitCond(t, fmt.Sprintf("%v requests completed over %s", n, tn), func() bool {
		if time.Since(last) < 10*time.Millisecond {
			return false
		}
		last = time.Now()
		got, err := foMetric(s.a, "moonring_peer_requests_total", map[string]string{"transport": tn, "status": "completed"})
		if err != nil {
			t.Fatal(err)
		}
		return got >= n
	})
}

// checkNone checks that every request so far went over the primary.
func (s *foStream) checkNone(t *testing.T) {
	t.Helper()
	s.waitCond(t, "probes", func() bool { return s.probes.Load() >= 3 })
	n, err := foMetric(s.a, "moonring_peer_requests_total", map[string]string{"transport": s.standby})
	if err != nil {
		t.Fatal(err)
	}
	p, err := foMetric(s.a, "moonring_peer_requests_total", map[string]string{"transport": s.primary, "status": "completed"})
	if err != nil {
		t.Fatal(err)
	}
	if n != 0 || p < 3*foTasks+3 {
		t.Fatalf("before the failure: %v requests ended over %s, %v completed over %s; want none and at least %d", n, s.standby, p, s.primary, 3*foTasks+3)
	}
	s.primaryBeforeDown = p
}

// kill runs f on the stream's goroutine right after it submitted its
// next batch (an error of f fails t). It returns when f began and how
// long f took, once f returned and a ring marked the primary path down,
// with how long after f began the segment's path info said so (polled
// every millisecond). The prober goes on meanwhile.
func (s *foStream) kill(t *testing.T, f func() error) (at time.Time, took, marked time.Duration) {
	t.Helper()
	var err error
	ran := make(chan struct{})
	hook := func() {
		defer close(ran)
		at = time.Now()
		err = f()
		took = time.Since(at)
	}
	s.watch.Store(true)
	s.hook.Store(&hook)
	var down time.Time
	s.waitCond(t, "the primary path marked down", func() bool {
		if down.IsZero() {
			info, err := s.a.Segment(s.seg)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range info.Paths {
				if p.Transport == s.primary && !p.Up {
					down = time.Now()
				}
			}
		}
		select {
		case <-ran:
			return !down.IsZero()
		default:
			return false
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return at, took, down.Sub(at)
}

// waitFirst waits for the first probe and the first batch with a task
// completed over the standby, and returns the times from down to their
// completions.
func (s *foStream) waitFirst(t *testing.T, down time.Time) (probe, batch time.Duration) {
	t.Helper()
	s.waitCond(t, "requests completed over "+s.standby, func() bool { return s.first.Load() != 0 && s.pfirst.Load() != 0 })
	return time.Unix(0, s.pfirst.Load()).Sub(down), time.Unix(0, s.first.Load()).Sub(down)
}

// checkFailedOver checks, once the primary path died and requests went
// over the standby: the segment is on the standby, one failover of the
// primary is counted (PathStats and metrics), requests moved, and a task
// pinned to the primary fails with ErrTransportDown.
func (s *foStream) checkFailedOver(t *testing.T) {
	t.Helper()
	a, seg := s.a, s.b.Name()
	if got := foTransport(t, a, s.seg); got != s.standby {
		t.Fatalf("after the failure the segment goes over %q, want %s", got, s.standby)
	}
	foWait(t, "the failover is counted", func() bool { return foPathStats(a, seg, s.primary).Failovers == 1 })
	if ps := foPathStats(a, seg, s.standby); ps.Failovers != 0 {
		t.Fatalf("the standby's counters: %+v", ps)
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   func(float64) bool
	}{
		{"moonring_path_failovers_total", map[string]string{"segment": seg, "transport": s.primary}, func(v float64) bool { return v == 1 }},
		{"moonring_segment_path", map[string]string{"segment": seg, "transport": s.standby}, func(v float64) bool { return v == 1 }},
		{"moonring_segment_path", map[string]string{"segment": seg, "transport": s.primary}, func(v float64) bool { return v == 0 }},
		{"moonring_peer_requests_total", map[string]string{"segment": seg, "transport": s.standby, "status": "completed"}, func(v float64) bool { return v >= 3*foTasks }},
		{"moonring_peer_requests_total", map[string]string{"status": "failed"}, func(v float64) bool { return v == 0 }},
	} {
		v, err := foMetric(a, c.name, c.labels)
		if err != nil {
			t.Fatal(err)
		}
		if !c.want(v) {
			t.Errorf("metric %s%v = %v", c.name, c.labels, v)
		}
	}
	moved, err := foMetric(a, "moonring_request_failovers_total", nil)
	if err != nil {
		t.Fatal(err)
	}
	if moved < 1 {
		// The target's UninstallTransport republishes its descriptor
		// without efa, and the watch takes the path down (a publish is
		// O(1) now: within a millisecond); when that beats the failure
		// of every efa slice in flight, none had to move. No request
		// failed (checked above) and every byte is checked; moving a
		// request in flight is tested apart (TestFailoverInFlight).
		t.Logf("no request was in flight on %s as it died: the withdrawal took the path down first", s.primary)
	}
	batch, err := foMetric(a, "moonring_request_failovers_total", map[string]string{"ring": "batch/*"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%v requests moved from %s to %s as it died, %v of them the batches' tasks", moved, s.primary, s.standby, batch)

	// A task that must take the primary fails at once; one that prefers
	// it takes the standby. The last 4 KiB of the buffers' first halves:
	// no task of the stream's touches them (its last task per op takes
	// 1 MiB+5 of a stride of 1 MiB+64 KiB).
	tail := s.half - 4096
	id, err := a.AllocateBatchID(2)
	if err != nil {
		t.Fatal(err)
	}
	defer a.FreeBatchID(id)
	req := moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(s.src[tail:]), TargetID: s.seg,
		TargetOffset: uint64(moonring.AddressOf(s.dst[tail:])), Length: 4096, Transport: s.primary, TransportOnly: true}
	prefer := req
	prefer.TransportOnly = false
	prefer.Source = moonring.AddressOf(s.back[tail:])
	prefer.Opcode = moonring.Read
	if err := a.SubmitTransfer(id, []moonring.TransferRequest{req, prefer}); err != nil {
		t.Fatal(err)
	}
	if err := a.WaitBatch(s.ctx, id); err != nil {
		t.Fatal(err)
	}
	st, err := a.GetTransferStatus(id, 0)
	if err != nil || st.Status != moonring.FAILED || st.Code != cq.CodeTransportDown || !errors.Is(st.Err(), moonring.ErrTransportDown) {
		t.Fatalf("a task that must take %s while it is down: %+v (%v, %v); want FAILED with CodeTransportDown (ErrTransportDown)", s.primary, st, st.Err(), err)
	}
	if st, err := a.GetTransferStatus(id, 1); err != nil || st.Status != moonring.COMPLETED {
		t.Fatalf("a task that prefers %s while it is down: %+v (%v, %v); want COMPLETED over %s", s.primary, st, st.Err(), err, s.standby)
	}
}

// waitFailback waits for the segment to move back to the primary, and
// returns when it saw it there; then it checks the counters.
func (s *foStream) waitFailback(t *testing.T) time.Time {
	t.Helper()
	s.waitCond(t, "failback to "+s.primary, func() bool { return foTransport(t, s.a, s.seg) == s.primary })
	at := time.Now()
	seg := s.b.Name()
	if ps := foPathStats(s.a, seg, s.primary); ps.Failovers != 1 || ps.Failbacks != 1 {
		t.Fatalf("counters of %s: %+v, want 1 failover and 1 failback", s.primary, ps)
	}
	if v, err := foMetric(s.a, "moonring_path_failbacks_total", map[string]string{"segment": seg, "transport": s.primary}); err != nil || v != 1 {
		t.Fatalf("moonring_path_failbacks_total of %s: %v (%v), want 1", s.primary, v, err)
	}
	return at
}

// finish waits for requests over the primary again, stops the goroutines
// and checks that they ended well and that no request but the pinned one
// failed.
func (s *foStream) finish(t *testing.T) {
	t.Helper()
	s.waitCompleted(t, s.primary, s.primaryBeforeDown+3*foTasks)
	s.stopOnce.Do(func() { close(s.stop) })
	s.wg.Wait()
	if err := s.ended(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"moonring_peer_requests_total", map[string]string{"status": "failed"}, 0},
		{"moonring_requests_total", map[string]string{"status": "timeout"}, 0},
		{"moonring_requests_total", map[string]string{"status": "canceled"}, 0},
		// The one pinned to the primary while it was down.
		{"moonring_requests_total", map[string]string{"status": "failed"}, 1},
	} {
		if v, err := foMetric(s.a, c.name, c.labels); err != nil || v != c.want {
			t.Errorf("metric %s%v = %v (%v), want %v", c.name, c.labels, v, err, c.want)
		}
	}
	t.Logf("%d rounds of %d tasks (WRITEs and READs of %v bytes) and %d probes (%d-byte WRITEs), every byte checked",
		s.rounds.Load(), foTasks, foSizes, s.probes.Load(), foProbeLen)
}

// foMetric returns the sum of e's series of the metric name whose labels
// have the values of want; a value ending in "*" is a prefix.
func foMetric(e *moonring.Engine, name string, want map[string]string) (float64, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(e.Collector()); err != nil {
		return 0, err
	}
	mfs, err := reg.Gather()
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range want {
				if p, ok := strings.CutSuffix(v, "*"); ok && strings.HasPrefix(have[k], p) {
					continue
				}
				if have[k] != v {
					continue series
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum, nil
}

// foRound rounds d for the logs: to 0.1 ms.
func foRound(d time.Duration) time.Duration { return d.Round(100 * time.Microsecond) }

func foPathStats(e *moonring.Engine, seg, tn string) moonring.PathStats {
	for _, ps := range e.PathStats() {
		if ps.Segment == seg && ps.Transport == tn {
			return ps
		}
	}
	return moonring.PathStats{Segment: seg, Transport: tn}
}

func foTransport(t testing.TB, e *moonring.Engine, id moonring.SegmentID) string {
	t.Helper()
	name, err := e.SegmentTransport(id)
	if err != nil {
		t.Fatal(err)
	}
	return name
}

func foWait(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(foHang)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("hang: %s (%v)", what, foHang)
		}
		time.Sleep(time.Millisecond)
	}
}

// foLeaks checks, once the test's cleanups ran (it registers its own
// first, so it runs last), that the test left no descriptor open and no
// goroutine running; those that end on their own get a while to.
func foLeaks(t *testing.T) {
	fds, gs := leakcheck.FDs(), runtime.NumGoroutine()
	t.Cleanup(func() {
		if t.Failed() {
			return
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			now, g := leakcheck.FDs(), runtime.NumGoroutine()
			if len(now) <= len(fds) && g <= gs {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("leak: %d descriptors open (%d before the test), %d goroutines (%d before)\nbefore: %s\nafter: %s\n%s",
					len(now), len(fds), g, gs, strings.Join(fds, ", "), strings.Join(now, ", "), foStacks())
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

func foStacks() string {
	buf := make([]byte, 1<<20)
	return string(bytes.TrimSpace(buf[:runtime.Stack(buf, true)]))
}

// TestUpdateWithdrawn: the peer's descriptor stops listing efa (its engine
// uninstalled the transport, and republished): the endpoint's slices fail
// as on a dead path (ErrPeer), not as a request the peer refuses
// (ErrDenied, which the engine does not fail over); once the descriptor
// lists efa again, slices go through. The engine's watch hands every path
// the new descriptor, and it may come before any slice in flight failed.
func TestUpdateWithdrawn(t *testing.T) {
	p := newPair(t, "tcp", testConfig("tcp"), testConfig("tcp"))
	w := newWaiter()
	p.writeCheck(t, p.ep, p.desc, p.tmem, 1)
	gone := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: p.desc.Name, Epoch: p.desc.Epoch,
		Endpoints: map[string]string{"tcp": "127.0.0.1:1"},
		Buffers:   []segtable.BufferDesc{{Addr: p.desc.Buffers[0].Addr, Length: p.desc.Buffers[0].Length, Keys: map[string]string{"tcp": "1.2"}}}}
	p.ep.Update(gone)
	for _, op := range []transport.Op{transport.Write, transport.Read} {
		what := map[transport.Op]string{transport.Write: "WRITE", transport.Read: "READ"}[op]
		s := []transport.Slice{p.slice(op, 4096)}
		n, err := p.ep.Post(w, s)
		if err == nil && n == 1 {
			err = w.wait(t, s, 30*time.Second)[0]
		}
		if !errors.Is(err, transport.ErrPeer) || errors.Is(err, transport.ErrDenied) {
			t.Fatalf("%s with efa withdrawn: Post took %d: %v; want an error wrapping ErrPeer", what, n, err)
		}
	}
	p.ep.Update(p.desc)
	p.writeCheck(t, p.ep, p.desc, p.tmem, 2)
}
