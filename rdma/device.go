//go:build rdma && cgo

// device.go holds the RDMA devices: opening one (its port, GID, protection
// domain and completion queues), the goroutine that handles its
// asynchronous events (port down and up, GID changes, fatal errors, queue
// pair errors), and freeing it.

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
)

// device is one opened RDMA device with its protection domain and
// completion queue, shared by every queue pair on it.
type device struct {
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

func (t *Transport) openDevice(name string) (*device, error) {
	ctx, err := openDevice(name)
	if err != nil {
		return nil, err
	}
	d := &device{name: name, ctx: ctx, numa: numaNode(name)}
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
	*d = device{name: d.name}
}

func (t *Transport) freeDevices() {
	for _, d := range t.devs {
		d.free()
	}
}
