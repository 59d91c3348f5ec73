//go:build rdma && cgo

// qp.go holds the initiator's RC queue pairs: their slots in flight, their
// failure and teardown, the watch on their control connection, and connect,
// which creates one and brings it to RTS through the handshake with the
// target's control listener (wire.go holds the handshake's messages).

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/moonring/moonring/transport"
)

// RC queue pair timing: local ACK timeout 4.096 us * 2^14 (67 ms), seven
// retries: a vanished peer fails a request in about half a second.
const (
	ackTimeout = 14
	retryCount = 7
)

const (
	qpLive    = iota // takes work
	qpFailed         // a completion failed: flushing, then reconnect
	qpClosing        // the endpoint or transport is closing it
)

// slot is one work request in flight on a queue pair.
type slot struct {
	c      transport.Completer
	token  uint64
	op     transport.Op
	n      uint32 // a READ's or WRITE's bytes, for its rail's measured speed
	posted int64  // when it was posted, on the pickers' clock, for the same
}

// qp is one of the initiator's RC queue pairs with its control connection.
//
// Slots form a ring: Post (under its endpoint's postMu) fills them at
// head, the poller holding the device's cqMu empties them at tail, in
// order, since a send queue completes in order.
type qp struct {
	t     *Transport
	ep    *Endpoint // whose rail it is: its picker hears of the rail's speed and failures
	rail  int       // its index in ep.rails
	id    uint32
	dev   *device
	rdev  int // the peer's device index
	q     *C.struct_ibv_qp
	conn  net.Conn // nil in Mooncake mode, which has no control connection
	slots []slot
	st    *stage
	head  atomic.Uint64
	tail  atomic.Uint64
	state atomic.Int32

	area    *msgArea
	noteMu  sync.Mutex
	notes   [notifySlots]note // by seq % notifySlots, under noteMu
	noteSeq uint32            // the next notification's seq, under the endpoint's postMu
	noteOut atomic.Int32      // notifications posted and not answered

	watch chan struct{} // closed when the watcher of conn returned
}

// ringIdle says whether no work request is in flight; idle, whether no
// notification waits for its answer either.
func (q *qp) ringIdle() bool { return q.head.Load() == q.tail.Load() }

func (q *qp) idle() bool { return q.ringIdle() && q.noteOut.Load() == 0 }

func (q *qp) free() int { return len(q.slots) - int(q.head.Load()-q.tail.Load()) }

// toErr moves a queue pair to the error state: its work requests flush
// with errors, and the peer's side hears nothing of it.
func toErr(q *C.struct_ibv_qp) { C.mr_to_err(q) }

// fail marks the queue pair failed and moves it to the error state, which
// flushes its work requests; the next Post reconnects its rail. It is the
// rail's failure: the endpoint's picker cools the rail (it gets no slices
// but a probe until the rail shows it works again).
func (q *qp) fail() {
	if q.broke() {
		q.ep.ch.pick.Failed(q.rail)
	}
}

// broke marks the queue pair failed as fail does, without holding it
// against the rail: for a failure of one request (a remote access error),
// not of the path. It reports whether this call broke it (false: it was
// failed or closing already).
func (q *qp) broke() bool {
	if !q.state.CompareAndSwap(qpLive, qpFailed) {
		return false
	}
	toErr(q.q)
	if q.conn != nil {
		q.conn.Close() // the target tears its side down
	}
	return true
}

func (q *qp) completionError(status, vendor uint32, op transport.Op) error {
	what := "WRITE"
	switch op {
	case transport.Read:
		what = "READ"
	case transport.Notify:
		what = "notification SEND"
	}
	var kind error
	switch status {
	case wcFlushErr:
		if q.state.Load() == qpClosing {
			return fmt.Errorf("rdma: %s flushed: %w", what, transport.ErrClosed)
		}
		kind = transport.ErrPeer
	case wcRemAccessErr:
		kind = transport.ErrDenied
	case wcRemInvReqErr, wcLocLenErr, wcLocProtErr:
		kind = transport.ErrRange
	default:
		kind = transport.ErrPeer
	}
	return fmt.Errorf("rdma: %s on %s: %s (vendor error %#x): %w", what, q.dev.name, wcStatusString(status), vendor, kind)
}

// destroy tears q down. Its slots must be empty (or given up), and no Post
// may use it.
func (q *qp) destroy() {
	q.state.Store(qpClosing)
	if q.conn != nil {
		q.conn.Close()
	}
	<-q.watch
	t := q.t
	t.qpMu.Lock()
	delete(t.qps, q.id)
	t.qpMu.Unlock()
	C.ibv_destroy_qp(q.q)
	q.st.free()
	if q.area != nil { // none in Mooncake mode
		q.area.free()
	}
	t.mu.Lock()
	t.nqp--
	t.mu.Unlock()
}

// watchConn waits for the control connection to end: the peer is gone (or
// tore its queue pair down), so q fails at once rather than after retries.
func (q *qp) watchConn() {
	defer close(q.watch)
	io.Copy(io.Discard, q.conn)
	q.fail()
}

// connect creates a queue pair for rail of ep, on local device li to the
// peer's device ri at addr, and connects it through the handshake.
func (t *Transport) connect(ctx context.Context, ep *Endpoint, rail int, addr string, key []byte, li, ri int) (*qp, error) {
	d := t.devs[li]
	if d.down.Load() {
		return nil, fmt.Errorf("rdma: %s port %d is down: %w", d.name, d.port, transport.ErrPeer)
	}
	gid, lid := d.addr()
	// ConnectTimeout bounds the connect even under a caller's later
	// deadline (WithTimeout keeps the earlier of the two).
	ctx, cancel := context.WithTimeout(ctx, t.cfg.ConnectTimeout)
	defer cancel()
	cq, err := C.mr_create_qp(d.pd, d.cq, C.int(t.cfg.Depth), notifySlots)
	if cq == nil {
		return nil, fmt.Errorf("rdma: ibv_create_qp on %s: %v: %w", d.name, err, transport.ErrPeer)
	}
	area, err := newMsgArea(d)
	if err != nil {
		C.ibv_destroy_qp(cq)
		return nil, fmt.Errorf("%w: %w", err, transport.ErrPeer)
	}
	ok := false
	defer func() {
		if !ok {
			C.ibv_destroy_qp(cq)
			area.free()
		}
	}()
	t.qpMu.Lock()
	for {
		t.qpSeq++
		if _, used := t.qps[t.qpSeq]; !used && t.qpSeq != 0 {
			break
		}
	}
	id := t.qpSeq
	t.qpMu.Unlock()
	if rc := C.mr_to_init(cq, C.int(d.port)); rc != 0 {
		return nil, fmt.Errorf("rdma: modify QP to INIT on %s: %v: %w", d.name, syscall.Errno(rc), transport.ErrPeer)
	}
	if err := area.postRecvs(cq, id, false); err != nil {
		return nil, fmt.Errorf("%w: %w", err, transport.ErrPeer)
	}
	psn := mrand.Uint32N(1 << 24)
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("rdma: dial %s: %v: %w", addr, err, transport.ErrUnreachable)
	}
	defer func() {
		if !ok {
			conn.Close()
		}
	}()
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	// A cancel (the endpoint closing) ends the handshake at once.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	hello := qpAddr{Kind: kindHello, Device: uint16(ri), GID: gid.Raw, LID: lid, MTU: d.mtu,
		RdAtomic: uint8(d.rdAtomic), QPN: uint32(cq.qp_num), PSN: psn}
	peer, err := dialHandshake(conn, key, &hello)
	if err != nil {
		if errors.Is(err, ErrAuth) {
			return nil, fmt.Errorf("rdma: handshake with %s: %w: %w", addr, err, transport.ErrUnreachable)
		}
		return nil, fmt.Errorf("rdma: handshake with %s: %w: %w", addr, err, transport.ErrPeer)
	}
	if peer.Kind != kindAccept {
		return nil, fmt.Errorf("rdma: %s refused the queue pair on its device %d: %s: %w: %w", addr, ri, refusal(peer), ErrHandshake, transport.ErrPeer)
	}
	mtu := min(d.mtu, peer.MTU)
	if rc := C.mr_to_rtr(cq, C.int(d.port), C.int(mtu), C.uint32_t(peer.QPN), C.uint32_t(peer.PSN), C.uint16_t(peer.LID),
		(*C.uint8_t)(unsafe.Pointer(&peer.GID[0])), C.int(gid.Index), boolInt(d.ethernet), C.int(d.rdAtomic)); rc != 0 {
		return nil, fmt.Errorf("rdma: modify QP to RTR on %s (GID %s to %s): %v: %w", d.name, gid, GID{Raw: peer.GID}.Addr(), syscall.Errno(rc), transport.ErrPeer)
	}
	if rc := C.mr_to_rts(cq, C.uint32_t(psn), C.int(min(d.rdAtomic, int(peer.RdAtomic))), ackTimeout, retryCount); rc != 0 {
		return nil, fmt.Errorf("rdma: modify QP to RTS on %s: %v: %w", d.name, syscall.Errno(rc), transport.ErrPeer)
	}
	if !stop() { // the cancel came: it may have set a past deadline on conn
		return nil, fmt.Errorf("rdma: handshake with %s: %w: %w", addr, context.Cause(ctx), transport.ErrPeer)
	}
	conn.SetDeadline(time.Time{})
	q := &qp{t: t, ep: ep, rail: rail, id: id, dev: d, rdev: ri, q: cq, conn: conn, slots: make([]slot, t.cfg.Depth), st: newStage(t.cfg.Depth),
		area: area, watch: make(chan struct{})}
	t.qpMu.Lock()
	t.qps[q.id] = q
	t.qpMu.Unlock()
	ok = true
	go q.watchConn()
	return q, nil
}

func boolInt(b bool) C.int {
	if b {
		return 1
	}
	return 0
}
