package tcp

import (
	"math"
	"sync/atomic"

	"github.com/moonring/moonring/segtable"
)

// regionIndex holds the remote-accessible regions by buffer ID, for the
// target's checks (one a frame) and unregistration: a fixed directory of
// chunks of slots, one slot per buffer index (segtable.BufferID.Index),
// holding the regions registered under that index, newest first (one
// BufferID may be registered twice while its first registration drains,
// and a new buffer may take an index whose old registration is still
// here). A lookup is two loads and a walk of that short list, without a
// lock or a search. A change stores one slot in place and makes one list
// node (a removal copies the nodes before the one it drops), so a
// register/unregister cycle copies nothing else: the copy-on-write tree it
// replaces (segtable.Sorted) copied a leaf and the nodes above it on every
// change, and searched O(log n) per frame. A chunk is made when an index
// first reaches it and kept: 8 KiB per 1,024 indexes.
//
// Lookups (Descend, newest, Values, Len) are safe for concurrent use with
// each other and with one changer; changes (add, remove) are serialized
// by the caller (Transport.mu). The zero value is empty and ready for
// use; it lives as long as its Transport.
type regionIndex struct {
	dir [regionDirs]atomic.Pointer[[regionChunk]atomic.Pointer[regionList]]
	n   atomic.Int64
}

const (
	regionChunkBits = 10
	regionChunk     = 1 << regionChunkBits
	regionDirs      = (segtable.MaxEntries + regionChunk) / regionChunk
)

// regionList is the regions of one buffer index, newest first; never
// modified once published.
type regionList struct {
	r    *region
	next *regionList
}

// head returns the list of index idx, or nil.
func (x *regionIndex) head(idx int) *regionList {
	c := x.dir[idx>>regionChunkBits].Load()
	if c == nil {
		return nil
	}
	return c[idx&(regionChunk-1)].Load()
}

// slot returns index idx's slot, making its chunk when it is not there
// yet. Changes only.
func (x *regionIndex) slot(idx int) *atomic.Pointer[regionList] {
	d := &x.dir[idx>>regionChunkBits]
	c := d.Load()
	if c == nil {
		c = new([regionChunk]atomic.Pointer[regionList])
		d.Store(c)
	}
	return &c[idx&(regionChunk-1)]
}

// add puts r at the head of its buffer index's list.
func (x *regionIndex) add(r *region) {
	s := x.slot(segtable.BufferID(r.id).Index())
	s.Store(&regionList{r: r, next: s.Load()})
	x.n.Add(1)
}

// remove drops r and reports whether it was there.
func (x *regionIndex) remove(r *region) bool {
	s := x.slot(segtable.BufferID(r.id).Index())
	head := s.Load()
	var before []*region
	for l := head; l != nil; l = l.next {
		if l.r != r {
			before = append(before, l.r)
			continue
		}
		rest := l.next
		for i := len(before) - 1; i >= 0; i-- {
			rest = &regionList{r: before[i], next: rest}
		}
		s.Store(rest)
		x.n.Add(-1)
		return true
	}
	return false
}

// newest returns the region registered last under buffer id, or nil.
func (x *regionIndex) newest(id segtable.BufferID) *region {
	for l := x.head(id.Index()); l != nil; l = l.next {
		if l.r.id == uint32(id) {
			return l.r
		}
	}
	return nil
}

// Descend calls fn for the regions of buffer id, newest first, until fn
// returns false; its arguments are the buffer ID and the region. It
// allocates nothing.
func (x *regionIndex) Descend(id uint64, fn func(id uint64, r *region) bool) {
	if id > math.MaxUint32 {
		return
	}
	for l := x.head(segtable.BufferID(id).Index()); l != nil; l = l.next {
		if uint64(l.r.id) == id && !fn(id, l.r) {
			return
		}
	}
}

// Values returns every region, by buffer index and, within one, newest
// first: a new slice.
func (x *regionIndex) Values() []*region {
	var out []*region
	for d := range x.dir {
		c := x.dir[d].Load()
		if c == nil {
			continue
		}
		for i := range c {
			for l := c[i].Load(); l != nil; l = l.next {
				out = append(out, l.r)
			}
		}
	}
	return out
}

// Len returns how many regions the index holds.
func (x *regionIndex) Len() int { return int(x.n.Load()) }
