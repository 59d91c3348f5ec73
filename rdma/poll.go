//go:build rdma && cgo

// poll.go holds the initiator's completions: Poll drains every device's
// completion queue in one cgo call each, tells each rail's picker of its
// slices done (their rail's measured speed) and of its queue pairs that
// failed, and completes slices and answered notifications after the queue
// is unlocked.

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"encoding/binary"
	"fmt"
	"time"

	"github.com/moonring/moonring/transport"
)

// Poll polls every device's completion queue once, up to 64 completions
// each in one cgo call, and completes their slices. Safe for concurrent
// use: a device polled by another goroutine is skipped.
func (t *Transport) Poll() int {
	if !t.life.TryRLock() {
		return 0
	}
	defer t.life.RUnlock()
	if t.freed {
		return 0
	}
	n := 0
	for _, d := range t.devs {
		if d.cqMu.TryLock() {
			n += t.pollDevice(d)
		}
	}
	return n
}

// done is a completion to deliver once the completion queue is unlocked.
type done struct {
	c     transport.Completer
	token uint64
	err   error
}

// pollDevice polls d's completion queue once; the caller holds d.cqMu,
// which pollDevice releases before it completes the slices.
func (t *Transport) pollDevice(d *device) int {
	wcs := d.pl.poll(d.cq)
	if len(wcs) == 0 {
		d.cqMu.Unlock()
		t.emptyPolls.Add(1)
		return 0
	}
	t.pollCalls.Add(1)
	var out [pollBatch]done
	var extra []done // notifications given up with their queue pair (rare)
	k := 0
	now := int64(-1) // the pickers' clock, read at the first success
	t.qpMu.RLock()
	for i := range wcs {
		wc := &wcs[i]
		id, low, status := uint32(wc.wr_id>>32), uint32(wc.wr_id), uint32(wc.status)
		q := t.qps[id]
		if q == nil {
			continue // a queue pair torn down after a deadline: its slices are done
		}
		if low&recvBit != 0 {
			// An answer to a notification.
			if status == wcSuccess {
				slot := int(low & lowMask % notifySlots)
				ack := q.area.small(slot)
				seq := binary.BigEndian.Uint32(ack)
				q.noteMu.Lock()
				if n := &q.notes[seq%notifySlots]; n.busy && n.seq == seq && wc.byte_len >= ackLen {
					out[k] = done{c: n.c, token: n.token, err: noteError(ack[4])}
					k++
					*n = note{}
					q.noteOut.Add(-1)
				}
				q.noteMu.Unlock()
				C.mr_post_recv(q.q, C.uint64_t(q.area.smallAddr(slot)), ackSize, C.uint32_t(q.area.lkey), C.uint64_t(wc.wr_id))
			}
			extra = q.giveUpNotes(extra)
			continue
		}
		seq := q.tail.Load()
		if seq == q.head.Load() {
			continue // nothing in flight: not ours (cannot happen)
		}
		s := &q.slots[seq%uint64(len(q.slots))]
		if s.op == transport.Notify {
			// The SEND of a notification: it completes on its answer,
			// or now when it failed.
			if status != wcSuccess {
				q.noteMu.Lock()
				if n := &q.notes[uint32(s.token)%notifySlots]; n.busy && n.seq == uint32(s.token) {
					out[k] = done{c: n.c, token: n.token, err: q.completionError(status, uint32(wc.vendor_err), transport.Notify)}
					k++
					*n = note{}
					q.noteOut.Add(-1)
				}
				q.noteMu.Unlock()
			}
		} else {
			out[k] = done{c: s.c, token: s.token}
			if status != wcSuccess {
				out[k].err = q.completionError(status, uint32(wc.vendor_err), s.op)
			} else {
				// The rail's measured speed: the slice's bytes, done at
				// this reap, posted when its Post read the clock (the
				// picker tells a rail backed up from one with room,
				// rails.Picker.Done).
				if now < 0 {
					now = t.cfg.railConfig.Now()
				}
				q.ep.ch.pick.Done(q.rail, uint64(s.n), s.posted, now)
			}
			k++
		}
		s.c = nil
		switch status {
		case wcSuccess, wcFlushErr:
		case wcRemAccessErr, wcRemInvReqErr, wcLocLenErr, wcLocProtErr:
			q.broke() // the request's fault (a key, a range), not the rail's
		default:
			q.fail()
		}
		q.tail.Store(seq + 1)
		extra = q.giveUpNotes(extra)
	}
	t.qpMu.RUnlock()
	d.cqMu.Unlock()
	n := 0
	for i := range out[:k] {
		if out[i].c != nil {
			out[i].c.Complete(out[i].token, out[i].err)
		}
		out[i] = done{}
		n++
	}
	for _, e := range extra {
		e.c.Complete(e.token, e.err)
	}
	return n + len(extra)
}

// giveUpNotes appends to extra the notifications of a failed queue pair
// whose send queue has drained: their answers will not come. The caller
// holds the device's cqMu.
func (q *qp) giveUpNotes(extra []done) []done {
	st := q.state.Load()
	if st == qpLive || q.noteOut.Load() == 0 || !q.ringIdle() {
		return extra
	}
	err := fmt.Errorf("rdma: notification unanswered, queue pair failed: %w", transport.ErrPeer)
	if st == qpClosing {
		err = fmt.Errorf("rdma: notification unanswered: %w", transport.ErrClosed)
	}
	q.noteMu.Lock()
	defer q.noteMu.Unlock()
	for i := range q.notes {
		if n := &q.notes[i]; n.busy {
			extra = append(extra, done{c: n.c, token: n.token, err: err})
			*n = note{}
			q.noteOut.Add(-1)
		}
	}
	return extra
}

// drainDevice polls d until cond holds or the deadline passes.
func (t *Transport) drainDevice(d *device, cond func() bool, deadline time.Time) {
	for !cond() && time.Now().Before(deadline) {
		d.cqMu.Lock()
		if t.pollDevice(d) == 0 {
			time.Sleep(50 * time.Microsecond)
		}
	}
}
