// lists.go holds prepared lists of blocks (ring.List): a caller that moves
// many scattered blocks between one buffer and one segment, as a KV cache's
// pages go, prepares their offsets and addresses once and moves a run of
// them with one entry (FlagList): one slot, one completion and one check of
// the entry for the run, each block still its own slice.

package moonring

import (
	"fmt"

	"github.com/moonring/moonring/ring"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
)

type (
	// Block is one block of a prepared list: Length bytes at offset Local
	// of the entry's buffer and at address Remote of its segment.
	Block = ring.Block
	// ListID names a prepared list; the zero value names none. An ID
	// kept after FreeList never names a list prepared later (IDs do not
	// run out: a slot's generation has 44 bits).
	ListID = ring.ListID
)

// Limits of prepared lists: at most MaxListBlocks blocks a list, each 1
// to MaxBlock bytes (and no longer than the slices of the path a request
// takes: 1.25 MiB over tcp and in process, the engine's own segment too,
// 5 MiB over shm), MaxLists lists an engine at once.
const (
	MaxListBlocks = ring.MaxListBlocks
	MaxBlock      = ring.MaxBlock
	MaxLists      = ring.MaxLists
)

// Errors of PrepareList: a list it refuses (ErrList), or one too many
// (ErrListsFull).
var (
	ErrList      = ring.ErrList
	ErrListsFull = ring.ErrListsFull
)

// PrepareList copies blocks into a list that entries with FlagList name by
// the returned ID, on every ring of the engine and the batch API's. It
// checks the blocks' count and lengths (ErrList), and refuses a list
// beyond the MaxLists the engine holds at once (ErrListsFull); where the
// blocks lie is checked per entry, against the entry's buffer and
// segment, when a poller takes it: a block outside either fails the whole
// request before any byte moves (ErrLocalRange, ErrRemoteRange), and so
// does one longer than the path's transport takes in one slice
// (ErrLength: see MaxBlock). The list lives until FreeList or Close; it
// is immutable, so one list may serve any number of requests at once.
// Its storage is reused once it is freed and no request holds it, so a
// list prepared and freed per request allocates nothing once the engine
// has held as many of its size class (a power of two) at once; up to 16
// MiB is kept for reuse. Safe for concurrent use.
func (e *Engine) PrepareList(blocks []Block) (ListID, error) {
	if e.closed.Load() {
		return 0, ErrClosed
	}
	id, err := e.lists.Prepare(blocks)
	if err != nil {
		return 0, fmt.Errorf("moonring: prepare list: %w", err)
	}
	return id, nil
}

// FreeList forgets the list id names. Requests a poller already took keep
// the blocks they had and finish as they would have; entries naming id
// that it takes afterwards complete with ErrInvalid. It returns an error
// wrapping segtable.ErrNotFound for an ID that names no list. Safe for
// concurrent use.
func (e *Engine) FreeList(id ListID) error {
	if !e.lists.Remove(id) {
		return fmt.Errorf("moonring: free list %d: %w", id, segtable.ErrNotFound)
	}
	return nil
}

// ListEntry returns the entry that moves count blocks of list, from its
// block first on, between buf and seg: op is Read (segment to buffer) or
// Write, userData comes back in its completion. Set Timeout, Tag (with
// FlagNotify on a Write) and the transport hints on it as on any entry.
func ListEntry(op Op, buf BufferID, seg SegmentID, list ListID, first, count int, userData uint64) Entry {
	return Entry{Op: op, Flags: sq.FlagList, Buffer: buf, Segment: seg,
		Local: uint64(list), Remote: uint64(first), Length: uint64(count), UserData: userData}
}
