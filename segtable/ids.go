package segtable

// BufferID names a registered local buffer. It packs a table index and a
// generation, so an ID kept after its buffer was unregistered never resolves
// to a buffer registered later in the same slot. The zero value names no
// buffer.
type BufferID uint32

// SegmentID names an opened segment. LocalSegmentID is the engine's own
// segment; other IDs, like BufferIDs, pack an index and a generation.
type SegmentID uint32

// LocalSegmentID names the engine's own memory: transfers to it are copies
// between the engine's registered buffers.
const LocalSegmentID SegmentID = 0

const (
	idIndexBits = 20
	idIndexMask = 1<<idIndexBits - 1
	// MaxEntries is how many buffers (or segments) one table holds at once.
	MaxEntries = idIndexMask
)

// Index returns the table index id packs: below MaxEntries+1, and the same
// for every generation of the index, so at most one live buffer has it at
// a time. A transport may key its own table of registrations by it.
func (id BufferID) Index() int { return int(uint32(id) & idIndexMask) }

func makeID(index int, gen uint32) uint32 { return gen<<idIndexBits | uint32(index) }

func splitID(id uint32) (index int, gen uint32) { return int(id & idIndexMask), id >> idIndexBits }
