package segtable

import "sync/atomic"

// Path is one way to reach a segment: an open endpoint of one transport.
// A segment holds every path it opened, in order of preference, and one
// of them is current: the one new requests take. Endpoint, Staged,
// Transport and SliceSize are set before the path is shared and never
// change; a path whose endpoint is reopened is replaced by a new Path.
// The health bits are atomics: safe for concurrent use.
type Path[E any] struct {
	Endpoint E
	// Staged, when set, is the endpoint for requests whose local buffer's
	// registration is Staged (see Registration): it moves them over
	// Endpoint through host buffers.
	Staged E
	// Transport is the slot of the transport that owns Endpoint.
	Transport int
	// SliceSize is the slice size of that transport; 0 means the default.
	SliceSize uint64

	down atomic.Bool
}

// Down reports whether the path was marked down (a request failed on it
// for a reason of the path) and has not been found healthy since.
func (p *Path[E]) Down() bool { return p.down.Load() }

// MarkUp clears the down mark: the path was probed and works.
func (p *Path[E]) MarkUp() { p.down.Store(false) }

// MarkDown sets the down mark and reports whether this call set it.
func (p *Path[E]) MarkDown() bool { return p.down.CompareAndSwap(false, true) }

// Path returns the segment's current path: the first of its paths, in
// order of preference, that is not down (the one it was opened with
// until another is added). Lock-free: one atomic load.
func (s *Segment[E]) Path() *Path[E] { return s.cur.Load() }

// Paths returns the segment's paths in order of preference. The slice is
// shared: callers must not modify it. Lock-free.
func (s *Segment[E]) Paths() []*Path[E] {
	if ps := s.paths.Load(); ps != nil {
		return *ps
	}
	return nil
}

// PathOf returns the segment's path through the transport in slot, or
// nil. Lock-free and allocation-free: for a request naming a transport.
func (s *Segment[E]) PathOf(slot int) *Path[E] {
	for _, p := range s.Paths() {
		if p.Transport == slot {
			return p
		}
	}
	return nil
}

// SetPaths replaces the segment's paths (in order of preference) and
// makes the first that is not down current. Writers serialize among
// themselves (the engine's health manager); readers are lock-free. ps
// must not be empty and is not modified afterwards.
func (s *Segment[E]) SetPaths(ps []*Path[E]) {
	s.paths.Store(&ps)
	s.Repick()
}

// Repick makes the first path that is not down current, and returns it;
// with every path down the current one stays. Safe for concurrent use.
func (s *Segment[E]) Repick() *Path[E] {
	for {
		old := s.cur.Load()
		next := old
		for _, p := range s.Paths() {
			if !p.Down() {
				next = p
				break
			}
		}
		if next == old || s.cur.CompareAndSwap(old, next) {
			return next
		}
	}
}

// Fail reports that a request failed on p for a reason of the path (the
// connection broke, the endpoint closed). When another path of the
// segment is up, p is marked down and the current path moves off it:
// Fail returns the path to take now and whether this call marked p down
// (the caller then tells the engine, once). When no other path is up,
// nothing changes and Fail returns p: the request retries there as it
// would with one path. Lock-free; safe for concurrent use.
func (s *Segment[E]) Fail(p *Path[E]) (next *Path[E], marked bool) {
	if p.Down() {
		next = s.Repick()
		if next.Down() {
			return p, false
		}
		return next, false
	}
	var other *Path[E]
	for _, x := range s.Paths() {
		if x != p && !x.Down() {
			other = x
			break
		}
	}
	if other == nil {
		return p, false
	}
	marked = p.MarkDown()
	next = s.Repick()
	if next.Down() || next == p {
		next = other
	}
	return next, marked
}
