package moonring

// Segments: the engine's own (its descriptor, published to the metadata
// store, withdrawn and published again) and its peers' (opened through the
// store and a transport, watched, closed), and what an open one offers.

import (
	"context"
	"errors"
	"fmt"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/rdma"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// SegmentInfo is what an open segment offers: its name, the epoch of the
// engine instance that published it, the transports that reach it, and
// its remote-accessible buffers. It is a copy the caller owns.
type SegmentInfo struct {
	Name  string
	Epoch uint64
	// Transport is the name of the transport new requests take now
	// ("tcp", "shm", ...); "local" for LocalSegmentID.
	Transport string
	// Paths are the transports whose endpoints to the segment are open,
	// in order of preference, each with whether it is up.
	Paths []PathInfo
	// Buffers are the segment's remote-accessible buffers, sorted by
	// address: a request's remote range lies inside one of them.
	Buffers []RemoteBuffer
}

// PathInfo is one of a segment's paths: a transport's endpoint to it.
type PathInfo struct {
	Transport string
	// Up is false while the path is down: a request failed on it for a
	// reason of the path, and no probe has found it working since.
	Up bool
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
	if s == nil || e.transports[s.Path().Transport] == nil {
		return SegmentInfo{}, fmt.Errorf("moonring: segment %d: %w", id, ErrBadSegment)
	}
	d := s.Desc()
	bufs := d.AllBuffers()
	info := SegmentInfo{Name: d.Name, Epoch: d.Epoch, Transport: e.transports[s.Path().Transport].Name(), Buffers: make([]RemoteBuffer, len(bufs))}
	for _, p := range s.Paths() {
		if t := e.transports[p.Transport]; t != nil {
			info.Paths = append(info.Paths, PathInfo{Transport: t.Name(), Up: !p.Down()})
		}
	}
	for i, b := range bufs {
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

// The engine's descriptor is kept one registration at a time: the local
// segment holds a segtable.DescList of every buffer but the staging arena,
// each entry's BufferDesc (its keys) built once, when the buffer is
// registered. A registration or unregistration changes one entry, and the
// local segment's flat descriptor is built only when asked for (Segment,
// a request naming TargetBuffer). Rebuilding it from every buffer and
// every transport's registrations on each call made n registrations cost
// n² (10k buffers one by one took 12.8 s). A publish hands the store the
// remote-accessible entries as the list's copy-on-write chunks
// (SegmentDesc.Chunked, with the list's Rev), which the store and a
// signing store keep by pointer: a publish after one registration copies
// and signs one chunk, whatever the number of buffers. Only a change of
// transports rebuilds the list.

// header returns the engine's descriptor without buffers: name, epoch,
// endpoints. mu must be held (or the engine not yet shared).
func (e *Engine) header() *segtable.SegmentDesc {
	return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: e.cfg.Name, Epoch: e.epoch, Endpoints: e.endpoints()}
}

// endpoints returns a new map of the transports' endpoints. mu must be
// held (or the engine not yet shared).
func (e *Engine) endpoints() map[string]string {
	eps := map[string]string{}
	for _, t := range e.transports {
		if t != nil {
			eps[t.Name()] = t.Endpoint()
		}
	}
	e.mooncakeEndpoints(eps)
	return eps
}

// publishEndpoints returns the endpoints for a publish: the map the last
// publish handed the store while every transport's endpoint is as it has
// it (none of the publish's readers changes it: stores copy what they
// keep), else a new one. A map a publish (two a register/unregister
// cycle) was 300 bytes of garbage. mu must be held.
func (e *Engine) publishEndpoints() map[string]string {
	if eps := e.pubEndpoints; eps != nil && e.mooncake == nil {
		n := 0
		for _, t := range e.transports {
			if t == nil {
				continue
			}
			if ep, ok := eps[t.Name()]; !ok || ep != t.Endpoint() {
				n = -1
				break
			}
			n++
		}
		if n == len(eps) {
			return eps
		}
	}
	e.pubEndpoints = e.endpoints()
	return e.pubEndpoints
}

// bufferDesc returns b's entry in the descriptor: its range, location and
// the key each transport attached. mu must be held.
func (e *Engine) bufferDesc(b *segtable.Buffer) segtable.BufferDesc {
	bd := segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length, Location: string(b.Location), Keys: map[string]string{}}
	for slot, t := range e.transports {
		if r := b.Regs[slot].Load(); t != nil && r != nil && r.Key != "" {
			bd.Keys[t.Name()] = r.Key
		}
	}
	return bd
}

// desc builds the engine's descriptor from every buffer: remote-accessible
// buffers only for peers, every buffer for the local segment. mu must be
// held (or the engine not yet shared).
func (e *Engine) desc(remoteOnly bool) *segtable.SegmentDesc {
	d := e.header()
	e.buffers.Each(func(b *segtable.Buffer) bool {
		if (!remoteOnly || b.Remote) && b != e.arena { // the staging arena is no request's to name
			d.Buffers = append(d.Buffers, e.bufferDesc(b))
		}
		return true
	})
	return d
}

// descList returns the local segment's list, made on first use. mu must
// be held (or the engine not yet shared).
func (e *Engine) descList() *segtable.DescList {
	if l := e.self.List(); l != nil {
		return l
	}
	l := new(segtable.DescList)
	e.refreshList(l)
	e.self.SetList(l)
	return l
}

// refreshList rebuilds l from every buffer: after the transports changed
// (new keys, keys gone). mu must be held (or the engine not yet shared).
func (e *Engine) refreshList(l *segtable.DescList) {
	var ids []segtable.BufferID
	var ds []segtable.BufferDesc
	var remote []bool
	e.buffers.Each(func(b *segtable.Buffer) bool {
		if b != e.arena {
			ids, ds, remote = append(ids, b.ID), append(ds, e.bufferDesc(b)), append(remote, b.Remote)
		}
		return true
	})
	l.Reset(ids, ds, remote)
}

// described adds b to the local segment's descriptor. mu must be held.
func (e *Engine) described(b *segtable.Buffer) {
	e.descList().Put(b.ID, e.bufferDesc(b), b.Remote)
}

// undescribed drops b from the local segment's descriptor. mu must be
// held.
func (e *Engine) undescribed(b *segtable.Buffer) {
	e.descList().Delete(b.ID, uint64(b.Addr))
}

// publish rebuilds the engine's descriptor from every buffer and every
// transport and republishes the engine's segment, unless
// RemoveLocalSegment withdrew it: for a change of transports. mu must be
// held (or the engine not yet shared).
func (e *Engine) publish() error {
	l := e.descList()
	e.refreshList(l)
	e.self.SetDesc(e.header())
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.Timeout)
	defer cancel()
	return e.publishCtx(ctx)
}

// publishCtx republishes the engine's segment as the local segment's list
// has it, unless RemoveLocalSegment withdrew it. mu must be held.
func (e *Engine) publishCtx(ctx context.Context) error {
	if e.withdrawn {
		return nil
	}
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: e.cfg.Name, Epoch: e.epoch, Endpoints: e.publishEndpoints()}
	l := e.descList()
	d.Chunked, d.Rev = l.Remote(), l.Rev()
	if err := e.store.Put(ctx, d); err != nil {
		return fmt.Errorf("moonring: publish segment %q to %s: %w", e.cfg.Name, e.cfg.Metadata, err)
	}
	return nil
}

// OpenSegment looks name up in the metadata store, opens the best
// transport that reaches it and returns its ID. Opening an open segment
// returns the same ID; the engine's own name returns LocalSegmentID. The
// store and the peer are asked without the engine's lock: a slow peer holds
// up this call only (bounded by ctx), not the engine.
//
// The other transports that may reach the segment (transport.Candidates:
// Config.Transports, else transport.Priority) are opened after it returns,
// in the background, as standby paths; none when the segment is reached
// in-process. Requests whose path fails (the connection broke, the
// endpoint closed) move to the next path that is up, and new requests
// move back once a probe finds the preferred path working again (see
// SegmentTransport and PathStats).
func (e *Engine) OpenSegment(ctx context.Context, name string) (SegmentID, error) {
	if name == e.cfg.Name {
		return LocalSegmentID, nil
	}
	e.mu.Lock()
	if e.closed.Load() {
		e.mu.Unlock()
		return 0, ErrClosed
	}
	if s := e.segments.Find(name); s != nil {
		e.mu.Unlock()
		return s.ID, nil
	}
	var installed []string
	for _, t := range e.transports {
		if t != nil {
			installed = append(installed, t.Name())
		}
	}
	e.mu.Unlock()
	desc, err := e.store.Get(ctx, name)
	if errors.Is(err, metadata.ErrForged) {
		return 0, fmt.Errorf("moonring: open segment %q: its descriptor does not verify under this engine's segment key (another key, check Config.Key or MOONRING_KEY on both sides, or a forged descriptor): %w: %w", name, ErrDenied, err)
	}
	if err != nil {
		return 0, fmt.Errorf("moonring: open segment %q: %w", name, err)
	}
	var errs []error
	names := transport.Candidates(installed, desc, e.cfg.Transports)
	cands := make([]candidate, len(names)) // every one, for the health manager
	ts := make([]transport.Transport, len(names))
	e.mu.Lock()
	for i, tname := range names {
		cands[i] = candidate{slot: e.slotOf(tname), name: tname}
		if cands[i].slot >= 0 {
			ts[i] = e.transports[cands[i].slot]
		}
		cands[i].dropped = ts[i] == nil // uninstalled meanwhile
	}
	e.mu.Unlock()
	for i, t := range ts {
		if t == nil {
			continue
		}
		slot := cands[i].slot
		ep, err := t.Open(ctx, desc)
		if err != nil {
			errs = append(errs, err)
			cands[i].dropped = errors.Is(err, transport.ErrUnreachable)
			continue
		}
		id, done, err := e.addSegment(name, desc, slot, t, ep, cands, i)
		if done {
			return id, err
		}
	}
	if e.closed.Load() {
		return 0, ErrClosed // its transports closed under the Opens
	}
	// A peer that refused this engine's segment key is ErrDenied, not a
	// missing transport: the fix is the key, on one side or the other.
	why := ErrNoTransport
	for _, err := range errs {
		if errors.Is(err, tcp.ErrPinMismatch) {
			// Not a key: the certificate is not the one the signed
			// descriptor pins (a relay, or a target restarted since).
			return 0, fmt.Errorf("moonring: open segment %q: its TLS certificate is not the one its descriptor pins (a relay on the path, or a descriptor older than the target): %w", name, errors.Join(append([]error{ErrDenied}, errs...)...))
		}
		if errors.Is(err, transport.ErrDenied) || errors.Is(err, tcp.ErrAuth) || errors.Is(err, rdma.ErrAuth) {
			why = ErrDenied
		}
	}
	if why == ErrDenied {
		return 0, fmt.Errorf("moonring: open segment %q: its engine refused this engine's segment key (check Config.Key, MOONRING_KEY, on both sides): %w", name, errors.Join(append([]error{why}, errs...)...))
	}
	return 0, fmt.Errorf("moonring: open segment %q (store %s): %w", name, e.cfg.Metadata, errors.Join(append([]error{why}, errs...)...))
}

// addSegment adds the segment OpenSegment reached through ep of t in slot,
// unless the engine closed, t was uninstalled (done false: try the next
// transport) or another OpenSegment of name added it first (its ID). The
// health manager opens the other candidates (cands; ep is the one at
// index first) in the background.
func (e *Engine) addSegment(name string, desc *segtable.SegmentDesc, slot int, t transport.Transport, ep transport.Endpoint, cands []candidate, first int) (SegmentID, bool, error) {
	e.mu.Lock()
	var unused bool // ep goes unused: closed after the lock (a Close may wait on dials)
	defer func() {
		e.mu.Unlock()
		if unused {
			ep.Close()
		}
	}()
	switch {
	case e.closed.Load():
		unused = true
		return 0, true, ErrClosed
	case e.transports[slot] != t:
		unused = true
		return 0, false, nil
	}
	if s := e.segments.Find(name); s != nil {
		unused = true
		return s.ID, true, nil
	}
	size := t.SliceSize()
	staged := e.stageEndpoint(ep, slot, size)
	s, err := e.segments.Open(desc.Name, desc, slot, size, ep, staged)
	if err != nil {
		closeSegment(ep, staged)
		return 0, true, fmt.Errorf("moonring: open segment %q: %w", desc.Name, err)
	}
	e.watch(s)
	e.health.add(s, cands, first)
	e.cfg.Logger.Info("moonring: segment opened", "segment", desc.Name, "transport", t.Name(), "id", s.ID)
	return s.ID, true, nil
}

// closeSegment closes a segment's endpoints: the staged one first, as it
// posts to the other.
func closeSegment(ep, staged transport.Endpoint) error {
	var err error
	if staged != nil {
		err = staged.Close()
	}
	return errors.Join(err, ep.Close())
}

// watch follows the segment's descriptor in the store. mu must be held.
func (e *Engine) watch(s *segtable.Segment[transport.Endpoint]) {
	ctx, cancel := context.WithCancel(context.Background())
	e.watches[s.ID] = cancel
	e.watchWG.Add(1)
	go func() {
		defer e.watchWG.Done()
		// Started here, not under the engine's lock: a store may fetch
		// the descriptor once before it answers.
		ch, err := e.store.Watch(ctx, s.Name)
		if err != nil {
			return // the cached descriptor stays in use
		}
		for ev := range ch {
			switch old := s.Desc(); {
			case ev.Deleted || ev.Desc == nil:
				e.cfg.Logger.Info("moonring: segment withdrawn", "segment", s.Name)
			case ev.Desc.Epoch != old.Epoch:
				e.cfg.Logger.Info("moonring: segment restarted", "segment", s.Name, "epoch", ev.Desc.Epoch)
			default:
				e.cfg.Logger.Debug("moonring: segment republished", "segment", s.Name, "buffers", ev.Desc.NumBuffers())
			}
			if ev.Deleted || ev.Desc == nil {
				// Gone: requests fail at the endpoint until the peer is back
				// (a new epoch arrives here) or the caller closes the segment.
				continue
			}
			// The same engine republished, or a restarted one (a new epoch)
			// took the name: either way the endpoint follows the new
			// descriptor (a transport redials a new address and keys), and
			// the SegmentID stays valid. From the Memory store ev.Desc
			// shares the publisher's chunks (nothing here modifies it):
			// the segment's tables and the tcp and local transports'
			// rebuild only the chunks that changed (segtable.Mirror).
			withdrawn := false
			// Only a descriptor the key vouches for withdraws a transport:
			// an unsigned one (metadata.Signed.AllowUnsigned lets a
			// Mooncake peer's through, cut down to its own transports)
			// lists none of the others, and must not take their paths
			// down and move the segment onto what it does list.
			trusted := len(e.cfg.Key) == 0 || ev.Desc.MAC != ""
			for _, p := range s.Paths() {
				if _, listed := ev.Desc.Endpoints[e.slotName(p.Transport)]; !listed && trusted {
					// The peer no longer offers this transport (it
					// uninstalled it): the path goes down while another is
					// up, as if it had failed, and keeps the keys it had
					// (the new descriptor has none for it, so requests
					// still on it would be denied, not failed over). Its
					// probes find it again once the peer lists it.
					if _, marked := s.Fail(p); marked {
						withdrawn = true
						e.cfg.Logger.Info("moonring: segment withdrew a transport", "segment", s.Name, "transport", e.slotName(p.Transport))
					}
					continue
				}
				p.Endpoint.Update(ev.Desc)
			}
			s.SetDesc(ev.Desc)
			if withdrawn {
				e.health.pathDown(s, nil)
			}
			e.health.updated(s) // paths down are probed again now
		}
	}()
}

// SegmentTransport returns the name of the transport that new requests to
// the open segment id take now ("shm", "tcp", ...): the first of its
// paths, in order of preference, that is up. It changes on a failover
// and a failback (the log says so). Safe for concurrent use.
func (e *Engine) SegmentTransport(id SegmentID) (string, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return "", ErrClosed // its transports are gone
	}
	s := e.segments.Get(id)
	if s == nil || e.transports[s.Path().Transport] == nil {
		return "", fmt.Errorf("moonring: segment %d: %w", id, ErrBadSegment)
	}
	return e.transports[s.Path().Transport].Name(), nil
}

// CloseSegment closes a segment once no request uses it. If ctx ends first
// the segment stays open and the error wraps ErrBusy; an OpenSegment of its
// name made meanwhile opened a second segment, which stays open too.
func (e *Engine) CloseSegment(ctx context.Context, id SegmentID) error {
	s, err := e.segments.Close(ctx, id)
	if errors.Is(err, segtable.ErrNotFound) {
		return fmt.Errorf("moonring: close segment %d (%v): %w", id, err, ErrBadSegment)
	}
	if err != nil {
		return fmt.Errorf("moonring: close segment: %w", err)
	}
	e.mu.Lock()
	if cancel := e.watches[id]; cancel != nil {
		cancel()
		delete(e.watches, id)
	}
	e.mu.Unlock()
	e.health.remove(s)
	return closePaths(s)
}

// closePaths closes every path's endpoints of a segment no request uses.
func closePaths(s *segment) error {
	var err error
	for _, p := range s.Paths() {
		err = errors.Join(err, closeSegment(p.Endpoint, p.Staged))
	}
	return err
}
