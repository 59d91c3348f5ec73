//go:build rdma && cgo

// rdma.go holds the Transport: its state and locks, New (devices opened,
// the control listener started, the segment key chosen), what it
// publishes (Endpoint, GIDs, Stats) and Close. The other ideas have a
// file each: device.go (devices and port events), register.go (memory
// regions), qp.go (the initiator's queue pairs and handshake), target.go
// (peers' queue pairs), endpoint.go (endpoints and rails), reconnect.go,
// post.go and poll.go; notifications are in notify.go.

package rdma

import (
	"crypto/rand"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/moonring/moonring/internal/rails"
	"github.com/moonring/moonring/transport"
)

// Available says whether this build carries the ibverbs transport (built
// with cgo and the "rdma" build tag). It is true here.
const Available = true

// Transport is the RDMA transport of one engine. Use New. It is safe for
// concurrent use.
type Transport struct {
	// hooks are the tests' fault injections: nil outside the tests.
	hooks atomic.Pointer[testHooks]

	cfg      Config
	name     string   // Name, or MooncakeName in Mooncake mode
	mc       *mcState // Mooncake mode (Config.Mooncake), nil outside it
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

	slices, postCalls, pollCalls, emptyPolls, reconnects, evictions, connectFails atomic.Uint64
}

// testHooks are fault injections for the tests, which alone set them
// (hooks_test.go): a Transport's hooks stay nil in every other program, so
// these paths cost it a nil check and are never taken.
type testHooks struct {
	// failAnswers makes the target fail every notification's answer, as
	// if posting it had.
	failAnswers atomic.Bool
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
	t := &Transport{cfg: cfg, name: Name, qps: map[uint32]*qp{}, peers: map[uint32]*peerQP{}, tqp: map[*peerQP]struct{}{}}
	if cfg.Mooncake != nil {
		t.name, t.mc = MooncakeName, newMCState(cfg.Mooncake)
		if _, _, err := net.SplitHostPort(t.mc.rpc); err != nil || t.mc.server == "" || strings.Contains(t.mc.server, "@") {
			return nil, fmt.Errorf("%w: RPC %q and server %q: want host:port and a name without '@'", ErrMooncakeConfig, t.mc.rpc, t.mc.server)
		}
	}
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
		d, err := t.openDevice(name)
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
	if n := len(t.devs) * cfg.QPsPerDevice; n > rails.MaxRails {
		t.freeDevices()
		return nil, fmt.Errorf("rdma: %d devices x %d queue pairs per device: %d rails, more than %d", len(t.devs), cfg.QPsPerDevice, n, rails.MaxRails)
	}
	if t.mc != nil {
		// Mooncake mode: no control listener; handshakes come through
		// the engine's RPC port (MooncakeHandshake).
		t.endpoint = t.mc.rpc
		return t, nil
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

// Name returns "rdma", or "mooncake-rdma" (MooncakeName) in Mooncake mode.
func (t *Transport) Name() string { return t.name }

// Endpoint returns the control listener's host:port, the device names and,
// without a configured Config.Key, the random segment key:
// "host:port/dev0,dev1[/key]" (PROTOCOL.md). In Mooncake mode it is the
// engine's RPC port (MooncakeMode.RPC).
func (t *Transport) Endpoint() string { return t.endpoint }

// SliceSize returns Config.SliceSize.
func (t *Transport) SliceSize() uint64 { return t.cfg.SliceSize }

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
	s := Stats{
		Slices: t.slices.Load(), PostCalls: t.postCalls.Load(), PollCalls: t.pollCalls.Load(),
		EmptyPolls: t.emptyPolls.Load(), Reconnects: t.reconnects.Load(), Evictions: t.evictions.Load(), QPs: n,
		ConnectFailures: t.connectFails.Load(),
	}
	if t.mc != nil {
		s.PeerQPs, s.PeerEvictions = t.mcPeerQPs(), t.mc.tgt.evictions.Load()
	}
	return s
}

// Close closes every endpoint (their slices in flight complete with
// ErrClosed), the control listener and the peers' queue pairs, and frees
// the devices.
func (t *Transport) Close() error {
	if t.closed.Swap(true) {
		return nil
	}
	if t.ln != nil {
		t.ln.Close()
	}
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
	t.mcCloseTargets()
	t.freeDevices()
	return nil
}
