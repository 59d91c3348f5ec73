package segtable

import "sync/atomic"

// slotDir is the slots of a table by index (Handles, and the engine's
// tables by ID): a fixed array of 64 pointers to arrays of 128 pointers
// to chunks of 128 slots, the middle arrays and chunks made as indexes
// reach them and kept. A lookup is three loads and no lock; an empty
// directory is 512 bytes, where a fixed array of every chunk's pointer
// was 64 KiB a table, two an engine, mostly never touched and all of it
// scanned by the collector (BenchmarkScaleSegments: 133 of the 152 KiB an
// idle target engine weighed). Lookups are safe for concurrent use with
// one maker; makers serialize.
type slotDir[T any] struct {
	dir [handleDirs]atomic.Pointer[[handleMids]atomic.Pointer[[tableChunk]handleSlot[T]]]
}

const (
	handleMidBits = 7
	handleMids    = 1 << handleMidBits
	handleDirBits = idIndexBits - handleMidBits - tableChunkBits
	handleDirs    = 1 << handleDirBits
)

// find returns idx's slot, or nil when its chunk was never made. idx is
// below MaxEntries.
func (d *slotDir[T]) find(idx uint32) *handleSlot[T] {
	m := d.dir[idx>>(handleMidBits+tableChunkBits)].Load()
	if m == nil {
		return nil
	}
	c := m[idx>>tableChunkBits&(handleMids-1)].Load()
	if c == nil {
		return nil
	}
	return &c[idx&(tableChunk-1)]
}

// chunk returns the chunk of slots that holds index ci<<tableChunkBits,
// or nil.
func (d *slotDir[T]) chunk(ci int) *[tableChunk]handleSlot[T] {
	m := d.dir[ci>>handleMidBits].Load()
	if m == nil {
		return nil
	}
	return m[ci&(handleMids-1)].Load()
}

// slot returns idx's slot, making the middle array and the chunk when
// they are not there yet; the caller serializes makers.
func (d *slotDir[T]) slot(idx int) *handleSlot[T] {
	p := &d.dir[idx>>(handleMidBits+tableChunkBits)]
	m := p.Load()
	if m == nil {
		m = new([handleMids]atomic.Pointer[[tableChunk]handleSlot[T]])
		p.Store(m)
	}
	cp := &m[idx>>tableChunkBits&(handleMids-1)]
	c := cp.Load()
	if c == nil {
		c = new([tableChunk]handleSlot[T])
		cp.Store(c)
	}
	return &c[idx&(tableChunk-1)]
}
