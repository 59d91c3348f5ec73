//go:build rdma && cgo

// mooncake_initiator.go holds the initiator side of Mooncake mode (and
// what it publishes, ExtraEndpoints): each local device's rails connected
// together through one Mooncake handshake with the peer's RPC port
// (Mooncake keeps one set of queue pairs per pair of NICs, so a set is
// made, replaced and acknowledged whole), and notifications sent as
// Mooncake's notify frames. mooncake_wire.go reads the peer's descriptor.

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// ExtraEndpoints returns, in Mooncake mode, what the engine publishes
// beside the transport's endpoint: its NICs, "name/lid/gid" in device
// order (mooncake.EndpointRDMANICs), each with the GID in use now. Nil
// outside Mooncake mode. Safe for concurrent use.
func (t *Transport) ExtraEndpoints() map[string]string {
	if t.mc == nil {
		return nil
	}
	nics := make([]string, len(t.devs))
	for i, d := range t.devs {
		gid, lid := d.addr()
		nics[i] = d.name + "/" + strconv.Itoa(int(lid)) + "/" + mooncake.FormatGID(gid.Raw)
	}
	return map[string]string{mooncake.EndpointRDMANICs: strings.Join(nics, ",")}
}

// mcGroup returns the rails connected together with rail i: the rails of
// its local device (Open lays them out device by device).
func (ep *Endpoint) mcGroup(i int) (first, n int) {
	n = ep.t.cfg.QPsPerDevice
	return i - i%n, n
}

// mcConnectGroup connects the rails of rail i's group, as Open does; the
// caller holds postMu. Within the wait after a failed attempt it fails at
// once with that attempt's error.
func (ep *Endpoint) mcConnectGroup(ctx context.Context, i int) error {
	t := ep.t
	first, n := ep.mcGroup(i)
	r := &ep.rails[i]
	if err := ep.backingOff(r); err != nil {
		return err
	}
	if err := t.reserveQPs(ep, n); err != nil {
		return err
	}
	qs, err := t.mcConnect(ctx, ep, first, n, r.li, r.ri, ep.mc)
	if err != nil {
		t.unreserveQPs(n)
		t.connectFails.Add(1)
		for k := first; k < first+n; k++ {
			ep.failedConnect(k, err)
		}
		return err
	}
	ep.mcInstall(first, qs)
	return nil
}

// mcRedial reconnects the rails of rail i's group on a goroutine, as
// redial does for one rail. The caller holds postMu, and the endpoint is
// open.
func (ep *Endpoint) mcRedial(i int) error {
	t := ep.t
	first, n := ep.mcGroup(i)
	r := &ep.rails[i]
	for k := first; k < first+n; k++ {
		if ep.rails[k].dialing {
			return nil // the group's dial is under way
		}
	}
	if err := ep.backingOff(r); err != nil {
		return err
	}
	if d := t.devs[r.li]; d.down.Load() {
		return fmt.Errorf("rdma: %s port %d is down: %w", d.name, d.port, transport.ErrPeer)
	}
	if err := t.reserveQPs(ep, n); err != nil {
		return err
	}
	ep.dials++
	tok := ep.dials
	ctx, stop := context.WithCancel(ep.dialCtx)
	for k := first; k < first+n; k++ {
		g := &ep.rails[k]
		g.dialing, g.dialTok, g.dialStop = true, tok, stop
	}
	peer, li, ri := ep.mc, r.li, r.ri
	t.wg.Add(1) // Transport.Close closes this endpoint first, then waits: the devices outlive the dial
	go func() {
		defer t.wg.Done()
		defer stop()
		qs, err := t.mcConnect(ctx, ep, first, n, li, ri, peer)
		ep.postMu.Lock()
		defer ep.postMu.Unlock()
		own := true
		for k := first; k < first+n; k++ {
			g := &ep.rails[k]
			if g.dialTok != tok {
				own = false // an Update dropped this dial
				continue
			}
			g.dialing, g.dialTok, g.dialStop = false, 0, nil
		}
		stale := ep.closed || !own
		switch {
		case err == nil && !stale:
			ep.mcInstall(first, qs)
			t.reconnects.Add(1)
		case err == nil:
			for _, q := range qs {
				q.destroy() // gives its reservation back
			}
		default:
			t.unreserveQPs(n)
			if !stale {
				t.connectFails.Add(1)
				for k := first; k < first+n; k++ {
					ep.failedConnect(k, err)
				}
			}
		}
	}()
	return nil
}

// mcInstall puts a freshly connected set on the rails from first on. The
// peer replaced its side of the set they had, so their old queue pairs
// are failed (their work flushes, and the engine retries it) and retired.
// The caller holds postMu.
func (ep *Endpoint) mcInstall(first int, qs []*qp) {
	for k, q := range qs {
		r := &ep.rails[first+k]
		if r.q != nil {
			r.q.broke()
			r.retired = append(r.retired, r.q)
		}
		r.q, r.connErr, r.wait = q, nil, 0
	}
}

// mcRepair pairs each local device's rails with the peer NIC rdev gives
// it (mcPair). A rail whose NIC changes gives up its dial under way and
// its queue pair (failed, which flushes its work for the engine to retry,
// and retired); its group connects to the new NIC when next used. The
// caller holds postMu.
func (ep *Endpoint) mcRepair(rdev []int) {
	for i := range ep.rails {
		r := &ep.rails[i]
		if r.ri == rdev[r.li] {
			continue
		}
		r.ri = rdev[r.li]
		if r.dialing {
			r.dialStop()
			r.dialing, r.dialTok, r.dialStop = false, 0, nil
		}
		if r.q != nil {
			r.q.broke()
			r.retired = append(r.retired, r.q)
			r.q = nil
		}
	}
}

// reserveQPs reserves n queue pairs (reserveQP), all or none.
func (t *Transport) reserveQPs(ep *Endpoint, n int) error {
	for k := 0; k < n; k++ {
		if err := t.reserveQP(ep); err != nil {
			t.unreserveQPs(k)
			return err
		}
	}
	return nil
}

func (t *Transport) unreserveQPs(n int) {
	for range n {
		t.unreserveQP()
	}
}

// mcConnect creates n queue pairs for the rails from first of ep, on local
// device li to the peer's NIC ri, and connects them through Mooncake's
// handshake with the peer's RPC port: the request, the answer's queue
// pairs (as many, the NIC paths crossed), RTR and RTS with Mooncake's
// attributes, and the ready acknowledgement when the peer knows it.
func (t *Transport) mcConnect(ctx context.Context, ep *Endpoint, first, n, li, ri int, peer mcPeer) ([]*qp, error) {
	d := t.devs[li]
	if d.down.Load() {
		return nil, fmt.Errorf("rdma: %s port %d is down: %w", d.name, d.port, transport.ErrPeer)
	}
	if ri >= len(peer.devs) {
		return nil, fmt.Errorf("rdma: the peer has no NIC %d: %w", ri, transport.ErrPeer)
	}
	gid, lid := d.addr()
	// ConnectTimeout bounds the connect even under a caller's later
	// deadline (WithTimeout keeps the earlier of the two): the handshake's
	// exchanges end at it, and the moves to RTR and RTS, which the kernel
	// cannot be interrupted in (RTR resolves the peer's address: up to 1 s
	// each), are checked against it.
	ctx, cancel := context.WithTimeout(ctx, t.cfg.ConnectTimeout)
	defer cancel()
	cqs := make([]*C.struct_ibv_qp, 0, n)
	ok := false
	defer func() {
		if !ok {
			for _, q := range cqs {
				C.ibv_destroy_qp(q)
			}
		}
	}()
	nums := make([]uint32, n)
	for k := range n {
		q, err := C.mr_create_qp(d.pd, d.cq, C.int(t.cfg.Depth), 1)
		if q == nil {
			return nil, fmt.Errorf("rdma: ibv_create_qp on %s: %v: %w", d.name, err, transport.ErrPeer)
		}
		cqs = append(cqs, q)
		if rc := C.mr_to_init(q, C.int(d.port)); rc != 0 {
			return nil, fmt.Errorf("rdma: modify QP to INIT on %s: %v: %w", d.name, syscall.Errno(rc), transport.ErrPeer)
		}
		nums[k] = uint32(q.qp_num)
	}
	req := mooncake.RDMAHandshake{LocalServer: t.mc.server, LocalDevice: d.name, PeerServer: peer.server, PeerDevice: peer.devs[ri],
		LID: lid, GID: gid.Raw, QPNums: nums, ReadyAckSupported: true}
	ans, err := t.mc.client.Handshake(ctx, peer.rpc, req.Desc())
	if err != nil {
		return nil, fmt.Errorf("rdma: Mooncake handshake with %s for %s: %w: %w: %w", peer.rpc, mooncake.NICPath(peer.server, peer.devs[ri]), ErrHandshake, err, transport.ErrPeer)
	}
	a, err := ans.RDMA()
	if err == nil {
		err = req.CheckAnswer(a)
	}
	if err != nil {
		return nil, fmt.Errorf("rdma: Mooncake handshake with %s: %w: %w: %w", peer.rpc, ErrHandshake, err, transport.ErrPeer)
	}
	for k, q := range cqs {
		if rc := mcRTR(q, d, gid, a.QPNums[k], a); rc != 0 {
			return nil, fmt.Errorf("rdma: modify QP to RTR on %s (GID %s to %s): %v: %w", d.name, gid, GID{Raw: a.GID}.Addr(), syscall.Errno(rc), transport.ErrPeer)
		}
		if rc := C.mr_to_rts(q, mcPSN, C.int(d.rdAtomic), ackTimeout, mcInitiatorRetry); rc != 0 {
			return nil, fmt.Errorf("rdma: modify QP to RTS on %s: %v: %w", d.name, syscall.Errno(rc), transport.ErrPeer)
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("rdma: Mooncake connect to %s: %d of %d queue pairs at RTS: %w: %w", peer.rpc, k+1, n, context.Cause(ctx), transport.ErrPeer)
		}
	}
	if a.ReadyAckSupported {
		ack := req
		ack.ReadyAck = true
		if _, err := t.mc.client.Handshake(ctx, peer.rpc, ack.Desc()); err != nil {
			return nil, fmt.Errorf("rdma: Mooncake ready acknowledgement to %s: %w: %w: %w", peer.rpc, ErrHandshake, err, transport.ErrPeer)
		}
	}
	qs := make([]*qp, n)
	t.qpMu.Lock()
	for k, cq := range cqs {
		for {
			t.qpSeq++
			if _, used := t.qps[t.qpSeq]; !used && t.qpSeq != 0 {
				break
			}
		}
		watch := make(chan struct{})
		close(watch) // no control connection to watch
		q := &qp{t: t, ep: ep, rail: first + k, id: t.qpSeq, dev: d, rdev: ri, q: cq, slots: make([]slot, t.cfg.Depth),
			st: newStage(t.cfg.Depth), watch: watch}
		t.qps[q.id] = q
		qs[k] = q
	}
	t.qpMu.Unlock()
	ok = true
	return qs, nil
}

// mcNotify sends a Notify slice to the segment's RPC port as Mooncake's
// notify frame, on a goroutine, and completes it: nil when the peer took
// it, transport.ErrNotifyFull when it refused (retried as a full queue),
// transport.ErrDenied for a message Mooncake's frame cannot carry,
// transport.ErrPeer when the port cannot be reached. Mooncake's
// notifications carry no tag. The caller holds postMu.
func (ep *Endpoint) mcNotify(c transport.Completer, sl *transport.Slice) {
	t := ep.t
	var msg []byte
	if sl.Length > 0 && sl.Local != nil {
		msg = unsafe.Slice((*byte)(sl.Local), sl.Length) // valid until the slice completes
	}
	token := sl.Token
	desc := &segtable.SegmentDesc{Name: ep.mc.server, Endpoints: map[string]string{mooncake.EndpointRPC: ep.mc.rpc}}
	from := t.mc.server
	ctx, cancel := context.WithTimeout(ep.dialCtx, mcNotifyTimeout)
	t.wg.Add(1)
	go func() {
		defer t.wg.Done()
		defer cancel()
		err := mooncake.SendNotification(ctx, t.mc.client, desc, &transport.Notification{From: from, Msg: msg})
		switch {
		case err == nil:
		case errors.Is(err, mooncake.ErrNotifyRefused):
			err = fmt.Errorf("rdma: notify %s: %w: %w", desc.Name, transport.ErrNotifyFull, err)
		case errors.Is(err, mooncake.ErrBadFrame):
			err = fmt.Errorf("rdma: notify %s: %w: %w", desc.Name, transport.ErrDenied, err)
		default:
			err = fmt.Errorf("rdma: notify %s: %w: %w", desc.Name, transport.ErrPeer, err)
		}
		c.Complete(token, err)
	}()
}

// mcNotifyTimeout bounds the sending of one notification.
const mcNotifyTimeout = 5 * time.Second
