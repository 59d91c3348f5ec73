package moonring_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// The open storm (issue 19): n engines open one target over TCP at the same
// moment, through the public API. It is how a prefill fleet finds a decode
// node after a restart: Mooncake's took about 96 s for 240 peers (its PR
// #2793). BENCHMARKS.md has the figures and the command.

// BenchmarkOpenStorm makes a target and n initiator engines in this process
// (MOONRING_STORM_PEERS, default 1000; each with the TCP transport, one
// rail, one shared metadata store and segment key), then releases them all
// at once: each opens the target and moves one 4 KiB READ, so its
// connection is up and proven. It reports the time until the last one is
// done, the per-peer open time's p50 and p99, and what the peers cost the
// process while they stay connected and idle: heap and goroutines per peer
// (both sides, since both are in this process) and the target's TCP
// connections. Each peer connects from 127.0.0.1, so the target's
// per-source handshake bound is lifted (MaxHandshakesPerSource -1: a
// fleet's peers come from their own hosts); its bound on handshakes in
// all (MaxHandshakes, 64) stays as it is.
func BenchmarkOpenStorm(b *testing.B) {
	n := 1000
	if s := os.Getenv("MOONRING_STORM_PEERS"); s != "" {
		var err error
		if n, err = strconv.Atoi(s); err != nil || n < 1 {
			b.Fatalf("MOONRING_STORM_PEERS=%q: want a count", s)
		}
	}
	for b.Loop() {
		stormOnce(b, n)
	}
}

// stormSide is a target and n peer engines of this process, each peer
// with a buffer of 4 KiB and a ring of ringEntries.
type stormSide struct {
	target *moonring.Engine
	base   uint64
	peers  []*moonring.Engine
	rings  []*moonring.Ring
	ids    []moonring.BufferID
}

func newStorm(b *testing.B, n, ringEntries int) *stormSide {
	key := []byte("open storm key")
	store := metadata.NewMemory()
	b.Cleanup(func() { store.Close() })
	target, err := moonring.New(moonring.Config{Name: "storm-target", Metadata: store, Key: key, Transports: []string{"tcp"},
		TCP: &tcp.Config{MaxHandshakesPerSource: -1}})
	if err != nil {
		b.Fatal(err)
	}
	mem, err := target.Alloc(1<<20, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { target.Close(); target.Free(mem) })
	if _, err := target.RegisterLocalMemory(mem, "cpu:0", true); err != nil {
		b.Fatal(err)
	}
	s := &stormSide{target: target, base: uint64(moonring.AddressOf(mem))}
	s.peers, s.rings, s.ids = newPeers(b, "storm-peer", n, ringEntries, store, key)
	return s
}

// newPeers makes n initiator engines named prefix-i (makePeers); the
// benchmark's cleanup closes them.
func newPeers(b *testing.B, prefix string, n, ringEntries int, store metadata.Store, key []byte) ([]*moonring.Engine, []*moonring.Ring, []moonring.BufferID) {
	peers, rings, ids, err := makePeers(prefix, n, ringEntries, store, key)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { closePeers(peers) })
	return peers, rings, ids
}

// makePeers makes n initiator engines named prefix-i (the TCP transport,
// one rail, store and key), each with a buffer of 4 KiB and a ring of
// ringEntries. On an error it closes those it made; else the caller
// closes them (closePeers).
func makePeers(prefix string, n, ringEntries int, store metadata.Store, key []byte) ([]*moonring.Engine, []*moonring.Ring, []moonring.BufferID, error) {
	peers, rings, ids := make([]*moonring.Engine, n), make([]*moonring.Ring, n), make([]moonring.BufferID, n)
	for i := range peers {
		p, err := moonring.New(moonring.Config{Name: fmt.Sprintf("%s-%d", prefix, i), Metadata: store, Key: key, Transports: []string{"tcp"},
			TCP: &tcp.Config{Rails: 1}})
		if err == nil {
			peers[i] = p
			ids[i], err = p.RegisterLocalMemory(make([]byte, 4096), "cpu:0", false)
		}
		if err == nil {
			// A small ring of its own: the batch API's rings are sized
			// for thousands of tasks, which is the peer's own cost, not
			// the connection's.
			rings[i], err = p.NewRing(moonring.RingConfig{Entries: ringEntries})
		}
		if err != nil {
			closePeers(peers)
			return nil, nil, nil, fmt.Errorf("peer %d of %d: %w", i, n, err)
		}
	}
	return peers, rings, ids, nil
}

// closePeers closes the engines of peers that were made.
func closePeers(peers []*moonring.Engine) {
	for _, p := range peers {
		if p != nil {
			p.Close()
		}
	}
}

// read is one 4 KiB READ of the target's buffer from peer i, waited for.
func (s *stormSide) read(ctx context.Context, i int, seg moonring.SegmentID) error {
	r := s.rings[i]
	if err := r.SubmitOne(&moonring.Entry{Op: moonring.OpRead, Segment: seg, Buffer: s.ids[i], Remote: s.base, Length: 4096}); err != nil {
		return err
	}
	return reap(ctx, r, 1)
}

// reap waits for n completions on r and checks them.
func reap(ctx context.Context, r *moonring.Ring, n int) error {
	var c [64]moonring.Completion
	for n > 0 {
		if err := r.CQ().Wait(ctx, 1); err != nil {
			return err
		}
		got := r.PeekBatch(c[:min(n, len(c))])
		for _, x := range c[:got] {
			if err := x.Err(); err != nil {
				return err
			}
		}
		r.Advance(got)
		n -= got
	}
	return nil
}

// heapNow is the heap live now: two collections, since the first only
// moves what sync.Pools hold (free buffers of idle connections) to their
// victim caches, and the second frees it.
func heapNow() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

func stormOnce(b *testing.B, n int) {
	s := newStorm(b, n, 4)
	h0, g0 := heapNow(), runtime.NumGoroutine()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	took := make([]time.Duration, n)
	errs := make([]error, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i, p := range s.peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			t0 := time.Now()
			seg, err := p.OpenSegment(ctx, "storm-target")
			if err == nil {
				err = s.read(ctx, i, seg)
			}
			took[i], errs[i] = time.Since(t0), err
		}()
	}
	t0 := time.Now()
	close(start)
	wg.Wait()
	all := time.Since(t0)
	for i, err := range errs {
		if err != nil {
			b.Fatalf("peer %d: %v", i, err)
		}
	}
	h1, g1 := heapNow(), runtime.NumGoroutine()
	slices.Sort(took)
	b.ReportMetric(all.Seconds(), "s-all-open")
	b.ReportMetric(float64(took[n/2].Microseconds())/1e3, "ms-open-p50")
	b.ReportMetric(float64(took[n*99/100].Microseconds())/1e3, "ms-open-p99")
	b.ReportMetric(float64(h1-min(h0, h1))/float64(n)/1024, "KiB-heap/peer")
	b.ReportMetric(float64(g1-g0)/float64(n), "goroutines/peer")
	b.ReportMetric(float64(n), "peers")
}

// BenchmarkScalePeers is the per-request cost as the target's distinct
// peers grow (1, 10, 100, 1000 engines of this process over loopback TCP,
// MOONRING_SCALE_MAX bounding the count): rounds of 64 READs of 4 KiB in
// flight, each round spread over the next 64 peers in turn (so with 1000
// peers every connection is used, 64 at a time), every completion
// checked. ns/op is per request, both sides' work. The shape changes with
// the count: one peer's 64 requests share a system call and a wake-up of
// each side, 64 peers' pay 64 of each (BenchmarkScalePeersRaw).
func BenchmarkScalePeers(b *testing.B) { scalePeers(b, true) }

// BenchmarkScalePeersTurn is BenchmarkScalePeers with the shape held: all
// n peers connected and warm, each round's 64 READs from one peer, the
// next peer in turn, so what grows is only the count of engines and
// connections the work moves among (their state out of the caches, the
// target's connections), not the system calls per request
// (BenchmarkScalePeersTurnRaw is its baseline).
func BenchmarkScalePeersTurn(b *testing.B) { scalePeers(b, false) }

// scalePeers runs BenchmarkScalePeers (spread: a round over the next
// peers) or BenchmarkScalePeersTurn (a round on the next peer).
func scalePeers(b *testing.B, spread bool) {
	for _, n := range scaleCounts(b, 1, 10, 100, 1000) {
		b.Run(fmt.Sprintf("peers=%d", n), func(b *testing.B) {
			s := newStorm(b, n, roundEntries(n, spread))
			ctx := context.Background()
			segs := make([]moonring.SegmentID, n)
			for i, p := range s.peers {
				var err error
				if segs[i], err = p.OpenSegment(ctx, "storm-target"); err != nil {
					b.Fatal(err)
				}
			}
			set := &peerSet{rings: s.rings, segs: segs, ids: s.ids, base: s.base}
			peerRounds(b, set, warmRounds(n, spread), spread) // connected, warm
			b.ResetTimer()
			peerRounds(b, set, b.N, spread)
		})
	}
}

// roundShape is the shape of a round of 64 READs over n peers: per
// requests from each of width peers (spread), or 64 from one.
func roundShape(n int, spread bool) (per, width int) {
	if spread {
		return max(1, 64/n), min(n, 64)
	}
	return 64, 1
}

// warmRounds is the count of requests that gives each of n peers its
// share of a round once: what the peers move before they are timed, so
// that what a peer's first full round pays once (the first touches of its
// connection's buffers: page faults, about 0.4 ms a peer) is paid.
func warmRounds(n int, spread bool) int {
	per, _ := roundShape(n, spread)
	return n * per
}

// roundEntries is the ring size a peer needs for its share of a round.
func roundEntries(n int, spread bool) int {
	per, _ := roundShape(n, spread)
	entries := 2
	for entries < per {
		entries <<= 1
	}
	return entries
}

// peerSet is n peers' rings, their buffers and the target's segment as
// each opened it, and the target buffer's address they read; rounds
// moves READs through them.
type peerSet struct {
	rings []*moonring.Ring
	segs  []moonring.SegmentID
	ids   []moonring.BufferID
	base  uint64
	next  int   // the peer the next round starts at
	used  []int // a round's peers and their counts
}

// rounds moves total READs of 4 KiB from the target's buffer at base
// into peer i's buffer ids[i] of segment segs[i], through its ring
// rings[i], in rounds of 64 (roundShape), the peers taken in turn from
// where the last call left off, and checks every completion. A total of
// warmRounds(n, spread) gives every peer its share of a round once.
func (p *peerSet) rounds(total int, spread bool) error {
	ctx := context.Background()
	n := len(p.rings)
	per, width := roundShape(n, spread)
	for done := 0; done < total; {
		p.used = p.used[:0]
		k := min(per*width, total-done) // no peer twice in a round
		for j := 0; j < k; {
			i := p.next % n
			p.next++
			m := min(per, k-j)
			for range m {
				if err := p.rings[i].SubmitOne(&moonring.Entry{Op: moonring.OpRead, Segment: p.segs[i], Buffer: p.ids[i], Remote: p.base, Length: 4096}); err != nil {
					return err
				}
			}
			p.used = append(p.used, i, m)
			j += m
		}
		for u := 0; u < len(p.used); u += 2 {
			if err := reap(ctx, p.rings[p.used[u]], p.used[u+1]); err != nil {
				return err
			}
		}
		done += k
	}
	return nil
}

// peerRounds is p.rounds, failing b on an error.
func peerRounds(b *testing.B, p *peerSet, total int, spread bool) {
	if err := p.rounds(total, spread); err != nil {
		b.Fatal(err)
	}
}
