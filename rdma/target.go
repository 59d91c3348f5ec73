//go:build rdma && cgo

// target.go holds the target side: the control listener's accept loop,
// the handshake answered for each peer (bounded while unproven, then under
// MaxPeerQPs), the queue pair created for it, and the device goroutine that
// polls peers' queue pairs for notifications.

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"syscall"
	"time"
	"unsafe"
)

// peerLoop waits for completion events of d's peer queue pairs and
// handles their completions (notifications) until d.chf is closed.
func (t *Transport) peerLoop(d *device) {
	defer close(d.loopDone)
	rc, err := d.chf.SyscallConn()
	if err != nil {
		return
	}
	for {
		if err := rc.Read(func(uintptr) bool { return C.mr_cq_event(d.ch) == 1 }); err != nil {
			return // closed
		}
		C.mr_req_notify(d.pcq)
		for t.pollPeers(d) > 0 {
		}
	}
}

// pollPeers polls d's peer completion queue once: notifications that
// arrived are delivered and answered. Only d's peer goroutine calls it.
func (t *Transport) pollPeers(d *device) int {
	wcs := d.ppl.poll(d.pcq)
	t.qpMu.RLock()
	defer t.qpMu.RUnlock()
	for i := range wcs {
		wc := &wcs[i]
		id, low := uint32(wc.wr_id>>32), uint32(wc.wr_id)
		p := t.peers[id]
		switch {
		case p == nil:
		case low&recvBit == 0 && uint32(wc.status) != wcSuccess:
			// An answer that did not go out: its notification would
			// wait for good. Ending the connection fails the peer's
			// queue pair, and with it the notification, which the
			// engine posts again on a fresh one.
			p.conn.Close()
		case low&recvBit == 0 || uint32(wc.status) != wcSuccess:
			// An answer's send done, or a receive flushed.
		default:
			slot := int(low & lowMask % notifySlots)
			seq, st := t.receiveNote(p.area.big(slot)[:min(int(wc.byte_len), msgSize)])
			if h := t.hooks.Load(); (h != nil && h.failAnswers.Load()) || p.answerNote(slot, seq, st) != 0 {
				p.conn.Close() // as for an answer that failed on the wire
			}
		}
	}
	return len(wcs)
}

// maxPendingHandshakes bounds the control connections still in the
// handshake, i.e. not yet proven to hold the segment key. They are not
// counted against Config.MaxPeerQPs, so a peer without the key cannot
// crowd out those with it; this bound caps what such a peer holds instead
// (a goroutine and a socket each, for up to ConnectTimeout). A handshake
// takes one round trip, so this many at once means a burst or a flood.
const maxPendingHandshakes = 64

// peerQP is a queue pair a peer connected to this transport.
type peerQP struct {
	conn    net.Conn
	q       *C.struct_ibv_qp
	id      uint32
	area    *msgArea
	hs      bool // counted in Transport.hs, under Transport.mu
	counted bool // counted in Transport.npqp, under Transport.mu
}

func (t *Transport) accept() {
	defer t.wg.Done()
	for {
		conn, err := t.ln.Accept()
		if err != nil {
			if t.closed.Load() {
				return
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p := &peerQP{conn: conn, hs: true}
		t.mu.Lock()
		if t.closed.Load() {
			t.mu.Unlock()
			conn.Close()
			return
		}
		if t.hs >= maxPendingHandshakes {
			// Closed before anything is read, so a flood costs no more
			// than the accept: the initiator's handshake fails as on any
			// lost connection.
			t.mu.Unlock()
			conn.Close()
			continue
		}
		t.hs++
		t.tqp[p] = struct{}{}
		t.wg.Add(1)
		t.mu.Unlock()
		go t.serve(p)
	}
}

// serve answers one peer's handshake and keeps its queue pair until the
// control connection ends.
func (t *Transport) serve(p *peerQP) {
	defer t.wg.Done()
	defer func() {
		p.conn.Close()
		if p.id != 0 {
			t.qpMu.Lock() // waits for a poller using p
			delete(t.peers, p.id)
			t.qpMu.Unlock()
		}
		if p.q != nil {
			C.ibv_destroy_qp(p.q)
		}
		if p.area != nil {
			p.area.free()
		}
		// Uncounted only once the queue pair is gone: the peers' CQs are
		// sized for MaxPeerQPs of them.
		t.mu.Lock()
		delete(t.tqp, p)
		t.leaveHandshake(p)
		if p.counted {
			t.npqp--
		}
		t.mu.Unlock()
	}()
	conn := p.conn
	conn.SetDeadline(time.Now().Add(t.cfg.ConnectTimeout))
	// A refusal carries its code, and for refuseQP the step that failed
	// (in the LID field) and its errno (in the QPN field), for the
	// initiator's error message.
	_, ans, err := serveHandshake(conn, t.key, func(hello *qpAddr) qpAddr {
		if int(hello.Device) >= len(t.devs) {
			return qpAddr{Kind: kindRefuse, Device: refuseDevice}
		}
		// The initiator proved the key: its connection leaves the
		// handshake bound and its queue pair takes a place under
		// MaxPeerQPs, if one is left.
		t.mu.Lock()
		t.leaveHandshake(p)
		full := t.npqp >= t.cfg.MaxPeerQPs
		if !full {
			t.npqp++
			p.counted = true
		}
		t.mu.Unlock()
		if full {
			return qpAddr{Kind: kindRefuse, Device: refuseLimit}
		}
		if !t.life.TryRLock() {
			return qpAddr{Kind: kindRefuse, Device: refuseClosed}
		}
		defer t.life.RUnlock()
		ans, step, errno := t.acceptQP(p, hello)
		if step != 0 {
			return qpAddr{Kind: kindRefuse, Device: refuseQP, LID: uint16(step), QPN: uint32(errno)}
		}
		return ans
	})
	if err != nil || ans.Kind != kindAccept {
		return
	}
	conn.SetDeadline(time.Time{})
	io.Copy(io.Discard, conn)
}

// leaveHandshake takes p out of the handshakes under way, once. The caller
// holds t.mu.
func (t *Transport) leaveHandshake(p *peerQP) {
	if p.hs {
		p.hs = false
		t.hs--
	}
}

// acceptQP creates and connects the target's queue pair for hello and
// writes the accept message into buf.
func (t *Transport) acceptQP(p *peerQP, hello *qpAddr) (ans qpAddr, step int, errno int) {
	if t.freed {
		return ans, 1, 0
	}
	d := t.devs[hello.Device]
	if d.down.Load() {
		return ans, 2, 0
	}
	gid, lid := d.addr()
	q, err := C.mr_create_qp(d.pd, d.pcq, notifySlots+1, notifySlots)
	if q == nil {
		return ans, 3, errnoOf(err)
	}
	p.q = q
	if p.area, err = newMsgArea(d); err != nil {
		return ans, 4, 0
	}
	t.qpMu.Lock()
	for {
		t.peerSeq++
		if _, used := t.peers[t.peerSeq]; !used && t.peerSeq != 0 {
			break
		}
	}
	p.id = t.peerSeq
	t.peers[p.id] = p
	t.qpMu.Unlock()
	psn := mrand.Uint32N(1 << 24)
	mtu := min(d.mtu, hello.MTU)
	if rc := C.mr_to_init(q, C.int(d.port)); rc != 0 {
		return ans, 5, int(rc)
	}
	if err := p.area.postRecvs(q, p.id, true); err != nil {
		return ans, 6, 0
	}
	if rc := C.mr_to_rtr(q, C.int(d.port), C.int(mtu), C.uint32_t(hello.QPN), C.uint32_t(hello.PSN), C.uint16_t(hello.LID),
		(*C.uint8_t)(unsafe.Pointer(&hello.GID[0])), C.int(gid.Index), boolInt(d.ethernet), C.int(d.rdAtomic)); rc != 0 {
		return ans, 7, int(rc)
	}
	if rc := C.mr_to_rts(q, C.uint32_t(psn), C.int(min(d.rdAtomic, int(hello.RdAtomic))), ackTimeout, retryCount); rc != 0 {
		return ans, 8, int(rc)
	}
	return qpAddr{Kind: kindAccept, Device: hello.Device, GID: gid.Raw, LID: lid, MTU: d.mtu,
		RdAtomic: uint8(d.rdAtomic), QPN: uint32(q.qp_num), PSN: psn}, 0, 0
}

// refusal says why a peer refused a queue pair.
func refusal(m qpAddr) string {
	switch m.Device {
	case refuseDevice:
		return "no such device"
	case refuseLimit:
		return "too many queue pairs (its MaxPeerQPs)"
	case refuseClosed:
		return "closing"
	case refuseQP:
		steps := []string{"", "closed", "port down", "ibv_create_qp", "notification buffers", "modify to INIT", "ibv_post_recv", "modify to RTR", "modify to RTS"}
		what := fmt.Sprintf("step %d", m.LID)
		if int(m.LID) < len(steps) {
			what = steps[m.LID]
		}
		return fmt.Sprintf("%s failed: %v", what, syscall.Errno(m.QPN))
	}
	return fmt.Sprintf("code %d", m.Device)
}

// errnoOf returns the errno in err (cgo's second result), or 0.
func errnoOf(err error) int {
	var e syscall.Errno
	if errors.As(err, &e) {
		return int(e)
	}
	return 0
}
