// stats.go holds the ring's counters, kept by its poller without atomics:
// Stats, the latency histogram and the per-segment counters, each read on
// the poller's goroutine.

package ring

import (
	"time"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Stats are a ring's counters, kept by its poller without atomics and read
// with Ring.Stats.
type Stats struct {
	Requests uint64 // entries COMPLETED (Nops included)
	Bytes    uint64 // bytes moved by completed requests
	Retries  uint64 // slices posted again after a failure
	Timeouts uint64
	Canceled uint64
	Failed   uint64 // entries that ended FAILED, bad entries included
	Stale    uint64 // slice completions for a slot's earlier use
	// Failovers counts requests moved to another path of their segment
	// after a failure of the path (each also counts as a retry).
	Failovers uint64
	InFlight  uint64 // requests in the in-flight table now (a gauge)
	// Held counts rounds in which the ring started nothing new because a
	// ring of a higher class was busy (Config.Class); Promoted the
	// rounds in which it was promoted after waiting PollerConfig.Promote.
	Held, Promoted uint64
	// Shared counts slices of synchronous copies handed to the poller's
	// copy workers (PollerConfig.CopyWorkers).
	Shared uint64
	// Codes counts every ended entry by its completion code (index: the
	// cq.Code), so errors can be told apart by kind.
	Codes [32]uint64
}

// Stats returns a snapshot of the ring's counters, taken on its poller's
// goroutine (a round trip to it). Safe for concurrent use.
func (r *Ring) Stats() Stats {
	var st Stats
	if r.poller.do(func() { st = r.stats; st.InFlight = uint64(r.active) }) != nil {
		st = r.stats // the poller is gone: nothing writes the counters any more
	}
	return st
}

// LatencyBuckets is the number of buckets of Ring.Latency: bucket i counts
// requests that took less than 2^(i+10) ns (about 1 µs to 9 min).
const LatencyBuckets = 30

// Latency returns the ring's histogram of completed requests' durations,
// from when the poller took them to their last slice (see LatencyBuckets),
// and the sum of those durations, read on the poller's goroutine (a round
// trip). The poller measures with the clock it reads every few rounds, so
// durations are within a few rounds' time.
func (r *Ring) Latency() (buckets [LatencyBuckets]uint64, sum time.Duration) {
	read := func() { buckets, sum = r.latency, time.Duration(r.latencySum) }
	if r.poller.do(read) != nil {
		read()
	}
	return buckets, sum
}

// SegmentStats are a ring's counters for one segment, path and op.
type SegmentStats struct {
	Segment *segtable.Segment[transport.Endpoint]
	// Transport is the engine's slot of the transport whose path the
	// requests ended on.
	Transport int
	Op        transport.Op
	Completed uint64 // requests COMPLETED
	Failed    uint64 // requests that ended otherwise (FAILED, TIMEOUT, CANCELED)
	Bytes     uint64 // bytes moved by completed requests
}

// countSegment adds a finished request to its segment's counters for the
// transport in slot: a slice indexed by the segment's table index, the
// slot and the op, grown when a new index first appears and reset when
// another segment takes the index (no allocation in the steady state, no
// atomics).
func (r *Ring) countSegment(seg *segtable.Segment[transport.Endpoint], slot int, op transport.Op, code cq.Code, bytes uint64) {
	slot &= segtable.MaxTransports - 1
	i := 2*(int(uint32(seg.ID)&segtable.MaxEntries)*segtable.MaxTransports+slot) + int(op-transport.Read)&1
	if i >= len(r.perSeg) {
		r.perSeg = append(r.perSeg, make([]SegmentStats, i+1-len(r.perSeg))...)
	}
	st := &r.perSeg[i]
	if st.Segment != seg {
		*st = SegmentStats{Segment: seg, Transport: slot, Op: op}
	}
	if code == cq.CodeOK {
		st.Completed++
		st.Bytes += bytes
	} else {
		st.Failed++
	}
}

// SegmentStats calls fn with the ring's counters of every segment and op
// it has finished requests for, on the poller's goroutine (a round trip):
// fn must not block or call back into the ring.
func (r *Ring) SegmentStats(fn func(SegmentStats)) {
	each := func() {
		for _, st := range r.perSeg {
			if st.Segment != nil {
				fn(st)
			}
		}
	}
	if r.poller.do(each) != nil {
		each() // the poller is gone: nothing writes the counters any more
	}
}
