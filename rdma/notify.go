//go:build rdma && cgo

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"github.com/moonring/moonring/transport"
)

// Notifications travel as a SEND on the same queue pair as the request's
// WRITEs, into one of notifySlots receive buffers the target posted; the
// target hands it to its engine from its poller and answers with a small
// inline SEND of the status into one of the initiator's receive buffers.
// The Notify slice completes on that answer. notifySlots is also the
// credit: an initiator has at most that many notifications unanswered per
// queue pair, so the target always has a receive buffer for the next.
//
// A notification message is
//
//	u32 seq | u64 tag | u16 name length | the sender's segment name | message
//
// and an answer u32 seq | u8 status (0 delivered, 1 refused: the target
// takes no notifications, 2 malformed, 3 the target engine's queue is full).
const (
	notifySlots = 8
	msgHeader   = 4 + 8 + 2
	maxName     = 255
	msgSize     = (msgHeader + maxName + transport.MaxNotifyMessage + 63) &^ 63
	ackSize     = 16
	ackLen      = 5

	noteOK     = 0
	noteDenied = 1
	noteBad    = 2
	noteFull   = 3

	// wr_id bits beside the queue pair id (high 32 bits).
	recvBit = 1 << 31 // a receive work request
	lowMask = 1<<30 - 1
)

// msgArea is a queue pair's registered C memory for notifications:
// notifySlots big buffers (messages) and notifySlots small ones (answers).
type msgArea struct {
	base unsafe.Pointer
	mr   *C.struct_ibv_mr
	lkey uint32
}

func newMsgArea(d *device) (*msgArea, error) {
	size := notifySlots * (msgSize + ackSize)
	a := &msgArea{base: C.calloc(1, C.size_t(size))}
	if a.base == nil {
		return nil, errors.New("rdma: out of C memory")
	}
	mr, err := C.mr_reg(d.pd, C.uintptr_t(uintptr(a.base)), C.size_t(size), 0)
	if mr == nil {
		C.free(a.base)
		return nil, fmt.Errorf("rdma: ibv_reg_mr of the notification buffers on %s: %v", d.name, err)
	}
	a.mr, a.lkey = mr, uint32(mr.lkey)
	return a, nil
}

func (a *msgArea) free() {
	C.ibv_dereg_mr(a.mr)
	C.free(a.base)
}

func (a *msgArea) bigAddr(k int) uint64 { return uint64(uintptr(a.base)) + uint64(k*msgSize) }

func (a *msgArea) big(k int) []byte {
	return unsafe.Slice((*byte)(unsafe.Add(a.base, k*msgSize)), msgSize)
}

func (a *msgArea) smallAddr(k int) uint64 {
	return uint64(uintptr(a.base)) + uint64(notifySlots*msgSize+k*ackSize)
}

func (a *msgArea) small(k int) []byte {
	return unsafe.Slice((*byte)(unsafe.Add(a.base, notifySlots*msgSize+k*ackSize)), ackSize)
}

// postRecvs posts every receive buffer of one kind: the big ones on a
// target's queue pair, the small ones on an initiator's.
func (a *msgArea) postRecvs(q *C.struct_ibv_qp, id uint32, peer bool) error {
	for k := 0; k < notifySlots; k++ {
		var rc C.int
		if peer {
			rc = C.mr_post_recv(q, C.uint64_t(a.bigAddr(k)), msgSize, C.uint32_t(a.lkey), C.uint64_t(uint64(id)<<32|recvBit|uint64(k)))
		} else {
			rc = C.mr_post_recv(q, C.uint64_t(a.smallAddr(k)), ackSize, C.uint32_t(a.lkey), C.uint64_t(uint64(id)<<32|recvBit|uint64(k)))
		}
		if rc != 0 {
			return fmt.Errorf("rdma: ibv_post_recv: %v", errnoString(rc))
		}
	}
	return nil
}

// note is a notification waiting for its answer.
type note struct {
	c     transport.Completer
	token uint64
	seq   uint32
	busy  bool
}

// SetNotify sets the engine's segment name (sent as From) and the function
// that takes the notifications peers send. Call it before Open.
func (t *Transport) SetNotify(self string, deliver func(*transport.Notification) error) {
	if len(self) > maxName {
		self = self[:maxName]
	}
	t.self = self
	t.deliver.Store(&deliver)
}

// writeNote composes notification seq into the send buffer of its slot and
// returns its length.
func (t *Transport) writeNote(a *msgArea, seq uint32, sl *transport.Slice) int {
	b := a.big(int(seq % notifySlots))
	binary.BigEndian.PutUint32(b, seq)
	binary.BigEndian.PutUint64(b[4:], sl.Remote)
	binary.BigEndian.PutUint16(b[12:], uint16(len(t.self)))
	n := msgHeader + copy(b[msgHeader:], t.self)
	if sl.Length > 0 {
		n += copy(b[n:], unsafe.Slice((*byte)(sl.Local), sl.Length))
	}
	return n
}

// receiveNote hands the message in a target's receive buffer to the engine
// and returns the answer's status.
func (t *Transport) receiveNote(msg []byte) (seq uint32, status uint8) {
	if len(msg) < msgHeader {
		return 0, noteBad
	}
	seq = binary.BigEndian.Uint32(msg)
	nlen := int(binary.BigEndian.Uint16(msg[12:]))
	if nlen > maxName || msgHeader+nlen > len(msg) || len(msg)-msgHeader-nlen > transport.MaxNotifyMessage {
		return seq, noteBad
	}
	d := t.deliver.Load()
	if d == nil || *d == nil {
		return seq, noteDenied
	}
	n := &transport.Notification{From: string(msg[msgHeader : msgHeader+nlen]), Tag: binary.BigEndian.Uint64(msg[4:]), Msg: msg[msgHeader+nlen:]}
	switch err := (*d)(n); {
	case err == nil:
		return seq, noteOK
	case errors.Is(err, transport.ErrNotifyFull):
		return seq, noteFull
	default:
		return seq, noteDenied
	}
}

// noteError is the completion error of an answer's status.
func noteError(status uint8) error {
	switch status {
	case noteOK:
		return nil
	case noteDenied:
		return fmt.Errorf("rdma: notification refused by the target: %w", transport.ErrDenied)
	case noteFull:
		return fmt.Errorf("rdma: notification: %w", transport.ErrNotifyFull)
	default:
		return fmt.Errorf("rdma: notification malformed (status %d): %w", status, transport.ErrRange)
	}
}

// answerNote answers the notification in receive buffer k of peer p and
// gives the buffer back, in one cgo call. It returns the verbs error of
// either post, 0 when both went.
func (p *peerQP) answerNote(k int, seq uint32, status uint8) int {
	a := p.area
	ack := a.small(k)
	binary.BigEndian.PutUint32(ack, seq)
	ack[4] = status
	return int(C.mr_note_reply(p.q, C.uint64_t(a.bigAddr(k)), msgSize, C.uint32_t(a.lkey), C.uint64_t(uint64(p.id)<<32|recvBit|uint64(k)),
		C.uint64_t(a.smallAddr(k)), ackLen, C.uint64_t(uint64(p.id)<<32|uint64(k))))
}
