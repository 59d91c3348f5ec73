package moonring

import (
	"errors"
	"fmt"
	"slices"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Transports of an engine: installing and uninstalling them, finding them
// by name.

// install installs a transport the configuration asked for, given what
// its constructor returned; a transport that InstallTransport refuses is
// closed. An optional one that cannot work here (err wraps
// transport.ErrNotSupported) is left out with a warning in the log.
func (e *Engine) install(name string, t transport.Transport, err error, optional bool) error {
	if optional && errors.Is(err, transport.ErrNotSupported) {
		e.cfg.Logger.Warn("moonring: transport not available; going on without it", "transport", name, "reason", err)
		return nil
	}
	if err == nil {
		if err = e.InstallTransport(t); err != nil && !e.has(t) {
			t.Close() // refused; one installed whose publish failed is the engine's to close
		}
	}
	if err != nil {
		return fmt.Errorf("moonring: %s transport: %w", name, err)
	}
	return nil
}

// has reports whether t is installed.
func (e *Engine) has(t transport.Transport) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Contains(e.transports[:], t)
}

// InstallTransport adds t: every registered buffer is registered with it,
// the engine's segment republished with its endpoint, and OpenSegment may
// choose it from then on. The engine owns t and closes it. When only that
// publish fails, t stays installed (and the engine's) and the error says
// so. The first
// transport.Stager installed (nvlink) stages device memory over the other
// transports from then on: for segments opened after it, and for buffers
// whenever registered.
func (e *Engine) InstallTransport(t transport.Transport) error {
	if t == nil {
		return fmt.Errorf("moonring: install a nil transport: %w", ErrInvalid)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return ErrClosed
	}
	slot := -1
	for i, x := range e.transports {
		if x != nil && x.Name() == t.Name() {
			return fmt.Errorf("moonring: install %s: %w", t.Name(), ErrTransportExists)
		}
		if x == nil && slot < 0 {
			slot = i
		}
	}
	if slot < 0 {
		return fmt.Errorf("moonring: install %s: %d transports installed already", t.Name(), segtable.MaxTransports)
	}
	if n, ok := t.(transport.Notifier); ok {
		n.SetNotify(e.cfg.Name, e.deliver)
	}
	if w, ok := t.(transport.Waker); ok {
		w.SetWake(e.wakePollers)
	}
	bufs := e.buffers.All()
	for i, b := range bufs {
		if !transport.Serves(t, b.Location) {
			continue
		}
		reg, err := t.Register(b)
		if err != nil {
			for _, b := range bufs[:i] {
				e.unregisterFrom(t, slot, b)
			}
			return fmt.Errorf("moonring: install %s: register buffer %d: %w", t.Name(), b.ID, err)
		}
		b.Regs[slot].Store(&reg)
	}
	e.transports[slot] = t
	e.refreshNames()
	if st, ok := t.(transport.Stager); ok && e.stager == nil {
		e.startStaging(st, slot)
	}
	for _, b := range e.buffers.All() {
		e.stage(b)
	}
	if h, ok := t.(transport.Poller); ok {
		for _, p := range e.pollers {
			p.AddHook(h)
		}
		// A transport that needs polling gets it even in an engine that
		// has no ring yet (a pure target: libfabric's software providers
		// move peers' bytes only while the target polls). The new poller
		// takes the hooks of every installed transport.
		if len(e.pollers) == 0 {
			e.poller(0)
		}
	}
	if err := e.publish(); err != nil {
		return fmt.Errorf("moonring: install %s: installed, but publishing the segment failed: %w", t.Name(), err)
	}
	return nil
}

// wakePollers wakes the engine's parked pollers (transport.Waker).
func (e *Engine) wakePollers() {
	if ps := e.pollerList.Load(); ps != nil {
		for _, p := range *ps {
			p.Wake()
		}
	}
}

// UninstallTransport removes the transport named name and closes it
// (peers see their paths through it go away, and fail over). It fails
// with ErrBusy while segments are open through it (any of their paths,
// standby ones included), or, for the
// transport that stages device memory (transport.Stager), while segments
// stage through it. The in-process transport cannot be removed.
func (e *Engine) UninstallTransport(name string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	slot := e.slotOf(name)
	if slot < 0 {
		return fmt.Errorf("moonring: uninstall %s: %w", name, ErrNoSuchTransport)
	}
	if slot == 0 {
		return fmt.Errorf("moonring: uninstall %s: the in-process transport stays", name)
	}
	busy := false
	e.segments.Each(func(s *segtable.Segment[transport.Endpoint]) { busy = busy || s.PathOf(slot) != nil })
	if busy {
		return fmt.Errorf("moonring: uninstall %s: segments are open through it (their paths, standby ones included): %w", name, ErrBusy)
	}
	t := e.transports[slot]
	if slot == e.stagerSlot && e.stager != nil {
		staged := false
		e.segments.Each(func(s *segtable.Segment[transport.Endpoint]) {
			for _, p := range s.Paths() {
				staged = staged || p.Staged != nil
			}
		})
		if staged {
			return fmt.Errorf("moonring: uninstall %s: segments stage GPU memory through it: %w", name, ErrBusy)
		}
		e.stopStaging()
	}
	e.transports[slot] = nil
	e.refreshNames()
	if h, ok := t.(transport.Poller); ok {
		for _, p := range e.pollers {
			p.RemoveHook(h)
		}
	}
	// Closed before its registrations are dropped, as Engine.Close does:
	// Close withdraws every buffer from the peers at once and hangs up,
	// so a peer sees its path go away (and fails over: ErrPeer, the
	// path's) rather than one buffer after another withdrawn while the
	// path still stands (ErrDenied, the request's).
	err := t.Close()
	for _, b := range e.buffers.All() {
		b.Regs[slot].Store(nil) // the transport released them with Close
	}
	if perr := e.publish(); perr != nil {
		err = errors.Join(err, perr)
	}
	return err
}

func (e *Engine) slotOf(name string) int {
	for i, t := range e.transports {
		if t != nil && t.Name() == name {
			return i
		}
	}
	return -1
}

// Transport returns the installed transport named name, or nil.
func (e *Engine) Transport(name string) transport.Transport {
	e.mu.Lock()
	defer e.mu.Unlock()
	if slot := e.slotOf(name); slot >= 0 {
		return e.transports[slot]
	}
	return nil
}

// installed returns the installed transports.
func (e *Engine) installed() []transport.Transport {
	e.mu.Lock()
	defer e.mu.Unlock()
	var ts []transport.Transport
	for _, t := range e.transports {
		if t != nil {
			ts = append(ts, t)
		}
	}
	return ts
}
