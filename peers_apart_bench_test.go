package moonring_test

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/proccpu"
	"github.com/moonring/moonring/metadata"
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
			d := c.targetDesc(b)
			ctx := context.Background()
			store := metadata.NewMemory()
			b.Cleanup(func() { store.Close() })
			if err := store.Put(ctx, d); err != nil {
				b.Fatal(err)
			}
			peers, rings, ids := newPeers(b, "apart-peer", n, roundEntries(n, false), store, childKey)
			segs := make([]moonring.SegmentID, n)
			base := d.Buffers[0].Addr
			for i := range rings {
				var err error
				if segs[i], err = peers[i].OpenSegment(ctx, d.Name); err != nil {
					b.Fatal(err)
				}
			}
			peerRounds(b, warmRounds(n, false), rings, segs, ids, base, false) // connected, warm
			tgt0, own0 := childCPU(b, c), proccpu.Self()
			b.ResetTimer()
			peerRounds(b, b.N, rings, segs, ids, base, false)
			b.StopTimer()
			tgt, own := childCPU(b, c)-tgt0, proccpu.Self()-own0
			b.ReportMetric(float64(tgt.Nanoseconds())/float64(b.N), "tgt-cpu-ns/op")
			b.ReportMetric(float64(own.Nanoseconds())/float64(b.N), "own-cpu-ns/op")
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
			tgt0, own0 := childCPU(b, c), proccpu.Self()
			b.ResetTimer()
			rawRounds(b, b.N, conns, false)
			b.StopTimer()
			tgt, own := childCPU(b, c)-tgt0, proccpu.Self()-own0
			b.ReportMetric(float64(tgt.Nanoseconds())/float64(b.N), "tgt-cpu-ns/op")
			b.ReportMetric(float64(own.Nanoseconds())/float64(b.N), "own-cpu-ns/op")
		})
	}
}

// childCPU is the CPU time child c has used.
func childCPU(b *testing.B, c *child) time.Duration {
	t, err := proccpu.Of(c.Pid())
	if err != nil {
		b.Fatal(err)
	}
	return t
}
