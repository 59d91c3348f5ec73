package metadata

import (
	"context"
	"errors"
	"os"

	"github.com/moonring/moonring/segtable"
)

// Sentinel errors. Stores wrap them with the store and the segment name; test
// with errors.Is.
var (
	// ErrNotFound reports that no descriptor is published under the name.
	// A retry helps only once the owner has published (see Store.Watch).
	ErrNotFound = errors.New("metadata: segment not found")
	// ErrExists reports a Put under a name that a descriptor with another
	// epoch holds: another engine instance owns the name. A retry does not
	// help until that owner deletes its descriptor.
	ErrExists = errors.New("metadata: segment name held by another epoch")
	// ErrEpoch reports a Delete whose epoch is not the one of the stored
	// descriptor: the caller is not the current owner, and the descriptor
	// is left in place. A retry does not help.
	ErrEpoch = errors.New("metadata: epoch mismatch")
	// ErrClosed reports a call on a closed store. It is os.ErrClosed; a
	// retry does not help.
	ErrClosed = os.ErrClosed
)

// Event is one change of a watched name. It is a plain value owned by the
// receiver.
type Event struct {
	// Desc is the descriptor now stored under the name or, when Deleted,
	// the descriptor that was removed. It is a copy the receiver may keep;
	// it may modify a flat one, and a Chunked one's header, but never
	// what its Chunked list holds (shared, immutable: see Store).
	Desc *segtable.SegmentDesc
	// Deleted reports that the name no longer holds a descriptor.
	Deleted bool
}

// Store keeps segment descriptors by name. Every implementation is safe for
// concurrent use and keeps the semantics below; metadata/storetest checks
// them.
//
// Every method that takes a context fails with an error wrapping ctx.Err()
// when the context is done before the operation completes, and every method
// but Close and String fails with [ErrClosed] after Close.
//
// Get returns a copy of the descriptor published under name, or
// [ErrNotFound]. Changing the copy does not change the store; the copy of
// a Chunked descriptor may share its chunks (see below), which nobody
// changes.
//
// Put checks d with Validate ([segtable.ErrBadDesc] if it fails, or if d is
// nil) and stores a copy: changing d afterwards does not change the store.
// Put must not change d, nor keep and later change anything d refers to:
// the engine hands every Put the same Endpoints map while its endpoints
// are unchanged.
// The chunks of a Chunked descriptor (an engine's, see
// [segtable.ChunkList]) are immutable: a store may keep them by pointer,
// and the in-process Memory does, so that a republish after one
// registration does not cost every buffer. What Get and Watch hand out
// is then Chunked too, a header of the reader's own and a list shared:
// from Memory the publisher's list ([segtable.SegmentDesc.CloneShared]);
// from the networked stores that move a Chunked descriptor as its chunks
// (HTTP and its Server, P2P, etcd) a list of chunks the reader's store
// made of what it read, each shared with every descriptor the store
// hands out while the publisher's headers list that chunk unchanged
// (segtable.JoinChunks), so that a reader's cost of a republish need not
// grow with the buffers either. The contract for readers: never modify
// what a Chunked list holds (its BufferDescs and their Keys maps are
// every reader's, and, from Memory, the publisher's); read its buffers
// with AllBuffers, or per chunk. A flat descriptor put is handed out
// flat, and so is what a networked store reads as a whole document.
// When the name holds a descriptor with a different Epoch, Put fails with
// [ErrExists] and leaves it alone: another live engine owns the name and must
// Delete it first. With the same Epoch, Put replaces the descriptor; that is
// how an engine republishes.
//
// Delete removes the descriptor under name if its Epoch is epoch, or whatever
// its epoch when epoch is 0. It fails with [ErrNotFound] when the name holds
// nothing and with [ErrEpoch], leaving the descriptor, when the epochs
// differ.
//
// Watch returns a channel of the changes of name. The current descriptor, if
// there is one, comes first; then every later Put (as the new descriptor) and
// Delete (Deleted set) until ctx is done or the store is closed, when the
// channel is closed. Events are coalesced, never queued: the channel holds at
// most one event, the latest, so a watcher that does not keep up misses
// intermediate events but never blocks Put or Delete, and the last event it
// receives always describes the current state. The caller must let ctx end or
// close the store to release the watch.
//
// Close ends every watch and releases the store's resources. It may be called
// more than once; calls after the first return nil.
//
// String names the store in error messages, e.g. "memory" or
// "etcd http://10.0.0.1:2379".
type Store interface {
	Get(ctx context.Context, name string) (*segtable.SegmentDesc, error)
	Put(ctx context.Context, d *segtable.SegmentDesc) error
	Delete(ctx context.Context, name string, epoch uint64) error
	Watch(ctx context.Context, name string) (<-chan Event, error)
	Close() error
	String() string
}

// SendLatest puts ev on ch, a watch channel of capacity 1, replacing an
// event the watcher has not received yet: the coalescing every Store's
// Watch promises. The caller must be ch's only sender, so that after the
// drain the send finds room and never blocks. It is for implementations of
// Store.
func SendLatest(ch chan Event, ev Event) {
	select {
	case ch <- ev:
		return
	default:
	}
	select {
	case <-ch:
	default: // the watcher took it meanwhile
	}
	ch <- ev
}
