//go:build rdma && cgo

// mooncake_target.go holds the target side of Mooncake mode: a Mooncake
// initiator's Connection frame (through the engine's RPC port) answered
// with as many RC queue pairs as it sent, connected with Mooncake's
// attributes, kept per pair of NICs until the same NIC connects again,
// the bound evicts them or the transport closes; and its ready
// acknowledgement checked.

package rdma

/*
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/moonring/moonring/mooncake"
)

// Mooncake's queue pair attributes (mooncake/FORMATS.md): PSNs 0, hop
// limit 16; the RNR timer (12), timeout (14), retry and RNR retry (7) are
// moonring's too (shim.h, qp.go), but for the retry count of the
// initiator's queue pairs, mcInitiatorRetry.
const (
	mcPSN      = 0
	mcHopLimit = 16
	// mcInitiatorRetry is the retry count of the initiator's queue pairs:
	// 6, not Mooncake's 7. It is the requester's own setting (the peer
	// never sees it), and Soft-RoCE (rdma_rxe) takes 7 as "retry for
	// ever": a request to a peer whose queue pairs went away (it
	// restarted, closed, or replaced them) would never complete there,
	// and the rail never reconnect. On a NIC, 6 retries at timeout 14 fail
	// such a request in about half a second, as 7 do.
	mcInitiatorRetry = 6
)

// mcKey names a set of queue pairs a Mooncake peer connected: our device
// and the peer's NIC path.
type mcKey struct {
	dev  int
	peer string
}

// mcSet is the queue pairs one Mooncake peer NIC connected to one of our
// devices, with the answer it got.
type mcSet struct {
	key     mcKey
	peerQPs []uint32
	qps     []*C.struct_ibv_qp
	ans     *mooncake.HandshakeDesc
	used    uint64 // mcTargets.clock at its handshake, for eviction
}

// mcTargets is the target side's state in Mooncake mode.
type mcTargets struct {
	mu    sync.Mutex // handshakes, one at a time (Mooncake's daemon takes one at a time too)
	sets  map[mcKey]*mcSet
	n     int    // queue pairs in sets
	clock uint64 // counts handshakes

	evictions atomic.Uint64 // sets destroyed for the bound (Stats.PeerEvictions)
}

// mcState is the transport's Mooncake mode.
type mcState struct {
	server string
	rpc    string
	client *mooncake.RPCClient
	tgt    mcTargets
}

func newMCState(m *MooncakeMode) *mcState {
	c := m.Client
	if c == nil {
		c = &mooncake.RPCClient{}
	}
	return &mcState{server: m.Server, rpc: m.RPC, client: c, tgt: mcTargets{sets: map[mcKey]*mcSet{}}}
}

// MooncakeHandshake answers a Mooncake peer's Connection frame: it is the
// engine's mooncake.RPCServer Handshake function in Mooncake mode. The
// request must name one of this transport's devices under its server name
// and carry 1 to mooncake.MaxRDMAQPs queue pairs; the answer carries as
// many of ours, each brought to RTS against the peer's of the same index.
// A second request from the same peer NIC replaces its queue pairs (the
// peer restarted or reconnects), unless it carries the same queue pair
// numbers (answered again, as Mooncake does). A ready acknowledgement
// (ready_ack true) is checked against the queue pairs recorded. Past
// Config.MaxPeerQPs the least recently connected sets are destroyed. An
// error is a refusal (its text goes back in reply_msg). Safe for
// concurrent use.
func (t *Transport) MooncakeHandshake(req *mooncake.HandshakeDesc) (*mooncake.HandshakeDesc, error) {
	if t.mc == nil {
		return nil, ErrNotMooncake
	}
	r, err := req.RDMA()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrHandshake, err)
	}
	if r.PeerServer != t.mc.server {
		return nil, fmt.Errorf("%w: the request is for server %.200q, this is %q", ErrHandshake, r.PeerServer, t.mc.server)
	}
	di := slices.IndexFunc(t.devs, func(d *device) bool { return d.name == r.PeerDevice })
	if di < 0 {
		return nil, fmt.Errorf("%w: no device %.200q here", ErrHandshake, r.PeerDevice)
	}
	if !t.life.TryRLock() {
		return nil, fmt.Errorf("%w: closing", ErrHandshake)
	}
	defer t.life.RUnlock()
	if t.freed || t.closed.Load() {
		return nil, fmt.Errorf("%w: closing", ErrHandshake)
	}
	m := &t.mc.tgt
	m.mu.Lock()
	defer m.mu.Unlock()
	key := mcKey{dev: di, peer: mooncake.NICPath(r.LocalServer, r.LocalDevice)}
	s := m.sets[key]
	m.clock++
	if r.ReadyAck {
		switch {
		case s == nil:
			return nil, fmt.Errorf("%w: a ready acknowledgement from %.200q, which has no queue pairs here", ErrHandshake, key.peer)
		case !slices.Equal(s.peerQPs, r.QPNums):
			return nil, fmt.Errorf("%w: a stale ready acknowledgement from %.200q (queue pairs %v, connected %v)", ErrHandshake, key.peer, r.QPNums, s.peerQPs)
		}
		s.used = m.clock
		return s.ans, nil
	}
	if s != nil {
		if slices.Equal(s.peerQPs, r.QPNums) {
			s.used = m.clock
			return s.ans, nil
		}
		t.mcDrop(s)
	}
	for m.n+len(r.QPNums) > t.cfg.MaxPeerQPs && len(m.sets) > 0 {
		var old *mcSet
		for _, x := range m.sets {
			if old == nil || x.used < old.used {
				old = x
			}
		}
		t.mcDrop(old)
		m.evictions.Add(1)
	}
	if m.n+len(r.QPNums) > t.cfg.MaxPeerQPs {
		return nil, fmt.Errorf("%w: %d queue pairs, more than MaxPeerQPs (%d)", ErrHandshake, len(r.QPNums), t.cfg.MaxPeerQPs)
	}
	d := t.devs[di]
	if d.down.Load() {
		return nil, fmt.Errorf("%w: %s port %d is down", ErrHandshake, d.name, d.port)
	}
	gid, lid := d.addr()
	s = &mcSet{key: key, peerQPs: r.QPNums, used: m.clock}
	nums := make([]uint32, 0, len(r.QPNums))
	for _, pqn := range r.QPNums {
		q, step, err := t.mcTargetQP(d, gid, pqn, r)
		if err != nil {
			for _, q := range s.qps {
				C.ibv_destroy_qp(q)
			}
			return nil, fmt.Errorf("%w: %s on %s: %v", ErrHandshake, step, d.name, err)
		}
		s.qps = append(s.qps, q)
		nums = append(nums, uint32(q.qp_num))
	}
	s.ans = r.Answer(lid, gid.Raw, nums)
	m.sets[key] = s
	m.n += len(s.qps)
	return s.ans, nil
}

// mcTargetQP creates one queue pair on d for the peer's queue pair pqn and
// brings it to RTS with Mooncake's attributes. It takes no work requests
// of its own: the peer READs and WRITEs through it.
func (t *Transport) mcTargetQP(d *device, gid GID, pqn uint32, r *mooncake.RDMAHandshake) (*C.struct_ibv_qp, string, error) {
	q, err := C.mr_create_qp(d.pd, d.pcq, 1, 1)
	if q == nil {
		return nil, "ibv_create_qp", err
	}
	step, rc := "modify to INIT", C.mr_to_init(q, C.int(d.port))
	if rc == 0 {
		step, rc = "modify to RTR", mcRTR(q, d, gid, pqn, r)
	}
	if rc == 0 {
		step, rc = "modify to RTS", C.mr_to_rts(q, mcPSN, C.int(d.rdAtomic), ackTimeout, retryCount)
	}
	if rc != 0 {
		C.ibv_destroy_qp(q)
		return nil, step, syscall.Errno(rc)
	}
	return q, "", nil
}

// mcRTR brings q to RTR against the peer's queue pair pqn as Mooncake
// does: a GRH always (the peer's GID, ours by index, hop limit 16), the
// peer's LID, PSN 0, the port's MTU (at most 4096, the largest code),
// max_dest_rd_atomic 16 (or the device's maximum, if lower).
func mcRTR(q *C.struct_ibv_qp, d *device, gid GID, pqn uint32, r *mooncake.RDMAHandshake) C.int {
	return C.mr_to_rtr_hop(q, C.int(d.port), C.int(d.mtu), C.uint32_t(pqn), mcPSN, C.uint16_t(r.LID),
		(*C.uint8_t)(unsafe.Pointer(&r.GID[0])), C.int(gid.Index), 1, C.int(d.rdAtomic), mcHopLimit)
}

// mcDrop destroys a set of queue pairs peers connected; the caller holds
// the targets' mu and the transport's life lock (shared).
func (t *Transport) mcDrop(s *mcSet) {
	m := &t.mc.tgt
	for _, q := range s.qps {
		C.ibv_destroy_qp(q)
	}
	m.n -= len(s.qps)
	delete(m.sets, s.key)
}

// mcCloseTargets destroys every set of queue pairs peers connected; Close
// calls it before the devices go.
func (t *Transport) mcCloseTargets() {
	if t.mc == nil {
		return
	}
	m := &t.mc.tgt
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, s := range m.sets {
		t.mcDrop(s)
	}
}

// mcPeerQPs returns how many queue pairs Mooncake peers hold here.
func (t *Transport) mcPeerQPs() int {
	m := &t.mc.tgt
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.n
}
