//go:build efa && cgo

package efa

/*
#cgo LDFLAGS: -lfabric
#cgo noescape mr_post
#cgo nocallback mr_post
#cgo noescape cq_poll
#cgo nocallback cq_poll
#include "shim.h"
*/
import "C"

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// chunk is how many slices one cgo call posts, and how many completions one
// Poll reads at most.
const chunk = 64

// Slot states. A slot is one operation's struct fi_context2 (in C memory)
// and the Go record beside it.
const (
	slotFree      = iota
	slotBusy      // posted; its completion is still to come
	slotAbandoned // completed to the engine already (timeout, Close); the provider still holds it
	slotRetry     // failed as if its connection broke; Poll posts it again when due
	slotExpiring  // expire is failing it, for a few instructions: then abandoned (or busy again)
)

// slot is the Go record of one operation. Post writes token, c, ep and
// posted, then publishes them with the store of state; whoever moves state
// from slotBusy with a CAS (Poll, the timeout scan, Close) owns the record
// and completes the slice, exactly once.
type slot struct {
	state  atomic.Uint32
	ep     atomic.Pointer[Endpoint]
	posted atomic.Int64 // UnixNano of the Post
	c      transport.Completer
	token  uint64
	gen    uint64      // the peer's generation at the Post
	peer   *peer       // the peer posted to; counted in its ops while busy or abandoned
	keys   *[]keyRange // the endpoint's keys at the Post, which op's rkey and raddr came from
	op     C.mr_op     // what was posted, for retries
	tries  int         // retries so far
	due    int64       // UnixNano when the retry is due
	failed int64       // UnixNano of the first failure, which started the retries
}

// Retries of operations that failed as if their connection broke: at
// most maxTries, the n-th retryDelay<<(2n) after the failure.
const (
	maxTries   = 4
	retryDelay = time.Millisecond
)

// peer is one remote fabric address in the address vector. When an
// operation to it fails as if the connection broke, the address is
// removed and inserted again (a new generation), so that a provider that
// connects underneath (tcp;ofi_rxm) starts a fresh connection for the
// retries instead of failing them on the broken one.
//
// Endpoints to the same endpoint string share one peer. It leaves the
// address vector and Transport.peers once no endpoint uses it (users) and
// the provider holds no operation to it (ops); see drop.
type peer struct {
	key  string        // its key in Transport.peers: the endpoint string
	name []byte        // the provider address
	addr atomic.Uint64 // fi_addr_t
	gen  atomic.Uint64
	// users counts the endpoints whose peer this is (Open, Update), and
	// changes under peerMu only; the completion path reads it without.
	users atomic.Int32
	// ops counts the slots holding an operation posted to addr that the
	// provider has not returned: busy ones and abandoned ones (a timeout
	// or Close failed their slices, but the provider still holds them).
	// It rises only under guard's read lock, and never once gone is set
	// (see drop).
	ops atomic.Int64
	// gone is set, under peerMu and guard's write lock, when addr left the
	// address vector (drop) or the transport closed: nothing may be
	// posted to addr, nor reset, after.
	gone atomic.Bool
	// stalled is the UnixNano of the first Post that the provider refused
	// with -FI_EAGAIN without taking anything since; 0 when none.
	stalled atomic.Int64
	// full is 1 + the transport's Poll count when the provider last took
	// nothing for the peer; 0 when it took something since. Until the
	// next Poll (which is what frees the provider's queue) Post does not
	// try again: on a busy machine a spinning poster would otherwise burn
	// the time the progress it waits for needs.
	full atomic.Uint64
	// budget is how many operations the provider took for the peer before
	// its last -FI_EAGAIN, doubled after every Post it took whole (0: no
	// limit). Post prepares no more than that: shm, for one, takes one
	// 4 KiB WRITE at a time, and preparing 64 to undo 63 cost more than
	// the provider's own work.
	budget atomic.Int32
}

// Transport moves slices with libfabric RMA on one FI_EP_RDM endpoint that
// all peers share. Use New. Safe for concurrent use.
type Transport struct {
	cfg      Config
	res      *C.fi_res // C memory: libfabric's objects
	prov     string
	endpoint string
	virt     bool // FI_MR_VIRT_ADDR: remote addresses are virtual, else offsets
	provKey  bool // FI_MR_PROV_KEY: the provider picks MR keys
	maxMsg   uint64
	strAddr  bool // FI_ADDR_STR: addresses are NUL-terminated strings
	nameLen  int  // the length of a fabric address, when not a string

	// guard is held shared by every call into libfabric on the endpoint,
	// completion queue and address vector, and exclusively by Close and
	// by Unregister (so that no Post uses an MR being closed).
	guard   sync.RWMutex
	closing atomic.Bool // Close began: no new slices, registrations, endpoints
	closed  atomic.Bool // Close drained what it could: libfabric's objects go

	regMu  sync.Mutex                // serializes changes of regs
	regSeq uint64                    // the last Registration handle, under regMu
	regs   atomic.Pointer[[]*region] // sorted by handle

	ctxs    unsafe.Pointer // C array of len(slots) fi_context2
	ctxSize uintptr
	slots   []slot
	freeMu  sync.Mutex
	free    []uint32 // indices of free slots, a stack

	lastScan atomic.Int64  // UnixNano of the last timeout scan
	polls    atomic.Uint64 // Poll calls, for peer.full

	retryMu sync.Mutex
	retries []uint32     // slots in slotRetry, under retryMu
	nretry  atomic.Int64 // len(retries)

	peerMu sync.Mutex
	peers  map[string]*peer // by endpoint string, shared by Endpoints; under peerMu; see drop

	scratch   unsafe.Pointer // C memory that Open's probe reads into
	scratchMR *C.struct_fid_mr

	stop     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
}

// region is one registered buffer.
type region struct {
	handle uint64
	addr   uint64
	length uint64
	mr     *C.struct_fid_mr
	desc   uint64 // fi_mr_desc, for FI_MR_LOCAL providers
}

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Poller    = (*Transport)(nil)
)

// errStages names the steps of fi_setup, for errors.
var errStages = [...]string{"fi_getinfo", "fi_fabric", "fi_domain", "fi_av_open", "fi_cq_open", "fi_endpoint", "fi_ep_bind", "fi_enable", "fi_getname"}

// New opens the first of cfg.Providers that libfabric offers with RMA on
// reliable datagram endpoints. When none works the error wraps
// transport.ErrNotSupported.
func New(cfg Config) (*Transport, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	res := (*C.fi_res)(C.calloc(1, C.sizeof_fi_res))
	if res == nil {
		return nil, errors.New("efa: out of C memory")
	}
	cqSize := cfg.Depth
	if cqSize == 0 {
		cqSize = 4096
	}
	var errs []error
	for _, p := range cfg.Providers {
		cp := C.CString(p)
		var cd *C.char
		if cfg.Domain != "" {
			cd = C.CString(cfg.Domain)
		}
		var stage C.int
		rc := C.fi_setup(res, cp, cd, C.int(cqSize), &stage)
		C.free(unsafe.Pointer(cp))
		C.free(unsafe.Pointer(cd))
		if rc == 0 {
			t, err := newTransport(cfg, res)
			if err != nil {
				C.fi_teardown(res)
				C.free(unsafe.Pointer(res))
				return nil, err
			}
			return t, nil
		}
		errs = append(errs, fmt.Errorf("provider %q: %s: %s", p, errStages[min(int(stage), len(errStages)-1)], fiStrerror(int(rc))))
	}
	C.free(unsafe.Pointer(res))
	return nil, fmt.Errorf("efa: %w: %w", transport.ErrNotSupported, errors.Join(errs...))
}

func newTransport(cfg Config, res *C.fi_res) (*Transport, error) {
	mode := uint64(res.mr_mode)
	if mode&C.FI_MR_RAW != 0 || res.key_size > 8 {
		return nil, fmt.Errorf("efa: provider %s: MR keys of %d bytes: %w", C.GoString(&res.prov[0]), res.key_size, transport.ErrNotSupported)
	}
	if cfg.Depth == 0 {
		cfg.Depth = int(min(max(uint64(res.tx_size), 16), 4096))
	}
	t := &Transport{
		cfg:     cfg,
		res:     res,
		prov:    C.GoString(&res.prov[0]),
		virt:    mode&C.FI_MR_VIRT_ADDR != 0,
		provKey: mode&C.FI_MR_PROV_KEY != 0,
		maxMsg:  uint64(res.max_msg),
		strAddr: res.addr_format == C.FI_ADDR_STR,
		nameLen: int(res.namelen),
		peers:   map[string]*peer{},
		stop:    make(chan struct{}),
	}
	t.cfg.SliceSize = min(cfg.SliceSize, t.maxMsg)
	t.endpoint = formatEndpoint(t.prov, C.GoBytes(unsafe.Pointer(&res.name[0]), C.int(res.namelen)))
	t.ctxSize = C.sizeof_struct_fi_context2
	t.ctxs = C.calloc(C.size_t(cfg.Depth), C.size_t(t.ctxSize))
	if t.ctxs == nil {
		return nil, errors.New("efa: out of C memory")
	}
	t.slots = make([]slot, cfg.Depth)
	t.free = make([]uint32, cfg.Depth)
	for i := range t.free {
		t.free[i] = uint32(cfg.Depth - 1 - i)
	}
	t.scratch = C.calloc(1, 64)
	var key, desc C.uint64_t
	if t.scratch == nil || C.fi_reg(res, C.uint64_t(uintptr(t.scratch)), 64, C.FI_READ|C.FI_WRITE, 1, &t.scratchMR, &key, &desc) != 0 {
		C.free(t.ctxs)
		C.free(t.scratch)
		return nil, errors.New("efa: cannot register the probe's scratch memory")
	}
	rs := []*region{{handle: 0, addr: uint64(uintptr(t.scratch)), length: 64, mr: t.scratchMR, desc: uint64(desc)}}
	t.regs.Store(&rs)
	t.lastScan.Store(time.Now().UnixNano())
	if cfg.Progress {
		t.wg.Add(1)
		go t.progress()
	}
	return t, nil
}

// Name returns "efa".
func (t *Transport) Name() string { return Name }

// Provider returns the libfabric provider in use ("efa", "tcp;ofi_rxm",
// "shm", ...).
func (t *Transport) Provider() string { return t.prov }

// Endpoint returns the provider's name and the endpoint's fabric address,
// which peers insert into their address vectors on Open.
func (t *Transport) Endpoint() string { return t.endpoint }

// SliceSize returns the configured slice size, capped by the provider's
// max_msg_size.
func (t *Transport) SliceSize() uint64 { return t.cfg.SliceSize }

// Depth returns how many slices may be in flight at once.
func (t *Transport) Depth() int { return len(t.slots) }

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
	if rc := C.fi_unreg(r.mr); rc != 0 {
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

// Open inserts the peer's address into the address vector (once per peer,
// shared by its endpoints, until the last of them closes) and returns an
// endpoint with the keys of desc.
// When desc publishes a buffer with a valid key, Open first reads one
// byte of it, polling, until ctx ends: that proves the peer answers, and
// lets a provider that connects underneath (tcp;ofi_rxm) connect before
// the first Post. The error wraps ErrUnreachable when the peer does not.
func (t *Transport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	if t.closed.Load() {
		return nil, fmt.Errorf("efa: open %s: %w", desc.Name, transport.ErrClosed)
	}
	p, err := t.peer(desc.Endpoints[Name])
	if err != nil {
		return nil, fmt.Errorf("efa: open %s: %w", desc.Name, err)
	}
	e := &Endpoint{t: t, name: desc.Endpoints[Name]}
	e.peer.Store(p)
	e.setKeys(desc)
	if err := e.probe(ctx); err != nil {
		e.Close()
		return nil, fmt.Errorf("efa: open %s: %w", desc.Name, err)
	}
	return e, nil
}

// probeTries is how many times Open probes a peer whose probe failed as
// if its connection broke (each time after the retries of the slice
// itself): a connection that other operations' faults tear down (a
// forged key makes tcp;ofi_rxm's target drop it) cancels the probe too.
const probeTries = 3

// probe reads one byte of the first buffer with a valid key into the
// transport's scratch memory and waits for it; it probes again, up to
// probeTries times, while the read fails with ErrPeer.
func (e *Endpoint) probe(ctx context.Context) error {
	var err error
	for range probeTries {
		if err = e.probeOnce(ctx); !errors.Is(err, transport.ErrPeer) {
			return err
		}
	}
	return err
}

func (e *Endpoint) probeOnce(ctx context.Context) error {
	var kr *keyRange
	for i, k := range *e.keys.Load() {
		if k.ok {
			kr = &(*e.keys.Load())[i]
			break
		}
	}
	if kr == nil {
		return nil
	}
	pc := &probeCompleter{done: make(chan error, 1)}
	s := []transport.Slice{{Op: transport.Read, LocalHandle: 0, Local: e.t.scratch, Remote: kr.addr, Length: 1, Token: 1}}
	for {
		n, err := e.Post(pc, s)
		if err != nil {
			return err
		}
		if n == 1 {
			break
		}
		if err := e.pollWait(ctx, nil); err != nil {
			return fmt.Errorf("probe not accepted: %w: %w", transport.ErrUnreachable, err)
		}
	}
	if err := e.pollWait(ctx, pc.done); err != nil {
		return fmt.Errorf("probe: %w: %w", transport.ErrUnreachable, err)
	}
	if err := <-pc.done; err != nil {
		return fmt.Errorf("probe: %w: %w", transport.ErrUnreachable, err)
	}
	return nil
}

// pollWait polls until done has a value (without taking it), or, when
// done is nil, for one round; it fails when ctx ends first.
func (e *Endpoint) pollWait(ctx context.Context, done chan error) error {
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		if e.t.closing.Load() {
			return transport.ErrClosed
		}
		if done != nil && len(done) > 0 {
			return nil
		}
		if e.t.Poll() == 0 {
			time.Sleep(20 * time.Microsecond)
		}
		if done == nil {
			return nil
		}
	}
}

type probeCompleter struct{ done chan error }

func (p *probeCompleter) Complete(_ uint64, err error) { p.done <- err }

// peer returns the peer that published ep, inserting its address into the
// address vector the first time.
func (t *Transport) peer(ep string) (*peer, error) {
	prov, addr, err := parseEndpoint(ep)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w: %w", ep, transport.ErrUnreachable, err)
	}
	if prov != t.prov {
		return nil, fmt.Errorf("peer on provider %q, this transport on %q: %w", prov, t.prov, transport.ErrUnreachable)
	}
	if t.strAddr {
		// A string address: one NUL, at the end, and printable before.
		for i, c := range addr {
			if (c == 0) != (i == len(addr)-1) || (c != 0 && (c < ' ' || c > '~')) {
				return nil, fmt.Errorf("address %q: %w: %w", addr, transport.ErrUnreachable, errBadDesc)
			}
		}
	} else if len(addr) != t.nameLen {
		return nil, fmt.Errorf("address of %d bytes, want %d: %w: %w", len(addr), t.nameLen, transport.ErrUnreachable, errBadDesc)
	}
	t.peerMu.Lock()
	defer t.peerMu.Unlock()
	if p, ok := t.peers[ep]; ok {
		p.users.Add(1)
		return p, nil
	}
	t.guard.RLock()
	defer t.guard.RUnlock()
	if t.closed.Load() {
		return nil, transport.ErrClosed
	}
	p := &peer{key: ep, name: addr}
	a, err := t.insert(addr)
	if err != nil {
		return nil, err
	}
	p.addr.Store(a)
	p.users.Store(1)
	t.peers[ep] = p
	return p, nil
}

// unuse gives back an endpoint's use of p (from peer), and drops p when it
// was the last.
func (t *Transport) unuse(p *peer) {
	t.peerMu.Lock()
	last := p.users.Add(-1) == 0
	t.peerMu.Unlock()
	if last {
		t.drop(p)
	}
}

// drop removes p's address from the address vector, and p from
// t.peers, when no endpoint uses p and the provider holds no operation to
// it; otherwise it does nothing, and the last of those to go calls it
// again (unuse, or the completion that brings ops to 0).
//
// Why wait for ops: libfabric leaves undefined what becomes of operations
// in progress to a removed address (fi_av(3)); the software providers free
// the AV index at once for the next fi_av_insert to reuse, shm unmaps the
// peer's region, and rxm (FI_AV_REMOVE_CLEANUP) frees the connection the
// operations are queued on. An operation still held, abandoned ones
// included, could then land at, or be retried to, another peer at the
// same fi_addr. Once the provider returned every context for the address,
// nothing refers to it any more. A peer whose operation the provider
// never returns stays, as that operation's slot does, until Close.
//
// ops rises only under guard's read lock: in Post, for the peer of an
// endpoint found open (which holds a use of it: Close marks the endpoint
// closed, and Update swaps its peer, before giving the use up); in
// retryDue, for a peer not gone. drop checks ops and sets gone under the
// write lock, after users fell to 0: any such section either ended before
// (its operations counted, or undone by their completion or by itself,
// which then calls drop again) or starts after, and finds the endpoint
// closed, another peer in it, or p gone. Endpoints are closed and updated
// seldom, so the write lock costs the data path little.
func (t *Transport) drop(p *peer) {
	t.peerMu.Lock()
	defer t.peerMu.Unlock()
	if p.users.Load() != 0 || p.gone.Load() {
		return // used again (Open of the same endpoint), or dropped already
	}
	t.guard.Lock()
	defer t.guard.Unlock()
	if p.ops.Load() != 0 {
		return
	}
	if !t.closed.Load() {
		t.remove(p) // after Close the entry went with the address vector
	}
	t.forget(p)
}

// remove takes p's address out of the address vector; a failure leaves
// nothing to undo (the entry goes with the vector at Close). The caller
// holds the guard exclusively, and the transport is not closed.
func (t *Transport) remove(p *peer) {
	C.fi_remove(t.res, C.uint64_t(p.addr.Load()))
}

// forget marks p gone, its address out of the vector, and takes it out of
// t.peers. The caller holds peerMu.
func (t *Transport) forget(p *peer) {
	p.gone.Store(true)
	delete(t.peers, p.key)
}

// returned counts one operation to p as returned by the provider, and
// reports whether p may be dropped now (its caller then calls drop, with
// no lock held).
func (p *peer) returned() bool {
	return p.ops.Add(-1) == 0 && p.users.Load() == 0
}

// opsDone counts n operations to p as returned by the provider (or never
// posted), and drops p when they were the last and no endpoint uses it.
// The caller holds no lock.
func (t *Transport) opsDone(p *peer, n int64) {
	if p.ops.Add(-n) == 0 && p.users.Load() == 0 {
		t.drop(p)
	}
}

// insert puts addr into the address vector; the caller holds guard.
func (t *Transport) insert(addr []byte) (uint64, error) {
	buf := C.CBytes(addr)
	defer C.free(buf)
	var a C.uint64_t
	if rc := C.fi_insert(t.res, buf, &a); rc != 0 {
		return 0, fmt.Errorf("fi_av_insert: %s: %w", fiStrerror(int(rc)), transport.ErrUnreachable)
	}
	return uint64(a), nil
}

// reset gives p a fresh address vector entry, unless an operation of a
// later generation already did. It holds the guard exclusively, as drop
// does: Post and retryDue load a peer's fi_addr and post to it under the
// read side, and tcp;ofi_rxm dereferences a NULL peer when an operation
// names an address that has left the vector.
func (t *Transport) reset(p *peer, gen uint64) {
	t.peerMu.Lock()
	defer t.peerMu.Unlock()
	if p.gen.Load() != gen || p.gone.Load() {
		return // a later generation reset it, or its address left the AV (drop)
	}
	t.guard.Lock()
	defer t.guard.Unlock()
	if t.closed.Load() {
		return
	}
	t.remove(p)
	a, err := t.insert(p.name)
	if err != nil {
		// The old address has left the vector and no new one came:
		// the peer is gone (Post fails its slices with ErrPeer), and
		// the next Open, or Update of an endpoint using it, inserts
		// the address afresh.
		t.forget(p)
		return
	}
	p.addr.Store(a)
	p.gen.Add(1)
}

// StopProgress stops the goroutine that Config.Progress started, and
// waits for it; nothing polls the transport afterwards unless its user
// calls Poll. Close stops it as well.
func (t *Transport) StopProgress() {
	t.stopOnce.Do(func() { close(t.stop) })
	t.wg.Wait()
}

// Close fails every slice in flight with ErrClosed, closes all endpoints,
// and releases the provider's objects.
func (t *Transport) Close() error {
	if t.closing.Swap(true) {
		return nil
	}
	// Let the slices in flight finish first, for up to Config.Linger:
	// a peer may be moving bytes of this side's memory for them.
	deadline := time.Now().Add(t.cfg.Linger)
	for t.busy() && time.Now().Before(deadline) {
		if t.Poll() == 0 {
			time.Sleep(20 * time.Microsecond)
		}
	}
	t.StopProgress()
	t.closed.Store(true)
	t.guard.Lock()
	for _, r := range t.regList() {
		C.fi_unreg(r.mr) // the scratch MR among them
	}
	C.fi_teardown(t.res)
	var done []completion
	for i := range t.slots {
		s := &t.slots[i]
		if s.state.CompareAndSwap(slotBusy, slotFree) || s.state.CompareAndSwap(slotRetry, slotFree) {
			if e := s.ep.Load(); e != nil {
				e.inflight.Add(-1)
			}
			done = append(done, completion{s.c, s.token, errClosed})
		}
	}
	C.free(t.ctxs)
	C.free(t.scratch)
	C.free(unsafe.Pointer(t.res))
	t.ctxs, t.res, t.scratch = nil, nil, nil
	t.guard.Unlock()
	// fi_teardown closed the address vector, and every entry with it.
	// (peerMu is taken after the guard, never under it: peer and drop
	// take them the other way round.)
	t.peerMu.Lock()
	for _, p := range t.peers {
		p.gone.Store(true)
	}
	clear(t.peers)
	t.peerMu.Unlock()
	for _, d := range done {
		d.c.Complete(d.token, d.err)
	}
	return nil
}

var errClosed = fmt.Errorf("efa: %w", transport.ErrClosed)

// busy reports whether a slice is in flight.
func (t *Transport) busy() bool {
	for i := range t.slots {
		if st := t.slots[i].state.Load(); st == slotBusy || st == slotRetry {
			return true
		}
	}
	return false
}

// completion is a Complete call to make once no lock is held.
type completion struct {
	c     transport.Completer
	token uint64
	err   error
}

// Poll reads up to 64 completions from the completion queue in one cgo
// call (which is also what makes a software provider progress peers'
// operations on this side), completes their slices, and fails slices
// older than Config.Timeout. It returns how many slices it completed.
// Safe for concurrent use; pollers of the engine call it.
func (t *Transport) Poll() int {
	polls := t.polls.Add(1)
	var ents [chunk]C.cq_ent
	t.guard.RLock()
	if t.closed.Load() {
		t.guard.RUnlock()
		return 0
	}
	n := int(C.cq_poll(t.res, &ents[0], chunk))
	base := uintptr(t.ctxs) // under the guard: Close clears it
	t.guard.RUnlock()
	nd := 0
	if n > 0 {
		nd = t.deliver(ents[:n], base)
	}
	if t.nretry.Load() > 0 {
		nd += t.retryDue()
	}
	if t.cfg.Timeout > 0 && polls%64 == 0 { // Add's own value: concurrent pollers could all miss a multiple of 64
		now := time.Now().UnixNano()
		last := t.lastScan.Load()
		if now-last > int64(min(t.cfg.Timeout/4, time.Second)) && t.lastScan.CompareAndSwap(last, now) {
			nd += t.expire(now-int64(t.cfg.Timeout), nil, errTimeout)
		}
	}
	return nd
}

// deliver completes the slices of the completion entries ents (queueing
// those to retry), and returns how many it completed. base is the address
// of the operation contexts when the entries were read.
func (t *Transport) deliver(ents []C.cq_ent, base uintptr) int {
	var (
		done  [chunk]completion
		retry [chunk]uint32
		idle  [chunk]*peer // peers that may be dropped now
	)
	nd, nr, ni := 0, 0, 0
	// returned counts s's operation as given back by the provider and
	// notes its peer when that was the peer's last use.
	returned := func(s *slot) {
		if s.peer.returned() {
			idle[ni] = s.peer
			ni++
		}
	}
	{
		var freed [chunk]uint32
		nf := 0
		for _, ent := range ents {
			off := uintptr(ent.ctx) - base
			i := off / t.ctxSize
			if uintptr(ent.ctx) < base || off%t.ctxSize != 0 || i >= uintptr(len(t.slots)) {
				continue // not ours: a provider bug; nothing to complete
			}
			s := &t.slots[i]
			var err error
			retryable := false
			if ent.err != 0 {
				err = cqError(int(ent.err), int(ent.perr))
				// An operation that failed as if its connection broke
				// is posted once more, on a fresh connection: RMA is
				// idempotent, and tcp;ofi_rxm fails the operations that
				// follow a broken connection until it connects again.
				// (Retried enough, it fails: the state never leaves
				// busy, so a Close sweeping at once cannot see it twice.)
				retryable = errors.Is(err, transport.ErrPeer) && s.tries < maxTries && !s.ep.Load().closed.Load()
			}
			switch s.claim(retryable) {
			case slotAbandoned:
				// Timed out or closed meanwhile: the slice was failed
				// there; this was the provider's last word.
				returned(s)
				s.peer = nil
				freed[nf] = uint32(i)
				nf++
				continue
			case slotRetry:
				// The provider is done with it: retryDue counts it
				// again, for the peer it posts it to.
				returned(s)
				retry[nr] = uint32(i)
				nr++
				continue
			case slotBusy:
			default:
				continue // not the provider's: a provider bug
			}
			returned(s)
			s.peer = nil
			e := s.ep.Load()
			e.inflight.Add(-1)
			if e.closed.Load() || t.closing.Load() {
				err = errClosed
			}
			done[nd] = completion{s.c, s.token, err}
			s.c = nil
			nd++
			freed[nf] = uint32(i)
			nf++
		}
		t.release(freed[:nf])
	}
	if nr > 0 {
		t.queueRetries(retry[:nr])
	}
	// Before the slices complete: whoever waits on them then finds the
	// peers that they were the last use of gone.
	for _, p := range idle[:ni] {
		t.drop(p)
	}
	for _, d := range done[:nd] {
		d.c.Complete(d.token, d.err)
	}
	return nd
}

var errPeerGone = fmt.Errorf("efa: the peer's address could not be inserted again after a failure: %w", transport.ErrPeer)

var errStalled = fmt.Errorf("efa: the provider took no operation for the peer within the timeout: %w", transport.ErrPeer)

var errTimeout = fmt.Errorf("efa: no completion from the provider within the timeout: %w", transport.ErrPeer)

// claim is how deliver takes slot s whose operation the provider returned:
// busy becomes free (the caller completes the slice; slotBusy returned) or,
// with retry, slotRetry (slotRetry returned); abandoned becomes free
// (slotAbandoned returned: the slice was completed already). An expire
// holding the slot (slotExpiring) lets it go within a few instructions,
// and claim waits for that. Any other state is returned as it is.
func (s *slot) claim(retry bool) uint32 {
	to := uint32(slotFree)
	if retry {
		to = slotRetry
	}
	for {
		switch st := s.settle(); st {
		case slotAbandoned:
			if s.state.CompareAndSwap(slotAbandoned, slotFree) {
				return slotAbandoned
			}
		case slotBusy:
			if s.state.CompareAndSwap(slotBusy, to) {
				if retry {
					return slotRetry
				}
				return slotBusy
			}
		default:
			return st
		}
	}
}

// reclaim takes back slot s, which retryDue holds but did not post (set
// busy, or left in slotRetry when its peer was gone): with wait it goes
// back to slotRetry (slotRetry returned), else it is freed for the caller
// to fail its slice (slotBusy returned); if expire failed it meanwhile it
// is freed (slotAbandoned returned).
func (s *slot) reclaim(wait bool) uint32 {
	for {
		switch st := s.settle(); st {
		case slotBusy:
			if wait && s.state.CompareAndSwap(slotBusy, slotRetry) {
				return slotRetry
			}
			if !wait && s.state.CompareAndSwap(slotBusy, slotFree) {
				return slotBusy
			}
		case slotRetry:
			if s.state.CompareAndSwap(slotRetry, slotFree) {
				return slotBusy
			}
		case slotAbandoned:
			if s.state.CompareAndSwap(slotAbandoned, slotFree) {
				return slotAbandoned
			}
		default:
			return st
		}
	}
}

// settle waits until no expire holds s, and returns s's state then.
func (s *slot) settle() uint32 {
	for {
		if st := s.state.Load(); st != slotExpiring {
			return st
		}
		runtime.Gosched()
	}
}

// queueRetries resets the peers of the slots in idx (in slotRetry) and
// queues the slots for Poll to post again when due.
func (t *Transport) queueRetries(idx []uint32) {
	now := time.Now().UnixNano()
	for _, i := range idx {
		s := &t.slots[i]
		if s.tries == 0 {
			// The peer the operation went to: after an Update, the
			// endpoint's peer is another, whose generations s.gen
			// does not count.
			t.reset(s.peer, s.gen)
			s.failed = now
		}
		s.due = now + int64(retryDelay)<<(2*s.tries)
		s.tries++
	}
	t.retryMu.Lock()
	t.retries = append(t.retries, idx...)
	t.nretry.Store(int64(len(t.retries)))
	t.retryMu.Unlock()
}

// retryDue posts the queued retries that are due; those it cannot post it
// completes, and counts.
func (t *Transport) retryDue() int {
	var (
		idx  [chunk]uint32
		ops  [chunk]C.mr_op
		done [chunk]completion
	)
	now := time.Now().UnixNano()
	n := 0
	t.retryMu.Lock()
	for k := 0; k < len(t.retries) && n < chunk; {
		i := t.retries[k]
		if t.slots[i].due > now {
			k++
			continue
		}
		idx[n] = i
		n++
		t.retries[k] = t.retries[len(t.retries)-1]
		t.retries = t.retries[:len(t.retries)-1]
	}
	t.nretry.Store(int64(len(t.retries)))
	t.retryMu.Unlock()
	if n == 0 {
		return 0
	}
	var (
		at   [chunk]uint8 // ops[j] is the slot idx[at[j]]
		ok   [chunk]bool  // idx[k]'s operation was posted
		wait [chunk]bool  // idx[k]'s operation waits for room at the provider
		idle [chunk]*peer // peers that may be dropped now
	)
	ni := 0
	t.guard.RLock()
	m := 0
	if !t.closed.Load() {
		for k, i := range idx[:n] {
			s := &t.slots[i]
			// The endpoint's peer now (Update may have replaced the one
			// that failed), loaded under the guard: see drop. A gone one
			// (its address left the AV) gets nothing: the slot fails
			// below, with ErrClosed when the endpoint closed.
			e := s.ep.Load()
			p := e.peer.Load()
			if p.gone.Load() || e.closed.Load() {
				continue
			}
			// Its rkey and remote address came from the keys of the
			// Post: after an Update (a restarted peer whose Go heap,
			// and provider-chosen keys, may well look the same) they
			// could name other memory. It fails instead, with ErrPeer,
			// and its caller's retry resolves it again.
			if e.keys.Load() != s.keys {
				continue
			}
			s.peer = p
			s.gen = p.gen.Load()
			s.op.dest = C.uint64_t(p.addr.Load())
			s.op.rc = 0
			ops[m] = s.op
			at[m] = uint8(k)
			m++
			p.ops.Add(1)
			s.posted.Store(now)
			s.state.Store(slotBusy)
		}
	}
	posted := 0
	if m > 0 {
		posted = int(C.mr_post(t.res, &ops[0], C.size_t(m)))
	}
	for j := 0; j < m; j++ {
		if j < posted && ops[j].rc == 0 {
			ok[at[j]] = true
			continue
		}
		s := &t.slots[idx[at[j]]]
		// Not taken (the provider's queue is full, as tcp;ofi_rxm's is
		// while it connects again): it waits for room, within the
		// timeout that counts from the failure.
		wait[at[j]] = j >= posted && (t.cfg.Timeout < 0 || now-s.failed < int64(t.cfg.Timeout)) // < 0: no timeout
		if p := s.peer; p.returned() {
			idle[ni] = p
			ni++
		}
	}
	nd, nf, nw := 0, 0, 0
	var freed, waiting [chunk]uint32
	for k, i := range idx[:n] {
		if ok[k] {
			continue
		}
		s := &t.slots[i]
		switch s.reclaim(wait[k]) {
		case slotRetry:
			s.peer = nil
			s.due = now + int64(retryDelay)
			waiting[nw] = i
			nw++
			continue
		case slotAbandoned:
			// Endpoint.Close expired it, and completed its slice: the
			// provider never had it, so no completion will free the
			// slot; free it here.
			s.peer = nil
			freed[nf] = i
			nf++
			continue
		case slotBusy:
		default:
			continue
		}
		s.peer = nil
		e := s.ep.Load()
		e.inflight.Add(-1)
		err := errPeerRetry
		if t.closed.Load() || e.closed.Load() {
			err = errClosed
		}
		done[nd] = completion{s.c, s.token, err}
		s.c = nil
		nd++
		freed[nf] = i
		nf++
	}
	if nw > 0 {
		t.retryMu.Lock()
		t.retries = append(t.retries, waiting[:nw]...)
		t.nretry.Store(int64(len(t.retries)))
		t.retryMu.Unlock()
	}
	t.guard.RUnlock()
	t.release(freed[:nf])
	for _, p := range idle[:ni] {
		t.drop(p)
	}
	for _, d := range done[:nd] {
		d.c.Complete(d.token, d.err)
	}
	return nd
}

var errPeerRetry = fmt.Errorf("efa: operation failed, and could not be posted again on a fresh connection: %w", transport.ErrPeer)

// expire abandons the busy slots posted before cutoff (of endpoint e when
// not nil) and completes them with err. The provider still holds them: they
// become free when their completion comes, or at Close.
//
// It scans under the guard's write lock: Post and retryDue hold it shared
// from marking their slots busy until those are posted or taken back (a
// plain store to free), so every busy slot the scan sees is the
// provider's. (Without it, a scan could fail a slot that Post then gave
// back as not taken: the slice completed and posted again, or lost.)
func (t *Transport) expire(cutoff int64, e *Endpoint, err error) int {
	var done []completion
	t.guard.Lock()
	for i := range t.slots {
		s := &t.slots[i]
		if s.state.Load() != slotBusy || s.posted.Load() >= cutoff || (e != nil && s.ep.Load() != e) {
			continue
		}
		// Hold the slot while reading it: the provider may return the
		// operation at any moment, and deliver would free the slot and
		// Post reuse it under a plain abandoned state.
		if !s.state.CompareAndSwap(slotBusy, slotExpiring) {
			continue
		}
		if s.posted.Load() >= cutoff || (e != nil && s.ep.Load() != e) {
			s.state.Store(slotBusy) // reused since the check above
			continue
		}
		s.ep.Load().inflight.Add(-1)
		done = append(done, completion{s.c, s.token, err})
		s.c = nil
		s.state.Store(slotAbandoned)
	}
	t.guard.Unlock()
	for _, d := range done {
		d.c.Complete(d.token, d.err)
	}
	return len(done)
}

// dropRetries fails with ErrClosed the slots of e that wait to be posted
// again (slotRetry, on the retry list): no completion from the provider
// will come for them. Under the guard's write lock, which retryDue holds
// shared while it posts or takes back the retries it popped; those it
// takes back it fails itself, with ErrClosed, as e is closed.
func (t *Transport) dropRetries(e *Endpoint) {
	var (
		done  []completion
		freed []uint32
	)
	t.guard.Lock()
	t.retryMu.Lock()
	k := 0
	for _, i := range t.retries {
		s := &t.slots[i]
		if s.ep.Load() != e || !s.state.CompareAndSwap(slotRetry, slotFree) {
			t.retries[k] = i
			k++
			continue
		}
		e.inflight.Add(-1)
		done = append(done, completion{s.c, s.token, errClosed})
		s.c, s.peer = nil, nil
		freed = append(freed, i)
	}
	t.retries = t.retries[:k]
	t.nretry.Store(int64(k))
	t.retryMu.Unlock()
	t.guard.Unlock()
	t.release(freed)
	for _, d := range done {
		d.c.Complete(d.token, d.err)
	}
}

// take pops up to len(dst) free slots into dst and returns how many.
func (t *Transport) take(dst []uint32) int {
	t.freeMu.Lock()
	n := min(len(dst), len(t.free))
	copy(dst, t.free[len(t.free)-n:])
	t.free = t.free[:len(t.free)-n]
	t.freeMu.Unlock()
	return n
}

func (t *Transport) release(idx []uint32) {
	if len(idx) == 0 {
		return
	}
	t.freeMu.Lock()
	t.free = append(t.free, idx...)
	t.freeMu.Unlock()
}

func (t *Transport) progress() {
	defer t.wg.Done()
	idle := time.Now()
	for {
		select {
		case <-t.stop:
			return
		default:
		}
		if t.Poll() > 0 {
			idle = time.Now()
			continue
		}
		if t.cfg.ProgressSleep > 0 && time.Since(idle) > 50*time.Microsecond {
			time.Sleep(t.cfg.ProgressSleep)
		} else {
			runtime.Gosched()
		}
	}
}

// Endpoint is the way to one peer segment: the peer's fabric address and
// the keys of its buffers. Safe for concurrent use.
type Endpoint struct {
	t        *Transport
	name     string                     // the endpoint string peer came from, under mu
	peer     atomic.Pointer[peer]       // a restarted peer's is swapped in by Update
	keys     atomic.Pointer[[]keyRange] // sorted by addr
	closed   atomic.Bool
	inflight atomic.Int64
	mu       sync.Mutex // serializes Update
}

// keyRange is one of the peer's buffers as its descriptor published it.
type keyRange struct {
	addr, length uint64
	key          uint64
	delta        uint64 // subtracted from addresses: 0, or the base for offset-addressed MRs
	ok           bool   // the key parsed and names this very buffer
}

var _ transport.Endpoint = (*Endpoint)(nil)

// Rails returns 1: one libfabric endpoint carries every slice; the
// provider spreads them over its own paths.
func (e *Endpoint) Rails() int { return 1 }

// Update takes the buffers and keys of desc, and the peer's new address
// when it restarted; the old address leaves the address vector once no
// endpoint uses it and its operations in flight are over. Safe for
// concurrent use.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	e.mu.Lock()
	defer e.mu.Unlock()
	// The keys first, then the peer: Post loads the peer, then the keys,
	// so it never pairs the new peer with the old keys (a restarted peer,
	// its Go heap at the same addresses and provider-chosen keys the
	// same small numbers, could take an old key for a new buffer). The
	// other mix, the old peer with the new keys, fails at the old peer.
	e.setKeys(desc)
	// A closed endpoint gave its peer up (Close) and takes no other: it
	// would never give that one up. A gone peer (its address could not be
	// inserted again after a reset) is replaced even by the same address.
	if ep := desc.Endpoints[Name]; (ep != e.name || e.peer.Load().gone.Load()) && !e.closed.Load() {
		if p, err := e.t.peer(ep); err == nil {
			old := e.peer.Swap(p)
			e.name = ep
			e.t.unuse(old) // after the swap: see drop
		}
	}
}

func (e *Endpoint) setKeys(desc *segtable.SegmentDesc) {
	ks := make([]keyRange, 0, len(desc.Buffers))
	for _, b := range desc.Buffers {
		if b.Length == 0 || b.Addr+b.Length < b.Addr {
			continue
		}
		kr := keyRange{addr: b.Addr, length: b.Length}
		if k, err := parseKey(b.Keys[Name]); err == nil && k.base == b.Addr && k.length == b.Length {
			kr.key, kr.ok = k.key, true
			if !e.t.virt {
				kr.delta = k.base
			}
		}
		ks = append(ks, kr)
	}
	slices.SortFunc(ks, func(x, y keyRange) int { return cmpU64(x.addr, y.addr) })
	e.keys.Store(&ks)
}

// lookup returns the key range holding [addr, addr+n).
func lookup(ks []keyRange, addr, n uint64) (*keyRange, bool) {
	i, j := 0, len(ks)
	for i < j {
		h := int(uint(i+j) >> 1)
		if ks[h].addr+ks[h].length > addr {
			j = h
		} else {
			i = h + 1
		}
	}
	if i == len(ks) || addr < ks[i].addr || n == 0 || n > ks[i].length || addr-ks[i].addr > ks[i].length-n {
		return nil, false
	}
	return &ks[i], true
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

var (
	errNotify   = fmt.Errorf("efa: notifications are not carried: %w", errors.Join(transport.ErrDenied, transport.ErrNotSupported))
	errRange    = fmt.Errorf("efa: %w", transport.ErrRange)
	errDenied   = fmt.Errorf("efa: no valid key for the range: %w", transport.ErrDenied)
	errLocal    = fmt.Errorf("efa: local range outside its registration: %w", transport.ErrRange)
	errTooLarge = fmt.Errorf("efa: slice longer than the provider's max_msg_size: %w", transport.ErrRange)
)

// Post posts the slices as fi_writemsg / fi_readmsg, one cgo call per 64
// slices. Slices that cannot be valid (range in no published buffer, no
// valid key, unknown local handle) are completed at once with an error. It
// accepts fewer slices when every slot is in flight or the provider's
// queue is full (-FI_EAGAIN): Poll frees both.
func (e *Endpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	t := e.t
	if len(s) == 0 {
		return 0, nil
	}
	if t.closing.Load() || e.closed.Load() {
		return 0, errClosed
	}
	if f := e.peer.Load().full.Load(); f != 0 && f == t.polls.Load()+1 {
		return 0, nil // the provider's queue is full until the next Poll
	}
	done := 0
	for done < len(s) {
		n, more, err := e.post(c, s[done:min(len(s), done+chunk)])
		done += n
		if err != nil || !more {
			return done, err
		}
	}
	return done, nil
}

// post posts at most chunk slices, and says whether the provider and the
// slots may take more.
func (e *Endpoint) post(c transport.Completer, s []transport.Slice) (int, bool, error) {
	t := e.t
	var (
		ops   [chunk]C.mr_op
		at    [chunk]uint8  // ops[j] is the slice s[at[j]]
		idx   [chunk]uint32 // the slots taken
		fails [chunk]failure
	)
	nf := 0
	p := e.peer.Load()
	if f := p.full.Load(); f != 0 && f == t.polls.Load()+1 && !t.closing.Load() && !e.closed.Load() {
		return 0, false, nil // the provider's queue is full until the next Poll
	}
	if b := int(p.budget.Load()); b > 0 && b < len(s) {
		s = s[:b]
	}
	t.guard.RLock()
	if t.closing.Load() || e.closed.Load() {
		t.guard.RUnlock()
		return 0, false, errClosed
	}
	// Again under the guard, which is what keeps drop from removing the
	// peer's address while its operations are counted and posted: an
	// Update since may have replaced the peer, and given it up.
	p = e.peer.Load()
	if p.gone.Load() {
		// Its address left the vector and could not come back (reset).
		t.guard.RUnlock()
		return 0, false, errPeerGone
	}
	nslots := t.take(idx[:len(s)])
	if nslots == 0 {
		t.guard.RUnlock()
		return 0, false, nil
	}
	regs := t.regList()
	kp := e.keys.Load()
	ks := *kp
	gen := p.gen.Load()
	dest := C.uint64_t(p.addr.Load())
	now := time.Now().UnixNano()
	var last *region
	end := len(s) // where the slots ran out
	m := 0
	for i := range s {
		sl := &s[i]
		var err error
		var kr *keyRange
		var r *region
		switch {
		case sl.Op == transport.Notify:
			err = errNotify
		case sl.Op != transport.Read && sl.Op != transport.Write:
			err = errRange
		case sl.Length > t.maxMsg:
			err = errTooLarge
		}
		if err == nil {
			var ok bool
			if kr, ok = lookup(ks, sl.Remote, sl.Length); !ok {
				err = errRange
			} else if !kr.ok {
				err = errDenied
			}
		}
		if err == nil {
			if last != nil && last.handle == sl.LocalHandle {
				r = last
			} else if r = findRegion(regs, sl.LocalHandle); r != nil {
				last = r
			}
			local := uint64(uintptr(sl.Local))
			if r == nil || local < r.addr || sl.Length > r.length || local-r.addr > r.length-sl.Length {
				err = errLocal
			}
		}
		if err != nil {
			fails[nf] = failure{i, err}
			nf++
			continue
		}
		if m == nslots {
			end = i
			break
		}
		k := idx[m]
		sp := &t.slots[k]
		sp.c, sp.token, sp.gen, sp.tries, sp.peer, sp.keys = c, sl.Token, gen, 0, p, kp
		sp.ep.Store(e)
		ops[m] = C.mr_op{
			local: C.uint64_t(uintptr(sl.Local)),
			len:   C.uint64_t(sl.Length),
			desc:  C.uint64_t(r.desc),
			raddr: C.uint64_t(sl.Remote - kr.delta),
			rkey:  C.uint64_t(kr.key),
			dest:  dest,
			ctx:   C.uint64_t(uintptr(t.ctxs) + uintptr(k)*t.ctxSize),
			op:    C.uint32_t(sl.Op),
		}
		sp.op = ops[m]
		sp.posted.Store(now)
		sp.state.Store(slotBusy)
		e.inflight.Add(1)
		at[m] = uint8(i)
		m++
	}
	posted := 0
	if m > 0 {
		// Counted before the provider has them: their completions may
		// come before mr_post returns.
		p.ops.Add(int64(m))
		posted = int(C.mr_post(t.res, &ops[0], C.size_t(m)))
	}
	accepted := end
	stall := false
	if posted < m {
		accepted = int(at[posted])
		since := p.stalled.Load()
		if posted > 0 {
			p.stalled.Store(0)
		} else if p.full.Store(t.polls.Load() + 1); since == 0 {
			p.stalled.Store(now)
		} else if t.cfg.Timeout > 0 && now-since > int64(t.cfg.Timeout) {
			// The provider has taken nothing for this peer for a whole
			// timeout (tcp;ofi_rxm does so while it cannot connect):
			// the slices fail as a broken peer's would.
			stall = true
			accepted = end
			for j := posted; j < m; j++ {
				fails[nf] = failure{int(at[j]), errStalled}
				nf++
			}
		}
	} else if m > 0 && p.stalled.Load() != 0 {
		p.stalled.Store(0)
	}
	if posted > 0 && p.full.Load() != 0 {
		p.full.Store(0)
	}
	if posted < m {
		p.budget.Store(int32(max(posted, 1)))
	} else if b := p.budget.Load(); b > 0 && m == int(b) {
		if b *= 2; b >= chunk {
			b = 0
		}
		p.budget.Store(b)
	}
	// Undo what was not posted, and free what failed to post, while the
	// guard still keeps Close from sweeping the slots.
	undone := int64(0)
	for j := 0; j < m; j++ {
		if j < posted && ops[j].rc == 0 {
			continue
		}
		sp := &t.slots[idx[j]]
		sp.state.Store(slotFree)
		sp.c, sp.peer = nil, nil
		e.inflight.Add(-1)
		undone++
		if j < posted {
			fails[nf] = failure{int(at[j]), postError(int(ops[j].rc))}
			nf++
		}
	}
	t.guard.RUnlock()
	if undone > 0 {
		t.opsDone(p, undone)
	}
	if stall {
		p.stalled.Store(0)
		t.reset(p, gen)
	}
	// Give back the slots not holding a posted operation.
	var back [chunk]uint32
	nb := 0
	for j := 0; j < nslots; j++ {
		if j >= posted || ops[j].rc != 0 {
			back[nb] = idx[j]
			nb++
		}
	}
	t.release(back[:nb])
	// Complete the failures among the accepted slices.
	for _, f := range fails[:nf] {
		if f.i < accepted {
			c.Complete(s[f.i].Token, f.err)
		}
	}
	return accepted, accepted > 0 && posted == m && end == len(s), nil
}

// failure is a slice that Post completes with an error.
type failure struct {
	i   int // in the posted slices
	err error
}

// Close refuses new slices and waits, polling, up to Config.Linger for
// the endpoint's slices in flight to complete; those it still sees then
// are failed with ErrClosed. Every slice of the endpoint that completes
// after Close began completes with ErrClosed. The peer's address leaves
// the address vector once no endpoint uses it and the provider holds no
// operation to it (see Transport.drop). Safe for concurrent use.
func (e *Endpoint) Close() error {
	if e.closed.Swap(true) {
		return nil
	}
	t := e.t
	deadline := time.Now().Add(t.cfg.Linger)
	for e.inflight.Load() > 0 && !t.closed.Load() && time.Now().Before(deadline) {
		if t.Poll() == 0 {
			time.Sleep(20 * time.Microsecond)
		}
	}
	// A Post that saw the endpoint open may still hold the guard, its
	// slots busy but not yet posted or undone: it finishes before the
	// write lock is granted, and a Post after it sees closed. Then the
	// slots that expire abandons are the provider's alone.
	t.guard.Lock()
	t.guard.Unlock()
	if e.inflight.Load() > 0 {
		t.expire(time.Now().UnixNano()+1, e, errClosed)
		t.dropRetries(e)
	}
	// Under mu, so that an Update in progress does not swap in a peer
	// after this gave up the one it saw.
	e.mu.Lock()
	t.unuse(e.peer.Load())
	e.mu.Unlock()
	return nil
}
