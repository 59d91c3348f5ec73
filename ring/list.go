// list.go holds prepared lists of blocks: a request with sq.FlagList
// moves a run of a list's blocks, each as one slice, so that a caller
// moving thousands of scattered blocks (a KV cache's pages) pays one
// entry, one slot and one completion for the run rather than one each per
// block, as NIXL's prepared descriptor lists and io_uring's READV do.

package ring

import (
	"errors"
	"fmt"
	"math"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// Block is one piece of a list: Length bytes at offset Local of the
// entry's local buffer and at address Remote of its segment.
type Block struct {
	Local, Remote, Length uint64
}

// Limits of a List.
const (
	// MaxListBlocks is the most blocks a list holds. A run's blocks are
	// checked in one go when the poller takes its entry, 10-18 ns a
	// block on the development VM (BenchmarkCheckList): a run of 256
	// holds the poller a few µs, one of MaxListBlocks about 1 ms (the
	// time it takes to copy some 20 MiB; the run moves 64 KiB or more).
	MaxListBlocks = 1 << 16
	// MaxBlock is the longest block (4 MiB): a block moves as one
	// slice, whatever the transport's slice size.
	MaxBlock = 4 << 20
)

// ErrList reports a list that NewList refuses: empty, too long, or with a
// block of length 0 or above MaxBlock.
var ErrList = errors.New("ring: bad block list")

// ListID names a prepared list (an index and a generation, as a
// segtable.Handle: an ID kept after its list was freed never names a
// later one). The zero value names none.
type ListID = segtable.Handle

// List is an immutable list of blocks. Rings find it by its ID in
// Tables.Lists; a request keeps the *List it started with, so freeing a
// list (taking it out of the table) ends no request that uses it: the
// entries not yet taken that name it complete with CodeInvalid. Safe for
// concurrent use.
type List struct {
	blocks []Block
}

// NewList returns a list of a copy of blocks, checked: 1 to MaxListBlocks
// blocks, each 1 to MaxBlock bytes long. Where they lie is checked per
// request, against the entry's buffer and segment.
func NewList(blocks []Block) (*List, error) {
	if len(blocks) == 0 || len(blocks) > MaxListBlocks {
		return nil, fmt.Errorf("%w: %d blocks (1 to %d)", ErrList, len(blocks), MaxListBlocks)
	}
	l := &List{blocks: make([]Block, len(blocks))}
	for i, b := range blocks {
		if b.Length == 0 || b.Length > MaxBlock {
			return nil, fmt.Errorf("%w: block %d is %d bytes long (1 to %d)", ErrList, i, b.Length, MaxBlock)
		}
		if b.Local+b.Length < b.Local || b.Remote+b.Length < b.Remote {
			return nil, fmt.Errorf("%w: block %d wraps around", ErrList, i)
		}
		l.blocks[i] = b
	}
	return l, nil
}

// Len returns the number of blocks.
func (l *List) Len() int { return len(l.blocks) }

// run returns the blocks an entry with FlagList names (first, count), or
// nil when they are not all in l.
func (l *List) run(first, count uint64) []Block {
	if count == 0 || first >= uint64(len(l.blocks)) || count > uint64(len(l.blocks))-first {
		return nil
	}
	return l.blocks[first : first+count]
}

// listRun is a run of a list's blocks that a request moves, as
// checkList found it.
type listRun struct {
	blocks []Block
	bytes  uint64 // their sum
	maxLen uint64 // the longest
	rindex uint32 // the position of the remote buffer of the first
	varies bool   // they lie in several remote buffers
}

// checkList returns the run of blocks e (with sq.FlagList) names, checked
// against buf and seg, or a code that fails the request: CodeInvalid for
// an ID that names no list or a run outside it, CodeLocalRange or
// CodeRemoteRange for a block outside its buffer or the segment,
// CodeLength for a run above the ring's MaxLength.
func (r *Ring) checkList(e *sq.Entry, buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint]) (listRun, cq.Code) {
	var l *List
	if r.tables.Lists != nil && e.Local <= math.MaxUint32 {
		l = r.tables.Lists.Get(ListID(e.Local))
	}
	if l == nil {
		return listRun{}, cq.CodeInvalid
	}
	run := listRun{blocks: l.run(e.Remote, e.Length)}
	if run.blocks == nil {
		return listRun{}, cq.CodeInvalid
	}
	for i := range run.blocks {
		b := &run.blocks[i]
		if !buf.Contains(b.Local, b.Length) {
			return listRun{}, cq.CodeLocalRange
		}
		ri := seg.Resolve(b.Remote, b.Length)
		if ri < 0 {
			return listRun{}, cq.CodeRemoteRange
		}
		if i == 0 {
			run.rindex = uint32(ri)
		} else if uint32(ri) != run.rindex {
			run.varies = true
		}
		run.bytes += b.Length // at most 2^16 blocks of 2^22 bytes: no overflow
		run.maxLen = max(run.maxLen, b.Length)
	}
	if run.bytes > r.cfg.MaxLength {
		return listRun{}, cq.CodeLength
	}
	return run, cq.CodeOK
}

// block returns the local offset, remote address, length and remote
// buffer position of slice i of request q, one of a list's.
func (q *request) block(i uint32) (local, remote, n uint64, rindex uint32) {
	b := &q.blocks[i]
	rindex = q.rindex
	if q.rvaries {
		// The blocks lie in several remote buffers: find this one's
		// again (a hint only: a transport checks it, and searches when
		// the descriptor changed since).
		if ri := q.seg.Resolve(b.Remote, b.Length); ri >= 0 {
			rindex = uint32(ri)
		}
	}
	return b.Local, b.Remote, b.Length, rindex
}
