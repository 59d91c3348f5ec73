package nvlink

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The grant table is how a target says which of its buffers peers may
// touch, with no message per slice: a small file in /dev/shm that the
// target creates and every initiator of the host maps. It has one slot per
// exported buffer; a slot's word holds
//
//	bits 63..32  generation: bumped on every registration in the slot
//	bit  31      closing: the buffer is being unregistered (or the target closed)
//	bits 30..0   copies in flight, counted by initiators
//
// An initiator takes a slot (one CAS) before it queues a copy and drops it
// (one atomic add) when the copy's event completed; it refuses the slice
// when the generation is not the one in the buffer's key or closing is
// set. The target's Unregister sets closing and waits for the count to
// drop to zero, so it returns only when no copy of any process touches the
// buffer any more.
//
// Layout (little-endian, one 64-byte line each):
//
//	line 0      header: magic, version, slot count, closed flag
//	line 1+i    slot i: its word, then padding
const (
	tableMagic   = 0x6e766c6b67726e74 // "nvlkgrnt"
	tableVersion = 1
	lineSize     = 64
	genShift     = 32
	closingBit   = 1 << 31
	countMask    = closingBit - 1
	tablePrefix  = "moonring-nvlink-"
)

// table is a mapped grant table, the target's own or a peer's.
type table struct {
	mem   []byte // the mapping
	slots int
	path  string
	owner bool // created by this process: unlinked at close
}

func tableSize(slots int) int { return lineSize * (1 + slots) }

// tableDir is where tables live: /dev/shm when the host has it.
func tableDir() string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return "/dev/shm"
	}
	return os.TempDir()
}

// createTable makes a fresh table for slots buffers, readable and writable
// by the user only.
func createTable(slots int) (*table, error) {
	var r [8]byte
	rand.Read(r[:])
	path := filepath.Join(tableDir(), fmt.Sprintf("%s%d-%s", tablePrefix, os.Getpid(), hex.EncodeToString(r[:])))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("nvlink: grant table: %w", err)
	}
	defer f.Close()
	if err := f.Truncate(int64(tableSize(slots))); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("nvlink: grant table: %w", err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, tableSize(slots), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("nvlink: grant table: mmap: %w", err)
	}
	t := &table{mem: mem, slots: slots, path: path, owner: true}
	binary.LittleEndian.PutUint32(mem[8:], tableVersion)
	binary.LittleEndian.PutUint32(mem[12:], uint32(slots))
	// The magic goes last: a peer that maps the file early sees no magic
	// and refuses it rather than reading a half-made header.
	atomic.StoreUint64(t.word(-1), tableMagic)
	return t, nil
}

// errBadTable reports a table path or file that is not a grant table.
var errBadTable = errors.New("nvlink: not a grant table")

// openTable maps a peer's table. path comes from a descriptor, so it is
// checked: a file named like a table in the table directory, of the size
// its header says.
func openTable(path string) (*table, error) {
	if filepath.Dir(path) != tableDir() || !strings.HasPrefix(filepath.Base(path), tablePrefix) || strings.ContainsAny(filepath.Base(path), "/\x00") {
		return nil, fmt.Errorf("%w: path %q", errBadTable, path)
	}
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("nvlink: grant table: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("nvlink: grant table: %w", err)
	}
	if !st.Mode().IsRegular() || st.Size() < 2*lineSize || st.Size() > int64(tableSize(maxSlots)) || st.Size()%lineSize != 0 {
		return nil, fmt.Errorf("%w: %s has %d bytes", errBadTable, path, st.Size())
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("nvlink: grant table: mmap: %w", err)
	}
	t := &table{mem: mem, path: path, slots: int(st.Size())/lineSize - 1}
	if atomic.LoadUint64(t.word(-1)) != tableMagic || binary.LittleEndian.Uint32(mem[8:]) != tableVersion || int(binary.LittleEndian.Uint32(mem[12:])) != t.slots {
		unix.Munmap(mem)
		return nil, fmt.Errorf("%w: %s has a bad header", errBadTable, path)
	}
	return t, nil
}

// word returns slot i's word; -1 is the header's magic.
func (t *table) word(i int) *uint64 {
	// The mapping is 64-byte aligned (page aligned) and outlives every
	// user of the pointer (close comes after all of them).
	return (*uint64)(unsafe.Pointer(&t.mem[lineSize*(1+i)]))
}

func (t *table) closedFlag() *uint32 { return (*uint32)(unsafe.Pointer(&t.mem[16])) }

// closed reports whether the target closed.
func (t *table) closed() bool { return atomic.LoadUint32(t.closedFlag()) != 0 }

// grant opens slot i for a new registration and returns its generation.
// Target only.
func (t *table) grant(i int) uint32 {
	w := t.word(i)
	gen := uint32(atomic.LoadUint64(w)>>genShift) + 1
	if gen == 0 {
		gen = 1
	}
	atomic.StoreUint64(w, uint64(gen)<<genShift)
	return gen
}

// acquire counts a copy into slot i's buffer of generation gen. It fails
// with errStale when the buffer is gone or going.
func (t *table) acquire(i int, gen uint32) bool {
	w := t.word(i)
	for {
		v := atomic.LoadUint64(w)
		if uint32(v>>genShift) != gen || v&closingBit != 0 || v&countMask == countMask {
			return false
		}
		if atomic.CompareAndSwapUint64(w, v, v+1) {
			return true
		}
	}
}

// release drops a count taken by acquire.
func (t *table) release(i int) { atomic.AddUint64(t.word(i), ^uint64(0)) }

// revoke sets slot i closing and waits until no copy counts on it, or ctx
// ends (a peer died with copies counted, or hangs).
func (t *table) revoke(ctx context.Context, i int) error {
	w := t.word(i)
	for {
		v := atomic.LoadUint64(w)
		if v&closingBit != 0 || atomic.CompareAndSwapUint64(w, v, v|closingBit) {
			break
		}
	}
	return t.drain(ctx, i)
}

func (t *table) drain(ctx context.Context, i int) error {
	w := t.word(i)
	for d := time.Microsecond; atomic.LoadUint64(w)&countMask != 0; d = min(2*d, time.Millisecond) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("nvlink: %d copies of peers still in flight: %w", atomic.LoadUint64(w)&countMask, ctx.Err())
		case <-time.After(d):
		}
	}
	return nil
}

// shut marks the table closed and every slot closing, then waits for
// peers' copies to drain until ctx ends. Target only.
func (t *table) shut(ctx context.Context) error {
	atomic.StoreUint32(t.closedFlag(), 1)
	var err error
	for i := 0; i < t.slots; i++ {
		w := t.word(i)
		for {
			v := atomic.LoadUint64(w)
			if v&closingBit != 0 || atomic.CompareAndSwapUint64(w, v, v|closingBit) {
				break
			}
		}
		if e := t.drain(ctx, i); e != nil && err == nil {
			err = e
		}
	}
	return err
}

// unmap releases the mapping and, for the target's own table, the file.
func (t *table) unmap() {
	if t.owner {
		os.Remove(t.path)
	}
	unix.Munmap(t.mem)
	t.mem = nil
}
