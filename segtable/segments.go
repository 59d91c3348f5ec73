package segtable

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
)

// Segment is one opened remote segment: its descriptor and the paths
// (endpoints of type E, the transports') that reach it, one of them
// current (see Path). The descriptor may be replaced when the peer
// republishes; paths are added, replaced and switched by the engine's
// health manager. Safe for concurrent use.
type Segment[E any] struct {
	ID   SegmentID
	Name string

	paths atomic.Pointer[[]*Path[E]]
	cur   atomic.Pointer[Path[E]]
	desc  atomic.Pointer[segView]
	list  atomic.Pointer[DescList]
	ref   ref
	// last is a Pos a search of the descriptor found, tried first by
	// the next Resolve (requests to one buffer pay no search). A miss
	// moves it one time in lastEvery (see Resolve). On a line of its own:
	// the fields above are read by every request.
	_    [64]byte
	last atomic.Uint32
	_    [60]byte
}

// Desc returns the current descriptor. Callers must not modify it. For a
// segment with a DescList it is the descriptor set with SetDesc with the
// list's buffers, built when the list has changed since the last Desc.
func (s *Segment[E]) Desc() *SegmentDesc {
	d := s.desc.Load().d
	if l := s.list.Load(); l != nil {
		return l.desc(d)
	}
	return d
}

// SetDesc replaces the descriptor (the peer republished it). For a
// segment with a DescList only its header counts (its Buffers are the
// list's). The packed tables Resolve searches follow the descriptor's
// chunks (a Mirror made from the last one's): a republish after one
// registration at the peer rebuilds the chunks it changed, not every
// buffer. Concurrent calls are safe; the last one stored wins.
func (s *Segment[E]) SetDesc(d *SegmentDesc) {
	var old *Mirror[span]
	if v := s.desc.Load(); v != nil {
		old = &v.m
	}
	s.desc.Store(&segView{d: d, m: *NewMirror(old, ChunksOf(d), spanOf)})
}

// segView is a descriptor with its buffers' starts and lengths packed in
// the tables of a Mirror: Resolve, once per request, searches 8-byte keys
// rather than 56-byte BufferDescs, a cache line for every probe among
// many buffers.
type segView struct {
	d *SegmentDesc
	m Mirror[span] // every buffer (a value: one load less a request)
}

// span is a buffer's range in a segView.
type span struct{ start, length uint64 }

func spanOf(b *BufferDesc) (span, bool) { return span{b.Addr, b.Length}, true }

// Buffer returns the buffer at index i of the descriptor's buffers in
// address order, and whether there is one. Lock-free; the Keys map is
// shared and must not be modified.
func (s *Segment[E]) Buffer(i int) (BufferDesc, bool) {
	if s.list.Load() != nil {
		d := s.Desc()
		if i < 0 || i >= len(d.Buffers) {
			return BufferDesc{}, false
		}
		return d.Buffers[i], true
	}
	v := s.desc.Load()
	if b := v.m.Buffer(i); b != nil {
		return *b, true
	}
	return BufferDesc{}, false
}

// NumBuffers returns the number of the descriptor's buffers.
func (s *Segment[E]) NumBuffers() int {
	if s.list.Load() != nil {
		return len(s.Desc().Buffers)
	}
	return s.desc.Load().m.Len()
}

// Index returns the index, in address order, of the buffer at the
// position Resolve returned, or -1 (for pos -1, or a position the
// descriptor has no longer).
func (s *Segment[E]) Index(pos int) int {
	if pos < 0 {
		return -1
	}
	if s.list.Load() != nil {
		return pos
	}
	return s.desc.Load().m.Index(Pos(pos))
}

// SetList gives the segment its buffers from l from now on: Resolve
// searches l and Desc builds from it. For the engine's own segment, whose
// buffers change with every registration.
func (s *Segment[E]) SetList(l *DescList) { s.list.Store(l) }

// List returns the segment's DescList, or nil.
func (s *Segment[E]) List() *DescList { return s.list.Load() }

// Acquire takes a reference that keeps the segment open; it fails once
// closing has begun. Every successful Acquire needs one Release.
func (s *Segment[E]) Acquire() bool { return s.ref.Acquire() }

// Release drops a reference taken by Acquire.
func (s *Segment[E]) Release() { s.ref.Release() }

// Closing reports whether closing has begun. Users that do not take
// references check it before each use and answer Segments.Busy.
func (s *Segment[E]) Closing() bool { return s.ref.Closing() }

// InUse returns how many references are held.
func (s *Segment[E]) InUse() int { return s.ref.InUse() }

// lastEvery: a miss of Segment.last moves it with probability
// 1/lastEvery. An atomic store is a locked instruction on amd64 (XCHG),
// which waits for the stores before it to drain (after a 4 KiB copy to
// cold memory, many), and moves the line away from the pollers of other
// nodes: requests to random buffers would pay it each, where now one in
// lastEvery does. A stream of requests to one buffer takes the hint over
// within a few dozen requests all the same.
const lastEvery = 16

// Resolve returns the position of the buffer that holds [addr, addr+n)
// in the descriptor's chunks (a Pos: Index gives its index in address
// order; a transport's Mirror of the same descriptor finds the buffer at
// it, see transport.Slice.RemoteIndex), or -1. For a segment with a
// DescList it is the index in the list. A buffer a recent search found
// is tried first, checked against the range (buffers do not overlap, so
// the one that holds it is the answer): requests to one buffer cost
// O(1), any other one search of the descriptor. Lock-free; it allocates
// nothing.
func (s *Segment[E]) Resolve(addr, n uint64) int {
	if n == 0 {
		return -1
	}
	if l := s.list.Load(); l != nil {
		return l.Find(addr, n)
	}
	m := &s.desc.Load().m
	h := s.last.Load()
	if b := m.At(h); b != nil && addr >= b.start && n <= b.length && addr-b.start <= b.length-n {
		return int(h)
	}
	b, pos := m.Floor(addr)
	if b == nil || n > b.length || addr-b.start > b.length-n {
		return -1
	}
	if rand.Uint32()%lastEvery == 0 {
		s.last.Store(pos)
	}
	return int(pos)
}

// Segments is the table of opened segments, with O(1) lock-free lookup by
// ID. Index 0 is reserved for LocalSegmentID, which the owner sets with
// SetLocal. The zero value is an empty table ready for use. Safe for
// concurrent use.
type Segments[E any] struct {
	// Busy, when set before the table is shared, reports whether users
	// that do not take references still use a segment; Close waits for it
	// to say false.
	Busy func(*Segment[E]) bool

	t     table[Segment[E]]
	local atomic.Pointer[Segment[E]]
	// byName indexes the open segments by name, under t.mu: Find was a
	// scan of every open segment, so opening n segments cost n² (the
	// thousandth open took 20 times the first).
	byName map[string][]*Segment[E]
}

// Open adds a segment with one path, ep of the transport in
// transportSlot, and returns it with its new ID. staged is the path's
// Staged endpoint, the zero E for none. More paths come with SetPaths.
func (ss *Segments[E]) Open(name string, desc *SegmentDesc, transportSlot int, sliceSize uint64, ep, staged E) (*Segment[E], error) {
	s := &Segment[E]{Name: name}
	s.SetPaths([]*Path[E]{{Endpoint: ep, Staged: staged, Transport: transportSlot, SliceSize: sliceSize}})
	s.SetDesc(desc)
	ss.t.mu.Lock()
	defer ss.t.mu.Unlock()
	ss.t.first = 1
	if _, err := ss.t.insert(s, func(id uint32) { s.ID = SegmentID(id) }); err != nil {
		return nil, err
	}
	if ss.byName == nil {
		ss.byName = map[string][]*Segment[E]{}
	}
	ss.byName[name] = append(ss.byName[name], s)
	return s, nil
}

// SetLocal installs the engine's own segment under LocalSegmentID.
func (ss *Segments[E]) SetLocal(name string, desc *SegmentDesc, transportSlot int, sliceSize uint64, ep E) *Segment[E] {
	s := &Segment[E]{ID: LocalSegmentID, Name: name}
	s.SetPaths([]*Path[E]{{Endpoint: ep, Transport: transportSlot, SliceSize: sliceSize}})
	s.SetDesc(desc)
	ss.local.Store(s)
	return s
}

// Get returns the live segment named id, or nil. Lock-free.
func (ss *Segments[E]) Get(id SegmentID) *Segment[E] {
	if id == LocalSegmentID {
		return ss.local.Load()
	}
	return ss.t.get(uint32(id))
}

// Find returns the open segment with the given name, or nil. A segment
// being closed is not found: it refuses new requests already.
func (ss *Segments[E]) Find(name string) *Segment[E] {
	ss.t.mu.Lock()
	defer ss.t.mu.Unlock()
	var found *Segment[E]
	for _, s := range ss.byName[name] {
		if !s.Closing() {
			found = s // the newest, as the scan by ID found it
		}
	}
	return found
}

// Each calls fn for every open segment other than the local one.
func (ss *Segments[E]) Each(fn func(*Segment[E])) { ss.t.each(fn) }

// Close removes the segment named id once no request holds it; new requests
// are refused from the moment it is called (and Find no longer returns
// it). If ctx ends first, the segment stays open and the error wraps
// ErrBusy.
func (ss *Segments[E]) Close(ctx context.Context, id SegmentID) (*Segment[E], error) {
	if id == LocalSegmentID {
		return nil, fmt.Errorf("%w: the local segment cannot be closed", ErrNotFound)
	}
	s := ss.Get(id)
	if s == nil {
		return nil, fmt.Errorf("%w: segment %d", ErrNotFound, id)
	}
	var busy func() bool
	if ss.Busy != nil {
		busy = func() bool { return ss.Busy(s) }
	}
	if err := s.ref.DrainWhile(ctx, busy); err != nil {
		return nil, fmt.Errorf("segment %d (%s): %w", id, s.Name, err)
	}
	ss.t.mu.Lock()
	defer ss.t.mu.Unlock()
	if ss.t.get(uint32(id)) != s {
		return nil, fmt.Errorf("%w: segment %d", ErrNotFound, id)
	}
	ss.t.set(uint32(id), nil)
	same := ss.byName[s.Name]
	for i, x := range same {
		if x == s {
			same = append(same[:i], same[i+1:]...)
			break
		}
	}
	if len(same) == 0 {
		delete(ss.byName, s.Name)
	} else {
		ss.byName[s.Name] = same
	}
	return s, nil
}
