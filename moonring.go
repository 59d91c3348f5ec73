package moonring

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/internal/mem"
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
	// when Metadata is a metadata.P2P, else "<hostname>-<pid>-<n>").
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
	// transport.Priority order.
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
	// BusyPoll keeps pollers polling forever: one core per NUMA node.
	BusyPoll bool
	// PinPollers pins each poller to the CPUs of its NUMA node.
	PinPollers bool
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
	// BatchEntries sizes the SQ and in-flight table of the ring that serves
	// the batch API, per NUMA node (default 4096).
	BatchEntries int
}

func (c *Config) fill() {
	if n, ok := c.Metadata.(interface{ Name() string }); ok && c.Name == "" {
		c.Name = n.Name() // a p2p store: the segment is named by its address
	}
	if c.Name == "" {
		host, _ := os.Hostname()
		c.Name = fmt.Sprintf("%s-%d-%d", host, os.Getpid(), engineSeq.Add(1))
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
	if c.MaxBatches == 0 {
		c.MaxBatches = 1024
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
	return fmt.Sprintf("name: %s\nmetadata: %s (descriptors signed: %v)\ntransports: %s\ntimeout: %v\nslice size: %d\nretry limit: %d\npoller spin: %v\nbusy poll: %v\npin pollers: %v\nmax batches: %d\nbatch entries: %d\nnotify queue: %d\n",
		c.Name, c.Metadata, len(c.Key) > 0, ts, c.Timeout, c.SliceSize, c.RetryLimit, c.PollerSpin, c.BusyPoll, c.PinPollers, c.MaxBatches, c.BatchEntries, c.NotifyQueue)
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

	mu         sync.Mutex // serializes registration, transports, segments, rings
	buffers    segtable.Buffers
	segments   segtable.Segments[transport.Endpoint]
	tables     ring.Tables
	transports [segtable.MaxTransports]transport.Transport
	local      *local.Transport
	self       *segtable.Segment[transport.Endpoint]
	pollers    map[int]*ring.Poller
	pollerList atomic.Pointer[[]*ring.Poller] // the values of pollers, for lock-free readers
	rings      map[*ring.Ring]int             // the caller's rings and their numbers (metrics labels)
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
	cfg.fill()
	if cfg.MaxBatches < 1 || cfg.MaxBatches > 1<<16-1 || cfg.BatchEntries < 2 || cfg.NotifyQueue < 1 {
		return nil, fmt.Errorf("moonring: bad config: MaxBatches %d (1..65535), BatchEntries %d, NotifyQueue %d", cfg.MaxBatches, cfg.BatchEntries, cfg.NotifyQueue)
	}
	topo, err := topology.Discover()
	if err != nil {
		return nil, fmt.Errorf("moonring: %w", err)
	}
	e := &Engine{
		cfg:     cfg,
		epoch:   uint64(time.Now().UnixNano()),
		topo:    topo,
		pollers: map[int]*ring.Poller{},
		rings:   map[*ring.Ring]int{},
		watches: map[SegmentID]context.CancelFunc{},
		local:   local.New(),
		notes:   make(chan Notification, cfg.NotifyQueue),
	}
	e.store = cfg.Metadata
	if len(cfg.Key) > 0 {
		if e.signed, err = metadata.NewSigned(cfg.Metadata, cfg.Key, cfg.Logger); err != nil {
			return nil, fmt.Errorf("moonring: %w", err)
		}
		e.store = e.signed
	} else {
		cfg.Logger.Warn("moonring: no segment key: descriptors are neither signed nor checked (set Config.Key or TCP.Key)", "segment", cfg.Name)
	}
	e.local.SetNotify(cfg.Name, e.deliver)
	e.tables = ring.Tables{Buffers: &e.buffers, Segments: &e.segments}
	e.buffers.Busy = func(b *segtable.Buffer) bool { return e.inFlight(b, nil) }
	e.segments.Busy = func(s *segtable.Segment[transport.Endpoint]) bool { return e.inFlight(nil, s) }
	e.transports[0] = e.local
	e.self = e.segments.SetLocal(cfg.Name, e.desc(false), 0, 0, e.local.Self())
	if err := e.publish(); err != nil {
		e.local.Close()
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
	return e, nil
}

// install installs a transport the configuration asked for, given what
// its constructor returned; a transport that InstallTransport refuses is
// closed. An optional one that cannot work here (err wraps
// transport.ErrNotSupported) is left out with a warning in the log.
func (e *Engine) install(name string, t transport.Transport, err error, optional bool) error {
	if optional && errors.Is(err, transport.ErrNotSupported) {
		e.cfg.Logger.Warn("moonring: transport not available; going on without it", "transport", name, "reason", err)
		return nil
	}
	if err == nil {
		if err = e.InstallTransport(t); err != nil && !e.has(t) {
			t.Close() // refused; one installed whose publish failed is the engine's to close
		}
	}
	if err != nil {
		return fmt.Errorf("moonring: %s transport: %w", name, err)
	}
	return nil
}

// has reports whether t is installed.
func (e *Engine) has(t transport.Transport) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Contains(e.transports[:], t)
}

// Config returns the engine's effective configuration.
func (e *Engine) Config() Config { return e.cfg }

// Name returns the engine's segment name.
func (e *Engine) Name() string { return e.cfg.Name }

// Topology returns what the engine found of the machine.
func (e *Engine) Topology() *topology.Topology { return e.topo }

// desc builds the engine's descriptor: remote-accessible buffers only for
// peers, every buffer for the local segment. mu must be held (or the engine
// not yet shared).
func (e *Engine) desc(remoteOnly bool) *segtable.SegmentDesc {
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: e.cfg.Name, Epoch: e.epoch, Endpoints: map[string]string{}}
	for _, t := range e.transports {
		if t != nil {
			d.Endpoints[t.Name()] = t.Endpoint()
		}
	}
	for _, b := range e.buffers.All() {
		if (remoteOnly && !b.Remote) || b == e.arena {
			continue // the staging arena is no request's to name
		}
		bd := segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length, Location: string(b.Location), Keys: map[string]string{}}
		for slot, t := range e.transports {
			if r := b.Regs[slot].Load(); t != nil && r != nil && r.Key != "" {
				bd.Keys[t.Name()] = r.Key
			}
		}
		d.Buffers = append(d.Buffers, bd)
	}
	return d
}

// publish refreshes the local segment's descriptor and republishes the
// engine's segment, unless RemoveLocalSegment withdrew it. mu must be held
// (or the engine not yet shared).
func (e *Engine) publish() error {
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.Timeout)
	defer cancel()
	return e.publishCtx(ctx)
}

func (e *Engine) publishCtx(ctx context.Context) error {
	e.self.SetDesc(e.desc(false))
	if e.withdrawn {
		return nil
	}
	if err := e.store.Put(ctx, e.desc(true)); err != nil {
		return fmt.Errorf("moonring: publish segment %q to %s: %w", e.cfg.Name, e.cfg.Metadata, err)
	}
	return nil
}

// poller returns the poller of a NUMA node, starting it. mu must be held.
func (e *Engine) poller(node int) *ring.Poller {
	if n, ok := e.topo.Node(node); !ok || n.ID != node {
		node = 0
	}
	if p := e.pollers[node]; p != nil {
		return p
	}
	pc := ring.PollerConfig{Spin: e.cfg.PollerSpin, Busy: e.cfg.BusyPoll}
	if n, ok := e.topo.Node(node); ok && e.cfg.PinPollers {
		pc.CPUs, pc.Pin = n.CPUs, topology.PinThread
	}
	p := ring.NewPoller(pc)
	for _, t := range e.transports {
		if h, ok := t.(transport.Poller); ok {
			p.AddHook(h)
		}
	}
	e.pollers[node] = p
	list := make([]*ring.Poller, 0, len(e.pollers))
	for _, p := range e.pollers {
		list = append(list, p)
	}
	e.pollerList.Store(&list)
	return p
}

// inFlight reports whether a request of any ring names buf or seg.
func (e *Engine) inFlight(buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint]) bool {
	if ps := e.pollerList.Load(); ps != nil {
		for _, p := range *ps {
			if p.Uses(buf, seg) {
				return true
			}
		}
	}
	return false
}

// nodeOf returns the NUMA node of a location: N for "cpu:N", else 0. It
// runs per request, so it does not call Location.Parse, whose fmt.Sscanf
// allocates; registered locations are valid, hence canonical.
func nodeOf(loc Location) int {
	if n, ok := strings.CutPrefix(string(loc), "cpu:"); ok {
		if idx, err := strconv.Atoi(n); err == nil && idx >= 0 {
			return idx
		}
	}
	return 0
}

// RingConfig sizes a ring made by NewRing. Zero fields take the defaults.
type RingConfig struct {
	// Entries is the SQ size, a power of two (default 256).
	Entries int
	// CQEntries is the CQ size, a power of two (default 2*Entries).
	CQEntries int
	// MaxInFlight bounds requests in flight (default Entries).
	MaxInFlight int
	// Node is the NUMA node whose poller drains the ring (default 0).
	Node int
}

// NewRing returns a ring drained by the poller of cfg.Node. The caller owns
// it and closes it; Engine.Close closes rings still open.
func (e *Engine) NewRing(cfg RingConfig) (*Ring, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return nil, ErrClosed
	}
	r, err := ring.New(ring.Config{
		Entries: cfg.Entries, CQEntries: cfg.CQEntries, MaxInFlight: cfg.MaxInFlight,
		SliceSize: e.cfg.SliceSize, RetryLimit: e.cfg.RetryLimit, Timeout: e.cfg.Timeout, Logger: e.cfg.Logger,
	}, &e.tables, e.poller(cfg.Node))
	if err != nil {
		return nil, fmt.Errorf("moonring: new ring: %w", err)
	}
	for old := range e.rings {
		if old.Closed() { // closed by their owner: Close need not see them
			delete(e.rings, old)
		}
	}
	e.ringSeq++
	e.rings[r] = e.ringSeq
	return r, nil
}

// InstallTransport adds t: every registered buffer is registered with it,
// the engine's segment republished with its endpoint, and OpenSegment may
// choose it from then on. The engine owns t and closes it. When only that
// publish fails, t stays installed (and the engine's) and the error says
// so. The first
// transport.Stager installed (nvlink) stages device memory over the other
// transports from then on: for segments opened after it, and for buffers
// whenever registered.
func (e *Engine) InstallTransport(t transport.Transport) error {
	if t == nil {
		return fmt.Errorf("moonring: install a nil transport: %w", ErrInvalid)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return ErrClosed
	}
	slot := -1
	for i, x := range e.transports {
		if x != nil && x.Name() == t.Name() {
			return fmt.Errorf("moonring: install %s: %w", t.Name(), ErrTransportExists)
		}
		if x == nil && slot < 0 {
			slot = i
		}
	}
	if slot < 0 {
		return fmt.Errorf("moonring: install %s: %d transports installed already", t.Name(), segtable.MaxTransports)
	}
	if n, ok := t.(transport.Notifier); ok {
		n.SetNotify(e.cfg.Name, e.deliver)
	}
	if w, ok := t.(transport.Waker); ok {
		w.SetWake(e.wakePollers)
	}
	bufs := e.buffers.All()
	for i, b := range bufs {
		if !transport.Serves(t, b.Location) {
			continue
		}
		reg, err := t.Register(b)
		if err != nil {
			for _, b := range bufs[:i] {
				e.unregisterFrom(t, slot, b)
			}
			return fmt.Errorf("moonring: install %s: register buffer %d: %w", t.Name(), b.ID, err)
		}
		b.Regs[slot].Store(&reg)
	}
	e.transports[slot] = t
	if st, ok := t.(transport.Stager); ok && e.stager == nil {
		e.startStaging(st, slot)
	}
	for _, b := range e.buffers.All() {
		e.stage(b)
	}
	if h, ok := t.(transport.Poller); ok {
		for _, p := range e.pollers {
			p.AddHook(h)
		}
		// A transport that needs polling gets it even in an engine that
		// has no ring yet (a pure target: libfabric's software providers
		// move peers' bytes only while the target polls). The new poller
		// takes the hooks of every installed transport.
		if len(e.pollers) == 0 {
			e.poller(0)
		}
	}
	if err := e.publish(); err != nil {
		return fmt.Errorf("moonring: install %s: installed, but publishing the segment failed: %w", t.Name(), err)
	}
	return nil
}

// wakePollers wakes the engine's parked pollers (transport.Waker).
func (e *Engine) wakePollers() {
	if ps := e.pollerList.Load(); ps != nil {
		for _, p := range *ps {
			p.Wake()
		}
	}
}

// UninstallTransport removes the transport named name and closes it. It
// fails with ErrBusy while segments are open through it, or, for the
// transport that stages device memory (transport.Stager), while segments
// stage through it. The in-process transport cannot be removed.
func (e *Engine) UninstallTransport(name string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	slot := e.slotOf(name)
	if slot < 0 {
		return fmt.Errorf("moonring: uninstall %s: %w", name, ErrNoSuchTransport)
	}
	if slot == 0 {
		return fmt.Errorf("moonring: uninstall %s: the in-process transport stays", name)
	}
	busy := false
	e.segments.Each(func(s *segtable.Segment[transport.Endpoint]) { busy = busy || s.Transport == slot })
	if busy {
		return fmt.Errorf("moonring: uninstall %s: segments are open through it: %w", name, ErrBusy)
	}
	t := e.transports[slot]
	if slot == e.stagerSlot && e.stager != nil {
		staged := false
		e.segments.Each(func(s *segtable.Segment[transport.Endpoint]) { staged = staged || s.Staged != nil })
		if staged {
			return fmt.Errorf("moonring: uninstall %s: segments stage GPU memory through it: %w", name, ErrBusy)
		}
		e.stopStaging()
	}
	for _, b := range e.buffers.All() {
		e.unregisterFrom(t, slot, b)
	}
	e.transports[slot] = nil
	if h, ok := t.(transport.Poller); ok {
		for _, p := range e.pollers {
			p.RemoveHook(h)
		}
	}
	err := t.Close()
	if perr := e.publish(); perr != nil {
		err = errors.Join(err, perr)
	}
	return err
}

func (e *Engine) slotOf(name string) int {
	for i, t := range e.transports {
		if t != nil && t.Name() == name {
			return i
		}
	}
	return -1
}

// Transport returns the installed transport named name, or nil.
func (e *Engine) Transport(name string) transport.Transport {
	e.mu.Lock()
	defer e.mu.Unlock()
	if slot := e.slotOf(name); slot >= 0 {
		return e.transports[slot]
	}
	return nil
}

// BufferSpec is one buffer for RegisterLocalMemoryBatch.
type BufferSpec struct {
	Buf      []byte
	Location Location
	Remote   bool
}

// RegisterLocalMemory registers buf with the engine and every installed
// transport. A remote-accessible buffer is published in the engine's
// segment so peers may read and write it; a local-only one may only be the
// local side of requests. buf must stay valid (Go memory is pinned) until
// UnregisterLocalMemory. Overlapping and empty ranges are refused.
func (e *Engine) RegisterLocalMemory(buf []byte, loc Location, remoteAccessible bool) (BufferID, error) {
	ids, err := e.RegisterLocalMemoryBatch([]BufferSpec{{buf, loc, remoteAccessible}})
	if err != nil {
		return 0, err
	}
	return ids[0], nil
}

// RegisterLocalMemoryBatch registers several buffers and publishes the
// segment once. It registers all or none.
func (e *Engine) RegisterLocalMemoryBatch(specs []BufferSpec) ([]BufferID, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return nil, ErrClosed
	}
	var done []*segtable.Buffer
	undo := func() {
		for _, b := range done {
			e.unregisterLocked(b)
		}
	}
	remote := false
	for _, s := range specs {
		b, err := e.buffers.Register(s.Buf, s.Location, s.Remote)
		if err != nil {
			undo()
			return nil, fmt.Errorf("moonring: register memory: %w", err)
		}
		done = append(done, b)
		for slot, t := range e.transports {
			if t == nil || !transport.Serves(t, b.Location) {
				continue
			}
			reg, err := t.Register(b)
			if err != nil {
				undo()
				return nil, fmt.Errorf("moonring: register memory with %s: %w", t.Name(), err)
			}
			b.Regs[slot].Store(&reg)
		}
		e.stage(b)
		remote = remote || s.Remote
	}
	ids := make([]BufferID, len(done))
	for i, b := range done {
		ids[i] = b.ID
	}
	e.self.SetDesc(e.desc(false))
	if remote {
		if err := e.publish(); err != nil {
			undo()
			e.self.SetDesc(e.desc(false))
			return nil, err
		}
	}
	return ids, nil
}

// unregisterLocked removes a buffer that no request holds. mu must be held.
func (e *Engine) unregisterLocked(b *segtable.Buffer) error {
	// Out of the table first, waiting for requests that found it (the
	// table is read lock-free), then out of the transports.
	var err error
	if _, uerr := e.buffers.Unregister(context.Background(), b.ID); uerr != nil {
		err = uerr
	}
	for slot, t := range e.transports {
		err = errors.Join(err, e.unregisterFrom(t, slot, b))
	}
	return err
}

// unregisterFrom drops b's registration with t in slot; a staged one was
// never t's. mu must be held.
func (e *Engine) unregisterFrom(t transport.Transport, slot int, b *segtable.Buffer) error {
	if r := b.Regs[slot].Swap(nil); r != nil && !r.Staged && t != nil {
		return t.Unregister(b, *r)
	}
	return nil
}

// unregisterFromContext is unregisterFrom for a caller with a deadline: a
// transport that can bound its wait on peers
// (transport.ContextUnregisterer) waits no longer than ctx. mu must be
// held.
func (e *Engine) unregisterFromContext(ctx context.Context, t transport.Transport, slot int, b *segtable.Buffer) error {
	if cu, ok := t.(transport.ContextUnregisterer); ok {
		if r := b.Regs[slot].Swap(nil); r != nil && !r.Staged {
			return cu.UnregisterContext(ctx, b, *r)
		}
		return nil
	}
	return e.unregisterFrom(t, slot, b)
}

// startStaging makes st the engine's stager: its arena is registered,
// local only, with every transport. Without an arena (the host cannot pin
// it) device memory reaches only st's own peers, as the log says. mu must
// be held.
func (e *Engine) startStaging(st transport.Stager, slot int) {
	b, err := e.registerArena(st)
	if err != nil {
		e.cfg.Logger.Warn("moonring: no staging of device memory over the other transports", "reason", err)
		return
	}
	e.stager, e.stagerSlot, e.arena = st, slot, b
}

// registerArena registers st's staging arena, local only, with the engine
// and every transport: all or none. mu must be held.
func (e *Engine) registerArena(st transport.Stager) (*segtable.Buffer, error) {
	mem, err := st.StagingArena()
	if err != nil {
		return nil, err
	}
	b, err := e.buffers.Register(mem, segtable.CPU(0), false)
	if err != nil {
		return nil, err
	}
	for slot, t := range e.transports {
		if t == nil {
			continue
		}
		reg, err := t.Register(b)
		if err != nil {
			e.unregisterLocked(b)
			return nil, err
		}
		b.Regs[slot].Store(&reg)
	}
	return b, nil
}

// stopStaging undoes startStaging: no segment has a staged endpoint any
// more. mu must be held.
func (e *Engine) stopStaging() {
	for _, b := range e.buffers.All() {
		for slot := range e.transports {
			if r := b.Regs[slot].Load(); r != nil && r.Staged {
				b.Regs[slot].Store(nil)
			}
		}
	}
	e.unregisterLocked(e.arena)
	e.stager, e.arena = nil, nil
}

// stage gives b, memory that only the stager serves, a staged
// registration on each transport that the arena is registered with and b
// is not. mu must be held.
func (e *Engine) stage(b *segtable.Buffer) {
	if kind, _, err := b.Location.Parse(); err != nil || kind == "cpu" || e.stager == nil {
		return
	}
	own := b.Regs[e.stagerSlot].Load()
	if own == nil {
		return
	}
	for slot, t := range e.transports {
		if t == nil || b.Regs[slot].Load() != nil || e.arena.Regs[slot].Load() == nil {
			continue
		}
		b.Regs[slot].Store(&segtable.Registration{Handle: own.Handle, Staged: true})
	}
}

// UnregisterLocalMemory unregisters the buffer that starts at buf's first
// byte. Requests taken from now on that name it fail; the call waits for
// those in flight, and if ctx ends first it leaves the buffer registered
// and returns an error wrapping ErrBusy. It then waits for the transports
// to withdraw the buffer from peers, and those that wait on peers (tcp,
// shm) stop waiting when ctx ends too: the error then wraps ctx's, the
// buffer is no longer the engine's, and its memory may be reused only
// after Close, which ends every peer's use of it.
func (e *Engine) UnregisterLocalMemory(ctx context.Context, buf []byte) error {
	return e.UnregisterLocalMemoryBatch(ctx, [][]byte{buf})
}

// UnregisterLocalMemoryBatch unregisters several buffers and republishes
// the segment once. It stops at the first buffer it cannot unregister.
func (e *Engine) UnregisterLocalMemoryBatch(ctx context.Context, bufs [][]byte) error {
	var err error
	remote := false
	for _, buf := range bufs {
		if len(buf) == 0 {
			err = fmt.Errorf("moonring: unregister memory: %w", ErrNotRegistered)
			break
		}
		addr := uintptr(unsafe.Pointer(unsafe.SliceData(buf)))
		b := e.buffers.Find(addr, 1)
		if b == nil || b.Addr != addr {
			err = fmt.Errorf("moonring: unregister memory %#x: %w", addr, ErrNotRegistered)
			break
		}
		// Refuse new requests and wait for those in flight, without the
		// lock: registration elsewhere goes on meanwhile.
		if _, derr := e.buffers.Unregister(ctx, b.ID); derr != nil {
			if errors.Is(derr, segtable.ErrNotFound) {
				derr = ErrNotRegistered // another call unregistered it meanwhile
			}
			err = fmt.Errorf("moonring: unregister memory %#x: %w", addr, derr)
			break
		}
		e.mu.Lock()
		for slot, t := range e.transports {
			if terr := e.unregisterFromContext(ctx, t, slot, b); terr != nil {
				err = errors.Join(err, fmt.Errorf("moonring: unregister memory from %s: %w", t.Name(), terr))
			}
		}
		e.mu.Unlock()
		remote = remote || b.Remote
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.self.SetDesc(e.desc(false))
	if remote && !e.closed.Load() {
		err = errors.Join(err, e.publish())
	}
	return err
}

// OpenSegment looks name up in the metadata store, picks the best
// transport that reaches it and returns its ID. Opening an open segment
// returns the same ID; the engine's own name returns LocalSegmentID. The
// store and the peer are asked without the engine's lock: a slow peer holds
// up this call only (bounded by ctx), not the engine.
func (e *Engine) OpenSegment(ctx context.Context, name string) (SegmentID, error) {
	if name == e.cfg.Name {
		return LocalSegmentID, nil
	}
	e.mu.Lock()
	if e.closed.Load() {
		e.mu.Unlock()
		return 0, ErrClosed
	}
	if s := e.segments.Find(name); s != nil {
		e.mu.Unlock()
		return s.ID, nil
	}
	var installed []string
	for _, t := range e.transports {
		if t != nil {
			installed = append(installed, t.Name())
		}
	}
	e.mu.Unlock()
	desc, err := e.store.Get(ctx, name)
	if errors.Is(err, metadata.ErrForged) {
		return 0, fmt.Errorf("moonring: open segment %q: its descriptor does not verify under this engine's segment key (another key, check Config.Key or MOONRING_KEY on both sides, or a forged descriptor): %w: %w", name, ErrDenied, err)
	}
	if err != nil {
		return 0, fmt.Errorf("moonring: open segment %q: %w", name, err)
	}
	var errs []error
	for _, tname := range transport.Candidates(installed, desc, e.cfg.Transports) {
		e.mu.Lock()
		slot := e.slotOf(tname)
		var t transport.Transport
		if slot >= 0 {
			t = e.transports[slot]
		}
		e.mu.Unlock()
		if t == nil {
			continue // uninstalled meanwhile
		}
		ep, err := t.Open(ctx, desc)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		id, done, err := e.addSegment(name, desc, slot, t, ep)
		if done {
			return id, err
		}
	}
	if e.closed.Load() {
		return 0, ErrClosed // its transports closed under the Opens
	}
	// A peer that refused this engine's segment key is ErrDenied, not a
	// missing transport: the fix is the key, on one side or the other.
	why := ErrNoTransport
	for _, err := range errs {
		if errors.Is(err, tcp.ErrPinMismatch) {
			// Not a key: the certificate is not the one the signed
			// descriptor pins (a relay, or a target restarted since).
			return 0, fmt.Errorf("moonring: open segment %q: its TLS certificate is not the one its descriptor pins (a relay on the path, or a descriptor older than the target): %w", name, errors.Join(append([]error{ErrDenied}, errs...)...))
		}
		if errors.Is(err, transport.ErrDenied) || errors.Is(err, tcp.ErrAuth) || errors.Is(err, rdma.ErrAuth) {
			why = ErrDenied
		}
	}
	if why == ErrDenied {
		return 0, fmt.Errorf("moonring: open segment %q: its engine refused this engine's segment key (check Config.Key, MOONRING_KEY, on both sides): %w", name, errors.Join(append([]error{why}, errs...)...))
	}
	return 0, fmt.Errorf("moonring: open segment %q (store %s): %w", name, e.cfg.Metadata, errors.Join(append([]error{why}, errs...)...))
}

// addSegment adds the segment OpenSegment reached through ep of t in slot,
// unless the engine closed, t was uninstalled (done false: try the next
// transport) or another OpenSegment of name added it first (its ID).
func (e *Engine) addSegment(name string, desc *segtable.SegmentDesc, slot int, t transport.Transport, ep transport.Endpoint) (SegmentID, bool, error) {
	e.mu.Lock()
	var unused bool // ep goes unused: closed after the lock (a Close may wait on dials)
	defer func() {
		e.mu.Unlock()
		if unused {
			ep.Close()
		}
	}()
	switch {
	case e.closed.Load():
		unused = true
		return 0, true, ErrClosed
	case e.transports[slot] != t:
		unused = true
		return 0, false, nil
	}
	if s := e.segments.Find(name); s != nil {
		unused = true
		return s.ID, true, nil
	}
	size := t.SliceSize()
	staged := e.stageEndpoint(ep, slot, size)
	s, err := e.segments.Open(desc.Name, desc, slot, size, ep, staged)
	if err != nil {
		closeSegment(ep, staged)
		return 0, true, fmt.Errorf("moonring: open segment %q: %w", desc.Name, err)
	}
	e.watch(s)
	e.cfg.Logger.Info("moonring: segment opened", "segment", desc.Name, "transport", t.Name(), "id", s.ID)
	return s.ID, true, nil
}

// stageEndpoint returns the Staged endpoint for a segment reached through
// ep of the transport in slot (slices of size bytes, 0 for the default),
// or nil when device memory does not go through it. mu must be held.
func (e *Engine) stageEndpoint(ep transport.Endpoint, slot int, size uint64) transport.Endpoint {
	if e.stager == nil || slot == e.stagerSlot {
		return nil
	}
	arena := e.arena.Regs[slot].Load()
	if arena == nil {
		return nil
	}
	if size == 0 {
		size = e.cfg.SliceSize
	}
	staged, err := e.stager.Stage(ep, arena.Handle, ring.MaxSlice(size))
	if err != nil {
		e.cfg.Logger.Warn("moonring: device memory will not reach this segment", "transport", e.transports[slot].Name(), "reason", err)
		return nil
	}
	return staged
}

// closeSegment closes a segment's endpoints: the staged one first, as it
// posts to the other.
func closeSegment(ep, staged transport.Endpoint) error {
	var err error
	if staged != nil {
		err = staged.Close()
	}
	return errors.Join(err, ep.Close())
}

// watch follows the segment's descriptor in the store. mu must be held.
func (e *Engine) watch(s *segtable.Segment[transport.Endpoint]) {
	ctx, cancel := context.WithCancel(context.Background())
	e.watches[s.ID] = cancel
	e.watchWG.Add(1)
	go func() {
		defer e.watchWG.Done()
		// Started here, not under the engine's lock: a store may fetch
		// the descriptor once before it answers.
		ch, err := e.store.Watch(ctx, s.Name)
		if err != nil {
			return // the cached descriptor stays in use
		}
		for ev := range ch {
			switch old := s.Desc(); {
			case ev.Deleted || ev.Desc == nil:
				e.cfg.Logger.Info("moonring: segment withdrawn", "segment", s.Name)
			case ev.Desc.Epoch != old.Epoch:
				e.cfg.Logger.Info("moonring: segment restarted", "segment", s.Name, "epoch", ev.Desc.Epoch)
			default:
				e.cfg.Logger.Debug("moonring: segment republished", "segment", s.Name, "buffers", len(ev.Desc.Buffers))
			}
			if ev.Deleted || ev.Desc == nil {
				// Gone: requests fail at the endpoint until the peer is back
				// (a new epoch arrives here) or the caller closes the segment.
				continue
			}
			// The same engine republished, or a restarted one (a new epoch)
			// took the name: either way the endpoint follows the new
			// descriptor (a transport redials a new address and keys), and
			// the SegmentID stays valid.
			s.Endpoint.Update(ev.Desc)
			s.SetDesc(ev.Desc)
		}
	}()
}

// SegmentTransport returns the name of the transport that reaches the open
// segment id ("shm", "tcp", ...). Safe for concurrent use.
func (e *Engine) SegmentTransport(id SegmentID) (string, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return "", ErrClosed // its transports are gone
	}
	s := e.segments.Get(id)
	if s == nil || e.transports[s.Transport] == nil {
		return "", fmt.Errorf("moonring: segment %d: %w", id, ErrBadSegment)
	}
	return e.transports[s.Transport].Name(), nil
}

// CloseSegment closes a segment once no request uses it. If ctx ends first
// the segment stays open and the error wraps ErrBusy; an OpenSegment of its
// name made meanwhile opened a second segment, which stays open too.
func (e *Engine) CloseSegment(ctx context.Context, id SegmentID) error {
	s, err := e.segments.Close(ctx, id)
	if errors.Is(err, segtable.ErrNotFound) {
		return fmt.Errorf("moonring: close segment %d (%v): %w", id, err, ErrBadSegment)
	}
	if err != nil {
		return fmt.Errorf("moonring: close segment: %w", err)
	}
	e.mu.Lock()
	if cancel := e.watches[id]; cancel != nil {
		cancel()
		delete(e.watches, id)
	}
	e.mu.Unlock()
	return closeSegment(s.Endpoint, s.Staged)
}

// Alloc returns size bytes of memory for RegisterLocalMemory. On a GPU
// ("cuda:N") it comes from the installed transport that serves it (nvlink),
// a view of device addresses that the CPU must not touch. On a CPU node it
// is page-aligned memory outside the Go heap, bound to the NUMA node of loc
// when the machine has several and advised for huge pages when large. With
// the shm transport installed it is a sealed memfd, which the transport
// hands to peers of this host that then copy into and out of it directly
// (such memory gets huge pages only where the kernel's shmem_enabled
// allows). Register it to use it; release it with Free.
func (e *Engine) Alloc(size int, loc Location) ([]byte, error) {
	kind, idx, err := loc.Parse()
	if err != nil {
		return nil, fmt.Errorf("moonring: alloc: %w", err)
	}
	if kind != "cpu" {
		for _, t := range e.installed() {
			if d, ok := t.(transport.DeviceMemory); ok && d.Accepts(loc) {
				b, err := d.AllocDevice(size, loc)
				if err != nil {
					return nil, fmt.Errorf("moonring: alloc on %s: %w", loc, err)
				}
				return b, nil
			}
		}
		return nil, fmt.Errorf("moonring: alloc on %s: no installed transport serves it: %w", loc, transport.ErrNotSupported)
	}
	alloc := mem.Alloc
	if e.Transport(shm.Name) != nil {
		alloc = mem.AllocShared
	}
	b, err := alloc(size, idx)
	if err != nil {
		return nil, fmt.Errorf("moonring: alloc: %w", err)
	}
	return b, nil
}

// Free releases memory from Alloc. It refuses memory still registered
// (ErrRegistered).
func (e *Engine) Free(b []byte) error {
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	hi := lo + uintptr(cap(b))
	for _, x := range e.buffers.All() {
		if x.Addr < hi && lo < x.Addr+uintptr(x.Length) {
			return fmt.Errorf("moonring: free: buffer %d lies in this memory (unregister it first): %w", x.ID, ErrRegistered)
		}
	}
	for _, t := range e.installed() {
		d, ok := t.(transport.DeviceMemory)
		if !ok {
			continue
		}
		switch err := d.FreeDevice(b); {
		case err == nil:
			return nil
		case !errors.Is(err, segtable.ErrNotFound): // its memory, but freeing failed
			return fmt.Errorf("moonring: free: %w", err)
		}
	}
	if err := mem.Free(b); err != nil {
		return fmt.Errorf("moonring: free: %w", err)
	}
	return nil
}

// installed returns the installed transports.
func (e *Engine) installed() []transport.Transport {
	e.mu.Lock()
	defer e.mu.Unlock()
	var ts []transport.Transport
	for _, t := range e.transports {
		if t != nil {
			ts = append(ts, t)
		}
	}
	return ts
}

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
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, cancel := range e.watches {
		cancel()
	}
	e.segments.Each(func(s *segtable.Segment[transport.Endpoint]) {
		closeSegment(s.Endpoint, s.Staged)
	})
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
