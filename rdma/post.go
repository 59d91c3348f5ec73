//go:build rdma && cgo

// post.go holds Post: each slice checked against the remote buffer and
// the local registration, put on the queue pair of the rail its endpoint
// chooses (choose.go: by measured speed, less for a far device, never a
// device that is down, in Mooncake mode none whose peer NIC the peer's
// priority matrix does not pick for the remote buffer; another live rail
// while one reconnects), its post timed for the rail's speed, and every
// rail's chain of work requests posted in one cgo call.

package rdma

import (
	"fmt"
	"sync/atomic"
	"syscall"

	"github.com/moonring/moonring/transport"
)

var useClock atomic.Int64

// Post checks each slice (the remote range inside one buffer with an
// rkey, the local range inside its registration), puts it on a rail's
// queue pair, and posts every rail's chain in one cgo call.
//
// A READ's or WRITE's rail is the endpoint's choice (chooser.choose): in
// proportion to each rail's measured speed (the engine's Rail hint is not
// needed), a FarNUMA share on a device far from the slice's local memory,
// none on a device that is down, none on a rail cooling after a failure
// but for its probes, and in Mooncake mode none on a device whose rails
// reach a peer NIC the peer's matrix does not pick for the remote buffer's
// location while another serves (mooncake_nics.go). A notification keeps its Rail hint (notifications
// sent on one rail arrive in order), moved to a device that is up.
//
// It accepts fewer slices when a queue pair is full (or, for
// notifications, has notifySlots unanswered), or when a rail must
// reconnect. That happens on a goroutine (see redial), started by the next
// Post after a queue pair failed (redialFailed); meanwhile a slice sent to
// the rail goes to another rail with a live queue pair, and with none Post
// takes fewer slices, or fails with the last reconnect's error within the
// wait after it failed. A slice that fails the checks completes at once
// with ErrRange or ErrDenied.
func (ep *Endpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	t := ep.t
	ep.postMu.Lock()
	if ep.closed || t.closed.Load() {
		ep.postMu.Unlock()
		return 0, fmt.Errorf("rdma: post: %w", transport.ErrClosed)
	}
	ep.used.Store(useClock.Add(1))
	if t.mc != nil && len(s) > 0 && s[0].Op == transport.Notify {
		// Mooncake mode: notifications go to the peer's RPC port.
		if s[0].Length > transport.MaxNotifyMessage {
			ep.postMu.Unlock()
			c.Complete(s[0].Token, fmt.Errorf("rdma: notification of %d bytes, more than %d: %w", s[0].Length, transport.MaxNotifyMessage, transport.ErrRange))
			return 1, nil
		}
		ep.mcNotify(c, &s[0])
		ep.postMu.Unlock()
		return 1, nil
	}
	ep.reap()
	ep.redialFailed()
	down := t.downDevices()
	now := int64(-1) // the pickers' clock, read at the first slice posted
	bufs := ep.bufs.Load()
	regs := *t.regs.Load()
	var (
		refused    error
		refusedTok uint64
		postErr    error // ibv_post_send failed
		connErr    error // a rail could not reconnect
		nb         int
	)
	bt := ep.bt.all()
	i := 0
	for ; i < len(s); i++ {
		sl := &s[i]
		if t.mc != nil && sl.Op == transport.Notify {
			break // the next Post sends it to the RPC port
		}
		rb, reg, err := ep.check(sl, bufs, regs)
		if err != nil {
			if i > 0 || refused != nil {
				break // completed by the Post that starts with it
			}
			refused, refusedTok = err, sl.Token
			continue
		}
		var ri int
		var avoid uint64
		if reg != nil {
			avoid = rb.nics.at(sl.Remote - rb.addr)
			ri = ep.ch.choose(reg.far, down, avoid)
		} else {
			ri = ep.ch.up(int(sl.Rail)%len(ep.rails), down)
		}
		if i >= len(ep.eff) {
			ep.eff = append(ep.eff, make([]uint16, i+1-len(ep.eff))...)
		}
		ep.eff[i] = uint16(ri)
		r := &ep.rails[ri]
		if r.q == nil || r.q.state.Load() != qpLive {
			if r.b >= 0 {
				break // failed while this Post filled it: the next Post reconnects
			}
			if r.q != nil {
				r.retired = append(r.retired, r.q)
				r.q = nil
			}
			var err error
			if !r.dialing {
				err = ep.redial(ri)
			}
			// Meanwhile another rail with a live queue pair takes the
			// slice; with none, the ring posts it again shortly, or
			// retries it elsewhere after the failed reconnect's error.
			alt := ep.liveRail(ri, avoid)
			if alt < 0 {
				connErr = err
				break
			}
			ri, r = alt, &ep.rails[alt]
			ep.eff[i] = uint16(ri)
		}
		q := r.q
		if r.b < 0 {
			r.b = nb
			b := &bt[nb]
			nb++
			b.qp = q.q
			b.req = q.st.req
			b.wr = q.st.wr
			b.sge = q.st.sge
			b.n = 0
		}
		b := &bt[r.b]
		if int(b.n) >= q.free() {
			break // full: backpressure
		}
		seq := q.head.Load() + uint64(b.n)
		wrID := uint64(q.id)<<32 | seq&lowMask
		if sl.Op == transport.Notify {
			ns := q.noteSeq
			q.noteMu.Lock()
			n := &q.notes[ns%notifySlots]
			if n.busy {
				q.noteMu.Unlock()
				break // no credit: notifySlots unanswered
			}
			*n = note{c: c, token: sl.Token, seq: ns, busy: true}
			q.noteOut.Add(1)
			q.noteMu.Unlock()
			q.noteSeq++
			q.slots[seq%uint64(len(q.slots))] = slot{op: transport.Notify, token: uint64(ns)}
			m := t.writeNote(q.area, ns, sl)
			q.st.setReq(int(b.n), wrID, q.area.bigAddr(int(ns%notifySlots)), uint64(ns), uint32(m), q.area.lkey, 0, 3)
			b.n++
			continue
		}
		if now < 0 {
			now = t.cfg.railConfig.Now() // once a Post: its slices were posted together
		}
		q.slots[seq%uint64(len(q.slots))] = slot{c: c, token: sl.Token, op: sl.Op, n: uint32(sl.Length), posted: now}
		q.st.setReq(int(b.n), wrID, uint64(uintptr(sl.Local)), sl.Remote,
			uint32(sl.Length), reg.lkeys[r.li], rb.rkeys[r.ri], uint8(sl.Op))
		b.n++
	}
	failed := 0
	var lostNotes []done
	if nb > 0 {
		for k := range ep.rails {
			r := &ep.rails[k]
			if r.b >= 0 {
				r.q.head.Add(uint64(bt[r.b].n))
			}
		}
		ep.bt.post(nb)
		t.postCalls.Add(1)
		for k := range ep.rails {
			r := &ep.rails[k]
			if r.b < 0 {
				continue
			}
			b := &bt[r.b]
			if b.posted < b.n {
				// Not taken: these never complete by themselves.
				q := r.q
				failed += int(b.n - b.posted)
				if postErr == nil {
					postErr = fmt.Errorf("rdma: ibv_post_send on %s: %v: %w", q.dev.name, syscall.Errno(b.err), transport.ErrPeer)
				}
				q.noteMu.Lock()
				for _, rq := range q.st.reqs()[b.posted:b.n] {
					if rq.op == 3 {
						if n := &q.notes[uint32(rq.raddr)%notifySlots]; n.busy && n.seq == uint32(rq.raddr) {
							lostNotes = append(lostNotes, done{c: n.c, token: n.token, err: postErr})
							*n = note{}
							q.noteOut.Add(-1)
						}
					}
				}
				q.noteMu.Unlock()
				q.head.Add(^uint64(b.n-b.posted) + 1)
				q.fail()
			}
		}
		t.slices.Add(uint64(i - failed))
	}
	// Slices accepted but not posted complete with ErrPeer, after the lock.
	var lostToks []uint64
	if failed > 0 {
		taken := make([]int, len(ep.rails))
		for j := range s[:i] {
			if j == 0 && refused != nil {
				continue
			}
			r := &ep.rails[ep.eff[j]]
			if r.b < 0 {
				continue
			}
			if taken[ep.eff[j]] >= int(bt[r.b].posted) && s[j].Op != transport.Notify {
				lostToks = append(lostToks, s[j].Token)
			}
			taken[ep.eff[j]]++
		}
	}
	for k := range ep.rails {
		ep.rails[k].b = -1
	}
	ep.postMu.Unlock()
	if refused != nil {
		c.Complete(refusedTok, refused)
	}
	for _, tok := range lostToks {
		c.Complete(tok, postErr)
	}
	for _, d := range lostNotes {
		d.c.Complete(d.token, d.err)
	}
	if i < len(s) && connErr != nil {
		return i, connErr
	}
	return i, nil
}

// liveRail returns the first rail after ri whose queue pair is live, on a
// device that is up, preferring one on a device not in avoid (the remote
// buffer's nicPick), or -1. The caller holds postMu.
func (ep *Endpoint) liveRail(ri int, avoid uint64) int {
	alt := -1
	for k := 1; k < len(ep.rails); k++ {
		j := (ri + k) % len(ep.rails)
		r := &ep.rails[j]
		if r.q != nil && r.q.state.Load() == qpLive && !ep.t.devs[r.li].down.Load() {
			if avoid&(1<<r.li) == 0 {
				return j
			}
			if alt < 0 {
				alt = j
			}
		}
	}
	return alt
}

// downDevices returns the devices whose port is down, one bit per device
// index (New opens at most 64).
func (t *Transport) downDevices() uint64 {
	var down uint64
	for i, d := range t.devs {
		if d.down.Load() {
			down |= 1 << i
		}
	}
	return down
}

// check returns the remote buffer and the local registration of sl, or
// why it cannot be posted.
func (ep *Endpoint) check(sl *transport.Slice, bufs *rbufs, regs map[uint64]*region) (*rbuf, *region, error) {
	if sl.Op == transport.Notify {
		if sl.Length > transport.MaxNotifyMessage {
			return nil, nil, fmt.Errorf("rdma: notification of %d bytes, more than %d: %w", sl.Length, transport.MaxNotifyMessage, transport.ErrRange)
		}
		return nil, nil, nil
	}
	if sl.Op != transport.Read && sl.Op != transport.Write {
		return nil, nil, fmt.Errorf("rdma: op %d: %w", sl.Op, transport.ErrNotSupported)
	}
	if sl.Length > MaxMessage {
		return nil, nil, fmt.Errorf("rdma: slice of %d bytes, more than %d: %w", sl.Length, MaxMessage, transport.ErrRange)
	}
	b := bufs.find(sl.Remote, sl.Length)
	if b == nil {
		return nil, nil, fmt.Errorf("rdma: remote range [%#x, +%d) is not inside one buffer of the segment: %w", sl.Remote, sl.Length, transport.ErrRange)
	}
	if b.rkeys == nil {
		return nil, nil, fmt.Errorf("rdma: remote buffer at %#x: %s: %w", b.addr, b.why, transport.ErrDenied)
	}
	reg := regs[sl.LocalHandle]
	if reg == nil {
		return nil, nil, fmt.Errorf("rdma: local handle %d is not registered: %w", sl.LocalHandle, transport.ErrRange)
	}
	l := uint64(uintptr(sl.Local))
	if l < reg.addr || sl.Length > reg.length || l-reg.addr > reg.length-sl.Length {
		return nil, nil, fmt.Errorf("rdma: local range [%#x, +%d) is outside its registration: %w", l, sl.Length, transport.ErrRange)
	}
	return b, reg, nil
}
