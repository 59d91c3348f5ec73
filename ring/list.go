// list.go holds prepared lists of blocks: a request with sq.FlagList
// moves a run of a list's blocks, each as one slice, so that a caller
// moving thousands of scattered blocks (a KV cache's pages) pays one
// entry, one slot and one completion for the run rather than one each per
// block, as NIXL's prepared descriptor lists and io_uring's READV do.

package ring

import (
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"sync/atomic"
	"unsafe"

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
	// time it takes to copy some 20 MiB; the run moves 64 KiB or more),
	// and a round takes up to 64 entries.
	MaxListBlocks = 1 << 16
	// MaxBlock is the longest block (4 MiB). A block moves as one slice:
	// a run with a block longer than its path's slice size allows
	// (MaxSlice: 1.25 MiB for tcp and in process, the engine's own
	// segment too, 5 MiB for shm) fails with CodeLength, and such a
	// request does not fail over to a path with shorter slices. Nor is a
	// block cut while a ring of a higher class shares the poller
	// (yieldBytes).
	MaxBlock = 4 << 20
)

// ErrList reports a list that Prepare refuses: empty, too long, or with a
// block of length 0, above MaxBlock or wrapping around the address space.
var ErrList = errors.New("ring: bad block list")

// ListID names a prepared list in a Lists table: an index and a 44-bit
// generation, so an ID kept after its list was freed never names a later
// one (a slot would have to be reused 2^44 times). The zero value names
// none.
type ListID uint64

// List is a list of blocks (Lists.Prepare makes them), immutable while a
// Lists table holds it. Rings find it by its ID in Tables.Lists; a request
// keeps the run of its blocks it started with, holding a reference, so
// freeing a list (taking it out of the table) ends no request that uses
// it: the entries not yet taken that name it complete with CodeInvalid.
// Its storage goes back to its table's cache once it is freed and no
// request holds it. Safe for concurrent use.
type List struct {
	blocks []Block
	// refs counts the table slots that hold the list and the requests
	// that took it (acquire); at zero a list of home's goes back to its
	// cache.
	refs atomic.Int32
	home *Lists
}

// checkBlocks checks a list's blocks: 1 to MaxListBlocks of them, each 1
// to MaxBlock bytes long and not wrapping around. Where they lie is
// checked per request, against the entry's buffer and segment.
func checkBlocks(blocks []Block) error {
	if len(blocks) == 0 || len(blocks) > MaxListBlocks {
		return fmt.Errorf("%w: %d blocks (1 to %d)", ErrList, len(blocks), MaxListBlocks)
	}
	for i, b := range blocks {
		if b.Length == 0 || b.Length > MaxBlock {
			return fmt.Errorf("%w: block %d is %d bytes long (1 to %d)", ErrList, i, b.Length, MaxBlock)
		}
		if b.Local+b.Length < b.Local || b.Remote+b.Length < b.Remote {
			return fmt.Errorf("%w: block %d wraps around", ErrList, i)
		}
	}
	return nil
}

// ref takes a reference to l unless it has none left (freed: in its
// table's cache, or being filled again), and reports whether it did.
func (l *List) ref() bool {
	for {
		n := l.refs.Load()
		if n <= 0 {
			return false
		}
		if l.refs.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// release drops a reference to l; the last one gives l's storage back
// to its table's cache (a list made without one is left to the GC).
func (l *List) release() {
	if l.refs.Add(-1) == 0 && l.home != nil {
		l.home.recycle(l)
	}
}

// Lists is a table of prepared lists by ListID. Looking a list up for a
// request (acquire) is lock-free: a few loads and a compare-and-swap, and
// a reference taken on a list freed meanwhile is given back, which may
// recycle it. Prepare and Remove take a lock, and allocate nothing once
// the slot's chunk of 1,024 exists and the cache has held as many lists
// of the size class (a last release takes the lock again to recycle). It
// holds up to MaxLists lists at once, and never runs out of IDs (a freed
// slot's next ID has the next generation). It keeps the storage of freed
// lists for Prepare to reuse (up to listCacheBytes), so that a list
// prepared and freed per request allocates nothing once warm. The zero
// value is an empty table ready for use; safe for concurrent use.
type Lists struct {
	mu     sync.Mutex
	chunks [MaxLists / listChunk]atomic.Pointer[[listChunk]listSlot]
	size   uint32   // indexes handed out; under mu
	free   []uint32 // indexes free again; under mu
	// cache holds freed lists by class, capacity 1<<class blocks;
	// cached is their bytes. Under mu.
	cache  [listClasses][]*List
	cached uint64
}

// listSlot holds a list and the ID that names it (0 when free); gen is
// the generation of the slot's last ID, under the table's mutex.
type listSlot struct {
	id  atomic.Uint64
	l   atomic.Pointer[List]
	gen uint64
}

const (
	// MaxLists is how many lists a Lists table holds at once.
	MaxLists  = 1 << listIndexBits
	listChunk = 1 << 10
	// listIndexBits of a ListID are the slot's index, the rest its
	// generation.
	listIndexBits = 20
	// listClasses are the capacities of cached lists: 1, 2, 4, … blocks,
	// up to MaxListBlocks.
	listClasses = 17
	// listCacheBytes bounds the storage a table keeps for reuse, lists'
	// headers counted: 16 MiB, about 700,000 blocks in large lists or
	// 200,000 lists of one; past it, a freed list is left to the GC.
	listCacheBytes = 16 << 20
	blockBytes     = uint64(unsafe.Sizeof(Block{}))
)

// ErrListsFull reports a Lists table that holds MaxLists lists.
var ErrListsFull = errors.New("ring: too many prepared lists")

// Prepare copies blocks (checked: ErrList, see checkBlocks) into a list,
// reusing the storage of a freed one of the table's where it can, and
// adds it (ErrListsFull past MaxLists).
func (t *Lists) Prepare(blocks []Block) (ListID, error) {
	if err := checkBlocks(blocks); err != nil {
		return 0, err
	}
	class := listClass(len(blocks))
	var l *List
	t.mu.Lock()
	if c := t.cache[class]; len(c) > 0 {
		l, t.cache[class] = c[len(c)-1], c[:len(c)-1]
		t.cached -= l.size()
	}
	t.mu.Unlock()
	if l == nil {
		l = &List{blocks: make([]Block, 0, 1<<class), home: t}
	}
	l.blocks = append(l.blocks[:0], blocks...) // no reference: nobody reads it
	id, err := t.add(l)
	if err != nil {
		t.recycle(l)
		return 0, err
	}
	return id, nil
}

// listClass is the size class of a list of n blocks: capacity 1<<class.
func listClass(n int) int { return bits.Len(uint(n - 1)) }

// size is what keeping l in a cache holds: its blocks' storage, its
// header and the cache's pointer to it.
func (l *List) size() uint64 {
	return uint64(cap(l.blocks))*blockBytes + uint64(unsafe.Sizeof(List{})) + 8
}

// recycle keeps l's storage for Prepare, unless the cache is full.
func (t *Lists) recycle(l *List) {
	n := l.size()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.cached+n > listCacheBytes {
		return
	}
	class := listClass(cap(l.blocks)) // a power of two: Prepare made it
	t.cache[class] = append(t.cache[class], l)
	t.cached += n
}

// add stores l, taking a reference to it, and returns its ID, or
// ErrListsFull. A list may be added under several IDs (tests do).
func (t *Lists) add(l *List) (ListID, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var idx uint32
	if n := len(t.free); n > 0 {
		idx, t.free = t.free[n-1], t.free[:n-1]
	} else {
		if t.size >= MaxLists {
			return 0, ErrListsFull
		}
		idx = t.size
		t.size++
	}
	c := t.chunks[idx/listChunk].Load()
	if c == nil {
		c = new([listChunk]listSlot)
		t.chunks[idx/listChunk].Store(c)
	}
	s := &c[idx%listChunk]
	s.gen++ // from 1: no ID is 0
	id := ListID(s.gen<<listIndexBits | uint64(idx))
	l.refs.Add(1)
	s.l.Store(l)
	s.id.Store(uint64(id)) // after the list: get reads the ID first
	return id, nil
}

// slot returns the slot id's index names, or nil.
func (t *Lists) slot(id ListID) *listSlot {
	idx := uint32(id & (1<<listIndexBits - 1))
	c := t.chunks[idx/listChunk].Load()
	if c == nil {
		return nil
	}
	return &c[idx%listChunk]
}

// get returns the list id names, or nil (freed, never added, 0), without
// a reference: its blocks are not to be read. Lock-free.
func (t *Lists) get(id ListID) *List {
	s := t.slot(id)
	if id == 0 || s == nil || s.id.Load() != uint64(id) {
		return nil
	}
	l := s.l.Load()
	// The ID again: a Remove and an Add since the first load would have
	// left another ID's list (the ID goes before the list on Remove, and
	// the new list comes before the new ID on Add).
	if s.id.Load() != uint64(id) {
		return nil
	}
	return l
}

// acquire returns the list id names with a reference taken, or nil
// (freed, never added, 0). Its blocks stay as they are until the
// reference is dropped (release). Lock-free.
func (t *Lists) acquire(id ListID) *List { return t.hold(id, t.get(id)) }

// hold takes a reference to l, which get(id) returned, and returns it if
// id still names it, else nil.
func (t *Lists) hold(id ListID, l *List) *List {
	if l == nil || !l.ref() {
		return nil
	}
	if t.get(id) != l {
		// Freed meanwhile, and maybe made again under another ID
		// (Prepare's reuse): not the list id named.
		l.release()
		return nil
	}
	return l
}

// Blocks returns the number of blocks of the list id names, 0 for none.
func (t *Lists) Blocks(id ListID) int {
	l := t.acquire(id)
	if l == nil {
		return 0
	}
	defer l.release()
	return len(l.blocks)
}

// Remove takes the list id names out of the table, dropping the table's
// reference, and reports whether there was one.
func (t *Lists) Remove(id ListID) bool {
	t.mu.Lock()
	s := t.slot(id)
	if id == 0 || s == nil || s.id.Load() != uint64(id) {
		t.mu.Unlock()
		return false
	}
	l := s.l.Load()
	s.id.Store(0)
	s.l.Store(nil)
	t.free = append(t.free, uint32(id&(1<<listIndexBits-1)))
	t.mu.Unlock()
	l.release() // outside mu: the last reference takes it to recycle
	return true
}

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
	list   *List // held: the request releases it when it ends
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
// CodeLength for a run above the ring's MaxLength. A run it returns holds
// a reference to its list, for the caller to release (refuseRun, or the
// request's end).
func (r *Ring) checkList(e *sq.Entry, buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint]) (listRun, cq.Code) {
	var l *List
	if r.tables.Lists != nil {
		l = r.tables.Lists.acquire(ListID(e.Local))
	}
	if l == nil {
		return listRun{}, cq.CodeInvalid
	}
	run, code := checkRun(l, e, buf, seg, r.cfg.MaxLength)
	if code != cq.CodeOK {
		l.release()
		return listRun{}, code
	}
	run.list = l
	return run, cq.CodeOK
}

// checkRun is checkList's checks of the run of l, which is held.
func checkRun(l *List, e *sq.Entry, buf *segtable.Buffer, seg *segtable.Segment[transport.Endpoint], maxLength uint64) (listRun, cq.Code) {
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
	if run.bytes > maxLength {
		return listRun{}, cq.CodeLength
	}
	return run, cq.CodeOK
}

// refuseRun completes a request refused after checkList, releasing its
// run's list (nil for a request of no list).
func (r *Ring) refuseRun(userData uint64, code cq.Code, l *List) {
	if l != nil {
		l.release()
	}
	r.complete(userData, code, 0)
}
