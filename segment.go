package moonring

// What an engine says of segments: an open segment's descriptor as the
// caller needs it, and the engine's own segment withdrawn from and
// published to the metadata store.

import (
	"context"
	"errors"
	"fmt"

	"github.com/moonring/moonring/metadata"
)

// SegmentInfo is what an open segment offers: its name, the epoch of the
// engine instance that published it, the transport that reaches it, and
// its remote-accessible buffers. It is a copy the caller owns.
type SegmentInfo struct {
	Name  string
	Epoch uint64
	// Transport is the transport's name ("tcp", "shm", ...); "local" for
	// LocalSegmentID.
	Transport string
	// Buffers are the segment's remote-accessible buffers, sorted by
	// address: a request's remote range lies inside one of them.
	Buffers []RemoteBuffer
}

// RemoteBuffer is one buffer of a segment: TransferRequest.TargetOffset
// and Entry.Remote are addresses in [Addr, Addr+Length).
type RemoteBuffer struct {
	Addr     uint64
	Length   uint64
	Location Location
}

// Segment returns what the open segment id offers, as its engine last
// published it (a segment that republishes or restarts changes it). Safe
// for concurrent use; for LocalSegmentID it describes this engine's own
// buffers, remote-accessible or not.
func (e *Engine) Segment(id SegmentID) (SegmentInfo, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return SegmentInfo{}, ErrClosed
	}
	s := e.segments.Get(id)
	if s == nil || e.transports[s.Transport] == nil {
		return SegmentInfo{}, fmt.Errorf("moonring: segment %d: %w", id, ErrBadSegment)
	}
	d := s.Desc()
	info := SegmentInfo{Name: d.Name, Epoch: d.Epoch, Transport: e.transports[s.Transport].Name(), Buffers: make([]RemoteBuffer, len(d.Buffers))}
	for i, b := range d.Buffers {
		info.Buffers[i] = RemoteBuffer{Addr: b.Addr, Length: b.Length, Location: Location(b.Location)}
	}
	return info, nil
}

// RemoveLocalSegment withdraws this engine's segment from the metadata
// store: peers watching it hear that it is gone, and OpenSegment of its name
// fails, until PublishLocalSegment. Registrations meanwhile change the
// engine's own view but publish nothing. Segments peers already opened
// keep their endpoints: requests from them are still served while the
// buffers stay registered (unregister them to stop that). Safe for
// concurrent use; a second call finds nothing to delete and returns nil.
func (e *Engine) RemoveLocalSegment(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return ErrClosed
	}
	e.withdrawn = true
	if err := e.store.Delete(ctx, e.cfg.Name, e.epoch); err != nil && !errors.Is(err, metadata.ErrNotFound) {
		return fmt.Errorf("moonring: remove segment %q from %s: %w", e.cfg.Name, e.cfg.Metadata, err)
	}
	return nil
}

// PublishLocalSegment publishes this engine's segment again after
// RemoveLocalSegment (or republishes it), with the buffers registered now.
// Safe for concurrent use.
func (e *Engine) PublishLocalSegment(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return ErrClosed
	}
	e.withdrawn = false
	return e.publishCtx(ctx)
}
