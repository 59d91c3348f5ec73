package nvlink

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Name is the transport's name in segment descriptors.
const Name = "nvlink"

// Defaults of Config.
const (
	DefaultLibrary      = "libcuda.so.1"
	DefaultSliceSize    = 64 << 20
	DefaultDepth        = 1024
	DefaultMaxBuffers   = 4096
	DefaultDrainTimeout = 10 * time.Second
	// DefaultStagingUnit and DefaultStagingUnits size the staging arena:
	// 256 units of 256 KiB, 64 MiB pinned, about 50 slices of TCP's
	// default 1 MiB in flight.
	DefaultStagingUnit  = 256 << 10
	DefaultStagingUnits = 256
)

// maxSlots bounds Config.MaxBuffers and the slots a peer's table may have.
const maxSlots = 1 << 20

// Errors of the transport.
var (
	// ErrLocation: a buffer's location says cuda:N but its memory is not
	// memory of that GPU. Fix the registration; a retry does not help.
	ErrLocation = errors.New("nvlink: buffer memory is not where its location says")
	// ErrNotify: notifications do not travel over NVLink; a WRITE with
	// notify to an nvlink segment fails with the engine's ErrNoTransport
	// (final, not retried) once its data has landed.
	ErrNotify = fmt.Errorf("nvlink: notifications: %w", transport.ErrNotSupported)
)

// Config configures a Transport. The zero value takes the defaults.
type Config struct {
	// Library is the CUDA driver library (DefaultLibrary).
	Library string
	// SliceSize is the largest slice the engine should post
	// (DefaultSliceSize). A slice costs a copy launch and an event on the
	// CPU; large slices keep device bandwidth near a raw copy's.
	SliceSize uint64
	// Depth is how many copies may be in flight per GPU, a power of two
	// (DefaultDepth); Post takes fewer slices when it is reached.
	Depth int
	// MaxBuffers is how many buffers may be exported at once
	// (DefaultMaxBuffers): the size of the grant table.
	MaxBuffers int
	// DrainTimeout bounds how long Unregister and Close wait for peers'
	// copies of exported buffers (DefaultDrainTimeout).
	DrainTimeout time.Duration
	// StagingUnit is the grain of the staging arena (DefaultStagingUnit):
	// a staged slice takes a run of whole units.
	StagingUnit int
	// StagingUnits is how many units the arena holds
	// (DefaultStagingUnits): the arena bounds both the longest slice
	// that can be staged and the bytes staged at once.
	StagingUnits int
	// NoBatchCopies queues every copy with its own call. By default the
	// device-to-device copies of one Post go to the GPU in one
	// cuMemcpyBatchAsync (CUDA 12.8 and later): one driver call instead
	// of one a copy (on an H200 the copy engine's own ~5 µs a copy stays,
	// BENCHMARKS.md); a driver without it gets a call per copy anyway.
	NoBatchCopies bool
	// NoCopyKernel leaves every copy to the copy engines. By default the
	// device-to-device slices of one Post of up to 1 MiB each (their
	// addresses and lengths multiples of 16, their local buffer on the
	// remote buffer's GPU) are copied in one launch of a small kernel on
	// the GPU's SMs (see kernel.go), since a copy engine spends about 5 µs
	// on each copy whatever its size: on an H200 a request's 16,384
	// scattered 32 KiB blocks moved between two engines at 87-94 GB/s
	// through the kernel against 6-7 GB/s on copy engines, and the same
	// bytes as 1 MiB blocks at 1.36 TB/s against 0.2 (BENCHMARKS.md).
	// The kernel takes SMs from the application's own kernels while it
	// runs; set NoCopyKernel where they must have every SM. A driver that
	// cannot load the kernel leaves the lane on copy engines anyway.
	NoCopyKernel bool
}

func (c *Config) defaults() error {
	if c.Library == "" {
		c.Library = DefaultLibrary
	}
	if c.SliceSize == 0 {
		c.SliceSize = DefaultSliceSize
	}
	if c.Depth == 0 {
		c.Depth = DefaultDepth
	}
	if c.MaxBuffers == 0 {
		c.MaxBuffers = DefaultMaxBuffers
	}
	if c.DrainTimeout == 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	if c.StagingUnit == 0 {
		c.StagingUnit = DefaultStagingUnit
	}
	if c.StagingUnits == 0 {
		c.StagingUnits = DefaultStagingUnits
	}
	if c.StagingUnit < 0 || c.StagingUnits < 0 || c.StagingUnits > 1<<16 || int64(c.StagingUnit)*int64(c.StagingUnits) > 1<<40 {
		return fmt.Errorf("nvlink: staging: %d units of %d bytes: want up to 65536 units and 1 TiB in all", c.StagingUnits, c.StagingUnit)
	}
	if c.Depth < 1 || c.Depth&(c.Depth-1) != 0 || c.Depth > 1<<16 {
		return fmt.Errorf("nvlink: depth %d: want a power of two up to 65536", c.Depth)
	}
	if c.MaxBuffers < 1 || c.MaxBuffers > maxSlots {
		return fmt.Errorf("nvlink: max buffers %d: want 1 to %d", c.MaxBuffers, maxSlots)
	}
	return nil
}

// Transport moves bytes between GPU memory of processes of one host with
// CUDA IPC: a peer's exported allocations are mapped once into this
// process and every slice is an asynchronous copy on a stream of the GPU
// that holds the peer's buffer, completed when its event has fired. The
// engine must call Poll (Transport is a transport.Poller) for slices to
// complete.
//
// A Transport is safe for concurrent use. It lives from New until Close.
type Transport struct {
	cfg  Config
	drv  driver
	addr string // Endpoint
	boot string
	tab  *table // the grant table of buffers this process exports
	devs []*device
	bus  map[string]*device // by PCI bus id

	mu     sync.Mutex // guards what follows, and device start
	seq    uint64
	slots  []int // free slots of tab
	eps    map[*Endpoint]struct{}
	maps   map[mapKey]*mapping
	allocs map[unsafe.Pointer]*device
	staged map[*stagedEndpoint]struct{}
	stg    atomic.Pointer[stager] // the staging arena, once StagingArena made it
	// unregs counts Unregisters under way (added under mu while open):
	// Close waits for them before it unmaps the grant table they drain.
	// shut is closed once Close has drained every peer's copies: an
	// Unregister that comes during Close waits for it.
	unregs sync.WaitGroup
	shut   chan struct{}

	regs   atomic.Pointer[map[uint64]*region] // copy on write, under mu
	wake   atomic.Pointer[func()]             // SetWake's
	closed atomic.Bool
	// retiring counts the endpoints' retired views not yet dropped
	// (written under mu): Poll looks at it to know when to try.
	retiring atomic.Int64
}

// device is one GPU as this process numbers it. Its context, stream and
// events are made on first use.
type device struct {
	ordinal int
	bus     string
	ready   atomic.Bool // ctx and lane are set; written under Transport.mu
	ctx     uintptr
	lane    *lane
}

// region is one buffer registered with the transport.
type region struct {
	handle uint64
	addr   uintptr
	length uint64
	dev    *device // nil: host memory
	slot   int     // grant-table slot; -1 when not exported
	// leaving is set (under Transport.mu) while an Unregister revokes it:
	// a second one is refused rather than free the slot twice.
	leaving bool
}

// mapping is a peer's allocation mapped into this process, shared by
// every endpoint that reaches it.
type mapping struct {
	ptr  uintptr
	size uint64 // bytes mapped at ptr, as the driver says
	dev  *device
	refs int
}

type mapKey struct {
	dev *device
	h   ipcHandle
}

var (
	_ transport.DeviceMemory = (*Transport)(nil)
	_ transport.Transport    = (*Transport)(nil)
	_ transport.Poller       = (*Transport)(nil)
	_ transport.Stager       = (*Transport)(nil)
	_ transport.InFlight     = (*Transport)(nil)
	_ transport.Waker        = (*Transport)(nil)
)

// New loads the CUDA driver and returns a transport. Without a usable
// driver (no libcuda.so.1, no GPU) the error wraps transport.ErrNotSupported
// and says why; the engine then goes on without NVLink.
func New(cfg Config) (*Transport, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	drv, err := loadCUDA(cfg.Library)
	if err != nil {
		return nil, err
	}
	return newTransport(cfg, drv)
}

func newTransport(cfg Config, drv driver) (*Transport, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	boot, err := bootID()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, transport.ErrNotSupported)
	}
	n, err := drv.deviceCount()
	if err != nil {
		return nil, fmt.Errorf("nvlink: %w (%w)", err, transport.ErrNotSupported)
	}
	if n == 0 {
		return nil, fmt.Errorf("nvlink: the driver sees no GPU: %w", transport.ErrNotSupported)
	}
	t := &Transport{
		cfg: cfg, drv: drv, boot: boot, bus: map[string]*device{},
		eps: map[*Endpoint]struct{}{}, maps: map[mapKey]*mapping{},
		allocs: map[unsafe.Pointer]*device{}, staged: map[*stagedEndpoint]struct{}{},
		shut: make(chan struct{}),
	}
	for i := 0; i < n; i++ {
		id, err := drv.pciBusID(i)
		if err != nil {
			return nil, fmt.Errorf("nvlink: GPU %d: %w", i, err)
		}
		if len(id) > busBytes {
			id = id[:busBytes] // as keys carry it; CUDA's are 12 or 16 characters
		}
		if id == "" {
			return nil, fmt.Errorf("nvlink: GPU %d has no PCI bus id", i)
		}
		d := &device{ordinal: i, bus: id}
		t.devs = append(t.devs, d)
		t.bus[id] = d
	}
	if t.tab, err = createTable(cfg.MaxBuffers); err != nil {
		return nil, err
	}
	for i := cfg.MaxBuffers - 1; i >= 0; i-- {
		t.slots = append(t.slots, i)
	}
	t.addr = peerAddr{boot: boot, pid: os.Getpid(), table: t.tab.path}.String()
	regs := map[uint64]*region{}
	t.regs.Store(&regs)
	return t, nil
}

// Name returns "nvlink".
func (t *Transport) Name() string { return Name }

// Endpoint returns the host's boot id, the process id and the path of the
// grant table: what a peer needs to know it shares the host and to check
// grants.
func (t *Transport) Endpoint() string { return t.addr }

// SliceSize returns Config.SliceSize.
func (t *Transport) SliceSize() uint64 { return t.cfg.SliceSize }

// Devices returns how many GPUs the process sees.
func (t *Transport) Devices() int { return len(t.devs) }

// start makes d's context, stream and events. mu must be held.
func (t *Transport) start(d *device) error {
	if d.ready.Load() {
		return nil
	}
	ctx, err := t.drv.retain(d.ordinal)
	if err != nil {
		return fmt.Errorf("nvlink: GPU %d: %w", d.ordinal, err)
	}
	lockThread()
	defer unlockThread()
	if err := t.drv.setCurrent(ctx); err != nil {
		t.drv.release(d.ordinal)
		return fmt.Errorf("nvlink: GPU %d: %w", d.ordinal, err)
	}
	l, err := newLane(t.drv, d, t.cfg.Depth, !t.cfg.NoBatchCopies && t.drv.canBatch(), !t.cfg.NoCopyKernel)
	if err != nil {
		t.drv.release(d.ordinal)
		return fmt.Errorf("nvlink: GPU %d: %w", d.ordinal, err)
	}
	d.ctx, d.lane = ctx, l
	d.ready.Store(true)
	return nil
}

// device returns GPU ordinal, started. mu must be held.
func (t *Transport) device(ordinal int) (*device, error) {
	if ordinal < 0 || ordinal >= len(t.devs) {
		return nil, fmt.Errorf("nvlink: GPU %d of %d: %w", ordinal, len(t.devs), ErrNoDevice)
	}
	d := t.devs[ordinal]
	if err := t.start(d); err != nil {
		return nil, err
	}
	return d, nil
}

// Alloc returns size bytes of memory of GPU gpu (cuMemAlloc), for
// RegisterLocalMemory with location cuda:gpu. The slice is a view of
// device addresses: the CPU must never read or write it. It lives until
// Free or Close. Safe for concurrent use.
func (t *Transport) Alloc(size int, gpu int) ([]byte, error) {
	if size <= 0 {
		return nil, fmt.Errorf("nvlink: alloc %d bytes: %w", size, segtable.ErrEmpty)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed.Load() {
		return nil, fmt.Errorf("nvlink: alloc: %w", transport.ErrClosed)
	}
	d, err := t.device(gpu)
	if err != nil {
		return nil, err
	}
	lockThread()
	defer unlockThread()
	if err := t.drv.setCurrent(d.ctx); err != nil {
		return nil, fmt.Errorf("nvlink: alloc: %w", err)
	}
	p, err := t.drv.memAlloc(uint64(size))
	if err != nil {
		return nil, fmt.Errorf("nvlink: alloc %d bytes on GPU %d: %w", size, gpu, err)
	}
	t.allocs[p] = d
	return unsafe.Slice((*byte)(p), size), nil
}

// Accepts reports whether loc is a GPU ("cuda:N"): the transport serves
// GPU memory, and host memory as the local side of a copy.
func (t *Transport) Accepts(loc segtable.Location) bool {
	kind, _, err := loc.Parse()
	return err == nil && kind == "cuda"
}

// AllocDevice is Alloc for a location "cuda:N" (transport.DeviceMemory).
func (t *Transport) AllocDevice(size int, loc segtable.Location) ([]byte, error) {
	kind, idx, err := loc.Parse()
	if err != nil || kind != "cuda" {
		return nil, fmt.Errorf("nvlink: alloc on %q: %w", loc, ErrLocation)
	}
	return t.Alloc(size, idx)
}

// FreeDevice is Free (transport.DeviceMemory).
func (t *Transport) FreeDevice(b []byte) error { return t.Free(b) }

// Free releases memory from Alloc. Unregister it first.
func (t *Transport) Free(b []byte) error {
	p := unsafe.Pointer(unsafe.SliceData(b))
	t.mu.Lock()
	defer t.mu.Unlock()
	d, ok := t.allocs[p]
	if !ok {
		return fmt.Errorf("nvlink: free %p: not from Alloc: %w", p, segtable.ErrNotFound)
	}
	delete(t.allocs, p)
	lockThread()
	defer unlockThread()
	if err := t.drv.setCurrent(d.ctx); err != nil {
		return fmt.Errorf("nvlink: free: %w", err)
	}
	if err := t.drv.memFree(p); err != nil {
		return fmt.Errorf("nvlink: free: %w", err)
	}
	return nil
}

// Register makes b usable by the transport. GPU memory registered
// remote-accessible is exported: its key carries the allocation's IPC
// handle and a grant-table slot. GPU memory registered local-only, and
// host memory, get no key: they are only ever the local side of a slice
// (host memory through HtoD and DtoH copies). The memory's kind and GPU
// come from the driver; a location of cuda:N that the driver does not
// confirm is refused with ErrLocation.
func (t *Transport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	kind, idx, err := b.Location.Parse()
	if err != nil {
		return segtable.Registration{}, fmt.Errorf("nvlink: register: %w", err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed.Load() {
		return segtable.Registration{}, fmt.Errorf("nvlink: register: %w", transport.ErrClosed)
	}
	ordinal, isDev, err := t.memoryDevice(b, kind, idx)
	if err != nil {
		return segtable.Registration{}, fmt.Errorf("nvlink: register: %w", err)
	}
	if kind == "cuda" && (!isDev || (idx >= 0 && ordinal != idx)) {
		return segtable.Registration{}, fmt.Errorf("nvlink: register %s buffer at %#x: %w", b.Location, b.Addr, ErrLocation)
	}
	r := &region{addr: b.Addr, length: b.Length, slot: -1}
	var key string
	if isDev {
		if r.dev, err = t.device(ordinal); err != nil {
			return segtable.Registration{}, fmt.Errorf("nvlink: register: %w", err)
		}
		if b.Remote {
			if key, err = t.export(r); err != nil {
				return segtable.Registration{}, fmt.Errorf("nvlink: register buffer at %#x: %w", b.Addr, err)
			}
		}
	}
	t.seq++
	r.handle = t.seq
	regs := make(map[uint64]*region, len(*t.regs.Load())+1)
	for h, x := range *t.regs.Load() {
		regs[h] = x
	}
	regs[r.handle] = r
	t.regs.Store(&regs)
	return segtable.Registration{Handle: r.handle, Key: key}, nil
}

// memoryDevice asks the driver what b's memory is, with a context
// current (pointer queries may need one): the GPU the location names, or
// GPU 0. mu must be held.
func (t *Transport) memoryDevice(b *segtable.Buffer, kind string, idx int) (int, bool, error) {
	ctxDev := 0
	if kind == "cuda" && idx >= 0 {
		ctxDev = idx
	}
	d, err := t.device(ctxDev)
	if err != nil {
		return 0, false, err
	}
	lockThread()
	defer unlockThread()
	if err := t.drv.setCurrent(d.ctx); err != nil {
		return 0, false, err
	}
	ordinal, ok := t.drv.memoryDevice(b.Pointer(0), b.Length)
	return ordinal, ok, nil
}

// export takes a slot for r and returns its key. mu must be held.
func (t *Transport) export(r *region) (string, error) {
	if len(t.slots) == 0 {
		return "", fmt.Errorf("nvlink: %d buffers exported already (Config.MaxBuffers)", t.cfg.MaxBuffers)
	}
	lockThread()
	defer unlockThread()
	if err := t.drv.setCurrent(r.dev.ctx); err != nil {
		return "", err
	}
	base, size, err := t.drv.addressRange(r.addr)
	if err != nil {
		return "", err
	}
	h, err := t.drv.ipcGetHandle(base)
	if err != nil {
		return "", err
	}
	r.slot = t.slots[len(t.slots)-1]
	t.slots = t.slots[:len(t.slots)-1]
	k := grantKey{
		slot: uint32(r.slot), gen: t.tab.grant(r.slot), handle: h,
		base: uint64(base), size: size, addr: uint64(r.addr), length: r.length, bus: r.dev.bus,
	}
	return k.encode(), nil
}

// Unregister forgets a registration. For an exported buffer it first
// revokes the grant and waits (up to Config.DrainTimeout) until no copy of
// any peer process touches the buffer; after a timeout the buffer stays
// revoked and the error says how many copies were left.
func (t *Transport) Unregister(b *segtable.Buffer, reg segtable.Registration) error {
	t.mu.Lock()
	if t.closed.Load() {
		t.mu.Unlock()
		<-t.shut // Close takes every registration down; once it has, no peer copies
		return nil
	}
	r := (*t.regs.Load())[reg.Handle]
	if r == nil || r.leaving {
		t.mu.Unlock()
		return fmt.Errorf("nvlink: unregister %#x: %w", b.Addr, segtable.ErrNotFound)
	}
	r.leaving = true
	t.unregs.Add(1)
	t.mu.Unlock()
	defer t.unregs.Done()
	if r.slot >= 0 {
		ctx, cancel := context.WithTimeout(context.Background(), t.cfg.DrainTimeout)
		err := t.tab.revoke(ctx, r.slot)
		cancel()
		if err != nil {
			t.mu.Lock()
			r.leaving = false // still registered (and revoked): it may be tried again
			t.mu.Unlock()
			return fmt.Errorf("nvlink: unregister %#x: %w", b.Addr, err)
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	regs := make(map[uint64]*region, len(*t.regs.Load()))
	for h, x := range *t.regs.Load() {
		if h != reg.Handle {
			regs[h] = x
		}
	}
	t.regs.Store(&regs)
	if r.slot >= 0 {
		t.slots = append(t.slots, r.slot)
	}
	return nil
}

// Open returns an endpoint to a segment of another process of this host.
// It fails with an error wrapping ErrUnreachable when the segment has no
// nvlink endpoint or no buffer with an nvlink key (no exported GPU
// memory), runs on another host (another boot id) or in this very process
// (CUDA does not open a process's own IPC handles; the in-process
// transport serves it), or its grant table cannot be mapped.
//
// The engine picks one transport per segment: host buffers of a segment
// opened through nvlink are denied (they have no nvlink key). A segment
// mixing GPU and host memory needs the engine to choose per buffer.
func (t *Transport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	if t.closed.Load() {
		return nil, fmt.Errorf("nvlink: open %s: %w", desc.Name, transport.ErrClosed)
	}
	keyed := false
	for _, b := range desc.AllBuffers() {
		keyed = keyed || b.Keys[Name] != ""
	}
	if !keyed {
		// Nothing of the segment is exported GPU memory: another
		// transport reaches its host memory, so let the engine pick it.
		return nil, fmt.Errorf("nvlink: open %s: no buffer has an nvlink key: %w", desc.Name, transport.ErrUnreachable)
	}
	tab, err := t.peerTable(desc)
	if err != nil {
		return nil, fmt.Errorf("nvlink: open %s: %w", desc.Name, err)
	}
	e := &Endpoint{t: t, addr: desc.Endpoints[Name], tab: tab}
	t.mu.Lock()
	e.mu.Lock()
	e.update(desc, tab, nil) // the first view: nothing to retire
	e.mu.Unlock()
	if t.closed.Load() {
		t.mu.Unlock()
		e.Close()
		return nil, fmt.Errorf("nvlink: open %s: %w", desc.Name, transport.ErrClosed)
	}
	t.eps[e] = struct{}{}
	t.mu.Unlock()
	return e, nil
}

// peerTable checks desc's endpoint and maps the peer's grant table.
func (t *Transport) peerTable(desc *segtable.SegmentDesc) (*table, error) {
	s, ok := desc.Endpoints[Name]
	if !ok {
		return nil, fmt.Errorf("no %s endpoint: %w", Name, transport.ErrUnreachable)
	}
	a, err := parseAddr(s)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, transport.ErrUnreachable)
	}
	if a.boot != t.boot {
		return nil, fmt.Errorf("on another host (boot id %s, ours %s): %w", a.boot, t.boot, transport.ErrUnreachable)
	}
	if a.pid == os.Getpid() && !t.drv.ipcSameProcess() {
		return nil, fmt.Errorf("in this process (CUDA opens no process's own IPC handles): %w", transport.ErrUnreachable)
	}
	tab, err := openTable(a.table)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, transport.ErrUnreachable)
	}
	return tab, nil
}

// mapHandle maps the allocation h names on d, once per process. mu must
// be held.
func (t *Transport) mapHandle(d *device, h ipcHandle) (*mapping, error) {
	k := mapKey{d, h}
	if m := t.maps[k]; m != nil {
		m.refs++
		return m, nil
	}
	lockThread()
	defer unlockThread()
	if err := t.drv.setCurrent(d.ctx); err != nil {
		return nil, err
	}
	p, err := t.drv.ipcOpen(h)
	if err != nil {
		return nil, err
	}
	// The size of what was mapped, from the driver: a peer's key names
	// ranges inside it, and is checked against it, not trusted.
	_, size, err := t.drv.addressRange(p)
	if err != nil {
		t.drv.ipcClose(p)
		return nil, err
	}
	m := &mapping{ptr: p, size: size, dev: d, refs: 1}
	t.maps[k] = m
	return m, nil
}

// unmapHandle drops a reference taken by mapHandle. mu must be held.
func (t *Transport) unmapHandle(m *mapping) {
	if m.refs--; m.refs > 0 {
		return
	}
	for k, x := range t.maps {
		if x == m {
			delete(t.maps, k)
		}
	}
	lockThread()
	defer unlockThread()
	if t.drv.setCurrent(m.dev.ctx) == nil {
		t.drv.ipcClose(m.ptr)
	}
}

// Poll completes the slices whose copies finished, on every GPU, and
// reports how many; then it drops what endpoints' replaced views used once
// their copies are done (see Endpoint.Update). It never blocks: a GPU
// another poller is reaping is skipped, and so is the dropping while
// another goroutine holds the locks it needs. Safe for concurrent use.
func (t *Transport) Poll() int {
	n := 0
	for _, d := range t.devs {
		if d.ready.Load() {
			n += d.lane.poll(t.drv)
		}
	}
	if t.retiring.Load() != 0 {
		t.reclaim()
	}
	if s := t.stg.Load(); s != nil {
		n += s.poll()
	}
	return n
}

// SetWake takes the function that wakes the engine's parked pollers
// (transport.Waker): copies are queued from goroutines other than the
// poller's (a staged READ's copy to the GPU from the inner transport's
// goroutine; any Post from a goroutine a parked poller lent its rings),
// and only a Poll sees them finish.
func (t *Transport) SetWake(wake func()) { t.wake.Store(&wake) }

// wakeup calls SetWake's function, if any: a copy was queued. Cheap when
// no poller is parked.
func (t *Transport) wakeup() {
	if w := t.wake.Load(); w != nil {
		(*w)()
	}
}

// InFlight reports whether copies are queued on a GPU or staged slices
// wait for room (transport.InFlight): the engine's pollers keep polling
// until they are done, as no event wakes them.
func (t *Transport) InFlight() bool {
	for _, d := range t.devs {
		if d.ready.Load() && d.lane.head.Load() != d.lane.tail.Load() {
			return true
		}
	}
	s := t.stg.Load()
	return s != nil && s.wait.Load() != 0
}

// reclaim drops what endpoints' replaced views used and no copy uses any
// more, unless another goroutine holds the locks. Rare: only after an
// Update replaced a view while its copies were in flight.
func (t *Transport) reclaim() {
	if !t.mu.TryLock() {
		return
	}
	defer t.mu.Unlock()
	for e := range t.eps {
		if t.retiring.Load() == 0 {
			return
		}
		if len(e.retired) == 0 || !e.mu.TryLock() { // e.retired changes under t.mu too
			continue
		}
		e.reclaim()
		e.mu.Unlock()
	}
}

// Close closes every endpoint (completing their slices in flight with
// ErrClosed once their copies stopped), revokes every exported buffer and
// waits up to Config.DrainTimeout for peers' copies, frees the memory of
// Alloc and the staging arena, and releases the GPUs. Idempotent.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed.Swap(true) {
		t.mu.Unlock()
		return nil
	}
	eps := make([]*Endpoint, 0, len(t.eps))
	for e := range t.eps {
		eps = append(eps, e)
	}
	staged := make([]*stagedEndpoint, 0, len(t.staged))
	for e := range t.staged {
		staged = append(staged, e)
	}
	t.mu.Unlock()
	var errs []error
	for _, e := range eps {
		errs = append(errs, e.Close())
	}
	for _, e := range staged {
		errs = append(errs, e.Close())
	}
	t.unregs.Wait() // their drains read the grant table
	ctx, cancel := context.WithTimeout(context.Background(), t.cfg.DrainTimeout)
	if err := t.tab.shut(ctx); err != nil {
		errs = append(errs, fmt.Errorf("nvlink: close: %w", err))
	}
	cancel()
	t.tab.unmap()
	close(t.shut)
	t.mu.Lock()
	defer t.mu.Unlock()
	lockThread()
	defer unlockThread()
	for p, d := range t.allocs {
		if t.drv.setCurrent(d.ctx) == nil {
			errs = append(errs, t.drv.memFree(p))
		}
	}
	clear(t.allocs)
	if s := t.stg.Load(); s != nil && t.drv.setCurrent(s.home.ctx) == nil {
		errs = append(errs, s.destroy())
	}
	for _, d := range t.devs {
		if !d.ready.Load() {
			continue
		}
		// Endpoints are closed, so the lane is empty; a Poll still running
		// holds pollMu and finds nothing.
		d.lane.pollMu.Lock()
		if t.drv.setCurrent(d.ctx) == nil {
			d.lane.destroy(t.drv)
		}
		d.lane.pollMu.Unlock()
		errs = append(errs, t.drv.release(d.ordinal))
	}
	return errors.Join(errs...)
}

// regions returns the live registrations by handle. Lock-free.
func (t *Transport) regions() map[uint64]*region { return *t.regs.Load() }
