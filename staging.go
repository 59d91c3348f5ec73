package moonring

import (
	"github.com/moonring/moonring/ring"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Staged registrations: device memory (nvlink's Stager) moved over the
// other transports through a pinned host arena.

// startStaging makes st the engine's stager: its arena is registered,
// local only, with every transport. Without an arena (the host cannot pin
// it) device memory reaches only st's own peers, as the log says. mu must
// be held.
func (e *Engine) startStaging(st transport.Stager, slot int) {
	b, err := e.registerArena(st)
	if err != nil {
		e.cfg.Logger.Warn("moonring: no staging of device memory over the other transports", "reason", err)
		return
	}
	e.stager, e.stagerSlot, e.arena = st, slot, b
}

// registerArena registers st's staging arena, local only, with the engine
// and every transport: all or none. mu must be held.
func (e *Engine) registerArena(st transport.Stager) (*segtable.Buffer, error) {
	mem, err := st.StagingArena()
	if err != nil {
		return nil, err
	}
	b, err := e.buffers.Register(mem, segtable.CPU(0), false)
	if err != nil {
		return nil, err
	}
	for slot, t := range e.transports {
		if t == nil {
			continue
		}
		reg, err := t.Register(b)
		if err != nil {
			e.unregisterLocked(b)
			return nil, err
		}
		b.Regs[slot].Store(&reg)
	}
	return b, nil
}

// stopStaging undoes startStaging: no segment has a staged endpoint any
// more. mu must be held.
func (e *Engine) stopStaging() {
	for _, b := range e.buffers.All() {
		for slot := range e.transports {
			if r := b.Regs[slot].Load(); r != nil && r.Staged {
				b.Regs[slot].Store(nil)
			}
		}
	}
	e.unregisterLocked(e.arena)
	e.stager, e.arena = nil, nil
}

// stage gives b, memory that only the stager serves, a staged
// registration on each transport that the arena is registered with and b
// is not. mu must be held.
func (e *Engine) stage(b *segtable.Buffer) {
	if kind, _, err := b.Location.Parse(); err != nil || kind == "cpu" || e.stager == nil {
		return
	}
	own := b.Regs[e.stagerSlot].Load()
	if own == nil {
		return
	}
	for slot, t := range e.transports {
		if t == nil || b.Regs[slot].Load() != nil || e.arena.Regs[slot].Load() == nil {
			continue
		}
		b.Regs[slot].Store(&segtable.Registration{Handle: own.Handle, Staged: true})
	}
}

// stageEndpoint returns the Staged endpoint for a segment reached through
// ep of the transport in slot (slices of size bytes, 0 for the default),
// or nil when device memory does not go through it. mu must be held.
func (e *Engine) stageEndpoint(ep transport.Endpoint, slot int, size uint64) transport.Endpoint {
	if e.stager == nil || slot == e.stagerSlot {
		return nil
	}
	arena := e.arena.Regs[slot].Load()
	if arena == nil {
		return nil
	}
	if size == 0 {
		size = e.cfg.SliceSize
	}
	staged, err := e.stager.Stage(ep, arena.Handle, ring.MaxSlice(size))
	if err != nil {
		e.cfg.Logger.Warn("moonring: device memory will not reach this segment", "transport", e.transports[slot].Name(), "reason", err)
		return nil
	}
	return staged
}
