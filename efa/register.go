//go:build efa && cgo

// register.go holds memory registration: a region is one registered
// buffer with its MR; the list of regions, sorted by handle, is read by
// Post without a lock.

package efa

/*
#include "shim.h"
*/
import "C"

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// region is one registered buffer.
type region struct {
	handle uint64
	addr   uint64
	length uint64
	mr     *C.struct_fid_mr
	desc   uint64 // fi_mr_desc, for FI_MR_LOCAL providers
}

func (t *Transport) regList() []*region {
	if p := t.regs.Load(); p != nil {
		return *p
	}
	return nil
}

// Register registers b's memory with the provider: for local use always
// (providers with FI_MR_LOCAL need a descriptor), for peers' READs and
// WRITEs only when b is remote-accessible, which alone gets a key.
func (t *Transport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	if t.closing.Load() {
		return segtable.Registration{}, fmt.Errorf("efa: register: %w", transport.ErrClosed)
	}
	if kind, _, err := b.Location.Parse(); err != nil || kind != "cpu" {
		return segtable.Registration{}, fmt.Errorf("efa: register %s memory: %w", b.Location, transport.ErrNotSupported)
	}
	access := uint64(C.FI_READ | C.FI_WRITE)
	if b.Remote {
		access |= C.FI_REMOTE_READ | C.FI_REMOTE_WRITE
	}
	r := &region{addr: uint64(b.Addr), length: b.Length}
	t.guard.RLock()
	defer t.guard.RUnlock()
	if t.closing.Load() {
		return segtable.Registration{}, fmt.Errorf("efa: register: %w", transport.ErrClosed)
	}
	var rc C.int
	var key, desc C.uint64_t
	for try := 0; try < 4; try++ {
		// Without FI_MR_PROV_KEY the key is ours to pick, unique in the
		// domain: a random one is also one a peer cannot guess.
		var k [8]byte
		rand.Read(k[:])
		req := binary.LittleEndian.Uint64(k[:])
		if t.res.key_size < 8 {
			req &= 1<<(8*t.res.key_size) - 1
		}
		rc = C.fi_reg(t.res, C.uint64_t(b.Addr), C.uint64_t(b.Length), C.uint64_t(access), C.uint64_t(req), &r.mr, &key, &desc)
		if rc != -C.FI_ENOKEY || t.provKey {
			break
		}
	}
	if rc != 0 {
		return segtable.Registration{}, fmt.Errorf("efa: register %#x+%d: fi_mr_reg: %s", b.Addr, b.Length, fiStrerror(int(rc)))
	}
	r.desc = uint64(desc)
	t.regMu.Lock()
	t.regSeq++
	r.handle = t.regSeq
	rs := append(slices.Clone(t.regList()), r)
	t.regs.Store(&rs)
	t.regMu.Unlock()
	reg := segtable.Registration{Handle: r.handle}
	if b.Remote {
		reg.Key = remoteKey{key: uint64(key), base: uint64(b.Addr), length: b.Length}.String()
	}
	return reg, nil
}

// Unregister closes the buffer's MR. It waits for Posts and Polls in
// progress (which may be moving its bytes) to return; see the package
// documentation for what software providers may still do after.
func (t *Transport) Unregister(b *segtable.Buffer, reg segtable.Registration) error {
	t.guard.Lock()
	defer t.guard.Unlock()
	if t.closing.Load() {
		return nil // Close closed every MR
	}
	if reg.Handle == 0 {
		// Handle 0 is the probe's scratch region, never a caller's: its
		// loss would fail every later Open.
		return fmt.Errorf("efa: unregister %#x: handle 0: %w", b.Addr, segtable.ErrNotFound)
	}
	t.regMu.Lock()
	rs := t.regList()
	i, ok := slices.BinarySearchFunc(rs, reg.Handle, func(r *region, h uint64) int { return cmpU64(r.handle, h) })
	if !ok {
		t.regMu.Unlock()
		return fmt.Errorf("efa: unregister %#x: %w", b.Addr, segtable.ErrNotFound)
	}
	r := rs[i]
	rs = slices.Delete(slices.Clone(rs), i, i+1)
	t.regs.Store(&rs)
	t.regMu.Unlock()
	t.pollMu.Lock() // nor a cq_poll (see Transport.pollMu)
	rc := C.fi_unreg(r.mr)
	t.pollMu.Unlock()
	if rc != 0 {
		return fmt.Errorf("efa: unregister %#x: fi_close: %s", b.Addr, fiStrerror(int(rc)))
	}
	return nil
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func findRegion(rs []*region, handle uint64) *region {
	i, j := 0, len(rs)
	for i < j {
		h := int(uint(i+j) >> 1)
		if rs[h].handle >= handle {
			j = h
		} else {
			i = h + 1
		}
	}
	if i < len(rs) && rs[i].handle == handle {
		return rs[i]
	}
	return nil
}
