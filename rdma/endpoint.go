//go:build rdma && cgo

// endpoint.go holds the Endpoint, the way to one remote segment: Open
// connects its rails (one queue pair each, devices times QPsPerDevice)
// and makes its choice of rail (choose.go), the remote segment's buffers
// and keys are kept for Post's checks and replaced on Update, and Close
// flushes and destroys the queue pairs.

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// rbufs is the remote segment's buffers. Where a buffer's entry is a
// function of the buffer alone (no NICs to pick: outside Mooncake mode
// with a priority matrix) they are the Mirror m, which a republish makes
// from the one before, converting the chunks that changed. Otherwise
// ranges holds their descriptors sorted by address, searched with
// segtable.SegmentDesc.Find, and bufs[i] the keys of ranges.Buffers[i].
type rbufs struct {
	m      *segtable.Mirror[rbuf]
	ranges segtable.SegmentDesc
	bufs   []rbuf
}

// find returns the buffer holding [addr, addr+n) (for n == 0, the one addr
// lies in), or nil.
func (r *rbufs) find(addr, n uint64) *rbuf {
	if r.m != nil {
		b, _ := r.m.Floor(addr)
		if b == nil || addr-b.addr >= b.length || n > b.length-(addr-b.addr) {
			return nil
		}
		return b
	}
	if i := r.ranges.Find(addr, n); i >= 0 {
		return &r.bufs[i]
	}
	return nil
}

// rbuf is one buffer of the remote segment.
type rbuf struct {
	addr, length uint64
	rkeys        []uint32 // per remote device; nil: no usable key
	why          string   // why rkeys is nil
	nics         nicPick  // Mooncake mode: the local devices its slices avoid (mooncake_nics.go)
}

// rail is one lane of an endpoint: a queue pair between a local and a
// remote device, reconnected when it fails.
type rail struct {
	li, ri  int
	q       *qp   // nil until connected, and after eviction
	retired []*qp // failed queue pairs still flushing
	b       int   // index in the endpoint's batches for the Post under way, -1 when none
	// After a failed reconnect, connErr fails the rail at once until
	// retryAt (UnixNano), the wait doubling from reconnectWait up to
	// maxReconnectWait: a peer host that vanished costs one dial of up to
	// ConnectTimeout per wait, not one per Post, each holding a poller.
	// The wait ends early when the peer republishes (Update) or the
	// device's port comes up again.
	connErr error
	retryAt int64
	wait    time.Duration
	ups     uint64 // the device's port-up count at the failure
	// dialing is set while a goroutine reconnects the rail (see redial):
	// Posts send its slices to another rail meanwhile, or leave them to
	// the ring's next try. dialTok names that goroutine (an Update to
	// another address drops its dial, and a later one may start), and
	// dialStop ends it.
	dialing  bool
	dialTok  uint64
	dialStop context.CancelFunc
}

// The backoff of a rail's reconnects after one failed.
const (
	reconnectWait    = 100 * time.Millisecond
	maxReconnectWait = 10 * time.Second
)

// Endpoint is the way to one remote segment: Rails() queue pairs, over
// which slices are spread by measured speed (chooser). Safe for concurrent
// use; Posts are serialized. It lives from Open to Close.
type Endpoint struct {
	t      *Transport
	postMu sync.Mutex // Post, reconnects, eviction and Close
	// updMu serializes Updates, which build the new table of buffers
	// outside postMu (posts go on meanwhile) and store it under it.
	updMu  sync.Mutex
	addr   string // under postMu
	key    []byte // the segment key, under postMu
	mc     mcPeer // in Mooncake mode, the peer's RPC port and NICs, under postMu
	nrdev  int
	rails  []rail   // under postMu
	ch     *chooser // each slice's rail (choose.go); set by Open
	bufs   atomic.Pointer[rbufs]
	bt     batches       // C memory, under postMu
	closed bool          // under postMu
	gone   chan struct{} // closed when the first Close has torn everything down
	eff    []uint16      // the rail each slice of the Post under way went to, under postMu
	used   atomic.Int64
	// dials numbers the reconnects (rail.dialTok), under postMu.
	dials uint64
	// dialCtx ends the endpoint's reconnects when it closes.
	dialCtx    context.Context
	dialCancel context.CancelFunc
}

var (
	_ transport.Endpoint = (*Endpoint)(nil)
)

// Open connects to the segment desc describes: Rails() queue pairs, each
// connected through the peer's control listener. It fails with an error
// wrapping transport.ErrUnreachable when desc has no rdma endpoint or the
// peer cannot be reached.
func (t *Transport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	if t.closed.Load() {
		return nil, fmt.Errorf("rdma: open: %w", transport.ErrClosed)
	}
	es, ok := desc.Endpoints[t.name]
	if !ok {
		return nil, fmt.Errorf("rdma: segment %q has no %s endpoint: %w", desc.Name, t.name, transport.ErrUnreachable)
	}
	var (
		addr  string
		rdevs []string
		key   []byte
		mc    mcPeer
		err   error
	)
	if t.mc != nil {
		mc, err = parseMooncakePeer(desc)
		addr, rdevs = mc.rpc, mc.devs
	} else {
		addr, rdevs, key, err = parseEndpoint(es)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, transport.ErrUnreachable)
	}
	if key == nil && t.mc == nil {
		if t.open {
			return nil, fmt.Errorf("rdma: endpoint %q publishes no key and none is configured: %w: %w", es, ErrAuth, transport.ErrUnreachable)
		}
		key = t.key
	}
	ep := &Endpoint{t: t, addr: addr, key: key, mc: mc, nrdev: len(rdevs), gone: make(chan struct{})}
	ep.dialCtx, ep.dialCancel = context.WithCancel(context.Background())
	// Local device i talks to the peer's device i (modulo its count): on a
	// rail-optimized fabric NIC i of every host shares a switch. In
	// Mooncake mode the peer's priority matrix says which of its NICs
	// serve (mcPair; without a matrix the same).
	rdev := mcPair(len(t.devs), len(rdevs), nil)
	if t.mc != nil {
		rdev = mcPair(len(t.devs), len(rdevs), mc.matrix)
	}
	for li := range t.devs {
		for k := 0; k < t.cfg.QPsPerDevice; k++ {
			ep.rails = append(ep.rails, rail{li: li, ri: rdev[li], b: -1})
		}
	}
	ep.setBuffers(desc)
	devs := make([]int, len(ep.rails))
	for i := range ep.rails {
		devs[i] = ep.rails[i].li
	}
	if ep.ch, err = newChooser(devs, t.cfg.railConfig); err != nil {
		ep.dialCancel()
		return nil, err
	}
	ep.bt = newBatches(len(ep.rails))
	t.mu.Lock()
	if t.closed.Load() {
		t.mu.Unlock()
		ep.bt.free()
		return nil, fmt.Errorf("rdma: open: %w", transport.ErrClosed)
	}
	t.eps = append(t.eps, ep)
	t.mu.Unlock()
	ep.postMu.Lock()
	if ep.closed {
		// Transport.Close closed it between the two locks: the devices
		// may be gone, and nothing may be connected on them.
		ep.postMu.Unlock()
		return nil, fmt.Errorf("rdma: open: %w", transport.ErrClosed)
	}
	for i := range ep.rails {
		if ep.rails[i].q != nil {
			continue // Mooncake mode: connected with the rest of its device's set
		}
		if err := ep.connectRail(ctx, i); err != nil {
			ep.postMu.Unlock()
			ep.Close()
			return nil, fmt.Errorf("%w: %w", err, transport.ErrUnreachable)
		}
	}
	ep.postMu.Unlock()
	return ep, nil
}

// setBuffers takes the remote buffers of desc, with their keys and (in
// Mooncake mode) the devices each one's slices avoid, for the peer's
// matrix (ep.mc) and the rails' peer NICs as they are now. The caller holds
// postMu, or is Open.
func (ep *Endpoint) setBuffers(desc *segtable.SegmentDesc) {
	var np *nicPicker
	if ep.t != nil && ep.t.mc != nil && len(ep.mc.matrix) > 0 {
		np = newNICPicker(ep.mc.matrix, ep.rdev())
	}
	ep.bufs.Store(ep.buildBuffers(desc, np))
}

// buildBuffers returns the table of desc's buffers: their ranges, and the
// keys of each (and its NICs, from np when not nil). Without NICs to pick
// it is a Mirror made from the table before (the chunks desc shares with
// the last descriptor are not converted again: a republish after one
// registration among n buffers parses one chunk's keys); with them,
// O(n log n). Outside Mooncake mode an Update builds it before it takes
// postMu, so that a republish does not hold posts back. updMu is held, or
// the endpoint is being opened.
func (ep *Endpoint) buildBuffers(desc *segtable.SegmentDesc, np *nicPicker) *rbufs {
	if np == nil {
		var old *segtable.Mirror[rbuf]
		if cur := ep.bufs.Load(); cur != nil {
			old = cur.m
		}
		return &rbufs{m: segtable.NewMirror(old, segtable.ChunksOf(desc), ep.rbufOf)}
	}
	ds := slices.Clone(desc.AllBuffers()) // flat: O(n) a republish (see segtable.SegmentDesc.AllBuffers)
	sort.Slice(ds, func(i, j int) bool { return ds[i].Addr < ds[j].Addr })
	bs := make([]rbuf, 0, len(ds))
	for i := range ds {
		rb, _ := ep.rbufOf(&ds[i])
		rb.nics = np.pick(ds[i].Location, ds[i].Length)
		bs = append(bs, rb)
	}
	return &rbufs{ranges: segtable.SegmentDesc{Buffers: ds}, bufs: bs}
}

// rbufOf is b's entry: its range and its keys, or why it has none (a
// slice to it is then denied, not out of range: every buffer is kept).
func (ep *Endpoint) rbufOf(b *segtable.BufferDesc) (rbuf, bool) {
	rb := rbuf{addr: b.Addr, length: b.Length}
	name, parse := Name, parseKey
	if ep.t != nil && ep.t.mc != nil {
		name, parse = MooncakeName, parseMooncakeKey
	}
	rkeys, err := parse(b.Keys[name], ep.nrdev)
	if err != nil {
		rb.why = err.Error()
	} else {
		rb.rkeys = rkeys
	}
	return rb, true
}

// rdev returns the peer NIC of each local device's rails. The caller holds
// postMu, or is Open.
func (ep *Endpoint) rdev() []int {
	rdev := make([]int, len(ep.t.devs))
	for i := range ep.rails {
		rdev[ep.rails[i].li] = ep.rails[i].ri
	}
	return rdev
}

// Rails returns the number of queue pairs: devices times QPsPerDevice.
func (ep *Endpoint) Rails() int { return len(ep.rails) }

// Update takes the segment's new descriptor: its buffers and keys, and its
// address for queue pairs connected from now on. In Mooncake mode it also
// takes the peer's priority matrix: the rails of a device whose peer NIC
// it changes drop their queue pairs (their work fails and is retried) and
// connect to the new NIC when next used, and each buffer's NICs are
// chosen anew.
func (ep *Endpoint) Update(desc *segtable.SegmentDesc) {
	ep.updMu.Lock()
	defer ep.updMu.Unlock()
	var (
		addr  string
		rdevs []string
		key   []byte
		mc    mcPeer
		err   error
		built *rbufs
	)
	if ep.t.mc == nil {
		built = ep.buildBuffers(desc, nil) // no NICs to pick: before postMu
	}
	if ep.t.mc != nil {
		mc, err = parseMooncakePeer(desc)
		addr, rdevs = mc.rpc, mc.devs
	} else {
		addr, rdevs, key, err = parseEndpoint(desc.Endpoints[Name])
	}
	ep.postMu.Lock()
	if err == nil && len(rdevs) == ep.nrdev {
		moved := addr != ep.addr || (key != nil && !bytes.Equal(key, ep.key)) || mc.server != ep.mc.server
		if ep.t.mc != nil {
			ep.mc = mc
			ep.mcRepair(mcPair(len(ep.t.devs), len(rdevs), mc.matrix))
		}
		for i := range ep.rails { // the peer republished: reconnect at once
			r := &ep.rails[i]
			r.connErr, r.wait = nil, 0
			if moved && r.dialing { // dialing the old address: give up on it
				r.dialStop()
				r.dialing, r.dialTok, r.dialStop = false, 0, nil
			}
		}
		ep.addr = addr
		if key != nil {
			ep.key = key
		}
	}
	if built != nil {
		ep.bufs.Store(built)
	} else {
		ep.setBuffers(desc) // the NICs from the rails as they are now
	}
	ep.postMu.Unlock()
}

// closeTimeout bounds the wait for flushed completions on Close.
const closeTimeout = 5 * time.Second

// Close moves the endpoint's queue pairs to the error state, waits for
// their flushed work requests (completed with ErrClosed), and destroys
// them. Safe to call more than once.
func (ep *Endpoint) Close() error {
	t := ep.t
	ep.dialCancel() // a reconnect under way gives up; it finds the endpoint closed
	ep.postMu.Lock()
	if ep.closed {
		ep.postMu.Unlock()
		<-ep.gone // a Transport.Close frees the devices only after this
		return nil
	}
	ep.closed = true
	defer close(ep.gone)
	var qs []*qp
	for i := range ep.rails {
		r := &ep.rails[i]
		if r.q != nil {
			qs = append(qs, r.q)
		}
		qs = append(qs, r.retired...)
		r.q, r.retired = nil, nil
	}
	ep.bt.free()
	ep.postMu.Unlock()
	// The devices stay until this teardown ends: held before the endpoint
	// leaves t.eps, so a Transport.Close that no longer sees it frees them
	// only after this (one that still sees it waits on ep.gone). Had it
	// freed them already, the queue pairs went with them, and only the
	// slices are left to complete.
	t.life.RLock()
	defer t.life.RUnlock()
	t.mu.Lock()
	if i := slices.Index(t.eps, ep); i >= 0 {
		t.eps = slices.Delete(t.eps, i, i+1)
	}
	t.mu.Unlock()
	hw := !t.freed
	for _, q := range qs {
		q.state.Store(qpClosing)
		if hw {
			toErr(q.q)
		}
	}
	deadline := time.Now().Add(closeTimeout)
	for _, q := range qs {
		if hw {
			t.drainDevice(q.dev, q.ringIdle, deadline)
		}
	}
	for _, q := range qs {
		// Work requests that never completed (a device that did not
		// flush) complete here; later completions find no queue pair.
		q.dev.cqMu.Lock()
		t.qpMu.Lock()
		delete(t.qps, q.id)
		t.qpMu.Unlock()
		var left []done
		for seq := q.tail.Load(); seq != q.head.Load(); seq++ {
			s := &q.slots[seq%uint64(len(q.slots))]
			if s.c != nil { // a notification's is in notes
				left = append(left, done{c: s.c, token: s.token})
			}
			s.c = nil
		}
		q.tail.Store(q.head.Load())
		q.noteMu.Lock()
		for i := range q.notes {
			if n := &q.notes[i]; n.busy {
				left = append(left, done{c: n.c, token: n.token})
				*n = note{}
				q.noteOut.Add(-1)
			}
		}
		q.noteMu.Unlock()
		q.dev.cqMu.Unlock()
		for _, d := range left {
			d.c.Complete(d.token, fmt.Errorf("rdma: endpoint closed (unflushed or unanswered): %w", transport.ErrClosed))
		}
		if hw {
			q.destroy()
		} else {
			if q.conn != nil {
				q.conn.Close()
			}
			<-q.watch
		}
	}
	return nil
}
