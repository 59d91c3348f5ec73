//go:build rdma && cgo

// register.go holds memory registration: a region is one registered
// buffer with its MR on every device, published to peers as its rkeys.

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// region is one registered buffer: its MR on every device.
type region struct {
	handle uint64
	addr   uint64
	length uint64
	mrs    []*C.struct_ibv_mr
	lkeys  []uint32
	far    uint64 // the devices far from the buffer's NUMA node, a bit each (farDevices)
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
	r := &region{addr: uint64(b.Addr), length: b.Length}
	nodes := make([]int, len(t.devs))
	for i, d := range t.devs {
		nodes[i] = d.numa
	}
	r.far = farDevices(nodes, b.Location)
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
		if t.mc != nil {
			key = formatMooncakeKey(rkeys)
		}
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
