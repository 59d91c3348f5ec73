package segtable

import (
	"sync/atomic"
	"unsafe"
)

// DescList holds the buffers of an engine's own descriptor, kept up to
// date one registration at a time: a Put or Delete copies a leaf of them
// and the nodes above it, or nothing for a value pending (see Sorted: a
// buffer registered and unregistered again with few registrations
// between), where rebuilding the descriptor from every buffer made each
// registration O(n) and n of them n². Find is lock-free. A
// Segment given a DescList (Segment.SetList) resolves requests with it
// and builds its flat descriptor only when asked for one, once per change.
//
// Find, Len and Buffers are safe for concurrent use with each other and
// with one changer; changes (Put, Delete, Reset) must be serialized by the
// caller. The zero value is empty and ready for use.
//
// The remote-accessible entries are also kept as a ChunkList (Remote),
// which a publish hands the store as it is: a change copies one chunk of
// at most ChunkSize buffers (half of one when it splits a full one, none
// when a Delete undoes the Put before it), and the descriptors published
// before share every other chunk.
type DescList struct {
	s      Sorted[descEntry]
	cache  atomic.Pointer[descCache] // the last flat descriptor built
	remote ChunkList                 // the remote-accessible entries
}

// descEntry is a value of the list's Sorted: 16 bytes, so that the copy
// of a leaf that a change makes is 1 KiB of them, not 1.5 (with the ID
// and the remote bit beside the length; their place in descItem costs
// nothing, a BufferDesc's 56 bytes taking an allocation of 64 either
// way).
type descEntry struct {
	d      *descItem // not modified once in the list
	length uint64    // d.Length, beside the key: Find reads no BufferDesc
}

// descItem is an entry's descriptor, with what the changes match on.
type descItem struct {
	BufferDesc
	id     BufferID
	remote bool
}

var _ [16 - unsafe.Sizeof(descEntry{})]byte // compile error if larger
var _ [64 - unsafe.Sizeof(descItem{})]byte  // one size class with a BufferDesc

type descCache struct {
	header *SegmentDesc
	ver    uint64 // the entries' version (Sorted.version) it was built from
	desc   *SegmentDesc
}

// Put adds d, the descriptor of buffer id (remote: whether peers see it).
// Entries whose ranges d meets are dropped first: their buffers left the
// owner's table already (it refuses overlaps), only their Deletes are
// still to come.
func (l *DescList) Put(id BufferID, d BufferDesc, remote bool) {
	end := d.Addr + d.Length - 1
	for {
		x, _, _, ok := l.s.Floor(end)
		if !ok || x.d.Addr+x.d.Length <= d.Addr {
			break
		}
		l.s.Delete(x.d.Addr, func(y descEntry) bool { return y.d == x.d })
		if x.d.remote {
			l.remote.Delete(x.d.Addr)
		}
	}
	l.s.Insert(d.Addr, descEntry{d: &descItem{BufferDesc: d, id: id, remote: remote}, length: d.Length})
	if remote {
		// It overlaps nothing now; a bad range (which the owner's table
		// refuses first) is left out of what peers see.
		_ = l.remote.Insert(d)
	}
}

// Delete drops the entry of buffer id, which starts at addr, if it is
// there.
func (l *DescList) Delete(id BufferID, addr uint64) {
	remote := false
	if l.s.Delete(addr, func(x descEntry) bool { remote = x.d.remote; return x.d.id == id }) && remote {
		l.remote.Delete(addr)
	}
}

// Remote returns the remote-accessible entries' descriptors as chunks
// (see ChunkList), for SegmentDesc.Chunked: immutable, sharing with what
// Remote returned before every chunk the changes since did not touch.
// Calls must be serialized with the changes.
func (l *DescList) Remote() *BufferChunks { return l.remote.Chunks() }

// Rev returns a number that grows with every change of the
// remote-accessible entries, for SegmentDesc.Rev. Calls must be
// serialized with the changes.
func (l *DescList) Rev() uint64 { return l.remote.Seq() }

// Reset replaces the entries with ds, the descriptors of the buffers ids,
// sorted by address and not overlapping; remote says which of them peers
// see.
func (l *DescList) Reset(ids []BufferID, ds []BufferDesc, remote []bool) {
	keys := make([]uint64, len(ds))
	es := make([]descEntry, len(ds))
	items := make([]descItem, len(ds))
	var rs []BufferDesc
	for i := range ds {
		keys[i] = ds[i].Addr
		items[i] = descItem{BufferDesc: ds[i], id: ids[i], remote: remote[i]}
		es[i] = descEntry{d: &items[i], length: ds[i].Length}
		if remote[i] {
			rs = append(rs, ds[i])
		}
	}
	l.s.Reset(keys, es)
	// Sorted and not overlapping, as the caller promises; if not, peers
	// see none rather than a list that Validate would refuse.
	if l.remote.Reset(rs) != nil {
		_ = l.remote.Reset(nil)
	}
}

// Len returns the number of entries.
func (l *DescList) Len() int { return l.s.Len() }

// Find returns the index, among all entries in address order, of the one
// that holds [addr, addr+n), or -1.
func (l *DescList) Find(addr, n uint64) int {
	x, start, i, ok := l.s.Floor(addr)
	if !ok || n == 0 || n > x.length || addr-start > x.length-n {
		return -1
	}
	return i
}

// Buffers returns the entries' descriptors in address order, only those
// peers see when remoteOnly: a new slice whose Keys maps are shared and
// must not be modified.
func (l *DescList) Buffers(remoteOnly bool) []BufferDesc {
	n := l.s.Len()
	if remoteOnly {
		n = 0
	}
	out := make([]BufferDesc, 0, n)
	l.s.Ascend(func(_ uint64, x descEntry) bool {
		if x.d.remote || !remoteOnly {
			out = append(out, x.d.BufferDesc)
		}
		return true
	})
	return out
}

// desc returns header with the buffers of every entry, built once per
// change of either. Built during changes, it holds the entries of the
// version its walk began on (a change publishes a new view), and the next
// call builds it again.
func (l *DescList) desc(header *SegmentDesc) *SegmentDesc {
	ver := l.s.version()
	if c := l.cache.Load(); c != nil && c.header == header && c.ver == ver {
		return c.desc
	}
	d := *header
	d.Buffers = make([]BufferDesc, 0, l.s.Len())
	l.s.Ascend(func(_ uint64, x descEntry) bool {
		d.Buffers = append(d.Buffers, x.d.BufferDesc)
		return true
	})
	l.cache.Store(&descCache{header: header, ver: ver, desc: &d})
	return &d
}
