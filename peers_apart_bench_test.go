package moonring_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/proccpu"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// BenchmarkScalePeersApart is BenchmarkScalePeersTurn with the target in a
// process of its own (a child: childTarget, its buffer 1 MiB): all n peers
// of this process connected and warm, each round's 64 READs of 4 KiB from
// one peer, the next peer in turn. A fleet's initiators are processes of
// their own, each warm for its own requests; what the count of peers
// costs the one target they share is its CPU per request, tgt-cpu-ns/op
// (the child's /proc/PID/stat over the timed loop, in 10 ms ticks), set
// apart here from the n engines' own (own-cpu-ns/op, getrusage of this
// process) and from the wall time per request (ns/op).
func BenchmarkScalePeersApart(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 10, 100, 1000) {
		b.Run(fmt.Sprintf("peers=%d", n), func(b *testing.B) {
			c := startChild(b, "target", "MOONRING_SIZE=1048576")
			set, closeAll, err := apartPeers("apart-peer", n, c.targetDesc(b))
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(closeAll)
			timeApart(b, c, func(total int) { peerRounds(b, set, total, false) })
		})
	}
}

// BenchmarkScalePeersApartRaw is BenchmarkScalePeersApart's baseline: n
// loopback TCP connections from this process to a child that answers
// them all (childAnswer, rawAnswer: 32-byte requests, 4 KiB answers, no
// engine), each round's 64 requests on one connection, the next in turn;
// tgt-cpu-ns/op is the child's CPU per request.
func BenchmarkScalePeersApartRaw(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 10, 100, 1000) {
		b.Run(fmt.Sprintf("peers=%d", n), func(b *testing.B) {
			c := startChild(b, "answer")
			conns := make([]net.Conn, n)
			for i := range conns {
				cn, err := net.Dial("tcp", c.Line)
				if err != nil {
					b.Fatal(err)
				}
				defer cn.Close()
				conns[i] = cn
			}
			rawRounds(b, warmRounds(n, false), conns, false) // accepted, warm
			timeApart(b, c, func(total int) { rawRounds(b, total, conns, false) })
		})
	}
}

// BenchmarkScalePeersProcs is BenchmarkScalePeersApart with the n peers
// spread over a few processes (up to 4 children, childPeers) as well as
// the target in one of its own. The peers' processes take turns: each
// moves its share, every one of its peers a round of 64 READs on one
// peer in turn (at least 64 rounds, so that the turn's hand-off through
// the children's pipes is under 1 % of it), then the next process. It
// reports ns/op (the wall time a request), tgt-cpu-ns/op (the target's
// CPU a request) and peers-cpu-ns/op (the peers' processes', all of
// them, from /proc/PID/stat).
func BenchmarkScalePeersProcs(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 10, 100, 1000) {
		b.Run(fmt.Sprintf("peers=%d", n), func(b *testing.B) {
			c := startChild(b, "target", "MOONRING_SIZE=1048576")
			procs := min(n, 4)
			kids, shares := make([]*child, procs), make([]int, procs)
			for p := range procs {
				k := n / procs
				if p < n%procs {
					k++
				}
				kids[p] = startChild(b, "peers", "MOONRING_PEERS="+strconv.Itoa(k),
					fmt.Sprintf("MOONRING_NAME=procs-peer-%d", p), "MOONRING_DESC="+c.Line)
				shares[p] = max(k*64, 64*64)
			}
			kidsCPU := func() time.Duration {
				var sum time.Duration
				for _, k := range kids {
					sum += childCPU(b, k)
				}
				return sum
			}
			tgt0, peers0 := childCPU(b, c), kidsCPU()
			b.ResetTimer()
			for done, p := 0, 0; done < b.N; p = (p + 1) % procs {
				m := min(shares[p], b.N-done)
				if got := kids[p].Ask(b, "run %d", m); got != "ok" {
					b.Fatalf("peers' process %d: %s", p, got)
				}
				done += m
			}
			b.StopTimer()
			tgt, peers := childCPU(b, c)-tgt0, kidsCPU()-peers0
			b.ReportMetric(float64(tgt.Nanoseconds())/float64(b.N), "tgt-cpu-ns/op")
			b.ReportMetric(float64(peers.Nanoseconds())/float64(b.N), "peers-cpu-ns/op")
		})
	}
}

// childPeers is BenchmarkScalePeersProcs' peers: MOONRING_PEERS engines
// (makePeers, named MOONRING_NAME-i, with the children's key) that open
// the target whose descriptor is MOONRING_DESC (JSON) and move a round
// each to be warm. It prints "ready", then answers "run N" with "ok" once
// it moved N READs (peerSet.rounds, a round of 64 on one peer in turn),
// or with "error: ..."; it stops when stdin closes.
func childPeers() error {
	n, err := strconv.Atoi(os.Getenv("MOONRING_PEERS"))
	if err != nil || n < 1 {
		return fmt.Errorf("MOONRING_PEERS=%q: want a count", os.Getenv("MOONRING_PEERS"))
	}
	d, err := segtable.UnmarshalDesc([]byte(os.Getenv("MOONRING_DESC")))
	if err != nil {
		return fmt.Errorf("MOONRING_DESC: %w", err)
	}
	set, closeAll, err := apartPeers(os.Getenv("MOONRING_NAME"), n, d)
	if err != nil {
		return err
	}
	defer closeAll()
	return childproc.Serve("ready", func(cmd string) string {
		var total int
		if _, err := fmt.Sscanf(cmd, "run %d", &total); err != nil || total < 1 {
			return "error: unknown command " + cmd
		}
		if err := set.rounds(total, false); err != nil {
			return "error: " + err.Error()
		}
		return "ok"
	})
}

// apartPeers makes n peers of this process (makePeers, named prefix-i,
// with the children's key) for the target whose descriptor is d, opens
// its segment on each and moves a round on each (warmRounds), so they are
// connected and warm. closeAll closes them and their store.
func apartPeers(prefix string, n int, d *segtable.SegmentDesc) (set *peerSet, closeAll func(), err error) {
	ctx := context.Background()
	store := metadata.NewMemory()
	if err := store.Put(ctx, d); err != nil {
		store.Close()
		return nil, nil, err
	}
	peers, rings, ids, err := makePeers(prefix, n, roundEntries(n, false), store, childKey)
	if err != nil {
		store.Close()
		return nil, nil, err
	}
	closeAll = func() { closePeers(peers); store.Close() }
	set = &peerSet{rings: rings, segs: make([]moonring.SegmentID, n), ids: ids, base: d.Buffers[0].Addr}
	for i, p := range peers {
		if set.segs[i], err = p.OpenSegment(ctx, d.Name); err != nil {
			closeAll()
			return nil, nil, err
		}
	}
	if err := set.rounds(warmRounds(n, false), false); err != nil {
		closeAll()
		return nil, nil, err
	}
	return set, closeAll, nil
}

// timeApart times move(b.N) and reports, besides ns/op, the CPU a
// request of the child c (tgt-cpu-ns/op) and of this process
// (own-cpu-ns/op).
func timeApart(b *testing.B, c *child, move func(total int)) {
	tgt0, own0 := childCPU(b, c), proccpu.Self()
	b.ResetTimer()
	move(b.N)
	b.StopTimer()
	tgt, own := childCPU(b, c)-tgt0, proccpu.Self()-own0
	b.ReportMetric(float64(tgt.Nanoseconds())/float64(b.N), "tgt-cpu-ns/op")
	b.ReportMetric(float64(own.Nanoseconds())/float64(b.N), "own-cpu-ns/op")
}

// childCPU is the CPU time child c has used.
func childCPU(b *testing.B, c *child) time.Duration {
	t, err := proccpu.Of(c.Pid())
	if err != nil {
		b.Fatal(err)
	}
	return t
}
