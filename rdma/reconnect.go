//go:build rdma && cgo

// reconnect.go holds a rail's reconnects: connecting it, redialing on a
// goroutine after its queue pair failed (at the next Post, whichever rails
// its slices take), the backoff after a failed connect, retired queue
// pairs reaped once flushed, and the MaxQPs bound with eviction of idle
// queue pairs of the least recently used endpoints.

package rdma

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/moonring/moonring/transport"
)

// connectRail connects rail i, as Open does; the caller holds postMu.
// Within the wait after a failed attempt it fails at once with that
// attempt's error.
func (ep *Endpoint) connectRail(ctx context.Context, i int) error {
	t := ep.t
	if t.mc != nil {
		return ep.mcConnectGroup(ctx, i)
	}
	r := &ep.rails[i]
	if err := ep.backingOff(r); err != nil {
		return err
	}
	if err := t.reserveQP(ep); err != nil {
		return err
	}
	q, err := t.connect(ctx, ep, i, ep.addr, ep.key, r.li, r.ri)
	if err != nil {
		t.unreserveQP()
		t.connectFails.Add(1)
		ep.failedConnect(i, err)
		return err
	}
	r.q, r.connErr, r.wait = q, nil, 0
	return nil
}

// redial reconnects rail i on a goroutine, for Post: a dial and handshake
// take up to ConnectTimeout, far too long to hold a poller. The rail's
// slices go elsewhere meanwhile (see Post). Within the wait after a
// failed attempt it fails at once with that attempt's error. The caller
// holds postMu, and the endpoint is open.
func (ep *Endpoint) redial(i int) error {
	t := ep.t
	if t.mc != nil {
		return ep.mcRedial(i)
	}
	r := &ep.rails[i]
	if err := ep.backingOff(r); err != nil {
		return err
	}
	if t.devs[r.li].down.Load() {
		return fmt.Errorf("rdma: %s port %d is down: %w", t.devs[r.li].name, t.devs[r.li].port, transport.ErrPeer)
	}
	if err := t.reserveQP(ep); err != nil {
		return err
	}
	ep.dials++
	tok := ep.dials
	ctx, stop := context.WithCancel(ep.dialCtx)
	r.dialing, r.dialTok, r.dialStop = true, tok, stop
	addr, key := ep.addr, ep.key
	t.wg.Add(1) // Transport.Close closes this endpoint first, then waits: the devices outlive the dial
	go func() {
		defer t.wg.Done()
		defer stop()
		q, err := t.connect(ctx, ep, i, addr, key, r.li, r.ri)
		ep.postMu.Lock()
		defer ep.postMu.Unlock()
		own := r.dialTok == tok // else an Update dropped this dial
		if own {
			r.dialing, r.dialTok, r.dialStop = false, 0, nil
		}
		stale := ep.closed || !own
		switch {
		case err == nil && !stale:
			r.q, r.connErr, r.wait = q, nil, 0
			t.reconnects.Add(1)
		case err == nil:
			q.destroy() // gives its reservation back
		default:
			t.unreserveQP()
			if !stale {
				t.connectFails.Add(1)
				ep.failedConnect(i, err)
			}
		}
	}()
	return nil
}

// redialFailed starts the reconnect of every rail whose queue pair failed,
// or whose last reconnect failed (once its wait is over), on a device that
// is up: such a rail cools (its picker sends it no slices), so no slice of
// its own would start it, and it should be live again by the time its
// cooldown lets a probe through. A rail whose queue pair was evicted,
// idle, is left to reconnect when a slice is sent its way. The caller
// holds postMu, and the endpoint is open.
func (ep *Endpoint) redialFailed() {
	for i := range ep.rails {
		r := &ep.rails[i]
		if r.dialing || ep.t.devs[r.li].down.Load() {
			continue
		}
		switch {
		case r.q != nil && r.q.state.Load() != qpLive:
			r.retired = append(r.retired, r.q)
			r.q = nil
		case r.q == nil && r.connErr != nil:
		default:
			continue
		}
		ep.redial(i) // within the wait after a failed one, an error and no dial
	}
}

// backingOff returns the error of r's last failed connect while its wait
// lasts, else nil. The caller holds postMu.
func (ep *Endpoint) backingOff(r *rail) error {
	if r.connErr != nil && time.Now().UnixNano() < r.retryAt && ep.t.devs[r.li].ups.Load() == r.ups {
		return r.connErr
	}
	return nil
}

// failedConnect starts or doubles rail i's wait after a failed connect,
// and tells the endpoint's picker of the failure: the rail cools (its
// probes meanwhile go elsewhere, see Post), or, if a probe went out since
// it cooled, cools for twice as long. The caller holds postMu.
func (ep *Endpoint) failedConnect(i int, err error) {
	r := &ep.rails[i]
	d := ep.t.devs[r.li]
	if d.down.Load() {
		return // a port down fails at once anyway (choose skips it), and its up event is news
	}
	r.wait = min(max(2*r.wait, reconnectWait), maxReconnectWait)
	r.retryAt = time.Now().Add(r.wait).UnixNano()
	r.connErr, r.ups = err, d.ups.Load()
	ep.ch.pick.Failed(i)
}

// unreserveQP gives back a reservation of reserveQP that did not become a
// queue pair.
func (t *Transport) unreserveQP() {
	t.mu.Lock()
	t.nqp--
	t.mu.Unlock()
}

// reserveQP counts a new queue pair against MaxQPs, evicting idle queue
// pairs of the least recently used other endpoints when the bound is
// reached. The caller holds ep.postMu.
func (t *Transport) reserveQP(ep *Endpoint) error {
	t.mu.Lock()
	if t.nqp < t.cfg.MaxQPs {
		t.nqp++
		t.mu.Unlock()
		return nil
	}
	cands := slices.Clone(t.eps)
	t.mu.Unlock()
	slices.SortFunc(cands, func(a, b *Endpoint) int { return int(a.used.Load() - b.used.Load()) })
	for _, o := range cands {
		if o == ep || !o.postMu.TryLock() {
			continue
		}
		for i := range o.rails {
			r := &o.rails[i]
			if r.q != nil && r.q.idle() && r.q.state.Load() == qpLive {
				r.q.destroy()
				r.q = nil
				t.evictions.Add(1)
				t.mu.Lock()
				if t.nqp < t.cfg.MaxQPs {
					t.nqp++
					t.mu.Unlock()
					o.postMu.Unlock()
					return nil
				}
				t.mu.Unlock()
			}
		}
		o.postMu.Unlock()
	}
	return fmt.Errorf("rdma: %d queue pairs: %w: %w", t.cfg.MaxQPs, ErrTooManyQPs, transport.ErrPeer)
}

// reap destroys retired queue pairs that finished flushing; the caller
// holds postMu.
func (ep *Endpoint) reap() {
	for i := range ep.rails {
		r := &ep.rails[i]
		if len(r.retired) == 0 {
			continue
		}
		keep := r.retired[:0]
		for _, q := range r.retired {
			if q.idle() {
				q.destroy()
			} else {
				keep = append(keep, q)
			}
		}
		clear(r.retired[len(keep):])
		r.retired = keep
	}
}
