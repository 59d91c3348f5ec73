package metadata

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/moonring/moonring/segtable"
)

var _ Store = (*Memory)(nil)

// Memory is the in-process [Store]: a map guarded by a mutex, for tests and
// for engines that share one process. It is safe for concurrent use. Its zero
// value is an empty, open store; a Memory must not be copied after first use.
// It holds no resource but its watches, which Close ends.
type Memory struct {
	mu     sync.Mutex
	closed bool
	descs  map[string]*segtable.SegmentDesc
	// watches holds the live watches of each name. A watch leaves the set,
	// and its channel is closed, exactly once: when its context ends or the
	// store closes, under mu.
	watches map[string]map[*watch]struct{}
}

type watch struct {
	ch   chan Event
	stop func() bool // cancels the context.AfterFunc that ends the watch
}

// NewMemory returns an empty in-process store. Close it to end its watches.
func NewMemory() *Memory { return new(Memory) }

// String returns "memory".
func (m *Memory) String() string { return "memory" }

func (m *Memory) errorf(op, name string, err error) error {
	return fmt.Errorf("metadata %s: %s %q: %w", m, op, name, err)
}

// check returns the error that stops an operation before it starts; m.mu is
// held.
func (m *Memory) check(ctx context.Context, op, name string) error {
	if m.closed {
		return m.errorf(op, name, ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return m.errorf(op, name, err)
	}
	return nil
}

// Get returns a copy of the descriptor under name: a flat one whole, a
// Chunked one as a header of its own sharing the immutable chunks
// (segtable.SegmentDesc.CloneShared, O(1) in the buffers); see [Store].
func (m *Memory) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.check(ctx, "get", name); err != nil {
		return nil, err
	}
	d, ok := m.descs[name]
	if !ok {
		return nil, m.errorf("get", name, ErrNotFound)
	}
	return d.CloneShared(), nil
}

// Put validates d and stores a copy unless another epoch holds its name;
// see [Store].
func (m *Memory) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil {
		return m.errorf("put", "", fmt.Errorf("%w: nil descriptor", segtable.ErrBadDesc))
	}
	if err := d.Validate(); err != nil {
		return m.errorf("put", d.Name, err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.check(ctx, "put", d.Name); err != nil {
		return err
	}
	old, ok := m.descs[d.Name]
	if ok && old.Epoch != d.Epoch {
		return m.errorf("put", d.Name, fmt.Errorf("%w: held by epoch %d, not %d", ErrExists, old.Epoch, d.Epoch))
	}
	if d.Chunked != nil {
		// The chunks are immutable and shared by pointer: a republish
		// after one registration costs the header, whatever the number of
		// buffers. Endpoints and devices as the copy it replaces has them
		// are shared with it (the store never changes what it holds, and
		// hands out copies: CloneShared), so the header is all it costs.
		c := *d
		c.Endpoints, c.Devices = sameOr(old, d)
		d = &c
	} else {
		d = cloneSharing(d, old)
	}
	if m.descs == nil {
		m.descs = make(map[string]*segtable.SegmentDesc)
	}
	m.descs[d.Name] = d
	m.notify(d.Name, d, false)
	return nil
}

// Delete removes the descriptor under name if its epoch matches (0 matches
// any); see [Store].
func (m *Memory) Delete(ctx context.Context, name string, epoch uint64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.check(ctx, "delete", name); err != nil {
		return err
	}
	old, ok := m.descs[name]
	if !ok {
		return m.errorf("delete", name, ErrNotFound)
	}
	if epoch != 0 && old.Epoch != epoch {
		return m.errorf("delete", name, fmt.Errorf("%w: held by epoch %d, not %d", ErrEpoch, old.Epoch, epoch))
	}
	delete(m.descs, name)
	m.notify(name, old, true)
	return nil
}

// Watch returns a coalescing channel of the changes of name, closed when ctx
// is done or the store is closed; see [Store].
func (m *Memory) Watch(ctx context.Context, name string) (<-chan Event, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.check(ctx, "watch", name); err != nil {
		return nil, err
	}
	w := &watch{ch: make(chan Event, 1)}
	if d, ok := m.descs[name]; ok {
		w.ch <- Event{Desc: d.CloneShared()}
	}
	if m.watches == nil {
		m.watches = make(map[string]map[*watch]struct{})
	}
	if m.watches[name] == nil {
		m.watches[name] = make(map[*watch]struct{})
	}
	m.watches[name][w] = struct{}{}
	// The function runs in its own goroutine, so it waits for mu if ctx is
	// already done; by then w is registered.
	w.stop = context.AfterFunc(ctx, func() { m.unwatch(name, w) })
	return w.ch, nil
}

func (m *Memory) unwatch(name string, w *watch) {
	m.mu.Lock()
	defer m.mu.Unlock()
	set := m.watches[name]
	if _, ok := set[w]; !ok {
		return // the store closed first
	}
	delete(set, w)
	if len(set) == 0 {
		delete(m.watches, name)
	}
	close(w.ch)
}

// notify hands every watcher of name its own copy of the event (a
// Chunked descriptor's header, sharing the chunks: see Get), replacing
// an event the watcher has not received yet. m.mu is held, and only holders
// of m.mu send, so after the drain the channel has room and the send cannot
// block.
func (m *Memory) notify(name string, d *segtable.SegmentDesc, deleted bool) {
	for w := range m.watches[name] {
		ev := Event{Desc: d.CloneShared(), Deleted: deleted}
		select {
		case w.ch <- ev:
		default:
			select {
			case <-w.ch:
			default: // the watcher took it meanwhile
			}
			w.ch <- ev
		}
	}
}

// Close ends every watch and makes later calls fail with [ErrClosed]. It is
// idempotent.
func (m *Memory) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	for _, set := range m.watches {
		for w := range set {
			w.stop()
			close(w.ch)
		}
	}
	m.watches = nil
	m.descs = nil
	return nil
}

// sameOr returns old's endpoints when d's are equal, else a copy of d's,
// and so with the devices: the store's own for d, shared with old (nil
// when there is none) where they did not change.
func sameOr(old, d *segtable.SegmentDesc) (map[string]string, []segtable.DeviceDesc) {
	if old == nil {
		return maps.Clone(d.Endpoints), slices.Clone(d.Devices)
	}
	eps, devs := old.Endpoints, old.Devices
	if !maps.Equal(eps, d.Endpoints) || (eps == nil) != (d.Endpoints == nil) {
		eps = maps.Clone(d.Endpoints)
	}
	if !slices.Equal(devs, d.Devices) || (devs == nil) != (d.Devices == nil) {
		devs = slices.Clone(d.Devices)
	}
	return eps, devs
}

// cloneSharing copies a flat d for the store, sharing with old, the copy it
// replaces, the key maps of the buffers that did not change: a segment
// that republishes after one registration among n buffers then costs n
// comparisons of small maps, not n new ones. The store never changes a map
// it holds, and hands out flat copies of a flat descriptor, so the sharing
// is invisible. Both
// descriptors' buffers are sorted by address (Validate).
func cloneSharing(d, old *segtable.SegmentDesc) *segtable.SegmentDesc {
	if old == nil {
		return d.Clone()
	}
	c := *d
	c.Endpoints = maps.Clone(d.Endpoints)
	c.Devices = slices.Clone(d.Devices)
	c.Buffers = make([]segtable.BufferDesc, len(d.Buffers))
	j := 0
	for i, b := range d.Buffers {
		for j < len(old.Buffers) && old.Buffers[j].Addr < b.Addr {
			j++
		}
		if j < len(old.Buffers) && old.Buffers[j].Addr == b.Addr && maps.Equal(old.Buffers[j].Keys, b.Keys) && (b.Keys == nil) == (old.Buffers[j].Keys == nil) {
			b.Keys = old.Buffers[j].Keys
		} else {
			b.Keys = maps.Clone(b.Keys)
		}
		c.Buffers[i] = b
	}
	return &c
}
