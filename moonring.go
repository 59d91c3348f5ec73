package moonring

// The engine: the names callers use from the lower packages, its errors,
// its configuration, New and Close. Its other parts are in rings.go,
// transports.go, register.go, staging.go, segment.go and batch.go.

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/rdma"
	"github.com/moonring/moonring/ring"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/topology"
	"github.com/moonring/moonring/transport"
)

// Types of the lower packages that callers use directly.
type (
	// Entry is a 64-byte submission descriptor; see sq.Entry.
	Entry = sq.Entry
	// Completion is a completion descriptor; see cq.Completion.
	Completion = cq.Completion
	// Op is an Entry's operation.
	Op = sq.Op
	// Ring is a submission/completion queue pair; see ring.Ring.
	Ring = ring.Ring
	// Status is a request's status word.
	Status = cq.Status
	// Code is a completion's error code.
	Code = cq.Code
	// BufferID names a registered local buffer.
	BufferID = segtable.BufferID
	// SegmentID names an opened segment.
	SegmentID = segtable.SegmentID
	// Location says where memory lives: "cpu:N" or "cuda:N".
	Location = segtable.Location
)

// FlagNotify on a WRITE Entry delivers a notification (Entry.Tag) to the
// target engine once the bytes are in its memory.
const FlagNotify = sq.FlagNotify

// Transport hints of an Entry: Entry.Transport is then the slot of the
// transport (Engine.TransportSlot). With FlagTransportOnly the request
// takes the segment's path through that transport or FAILs at once with
// ErrTransportDown (down, not open), and never fails over; with
// FlagTransportPrefer it takes that path while it is up, else the
// segment's current one.
const (
	FlagTransportOnly   = sq.FlagTransportOnly
	FlagTransportPrefer = sq.FlagTransportPrefer
)

// FlagList on a READ or WRITE Entry moves a run of a prepared list's
// blocks (Engine.PrepareList): Local is the ListID, Remote the index of
// the first block, Length the number of blocks. See sq.FlagList and
// ListEntry.
const FlagList = sq.FlagList

// Class is the priority class of a ring (RingConfig.Class) or of a batch
// task (TransferRequest.Class). A poller steps rings of a higher class
// first; while a higher-class ring of the same poller is busy (it took or
// completed a request in the last 100 µs, or has one in flight that moved
// in the last 10 ms), rings of lower classes start nothing new, to any
// peer, but for one request each Config.PromoteAfter they have waited (so
// they are never starved), and the copies a lower-class ring makes on the
// poller (in-process, shm) go in 64 KiB slices. Transports with queues of their own keep low-class streams out
// of a high-class request's way: tcp sends ClassHigh on a connection of its
// own. The zero value is ClassNormal.
type Class = transport.Class

// The classes.
const (
	ClassNormal = transport.ClassNormal
	ClassHigh   = transport.ClassHigh
	ClassLow    = transport.ClassLow
)

// Entry ops.
const (
	OpNop    = sq.Nop
	OpRead   = sq.Read
	OpWrite  = sq.Write
	OpCancel = sq.Cancel
)

// Status words, as in Mooncake's transfer engine.
const (
	WAITING   = cq.Waiting
	PENDING   = cq.Pending
	COMPLETED = cq.Completed
	TIMEOUT   = cq.Timeout
	FAILED    = cq.Failed
	CANCELED  = cq.Canceled
)

// LocalSegmentID names the engine's own memory.
const LocalSegmentID = segtable.LocalSegmentID

// Sentinel errors of requests (see package cq for their meaning).
var (
	ErrInvalid     = cq.ErrInvalid
	ErrBadBuffer   = cq.ErrBadBuffer
	ErrLocalRange  = cq.ErrLocalRange
	ErrBadSegment  = cq.ErrBadSegment
	ErrRemoteRange = cq.ErrRemoteRange
	ErrLength      = cq.ErrLength
	ErrTimeout     = cq.ErrTimeout
	ErrCanceled    = cq.ErrCanceled
	ErrTransport   = cq.ErrTransport
	ErrDenied      = cq.ErrDenied
	ErrNoTransport = cq.ErrNoTransport
	ErrQueueFull   = cq.ErrQueueFull
	// ErrTransportDown: a request that must take one transport found the
	// segment's path through it down or not open.
	ErrTransportDown = cq.ErrTransportDown
	// ErrClosed: the engine (or ring) is closed. Equals os.ErrClosed.
	ErrClosed = cq.ErrClosed
	// ErrSQFull: a submission queue is full; reap, then retry. It is
	// ErrQueueFull, also the code of batch tasks that could not be queued.
	ErrSQFull = ring.ErrSQFull
)

// Errors of the engine's methods.
var (
	// ErrBusy: requests in flight still use the buffer, segment or batch;
	// nothing was changed. Retry once they complete.
	ErrBusy = segtable.ErrBusy
	// ErrNotRegistered: the memory is not (exactly) a registered buffer.
	ErrNotRegistered = errors.New("moonring: memory not registered")
	// ErrRegistered: Free of memory that a registered buffer lies in;
	// unregister it first.
	ErrRegistered = errors.New("moonring: memory still registered")
	// ErrOverlap: a registration overlaps a registered buffer (or two of
	// one batch overlap); nothing was registered.
	ErrOverlap = segtable.ErrOverlap
	// ErrBadBatch: unknown or freed BatchID, or task index out of range.
	ErrBadBatch = errors.New("moonring: bad batch id or task")
	// ErrBatchFull: more requests than the batch was allocated for.
	ErrBatchFull = errors.New("moonring: batch full")
	// ErrTooManyBatches: Config.MaxBatches batches are allocated.
	ErrTooManyBatches = errors.New("moonring: too many batches")
	// ErrTransportExists: a transport with that name is installed.
	ErrTransportExists = errors.New("moonring: transport already installed")
	// ErrNoSuchTransport: no transport with that name is installed.
	ErrNoSuchTransport = errors.New("moonring: no such transport")
)

// Config configures an Engine. Zero fields take the defaults that String
// prints.
type Config struct {
	// Name is the engine's segment name (default: the p2p store's address
	// when Metadata is a metadata.P2P, else "<hostname>-<pid>-<n>-<8 random
	// hex digits>": processes of one host name in pid namespaces of their
	// own, containers on the host's network, have the same pids, and a
	// restarted process would meet the entry of the one it replaces, held
	// under its owner token until its time to live ends).
	Name string
	// Metadata is where the engine publishes its segment and looks up
	// others (default: a store shared by the engines of this process).
	Metadata metadata.Store
	// Key is the deployment's segment key, shared by every engine that may
	// reach this one (default: TCP.Key, else SHM.Key). With a key, the
	// engine signs the descriptor it publishes and takes a peer's
	// descriptor only if its signature holds under the key and its epoch
	// is not older than one seen (metadata.Signed): a party without the
	// key cannot point peers at another endpoint or buffer. It is also the
	// default key of the TCP and shm transports. Without one, descriptors
	// are neither signed nor checked, and New logs a warning.
	Key []byte
	// Transports, when not empty, lists the transport names OpenSegment may
	// use, in order of preference; by default any installed transport, in
	// transport.Priority order. A segment keeps a path through each that
	// reaches it (the first that opens, the others opened behind as
	// standbys) and new requests take the first that is up.
	Transports []string
	// Timeout is the default deadline of a request (default 30 s).
	Timeout time.Duration
	// SliceSize is the slice size for transports that name none (64 KiB).
	SliceSize uint64
	// RetryLimit is how many failed slices a request may retry (default 3;
	// negative: none).
	RetryLimit int
	// PollerSpin is how long pollers poll after their last work before they
	// park (default 20 µs; none while GOMAXPROCS is 1).
	PollerSpin time.Duration
	// BusyPoll keeps pollers polling forever: a core per poller.
	BusyPoll bool
	// Pollers is how many pollers each NUMA node may run (default 1, at
	// most 64). NewRing puts a ring on the node's poller with the fewest
	// open rings, starting another while fewer than Pollers run: a
	// workload whose entries keep one poller's core busy (a KV cache's
	// thousands of small blocks through nvlink cost about 370 ns each)
	// then goes faster through several rings. Each poller is a goroutine
	// that spins PollerSpin after its last work, then parks; while a
	// transport that must be polled has work out (nvlink's GPU copies)
	// every poller keeps polling it, so N pollers spin on N cores then. The
	// batch API's rings stay on a node's first poller.
	Pollers int
	// PromoteAfter is how long a ring waits behind a busy ring of a higher
	// class before it may start one request (see Class); default 1 ms.
	// Longer gives the higher class more of the machine under a lower
	// class's stream, and the stream less.
	PromoteAfter time.Duration
	// PinPollers pins each poller to the CPUs of its NUMA node.
	PinPollers bool
	// CopyWorkers is how many goroutines per poller share large batches
	// of memory copies (the local and shm transports': a batch of 256 KiB
	// or more, which one-slice requests of 16 KiB and up join rather than
	// be copied one at a time when more wait behind them) with it, each
	// taking a part (equal to the poller's, or more while they wait for
	// it) while the poller copies the rest: one copy
	// stream leaves memory bandwidth unused when blocks are scattered, as
	// a KV cache's are. Each polls for its next part for 100 µs after one
	// (none while GOMAXPROCS is 1), then parks. Requests in flight at
	// once are then copied in no set order (see ring's package doc).
	// Default: GOMAXPROCS-1, at most 3; negative: none.
	CopyWorkers int
	// MaxBatches bounds the batches allocated at once (default 1024).
	MaxBatches int
	// NotifyQueue is how many received notifications wait for the caller
	// (default 1024); beyond it a sender's notification fails, is retried
	// up to its RetryLimit, and then its request FAILs with ErrTransport.
	NotifyQueue int
	// Logger receives the engine's events (segments opened, peers that
	// republish, restart or go away; slices retried; requests that fail or
	// time out; the TCP transport's connections when its own Logger is
	// unset). Default: discard. Nothing is logged for a request that goes
	// well.
	Logger *slog.Logger
	// TCP, when set, installs the TCP transport with this configuration.
	TCP *tcp.Config
	// SHM, when set, installs the same-host shared-memory transport: peers
	// on this host are then reached through it rather than TCP (buffers
	// from Alloc are mapped by them; other memory goes through
	// process_vm_readv/writev), with TCP as the fallback.
	SHM *shm.Config
	// RDMA, when set, installs the ibverbs transport (a binary built with
	// cgo and the "rdma" tag). Where it cannot work (no such build, no
	// usable device) the engine logs why and goes on without it.
	RDMA *rdma.Config
	// EFA, when set, installs the libfabric transport (a binary built with
	// cgo and the "efa" tag), or logs why it cannot here and goes on.
	// With libfabric's software providers (tcp, shm) a target moves its
	// peers' bytes only while it polls: the engine's poller does, but
	// looks only every millisecond once idle; set Progress (with a
	// ProgressSleep) on such targets for prompt answers.
	EFA *efa.Config
	// Mooncake, when set, makes the engine speak the Mooncake Transfer
	// Engine's wire beside its own (Mooncake's TCP data protocol, its RPC
	// port, its descriptors; with Metadata nil, its P2PHANDSHAKE mode):
	// see MooncakeConfig, and its warning. Off by default.
	Mooncake *MooncakeConfig
	// BatchEntries sizes the SQ and in-flight table of the ring that serves
	// the batch API, per NUMA node (default 4096).
	BatchEntries int
	// HugeTLB makes Alloc take CPU memory whose size is a multiple of
	// 2 MiB from the kernel's reserved huge pages (vm.nr_hugepages or
	// vm.nr_overcommit_hugepages) while enough are free, and ordinary
	// pages otherwise. Reserved pages serve shared memory on any kernel,
	// where a memfd's transparent huge pages (what Alloc gives memory
	// that the shm transport hands to peers) depend on the kernel's
	// shmem_enabled, whose Debian default (never) gives none: a pool of
	// 4 KiB pages costs TCP and RDMA a TLB miss every 4 KiB. Off by
	// default: the reserved pages are the host's, set aside for whoever
	// asks for them first.
	HugeTLB bool
}

func (c *Config) fill() {
	if n, ok := c.Metadata.(interface{ Name() string }); ok && c.Name == "" {
		c.Name = n.Name() // a p2p store: the segment is named by its address
	}
	if c.Name == "" {
		host, _ := os.Hostname()
		var r [4]byte
		rand.Read(r[:])
		c.Name = fmt.Sprintf("%s-%d-%d-%x", host, os.Getpid(), engineSeq.Add(1), r)
	}
	if c.Metadata == nil {
		c.Metadata = processStore
	}
	if len(c.Key) == 0 && c.TCP != nil {
		c.Key = c.TCP.Key
	}
	if len(c.Key) == 0 && c.SHM != nil {
		c.Key = c.SHM.Key
	}
	if c.Timeout == 0 {
		c.Timeout = ring.DefaultTimeout
	}
	if c.SliceSize == 0 {
		c.SliceSize = ring.DefaultSliceSize
	}
	if c.RetryLimit == 0 {
		c.RetryLimit = ring.DefaultRetryLimit
	}
	if c.PollerSpin == 0 {
		c.PollerSpin = ring.DefaultSpin
	}
	if c.PromoteAfter == 0 {
		c.PromoteAfter = ring.DefaultPromote
	}
	if c.CopyWorkers == 0 {
		c.CopyWorkers = min(runtime.GOMAXPROCS(0)-1, 3)
	}
	if c.MaxBatches == 0 {
		c.MaxBatches = 1024
	}
	if c.Pollers == 0 {
		c.Pollers = 1
	}
	if c.BatchEntries == 0 {
		c.BatchEntries = 4096
	}
	if c.NotifyQueue == 0 {
		c.NotifyQueue = 1024
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
}

// String prints the effective configuration, one field per line.
func (c Config) String() string {
	c.fill()
	ts := "any installed, in order " + strings.Join(transport.Priority, " > ")
	if len(c.Transports) > 0 {
		ts = strings.Join(c.Transports, " > ")
	}
	if c.TCP != nil {
		tc, _ := c.TCP.Effective()
		ts += fmt.Sprintf("\ntcp: listen %s, %d rails, depth %d, slice %d, tls %v (pinned self-signed: %v), handshakes %d (%d per source), conns %d, idle %v",
			tc.Listen, tc.Rails, tc.Depth, tc.SliceSize, tc.TLS != nil || tc.AutoTLS, tc.AutoTLS, tc.MaxHandshakes, tc.MaxHandshakesPerSource, tc.MaxConns, tc.IdleTimeout)
		ts += fmt.Sprintf(", drive spin %v, same-host send buffer %d", tc.DriveSpin, tc.LoopbackSendBuffer)
	}
	if c.SHM != nil {
		ts += fmt.Sprintf("\nshm: same-host peers, no mapping %v", c.SHM.NoMap)
	}
	if c.EFA != nil {
		ts += fmt.Sprintf("\nefa: providers %v, progress goroutine %v", c.EFA.Providers, c.EFA.Progress)
	}
	if c.RDMA != nil {
		ts += fmt.Sprintf("\nrdma: listen %s, devices %v (in this build: %v)", c.RDMA.Listen, c.RDMA.Devices, rdma.Available)
	}
	if c.Mooncake != nil {
		ts += fmt.Sprintf("\nmooncake: ON, NO AUTHENTICATION on its ports: rpc %s, tcp data %s", orDefault(c.Mooncake.RPC.Listen, "127.0.0.1:0"), orDefault(c.Mooncake.TCP.Listen, "the rpc port's host, any port"))
		if c.Mooncake.RDMA != nil {
			ts += fmt.Sprintf(", rdma (handshake on the rpc port) devices %v (in this build: %v)", c.Mooncake.RDMA.Devices, rdma.Available)
		}
	} else {
		ts += "\nmooncake: off (Config.Mooncake speaks Mooncake's wire, without authentication)"
	}
	return fmt.Sprintf("name: %s\nmetadata: %s (descriptors signed: %v)\ntransports: %s\ntimeout: %v\nslice size: %d\nretry limit: %d\npollers a node: %d\npoller spin: %v\nbusy poll: %v\npin pollers: %v\ncopy workers: %d\npromote after: %v\nmax batches: %d\nbatch entries: %d\nnotify queue: %d\nreserved huge pages for Alloc: %v\n",
		c.Name, c.Metadata, len(c.Key) > 0, ts, c.Timeout, c.SliceSize, c.RetryLimit, c.Pollers, c.PollerSpin, c.BusyPoll, c.PinPollers, max(c.CopyWorkers, 0), c.PromoteAfter, c.MaxBatches, c.BatchEntries, c.NotifyQueue, c.HugeTLB)
}

var (
	engineSeq    atomic.Uint64
	processStore = metadata.NewMemory()
)

// Engine moves bytes between its registered buffers and the segments it
// opens. Use New. Safe for concurrent use.
type Engine struct {
	cfg   Config
	epoch uint64
	topo  *topology.Topology
	// store is cfg.Metadata, wrapped in a metadata.Signed with a key.
	store  metadata.Store
	signed *metadata.Signed
	// mooncake is Mooncake mode's RPC port and store (Config.Mooncake),
	// or nil; set once by New, guarded by mu.
	mooncake *mooncakeState

	mu         sync.Mutex // serializes registration, transports, segments, rings
	buffers    segtable.Buffers
	segments   segtable.Segments[transport.Endpoint]
	tables     ring.Tables
	lists      ring.Lists // prepared lists (lists.go)
	transports [segtable.MaxTransports]transport.Transport
	// tnames are the installed transports' names by slot, for readers
	// without mu (TransportSlot, the health manager's log lines).
	tnames atomic.Pointer[[segtable.MaxTransports]string]
	// health opens segments' standby paths, probes paths gone down and
	// fails back (failover.go).
	health     health
	local      *local.Transport
	self       *segtable.Segment[transport.Endpoint]
	pollers    map[pollerKey]*ring.Poller
	pollerList atomic.Pointer[[]*ring.Poller] // the values of pollers, for lock-free readers
	rings      map[*ring.Ring]openRing        // the caller's rings
	ringSeq    int
	watches    map[SegmentID]context.CancelFunc
	watchWG    sync.WaitGroup
	// stager, when a transport.Stager is installed (nvlink), moves device
	// memory over the other transports through arena, its pinned host
	// memory registered (local only) with every transport.
	stager     transport.Stager
	stagerSlot int
	arena      *segtable.Buffer
	closed     atomic.Bool

	batches batchTable
	notes   chan Notification
	// withdrawn is set by RemoveLocalSegment and cleared by
	// PublishLocalSegment; guarded by mu.
	withdrawn bool
	// pubEndpoints is the Endpoints map of the last descriptor published,
	// never changed once made: the next publish hands it on again while
	// the transports' endpoints are the same (publishEndpoints). Guarded
	// by mu.
	pubEndpoints map[string]string
	// retiring holds the memory of buffers whose transport unregister gave
	// up on its context: Free refuses it until Close. Guarded by mu.
	retiring []span
}

// span is a range of memory.
type span struct {
	addr   uintptr
	length uint64
}

// Notification is what a peer's WRITE with FlagNotify (or a
// TransferRequest with Notify) delivered to this engine: the peer's segment
// name, the tag and the message. The engine owns no part of it.
type Notification = transport.Notification

// Notifications returns the channel on which notifications from peers
// arrive, once the bytes of their request are in this engine's memory. The
// channel holds Config.NotifyQueue of them; while it is full, senders'
// notifications fail (retried up to their RetryLimit, then their requests
// FAIL). It is never closed.
func (e *Engine) Notifications() <-chan Notification { return e.notes }

// deliver queues a notification for Notifications, without blocking.
func (e *Engine) deliver(n *transport.Notification) error {
	select {
	case e.notes <- Notification{From: n.From, Tag: n.Tag, Msg: bytes.Clone(n.Msg)}:
		return nil
	default:
		return transport.ErrNotifyFull
	}
}

// New starts an engine with the in-process transport installed and
// publishes its (empty) segment.
func New(cfg Config) (*Engine, error) {
	p2p, err := cfg.mooncakeStore() // before fill, which names the engine after it
	if err != nil {
		return nil, err
	}
	cfg.fill()
	if cfg.MaxBatches < 1 || cfg.MaxBatches > 1<<16-1 || cfg.BatchEntries < 2 || cfg.NotifyQueue < 1 || cfg.Pollers < 1 || cfg.Pollers > maxPollers {
		closeStore(p2p)
		return nil, fmt.Errorf("moonring: bad config: MaxBatches %d (1..65535), BatchEntries %d, NotifyQueue %d, Pollers %d (1..%d)", cfg.MaxBatches, cfg.BatchEntries, cfg.NotifyQueue, cfg.Pollers, maxPollers)
	}
	topo, err := topology.Discover()
	if err != nil {
		closeStore(p2p)
		return nil, fmt.Errorf("moonring: %w", err)
	}
	e := &Engine{
		cfg:     cfg,
		epoch:   uint64(time.Now().UnixNano()),
		topo:    topo,
		pollers: map[pollerKey]*ring.Poller{},
		rings:   map[*ring.Ring]openRing{},
		watches: map[SegmentID]context.CancelFunc{},
		local:   local.New(),
		notes:   make(chan Notification, cfg.NotifyQueue),
	}
	if cfg.Mooncake != nil {
		e.mooncake = &mooncakeState{p2p: p2p} // Close closes the store from here on
	}
	e.store = cfg.Metadata
	if len(cfg.Key) > 0 {
		if e.signed, err = metadata.NewSigned(cfg.Metadata, cfg.Key, cfg.Logger); err != nil {
			closeStore(p2p)
			return nil, fmt.Errorf("moonring: %w", err)
		}
		if cfg.Mooncake != nil {
			mooncakeSigned(e.signed)
		}
		e.store = e.signed
	} else {
		cfg.Logger.Warn("moonring: no segment key: descriptors are neither signed nor checked (set Config.Key or TCP.Key)", "segment", cfg.Name)
	}
	e.local.SetNotify(cfg.Name, e.deliver)
	e.health.init(e)
	e.tables = ring.Tables{Buffers: &e.buffers, Segments: &e.segments, Lists: &e.lists, PathDown: e.health.pathDown}
	e.buffers.Busy = func(b *segtable.Buffer) bool { return e.inFlight(b, nil) }
	e.segments.Busy = func(s *segtable.Segment[transport.Endpoint]) bool { return e.inFlight(nil, s) }
	e.transports[0] = e.local
	e.refreshNames()
	e.self = e.segments.SetLocal(cfg.Name, e.desc(false), 0, e.local.SliceSize(), e.local.Self())
	if err := e.publish(); err != nil {
		e.health.stop()
		e.local.Close()
		closeStore(p2p)
		return nil, err
	}
	e.batches.init(e, cfg.MaxBatches)
	if cfg.TCP != nil {
		tc := *cfg.TCP
		if len(tc.Key) == 0 {
			tc.Key = cfg.Key
		}
		if tc.Logger == nil {
			tc.Logger = cfg.Logger
		}
		t, err := tcp.New(tc)
		if err := e.install(tcp.Name, t, err, false); err != nil {
			e.Close()
			return nil, err
		}
	}
	if cfg.SHM != nil {
		sc := *cfg.SHM
		if len(sc.Key) == 0 {
			sc.Key = cfg.Key // one segment key for the deployment
		}
		if sc.Logger == nil {
			sc.Logger = cfg.Logger
		}
		t, err := shm.New(sc)
		if err := e.install(shm.Name, t, err, false); err != nil {
			e.Close()
			return nil, err
		}
	}
	if cfg.RDMA != nil {
		t, err := rdma.New(*cfg.RDMA)
		if err := e.install(rdma.Name, t, err, true); err != nil {
			e.Close()
			return nil, err
		}
	}
	if cfg.EFA != nil {
		t, err := efa.New(*cfg.EFA)
		if err := e.install(efa.Name, t, err, true); err != nil {
			e.Close()
			return nil, err
		}
	}
	if cfg.Mooncake != nil {
		if err := e.startMooncake(p2p); err != nil {
			e.Close()
			return nil, err
		}
	}
	return e, nil
}

// Config returns the engine's effective configuration.
func (e *Engine) Config() Config { return e.cfg }

// Name returns the engine's segment name.
func (e *Engine) Name() string { return e.cfg.Name }

// Topology returns what the engine found of the machine.
func (e *Engine) Topology() *topology.Topology { return e.topo }

// Close stops the engine. Requests in flight complete with ErrClosed, rings
// and segments close, the segment is withdrawn from the store, transports
// close and buffers are unregistered. Close is idempotent.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed.Swap(true) {
		e.mu.Unlock()
		return nil
	}
	rings := e.rings
	e.rings = nil
	e.mu.Unlock()

	var err error
	for r := range rings {
		r.Close()
	}
	e.batches.close()
	e.health.stop() // no probe adds or replaces a path from here on
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, cancel := range e.watches {
		cancel()
	}
	e.segments.Each(func(s *segtable.Segment[transport.Endpoint]) { closePaths(s) })
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.Timeout)
	defer cancel()
	if derr := e.store.Delete(ctx, e.cfg.Name, e.epoch); derr != nil && !errors.Is(derr, metadata.ErrNotFound) {
		err = errors.Join(err, derr)
	}
	for i, t := range e.transports {
		if t != nil {
			err = errors.Join(err, t.Close())
			e.transports[i] = nil
		}
	}
	err = errors.Join(err, e.stopMooncake())
	e.refreshNames()
	for _, p := range e.pollers {
		p.Stop()
	}
	for _, b := range e.buffers.All() {
		// Pollers are stopped and transports closed: nothing touches the
		// memory any more.
		e.buffers.Unregister(context.Background(), b.ID)
	}
	e.watchWG.Wait()
	return err
}
