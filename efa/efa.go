//go:build efa && cgo

// efa.go holds the Transport: its state and locks, New (the first
// provider that offers RMA on reliable datagram endpoints), what it
// publishes, the progress goroutine, and Close. The other ideas have a
// file each: slot.go (operation slots and their states), register.go
// (memory regions), peer.go (address vector entries), endpoint.go
// (Open, the probe, Update, Close), post.go, poll.go (completions and
// timeouts) and retry.go. This file's cgo preamble carries the link
// flags and the noescape/nocallback marks for the whole package.

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
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/transport"
)

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

	// guard is held shared by every call into libfabric on the endpoint
	// and address vector (mr_post, fi_av_insert, fi_mr_reg), and
	// exclusively by Close and an Endpoint's Close (both polling while
	// they wait: lockPolling), by Unregister (so that no Post uses an MR
	// being closed), and by the few changes that Post and retryDue must
	// not overlap: the timeout scan (expire), drop, reset, dropRetries.
	//
	// The data path (Post, Poll and all they call, Complete's re-entrant
	// Posts included) never waits for it: a post may stay inside the
	// provider until progress is made, on this side or the peer's, and a
	// goroutine waiting for the guard while that post holds it shared
	// would poll no more. Post and retryDue take it with TryRLock, and
	// take nothing while a writer holds it or waits for it (a waiting
	// writer fails TryRLock, so writers are not starved); the data path's
	// own writers take it with TryLock, or leave the work to a goroutine
	// that waits (soon, scan). cq_poll is not under it at all: see pollMu.
	guard sync.RWMutex
	// soonWaiting counts soon's goroutines not yet ended, soonWrote those
	// of them that took the guard (tests).
	soonWaiting, soonWrote atomic.Int64
	// pollMu keeps Close and Unregister from closing objects under a
	// cq_poll: Poll holds it shared around cq_poll. It is taken
	// exclusively only by holders of the guard's write lock, around their
	// calls into libfabric (Close, Unregister, and the address vector
	// changes of drop and reset): no post is in the provider then, so its
	// writer waits only for the cq_polls in progress, which never wait,
	// and Poll waits behind it for no post.
	pollMu   sync.RWMutex
	scanning atomic.Bool // a timeout scan waits for the guard (scan)
	closing  atomic.Bool // Close began: no new slices, registrations, endpoints
	closed   atomic.Bool // Close drained what it could: libfabric's objects go

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
	// The write lock waits out the posts in the provider while Polls (the
	// progress goroutine's, the engine's) go on, which such a post may be
	// waiting for; new Posts see closing. Then no cq_poll starts (closed)
	// and pollMu waits out those in progress.
	t.lockPolling()
	t.closed.Store(true)
	t.pollMu.Lock()
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
	t.pollMu.Unlock()
	t.guard.Unlock()
	// Only now: the progress goroutine polled while the write lock waited
	// for posts in the provider.
	t.StopProgress()
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

// lockPolling takes the guard's write lock, polling the transport until
// it has it: a post that holds the guard shared may wait inside the
// provider for progress on this side, and a transport with neither a
// progress goroutine nor an engine's pollers gets that only from the
// goroutine that waits here. The lock is asked for at once (a writer
// waiting holds new Posts back, so a stream of them cannot starve it);
// Poll does not need the guard.
func (t *Transport) lockPolling() {
	if t.guard.TryLock() {
		return
	}
	got := make(chan struct{})
	go func() {
		t.guard.Lock()
		close(got)
	}()
	for {
		select {
		case <-got:
			return
		default:
		}
		if t.Poll() == 0 {
			time.Sleep(20 * time.Microsecond)
		}
	}
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
