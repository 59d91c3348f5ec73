//go:build rdma && cgo

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"os"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Available says whether this build carries the ibverbs transport (built
// with cgo and the "rdma" build tag). It is true here.
const Available = true

// RC queue pair timing: local ACK timeout 4.096 us * 2^14 (67 ms), seven
// retries: a vanished peer fails a request in about half a second.
const (
	ackTimeout = 14
	retryCount = 7
)

// device is one opened RDMA device with its protection domain and
// completion queue, shared by every queue pair on it.
type device struct {
	idx      int
	name     string
	ctx      *C.struct_ibv_context
	pd       *C.struct_ibv_pd
	cq       *C.struct_ibv_cq
	port     int
	lid      uint16 // under gidMu once the device is open
	mtu      uint8
	ethernet bool
	rdAtomic int
	numa     int // -1: unknown

	cqMu sync.Mutex // one poller at a time
	pl   poller     // under cqMu

	// The queue pairs peers connect complete into pcq, whose events wake
	// the device's peer goroutine: notifications reach the engine without
	// its pollers, which a target with no ring of its own does not run.
	ch       *C.struct_ibv_comp_channel
	pcq      *C.struct_ibv_cq
	ppl      poller
	chf      *os.File      // a dup of ch's fd, for the netpoller
	loopDone chan struct{} // closed when the peer goroutine returned

	// Asynchronous events: port down and up, device fatal, QP errors.
	af        *os.File      // a dup of ctx's async fd
	asyncDone chan struct{} // closed when the event goroutine returned
	down      atomic.Bool   // the port is down or the device failed
	ups       atomic.Uint64 // how many times the port came up: a rail's reconnect backoff ends then
	fatal     atomic.Bool   // the device failed: it stays down
	events    atomic.Uint64 // asynchronous events seen
	gidMu     sync.Mutex
	cur       GID // the GID in use, under gidMu (re-chosen when the table changes)
}

// region is one registered buffer: its MR on every device.
type region struct {
	handle uint64
	addr   uint64
	length uint64
	remote bool
	mrs    []*C.struct_ibv_mr
	lkeys  []uint32
	order  []int // devices by preference for the buffer's NUMA node
	near   int   // how many of order are on that node
}

// Transport is the RDMA transport of one engine. Use New. It is safe for
// concurrent use.
type Transport struct {
	// failAnswers makes the target fail every notification's answer, as
	// if posting it had: fault injection for the tests.
	failAnswers atomic.Bool

	cfg      Config
	devs     []*device
	ln       net.Listener
	endpoint string
	key      []byte // the segment key: configured, or random and published
	open     bool   // the key is random and published in the endpoint

	life   sync.RWMutex // Poll holds it shared; Close frees the devices under it
	freed  bool         // under life
	closed atomic.Bool

	mu   sync.Mutex                         // registrations, endpoints, peers
	seq  uint64                             // last registration handle, under mu
	regs atomic.Pointer[map[uint64]*region] // copy on write under mu
	eps  []*Endpoint                        // open endpoints, least recently used first, under mu
	nqp  int                                // the initiator's live queue pairs, under mu
	tqp  map[*peerQP]struct{}               // peers' control connections, handshaking or not, under mu
	hs   int                                // of those, still in the handshake (maxPendingHandshakes), under mu
	npqp int                                // peers' queue pairs whose initiator proved the key (MaxPeerQPs), under mu

	qpMu    sync.RWMutex
	qps     map[uint32]*qp     // initiator queue pairs by id, for completions
	qpSeq   uint32             // under qpMu
	peers   map[uint32]*peerQP // queue pairs peers connected, by id
	peerSeq uint32             // under qpMu

	self    string // the engine's segment name, sent with notifications
	deliver atomic.Pointer[func(*transport.Notification) error]

	wg sync.WaitGroup // the accept loop, peer connections, watchers

	slices, postCalls, pollCalls, emptyPolls, reconnects, evictions atomic.Uint64
}

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Poller    = (*Transport)(nil)
	_ transport.Notifier  = (*Transport)(nil)
)

// New opens the RDMA devices (Config.Devices, or every device with an
// ACTIVE port and a usable GID) and starts the control listener. It fails
// with an error wrapping ErrNoDevice and transport.ErrNotSupported when no
// device is usable.
func New(cfg Config) (*Transport, error) {
	cfg = cfg.withDefaults()
	t := &Transport{cfg: cfg, qps: map[uint32]*qp{}, peers: map[uint32]*peerQP{}, tqp: map[*peerQP]struct{}{}}
	empty := map[uint64]*region{}
	t.regs.Store(&empty)
	names, err := deviceList()
	if err != nil {
		return nil, fmt.Errorf("%w: %w: %v", ErrNoDevice, transport.ErrNotSupported, err)
	}
	if len(cfg.Devices) > 0 {
		for _, want := range cfg.Devices {
			if !slices.Contains(names, want) {
				return nil, fmt.Errorf("%w: %w: no device %q (have %v)", ErrNoDevice, transport.ErrNotSupported, want, names)
			}
		}
		names = cfg.Devices
	}
	var why []string
	for _, name := range names {
		d, err := t.openDevice(name, len(t.devs))
		if err != nil {
			if len(cfg.Devices) > 0 {
				t.freeDevices()
				return nil, err
			}
			why = append(why, err.Error())
			continue
		}
		t.devs = append(t.devs, d)
	}
	if len(t.devs) == 0 {
		return nil, fmt.Errorf("%w: %w: %d devices %v", ErrNoDevice, transport.ErrNotSupported, len(names), why)
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		t.freeDevices()
		return nil, fmt.Errorf("rdma: listen: %w", err)
	}
	t.ln = ln
	adv := cfg.Advertise
	if adv == "" {
		adv = ln.Addr().String()
	}
	devNames := make([]string, len(t.devs))
	for i, d := range t.devs {
		devNames[i] = d.name
	}
	if len(cfg.Key) > 0 {
		t.key = deriveKey(cfg.Key)
		t.endpoint = formatEndpoint(adv, devNames, nil)
	} else {
		t.key = make([]byte, keySize)
		rand.Read(t.key)
		t.open = true
		t.endpoint = formatEndpoint(adv, devNames, t.key)
	}
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

func (t *Transport) openDevice(name string, idx int) (*device, error) {
	ctx, err := openDevice(name)
	if err != nil {
		return nil, err
	}
	d := &device{idx: idx, name: name, ctx: ctx, numa: numaNode(name)}
	fail := func(err error) (*device, error) {
		d.free()
		return nil, fmt.Errorf("rdma: %s: %w", name, err)
	}
	ports, rdAtomic, err := queryPorts(ctx)
	if err != nil {
		return fail(err)
	}
	d.rdAtomic = max(min(rdAtomic, 16), 1)
	var chosen *portInfo
	for i := range ports {
		p := &ports[i]
		if t.cfg.Port != 0 && p.Port != t.cfg.Port {
			continue
		}
		if p.State != "ACTIVE" && t.cfg.Port == 0 {
			continue
		}
		chosen = p
		break
	}
	if chosen == nil {
		return fail(fmt.Errorf("no ACTIVE port (or no port %d)", t.cfg.Port))
	}
	d.port = chosen.Port
	d.ethernet = chosen.LinkLayer == "Ethernet"
	d.cur, err = ChooseGID(chosen.GIDs, d.ethernet, t.cfg.GIDIndex)
	if err != nil {
		return fail(fmt.Errorf("port %d: %w", chosen.Port, err))
	}
	d.lid = chosen.LID
	d.mtu = chosen.mtuCode
	if d.mtu < 1 || d.mtu > 5 {
		return fail(fmt.Errorf("port %d: MTU code %d", chosen.Port, d.mtu))
	}
	d.pd, err = C.ibv_alloc_pd(ctx)
	if d.pd == nil {
		return fail(fmt.Errorf("ibv_alloc_pd: %v", err))
	}
	// Each of the initiator's queue pairs completes its Depth work
	// requests and its notification receives into d.cq; peers' queue
	// pairs complete into d.pcq. Both are capped by the device.
	cqe := t.cfg.MaxQPs*(t.cfg.Depth+notifySlots) + 64
	pcqe := t.cfg.MaxPeerQPs*2*(notifySlots+1) + 64
	var da C.struct_ibv_device_attr
	if C.ibv_query_device(ctx, &da) == 0 && int(da.max_cqe) > 0 {
		cqe, pcqe = min(cqe, int(da.max_cqe)), min(pcqe, int(da.max_cqe))
	}
	d.cq, err = C.ibv_create_cq(ctx, C.int(cqe), nil, nil, 0)
	if d.cq == nil {
		return fail(fmt.Errorf("ibv_create_cq(%d): %v", cqe, err))
	}
	d.pl = newPoller()
	d.ch, err = C.ibv_create_comp_channel(ctx)
	if d.ch == nil {
		return fail(fmt.Errorf("ibv_create_comp_channel: %v", err))
	}
	d.pcq, err = C.ibv_create_cq(ctx, C.int(pcqe), nil, d.ch, 0)
	if d.pcq == nil {
		return fail(fmt.Errorf("ibv_create_cq for peers: %v", err))
	}
	d.ppl = newPoller()
	if err := syscall.SetNonblock(int(d.ch.fd), true); err != nil {
		return fail(fmt.Errorf("completion channel: %v", err))
	}
	nfd, err := syscall.Dup(int(d.ch.fd))
	if err != nil {
		return fail(fmt.Errorf("completion channel: %v", err))
	}
	syscall.CloseOnExec(nfd)
	d.chf = os.NewFile(uintptr(nfd), "rdma-"+name+"-cq-events")
	if rc := C.mr_req_notify(d.pcq); rc != 0 {
		return fail(fmt.Errorf("ibv_req_notify_cq: %v", syscall.Errno(rc)))
	}
	d.loopDone = make(chan struct{})
	go t.peerLoop(d)
	if err := syscall.SetNonblock(int(ctx.async_fd), true); err != nil {
		return fail(fmt.Errorf("async events: %v", err))
	}
	afd, err := syscall.Dup(int(ctx.async_fd))
	if err != nil {
		return fail(fmt.Errorf("async events: %v", err))
	}
	syscall.CloseOnExec(afd)
	d.af = os.NewFile(uintptr(afd), "rdma-"+name+"-async")
	d.asyncDone = make(chan struct{})
	go t.asyncLoop(d)
	return d, nil
}

// asyncLoop handles d's asynchronous events until d.af is closed: a port
// going down (or the device failing) fails the device's queue pairs, whose
// slices the engine then retries, and Post moves rails to the devices still
// up; a port coming back, or a changed GID table, re-chooses the GID.
func (t *Transport) asyncLoop(d *device) {
	defer close(d.asyncDone)
	rc, err := d.af.SyscallConn()
	if err != nil {
		return
	}
	for {
		var typ, port C.int
		var qp *C.struct_ibv_qp
		if err := rc.Read(func(uintptr) bool { return C.mr_async_event(d.ctx, &typ, &port, &qp) == 1 }); err != nil {
			return // closed
		}
		d.events.Add(1)
		switch typ {
		case C.IBV_EVENT_PORT_ERR:
			if int(port) == d.port {
				d.down.Store(true)
				t.failDevice(d)
			}
		case C.IBV_EVENT_DEVICE_FATAL:
			d.fatal.Store(true)
			d.down.Store(true)
			t.failDevice(d)
		case C.IBV_EVENT_PORT_ACTIVE, C.IBV_EVENT_GID_CHANGE, C.IBV_EVENT_LID_CHANGE:
			if int(port) == d.port && !d.fatal.Load() {
				t.refreshPort(d)
			}
		case C.IBV_EVENT_QP_FATAL, C.IBV_EVENT_QP_REQ_ERR, C.IBV_EVENT_QP_ACCESS_ERR:
			t.qpMu.RLock()
			for _, q := range t.qps {
				if q.q == qp {
					q.fail()
				}
			}
			t.qpMu.RUnlock()
		}
	}
}

// failDevice fails every queue pair of d.
func (t *Transport) failDevice(d *device) {
	t.qpMu.RLock()
	defer t.qpMu.RUnlock()
	for _, q := range t.qps {
		if q.dev == d {
			q.fail()
		}
	}
}

// refreshPort re-reads d's port: up when ACTIVE with a usable GID.
func (t *Transport) refreshPort(d *device) {
	ports, _, err := queryPorts(d.ctx)
	if err != nil {
		return
	}
	for _, p := range ports {
		if p.Port != d.port {
			continue
		}
		g, err := ChooseGID(p.GIDs, d.ethernet, t.cfg.GIDIndex)
		if p.State != "ACTIVE" || err != nil {
			return // still down: a GID_CHANGE or PORT_ACTIVE follows
		}
		d.gidMu.Lock()
		d.cur, d.lid = g, p.LID
		d.gidMu.Unlock()
		if d.down.Swap(false) {
			d.ups.Add(1)
		}
	}
}

// addr returns the GID and LID the device uses now.
func (d *device) addr() (GID, uint16) {
	d.gidMu.Lock()
	defer d.gidMu.Unlock()
	return d.cur, d.lid
}

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
			if t.failAnswers.Load() || p.answerNote(slot, seq, st) != 0 {
				p.conn.Close() // as for an answer that failed on the wire
			}
		}
	}
	return len(wcs)
}

func (d *device) free() {
	// A device that failed half way may have a file and no goroutine yet.
	if d.af != nil {
		d.af.Close()
		if d.asyncDone != nil {
			<-d.asyncDone
		}
	}
	if d.chf != nil {
		d.chf.Close()
		if d.loopDone != nil {
			<-d.loopDone
		}
	}
	if d.pcq != nil {
		C.ibv_destroy_cq(d.pcq)
		d.ppl.free()
	}
	if d.ch != nil {
		C.ibv_destroy_comp_channel(d.ch)
	}
	if d.cq != nil {
		C.ibv_destroy_cq(d.cq)
		d.pl.free()
	}
	if d.pd != nil {
		C.ibv_dealloc_pd(d.pd)
	}
	if d.ctx != nil {
		C.ibv_close_device(d.ctx)
	}
	*d = device{idx: d.idx, name: d.name}
}

func (t *Transport) freeDevices() {
	for _, d := range t.devs {
		d.free()
	}
}

// Name returns "rdma".
func (t *Transport) Name() string { return Name }

// Endpoint returns the control listener's host:port, the device names and,
// without a configured Config.Key, the random segment key:
// "host:port/dev0,dev1[/key]" (PROTOCOL.md).
func (t *Transport) Endpoint() string { return t.endpoint }

// SliceSize returns Config.SliceSize.
func (t *Transport) SliceSize() uint64 { return t.cfg.SliceSize }

// DeviceNames returns the names of the devices in use, in index order.
func (t *Transport) DeviceNames() []string {
	out := make([]string, len(t.devs))
	for i, d := range t.devs {
		out[i] = d.name
	}
	return out
}

// GIDs returns the GID each device uses, in device order.
func (t *Transport) GIDs() []GID {
	out := make([]GID, len(t.devs))
	for i, d := range t.devs {
		out[i], _ = d.addr()
	}
	return out
}

// Stats returns the transport's counters.
func (t *Transport) Stats() Stats {
	t.mu.Lock()
	n := t.nqp
	t.mu.Unlock()
	return Stats{
		Slices: t.slices.Load(), PostCalls: t.postCalls.Load(), PollCalls: t.pollCalls.Load(),
		EmptyPolls: t.emptyPolls.Load(), Reconnects: t.reconnects.Load(), Evictions: t.evictions.Load(), QPs: n,
	}
}

// Register registers b's memory on every device: local access only, or
// also remote read and write when b.Remote. The key of a remote-accessible
// buffer is its rkeys; a local-only buffer has none.
func (t *Transport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	if t.closed.Load() {
		return segtable.Registration{}, fmt.Errorf("rdma: register: %w", transport.ErrClosed)
	}
	if b.Length == 0 {
		return segtable.Registration{}, fmt.Errorf("rdma: register: empty buffer")
	}
	t.life.RLock()
	defer t.life.RUnlock()
	if t.freed {
		return segtable.Registration{}, fmt.Errorf("rdma: register: %w", transport.ErrClosed)
	}
	r := &region{addr: uint64(b.Addr), length: b.Length, remote: b.Remote}
	nodes := make([]int, len(t.devs))
	for i, d := range t.devs {
		nodes[i] = d.numa
	}
	r.order, r.near = preferDevices(nodes, b.Location)
	rkeys := make([]uint32, 0, len(t.devs))
	remote := C.int(0)
	if b.Remote {
		remote = 1
	}
	for _, d := range t.devs {
		mr, err := C.mr_reg(d.pd, C.uintptr_t(b.Addr), C.size_t(b.Length), remote)
		if mr == nil {
			r.dereg()
			return segtable.Registration{}, fmt.Errorf("rdma: ibv_reg_mr of %d bytes on %s: %v", b.Length, d.name, err)
		}
		r.mrs = append(r.mrs, mr)
		r.lkeys = append(r.lkeys, uint32(mr.lkey))
		rkeys = append(rkeys, uint32(mr.rkey))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed.Load() {
		r.dereg()
		return segtable.Registration{}, fmt.Errorf("rdma: register: %w", transport.ErrClosed)
	}
	t.seq++
	r.handle = t.seq
	old := *t.regs.Load()
	m := make(map[uint64]*region, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[r.handle] = r
	t.regs.Store(&m)
	key := ""
	if b.Remote {
		key = formatKey(rkeys)
	}
	return segtable.Registration{Handle: r.handle, Key: key}, nil
}

func (r *region) dereg() {
	for _, mr := range r.mrs {
		C.ibv_dereg_mr(mr)
	}
	r.mrs = nil
}

// Unregister deregisters the buffer's MRs: peers' operations on it fail
// from then on with a remote access error (the hardware checks, not this
// process, so there is nothing in progress here to wait for). The engine
// waits for its own slices on the buffer before it calls Unregister.
func (t *Transport) Unregister(b *segtable.Buffer, reg segtable.Registration) error {
	t.life.RLock()
	defer t.life.RUnlock()
	if t.freed {
		return nil // Close deregistered everything
	}
	t.mu.Lock()
	old := *t.regs.Load()
	r, ok := old[reg.Handle]
	if !ok {
		t.mu.Unlock()
		return fmt.Errorf("rdma: unregister: unknown handle %d", reg.Handle)
	}
	m := make(map[uint64]*region, len(old))
	for k, v := range old {
		if k != reg.Handle {
			m[k] = v
		}
	}
	t.regs.Store(&m)
	t.mu.Unlock()
	r.dereg()
	return nil
}

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
			}
			k++
		}
		s.c = nil
		if status != wcSuccess && status != wcFlushErr {
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

// Close closes every endpoint (their slices in flight complete with
// ErrClosed), the control listener and the peers' queue pairs, and frees
// the devices.
func (t *Transport) Close() error {
	if t.closed.Swap(true) {
		return nil
	}
	t.ln.Close()
	t.mu.Lock()
	eps := slices.Clone(t.eps)
	peers := make([]*peerQP, 0, len(t.tqp))
	for p := range t.tqp {
		peers = append(peers, p)
	}
	t.mu.Unlock()
	for _, ep := range eps {
		ep.Close()
	}
	for _, p := range peers {
		p.conn.Close()
	}
	t.wg.Wait()
	t.life.Lock()
	defer t.life.Unlock()
	t.freed = true
	t.mu.Lock()
	regs := *t.regs.Load()
	empty := map[uint64]*region{}
	t.regs.Store(&empty)
	t.mu.Unlock()
	for _, r := range regs {
		r.dereg()
	}
	t.freeDevices()
	return nil
}

// ---------------------------------------------------------------- queue pairs

const (
	qpLive    = iota // takes work
	qpFailed         // a completion failed: flushing, then reconnect
	qpClosing        // the endpoint or transport is closing it
)

// slot is one work request in flight on a queue pair.
type slot struct {
	c     transport.Completer
	token uint64
	op    transport.Op
}

// qp is one of the initiator's RC queue pairs with its control connection.
//
// Slots form a ring: Post (under its endpoint's postMu) fills them at
// head, the poller holding the device's cqMu empties them at tail, in
// order, since a send queue completes in order.
type qp struct {
	t     *Transport
	id    uint32
	dev   *device
	rdev  int // the peer's device index
	q     *C.struct_ibv_qp
	conn  net.Conn
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

// fail marks the queue pair failed and moves it to the error state, which
// flushes its work requests; the next Post on its rail connects a new one.
func (q *qp) fail() {
	if q.state.CompareAndSwap(qpLive, qpFailed) {
		C.mr_to_err(q.q)
		q.conn.Close() // the target tears its side down
	}
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
	q.conn.Close()
	<-q.watch
	t := q.t
	t.qpMu.Lock()
	delete(t.qps, q.id)
	t.qpMu.Unlock()
	C.ibv_destroy_qp(q.q)
	q.st.free()
	q.area.free()
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

// connect creates a queue pair on local device li to the peer's device ri
// at addr and connects it through the handshake.
func (t *Transport) connect(ctx context.Context, addr string, key []byte, li, ri int) (*qp, error) {
	d := t.devs[li]
	if d.down.Load() {
		return nil, fmt.Errorf("rdma: %s port %d is down: %w", d.name, d.port, transport.ErrPeer)
	}
	gid, lid := d.addr()
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, t.cfg.ConnectTimeout)
		defer cancel()
	}
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
	q := &qp{t: t, id: id, dev: d, rdev: ri, q: cq, conn: conn, slots: make([]slot, t.cfg.Depth), st: newStage(t.cfg.Depth),
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

// ---------------------------------------------------------------- target side

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

// ---------------------------------------------------------------- endpoints

// rbuf is one buffer of the remote segment.
type rbuf struct {
	addr, length uint64
	rkeys        []uint32 // per remote device; nil: no usable key
	why          string   // why rkeys is nil
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

// Endpoint is the way to one remote segment: Rails() queue pairs. Safe for
// concurrent use; Posts are serialized.
type Endpoint struct {
	t      *Transport
	postMu sync.Mutex // Post, reconnects, eviction and Close
	addr   string     // under postMu
	key    []byte     // the segment key, under postMu
	nrdev  int
	rails  []rail // under postMu
	bufs   atomic.Pointer[[]rbuf]
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
	es, ok := desc.Endpoints[Name]
	if !ok {
		return nil, fmt.Errorf("rdma: segment %q has no rdma endpoint: %w", desc.Name, transport.ErrUnreachable)
	}
	addr, rdevs, key, err := parseEndpoint(es)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, transport.ErrUnreachable)
	}
	if key == nil {
		if t.open {
			return nil, fmt.Errorf("rdma: endpoint %q publishes no key and none is configured: %w: %w", es, ErrAuth, transport.ErrUnreachable)
		}
		key = t.key
	}
	ep := &Endpoint{t: t, addr: addr, key: key, nrdev: len(rdevs), gone: make(chan struct{})}
	ep.dialCtx, ep.dialCancel = context.WithCancel(context.Background())
	ep.setBuffers(desc)
	// Local device i talks to the peer's device i (modulo its count): on a
	// rail-optimized fabric NIC i of every host shares a switch.
	for li := range t.devs {
		for k := 0; k < t.cfg.QPsPerDevice; k++ {
			ep.rails = append(ep.rails, rail{li: li, ri: li % len(rdevs), b: -1})
		}
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
		if err := ep.connectRail(ctx, i); err != nil {
			ep.postMu.Unlock()
			ep.Close()
			return nil, fmt.Errorf("%w: %w", err, transport.ErrUnreachable)
		}
	}
	ep.postMu.Unlock()
	return ep, nil
}

func (ep *Endpoint) setBuffers(desc *segtable.SegmentDesc) {
	bs := make([]rbuf, 0, len(desc.Buffers))
	for _, b := range desc.Buffers {
		rb := rbuf{addr: b.Addr, length: b.Length}
		rkeys, err := parseKey(b.Keys[Name], ep.nrdev)
		if err != nil {
			rb.why = err.Error()
		} else {
			rb.rkeys = rkeys
		}
		bs = append(bs, rb)
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].addr < bs[j].addr })
	ep.bufs.Store(&bs)
}

// find returns the buffer holding [addr, addr+n), or nil.
func find(bs []rbuf, addr, n uint64) *rbuf {
	i := sort.Search(len(bs), func(i int) bool { return bs[i].addr+bs[i].length > addr })
	if i == len(bs) {
		return nil
	}
	b := &bs[i]
	if addr < b.addr || n > b.length || addr-b.addr > b.length-n {
		return nil
	}
	return b
}

// Rails returns the number of queue pairs: devices times QPsPerDevice.
func (ep *Endpoint) Rails() int { return len(ep.rails) }

// Update takes the segment's new descriptor: its buffers and keys, and its
// address for queue pairs connected from now on.
func (ep *Endpoint) Update(desc *segtable.SegmentDesc) {
	addr, rdevs, key, err := parseEndpoint(desc.Endpoints[Name])
	ep.postMu.Lock()
	if err == nil && len(rdevs) == ep.nrdev {
		moved := addr != ep.addr || (key != nil && !bytes.Equal(key, ep.key))
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
	ep.setBuffers(desc)
	ep.postMu.Unlock()
}

// connectRail connects rail i, as Open does; the caller holds postMu.
// Within the wait after a failed attempt it fails at once with that
// attempt's error.
func (ep *Endpoint) connectRail(ctx context.Context, i int) error {
	t := ep.t
	r := &ep.rails[i]
	if err := ep.backingOff(r); err != nil {
		return err
	}
	if err := t.reserveQP(ep); err != nil {
		return err
	}
	q, err := t.connect(ctx, ep.addr, ep.key, r.li, r.ri)
	if err != nil {
		t.unreserveQP()
		ep.failedConnect(r, err)
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
		q, err := t.connect(ctx, addr, key, r.li, r.ri)
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
				ep.failedConnect(r, err)
			}
		}
	}()
	return nil
}

// backingOff returns the error of r's last failed connect while its wait
// lasts, else nil. The caller holds postMu.
func (ep *Endpoint) backingOff(r *rail) error {
	if r.connErr != nil && time.Now().UnixNano() < r.retryAt && ep.t.devs[r.li].ups.Load() == r.ups {
		return r.connErr
	}
	return nil
}

// failedConnect starts or doubles r's wait after a failed connect. The
// caller holds postMu.
func (ep *Endpoint) failedConnect(r *rail, err error) {
	d := ep.t.devs[r.li]
	if d.down.Load() {
		return // a port down fails at once anyway, and its up event is news
	}
	r.wait = min(max(2*r.wait, reconnectWait), maxReconnectWait)
	r.retryAt = time.Now().Add(r.wait).UnixNano()
	r.connErr, r.ups = err, d.ups.Load()
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

var useClock atomic.Int64

// Post checks each slice (the remote range inside one buffer with an
// rkey, the local range inside its registration), puts it on its rail's
// queue pair, and posts every rail's chain in one cgo call. It accepts
// fewer slices when a queue pair is full (or, for notifications, has
// notifySlots unanswered), or when a rail must reconnect. That happens on
// a goroutine (see redial); meanwhile the rail's slices go to another rail
// with a live queue pair, and with none Post takes fewer slices, or fails
// with the last reconnect's error within the wait after it failed. A slice that fails the checks completes at once
// with ErrRange or ErrDenied.
func (ep *Endpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	t := ep.t
	ep.postMu.Lock()
	if ep.closed || t.closed.Load() {
		ep.postMu.Unlock()
		return 0, fmt.Errorf("rdma: post: %w", transport.ErrClosed)
	}
	ep.used.Store(useClock.Add(1))
	ep.reap()
	bufs := *ep.bufs.Load()
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
		rb, reg, err := ep.check(sl, bufs, regs)
		if err != nil {
			if i > 0 || refused != nil {
				break // completed by the Post that starts with it
			}
			refused, refusedTok = err, sl.Token
			continue
		}
		ri := int(sl.Rail) % len(ep.rails)
		if reg != nil {
			ri = railFor(int(sl.Rail), len(ep.rails), t.cfg.QPsPerDevice, reg.order, reg.near)
		}
		if t.devs[ep.rails[ri].li].down.Load() {
			ri = ep.upRail(ri)
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
			alt := ep.liveRail(ri)
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
		q.slots[seq%uint64(len(q.slots))] = slot{c: c, token: sl.Token, op: sl.Op}
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
// device that is up, or -1. The caller holds postMu.
func (ep *Endpoint) liveRail(ri int) int {
	for k := 1; k < len(ep.rails); k++ {
		j := (ri + k) % len(ep.rails)
		r := &ep.rails[j]
		if r.q != nil && r.q.state.Load() == qpLive && !ep.t.devs[r.li].down.Load() {
			return j
		}
	}
	return -1
}

// upRail returns the first rail after ri whose device is up, or ri.
func (ep *Endpoint) upRail(ri int) int {
	for k := 1; k < len(ep.rails); k++ {
		j := (ri + k) % len(ep.rails)
		if !ep.t.devs[ep.rails[j].li].down.Load() {
			return j
		}
	}
	return ri
}

// check returns the remote buffer and the local registration of sl, or
// why it cannot be posted.
func (ep *Endpoint) check(sl *transport.Slice, bufs []rbuf, regs map[uint64]*region) (*rbuf, *region, error) {
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
	b := find(bufs, sl.Remote, sl.Length)
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
			C.mr_to_err(q.q)
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
			q.conn.Close()
			<-q.watch
		}
	}
	return nil
}

// stallPeers moves every queue pair peers connected to this transport to
// the error state without telling the peers: their requests go unanswered
// until they time out. Fault injection for the tests; it returns how many.
func (t *Transport) stallPeers() int {
	t.qpMu.RLock()
	defer t.qpMu.RUnlock()
	for _, p := range t.peers {
		C.mr_to_err(p.q)
	}
	return len(t.peers)
}
