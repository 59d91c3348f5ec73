package moonring

import (
	"net/http"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/moonring/moonring/ring"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// Collector returns a Prometheus collector of the engine's metrics, to
// register into the host's own registry. Nothing on the request path
// touches it: it reads, at scrape time, the counters that each poller keeps
// without atomics (a round trip to every poller per scrape). Safe for
// concurrent use; it reports nothing once the engine is closed.
//
// Metrics: moonring_requests_total{ring,status}, moonring_bytes_total{ring},
// moonring_slice_retries_total{ring}, moonring_request_failovers_total{ring}
// (requests moved to another path), moonring_stale_completions_total{ring},
// moonring_requests_in_flight{ring},
// moonring_peer_requests_total{ring,segment,transport,op,status},
// moonring_peer_bytes_total{ring,segment,transport,op},
// moonring_request_duration_seconds{ring} (a histogram),
// moonring_errors_total{ring,error},
// moonring_poller_up_seconds_total{node,poller},
// moonring_poller_parked_seconds_total{node,poller}, moonring_poller_parks_total{node,poller},
// moonring_buffers_registered, moonring_segments_open,
// moonring_notifications_queued,
// moonring_path_failovers_total{segment,transport} (requests left the
// segment's path through the transport after it failed),
// moonring_path_failbacks_total{segment,transport} (new requests moved
// back to it) and moonring_segment_path{segment,transport} (1 for the
// path new requests take, 0 for the segment's other open paths). A ring is "batch/<node>" for the batch
// API's rings and "ring/<n>" for NewRing's, numbered in creation order.
func (e *Engine) Collector() prometheus.Collector { return (*collector)(e) }

// MetricsHandler serves the engine's metrics (and nothing else) in the
// Prometheus text format, for an endpoint of the host's choosing, such as
// the Handler of a metadata.P2P store.
func (e *Engine) MetricsHandler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(e.Collector())
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

type collector Engine

var (
	mRequests  = prometheus.NewDesc("moonring_requests_total", "Requests ended, by terminal status.", []string{"ring", "status"}, nil)
	mBytes     = prometheus.NewDesc("moonring_bytes_total", "Bytes moved by completed requests.", []string{"ring"}, nil)
	mRetries   = prometheus.NewDesc("moonring_slice_retries_total", "Slices posted again after a failure.", []string{"ring"}, nil)
	mReqFO     = prometheus.NewDesc("moonring_request_failovers_total", "Requests moved to another path of their segment after a failure of the path.", []string{"ring"}, nil)
	mStale     = prometheus.NewDesc("moonring_stale_completions_total", "Slice completions that arrived for a slot's earlier use.", []string{"ring"}, nil)
	mShared    = prometheus.NewDesc("moonring_shared_copy_slices_total", "Slices of synchronous copies (local, shm) a copy worker moved beside the poller (Config.CopyWorkers).", []string{"ring"}, nil)
	mHeld      = prometheus.NewDesc("moonring_ring_held_rounds_total", "Poller rounds in which a ring started nothing because a ring of a higher class was busy (RingConfig.Class).", []string{"ring"}, nil)
	mPromoted  = prometheus.NewDesc("moonring_ring_promoted_rounds_total", "Poller rounds in which a held ring was promoted after waiting (RingConfig.Class).", []string{"ring"}, nil)
	mInFlight  = prometheus.NewDesc("moonring_requests_in_flight", "Requests in the in-flight table, including ended ones whose slices are still out.", []string{"ring"}, nil)
	mPollerUp  = prometheus.NewDesc("moonring_poller_up_seconds_total", "Time the poller (of its NUMA node's Config.Pollers) has run.", []string{"node", "poller"}, nil)
	mPollerPk  = prometheus.NewDesc("moonring_poller_parked_seconds_total", "Time the poller slept (the rest it worked or spun).", []string{"node", "poller"}, nil)
	mPollerNo  = prometheus.NewDesc("moonring_poller_parks_total", "Times the poller went to sleep.", []string{"node", "poller"}, nil)
	mBuffers   = prometheus.NewDesc("moonring_buffers_registered", "Registered local buffers.", nil, nil)
	mSegments  = prometheus.NewDesc("moonring_segments_open", "Open remote segments.", nil, nil)
	mNotesWait = prometheus.NewDesc("moonring_notifications_queued", "Notifications waiting on Engine.Notifications.", nil, nil)
	mErrors    = prometheus.NewDesc("moonring_errors_total", "Requests ended with an error, by kind.", []string{"ring", "error"}, nil)
	mLatency   = prometheus.NewDesc("moonring_request_duration_seconds", "Completed requests, from when the poller took them to their last slice.", []string{"ring"}, nil)
	mPeerReqs  = prometheus.NewDesc("moonring_peer_requests_total", "READ/WRITE requests ended, by peer segment, transport, op and outcome.", []string{"ring", "segment", "transport", "op", "status"}, nil)
	mRefused   = prometheus.NewDesc("moonring_refused_total", "What the engine refused from others: peers' descriptors that failed their signature check or were of an old epoch (what=descriptor), and its transports' refused connections, by reason.", []string{"what", "reason"}, nil)
	mServed    = prometheus.NewDesc("moonring_served_requests_total", "READ/WRITE requests this engine served as a target, by transport, peer address, op and outcome (the TCP transport; shm peers copy without the target).", []string{"transport", "peer", "op", "status"}, nil)
	mServedB   = prometheus.NewDesc("moonring_served_bytes_total", "Bytes this engine served as a target, by transport, peer address and op.", []string{"transport", "peer", "op"}, nil)
	mFailovers = prometheus.NewDesc("moonring_path_failovers_total", "Times requests left a segment's path through a transport after it failed.", []string{"segment", "transport"}, nil)
	mFailbacks = prometheus.NewDesc("moonring_path_failbacks_total", "Times new requests moved back to a segment's path through a transport after a probe found it working.", []string{"segment", "transport"}, nil)
	mSegPath   = prometheus.NewDesc("moonring_segment_path", "A segment's open paths: 1 for the one new requests take, 0 for the others.", []string{"segment", "transport"}, nil)
	mPeerBytes = prometheus.NewDesc("moonring_peer_bytes_total", "Bytes moved by completed requests, by peer segment, transport and op.", []string{"ring", "segment", "transport", "op"}, nil)
)

// Describe implements prometheus.Collector.
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{mRequests, mBytes, mRetries, mReqFO, mStale, mShared, mHeld, mPromoted, mInFlight, mPollerUp, mPollerPk, mPollerNo, mBuffers, mSegments, mNotesWait, mPeerReqs, mPeerBytes, mLatency, mErrors, mRefused, mServed, mServedB, mFailovers, mFailbacks, mSegPath} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	e := (*Engine)(c)
	if e.closed.Load() {
		return
	}
	type named struct {
		name string
		r    *ring.Ring
	}
	var rings []named
	pollers := map[pollerKey]*ring.Poller{}
	e.mu.Lock()
	for r, o := range e.rings {
		if !r.Closed() {
			rings = append(rings, named{"ring/" + strconv.Itoa(o.n), r})
		}
	}
	for k, p := range e.pollers {
		pollers[k] = p
	}
	var tnames [segtable.MaxTransports]string
	for i, t := range e.transports {
		if t != nil {
			tnames[i] = t.Name()
		}
	}
	e.mu.Unlock()
	e.batches.mu.Lock()
	for k, r := range e.batches.rings {
		name := "batch/" + strconv.Itoa(k.node)
		if k.class != ClassNormal {
			name += "/" + k.class.String()
		}
		rings = append(rings, named{name, r})
	}
	e.batches.mu.Unlock()
	for _, x := range rings {
		st := x.r.Stats()
		for status, v := range map[string]uint64{"completed": st.Requests, "timeout": st.Timeouts, "canceled": st.Canceled, "failed": st.Failed} {
			ch <- prometheus.MustNewConstMetric(mRequests, prometheus.CounterValue, float64(v), x.name, status)
		}
		ch <- prometheus.MustNewConstMetric(mBytes, prometheus.CounterValue, float64(st.Bytes), x.name)
		ch <- prometheus.MustNewConstMetric(mRetries, prometheus.CounterValue, float64(st.Retries), x.name)
		ch <- prometheus.MustNewConstMetric(mReqFO, prometheus.CounterValue, float64(st.Failovers), x.name)
		ch <- prometheus.MustNewConstMetric(mStale, prometheus.CounterValue, float64(st.Stale), x.name)
		ch <- prometheus.MustNewConstMetric(mShared, prometheus.CounterValue, float64(st.Shared), x.name)
		ch <- prometheus.MustNewConstMetric(mHeld, prometheus.CounterValue, float64(st.Held), x.name)
		ch <- prometheus.MustNewConstMetric(mPromoted, prometheus.CounterValue, float64(st.Promoted), x.name)
		ch <- prometheus.MustNewConstMetric(mInFlight, prometheus.GaugeValue, float64(st.InFlight), x.name)
		for code, n := range st.Codes {
			if code > 0 && n > 0 {
				ch <- prometheus.MustNewConstMetric(mErrors, prometheus.CounterValue, float64(n), x.name, errorKind(Code(code)))
			}
		}
		lb, lsum := x.r.Latency()
		buckets := make(map[float64]uint64, len(lb))
		var count uint64
		for i, n := range lb {
			count += n
			buckets[float64(uint64(1)<<(i+10))/1e9] = count
		}
		ch <- prometheus.MustNewConstHistogram(mLatency, count, lsum.Seconds(), buckets, x.name)
		// Copied out on the poller, sent after: a slow reader of ch must
		// not hold the poller up. Added up by label set: a ring keeps the
		// counters of a closed segment until another takes its index, so
		// one name can come twice (and duplicates fail a whole scrape).
		type peerKey struct{ seg, tn, op string }
		peers := map[peerKey]ring.SegmentStats{}
		x.r.SegmentStats(func(ss ring.SegmentStats) {
			op := "read"
			if ss.Op == transport.Write {
				op = "write"
			}
			k := peerKey{ss.Segment.Name, tnames[ss.Transport], op}
			sum := peers[k]
			sum.Completed += ss.Completed
			sum.Failed += ss.Failed
			sum.Bytes += ss.Bytes
			peers[k] = sum
		})
		for k, ss := range peers {
			// NewConstMetric, not Must: a segment name that is not UTF-8
			// loses its series, not the process.
			send(ch, mPeerReqs, float64(ss.Completed), x.name, k.seg, k.tn, k.op, "completed")
			send(ch, mPeerReqs, float64(ss.Failed), x.name, k.seg, k.tn, k.op, "failed")
			send(ch, mPeerBytes, float64(ss.Bytes), x.name, k.seg, k.tn, k.op)
		}
	}
	for k, p := range pollers {
		st := p.Stats()
		n, i := strconv.Itoa(k.node), strconv.Itoa(k.idx)
		ch <- prometheus.MustNewConstMetric(mPollerUp, prometheus.CounterValue, st.Up.Seconds(), n, i)
		ch <- prometheus.MustNewConstMetric(mPollerPk, prometheus.CounterValue, st.Parked.Seconds(), n, i)
		ch <- prometheus.MustNewConstMetric(mPollerNo, prometheus.CounterValue, float64(st.Parks), n, i)
	}
	segs := 0
	type segPath struct{ seg, tn string }
	paths := map[segPath]float64{}
	e.segments.Each(func(s *segtable.Segment[transport.Endpoint]) {
		segs++
		cur := s.Path()
		for _, p := range s.Paths() {
			if tn := e.slotName(p.Transport); tn != "" {
				v := 0.0
				if p == cur {
					v = 1
				}
				paths[segPath{s.Name, tn}] = max(paths[segPath{s.Name, tn}], v)
			}
		}
	})
	for k, v := range paths {
		if m, err := prometheus.NewConstMetric(mSegPath, prometheus.GaugeValue, v, k.seg, k.tn); err == nil {
			ch <- m
		}
	}
	for _, ps := range e.PathStats() {
		send(ch, mFailovers, float64(ps.Failovers), ps.Segment, ps.Transport)
		send(ch, mFailbacks, float64(ps.Failbacks), ps.Segment, ps.Transport)
	}
	ch <- prometheus.MustNewConstMetric(mBuffers, prometheus.GaugeValue, float64(e.buffers.Len()))
	ch <- prometheus.MustNewConstMetric(mSegments, prometheus.GaugeValue, float64(segs))
	ch <- prometheus.MustNewConstMetric(mNotesWait, prometheus.GaugeValue, float64(len(e.notes)))
	if t, ok := e.Transport(tcp.Name).(*tcp.Transport); ok {
		r := t.Refusals()
		for reason, n := range map[string]uint64{
			"handshake_cap": r.HandshakeCap, "source_cap": r.SourceCap, "descriptors": r.Descriptors,
			"accept_error": r.AcceptErrors, "handshake_timeout": r.HandshakeTimeout, "bad_hello": r.BadHello,
			"auth": r.Auth, "conn_cap": r.ConnCap, "idle": r.Idle, "bad_frame": r.BadFrame,
		} {
			ch <- prometheus.MustNewConstMetric(mRefused, prometheus.CounterValue, float64(n), "tcp", reason)
		}
		t.Served(func(s tcp.Served) {
			peer := s.Peer.String()
			if !s.Peer.IsValid() {
				peer = "other"
			}
			send(ch, mServed, float64(s.Reads), "tcp", peer, "read", "completed")
			send(ch, mServed, float64(s.Writes), "tcp", peer, "write", "completed")
			send(ch, mServed, float64(s.Denied), "tcp", peer, "any", "refused")
			send(ch, mServedB, float64(s.ReadBytes), "tcp", peer, "read")
			send(ch, mServedB, float64(s.WriteBytes), "tcp", peer, "write")
		})
	}
	if t, ok := e.Transport(shm.Name).(*shm.Transport); ok {
		st := t.Stats()
		for reason, n := range map[string]uint64{
			"handshake_cap": st.Evicted, "uid_cap": st.EvictedUID, "conn_cap": st.Refused, "auth": st.BadKey, "bad_hello": st.Failed,
		} {
			ch <- prometheus.MustNewConstMetric(mRefused, prometheus.CounterValue, float64(n), "shm", reason)
		}
	}
	if e.signed != nil {
		st := e.signed.Refused()
		ch <- prometheus.MustNewConstMetric(mRefused, prometheus.CounterValue, float64(st.Forged), "descriptor", "forged")
		ch <- prometheus.MustNewConstMetric(mRefused, prometheus.CounterValue, float64(st.Stale), "descriptor", "stale")
	}
}

// errorKind names an error code for the metrics: the sentinel's text
// without the package prefix.
func errorKind(c Code) string {
	if err := c.Err(); err != nil {
		return strings.TrimPrefix(err.Error(), "moonring: ")
	}
	return "ok"
}

// send sends a counter, unless its labels are invalid.
func send(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	if m, err := prometheus.NewConstMetric(d, prometheus.CounterValue, v, labels...); err == nil {
		ch <- m
	}
}
