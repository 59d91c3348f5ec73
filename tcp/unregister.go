package tcp

import (
	"context"
	"fmt"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

var _ transport.ContextUnregisterer = (*Transport)(nil)

// UnregisterContext is Unregister with its wait bounded by ctx: it stops
// serving the buffer at once (no new frame finds it) and waits for the
// frames already moving its bytes, each of which FrameTimeout bounds,
// until ctx ends. It then returns an error wrapping ctx's: those frames
// may go on until they end or Close closes their connections, so the
// memory may be reused only after Close. Safe for concurrent use.
func (t *Transport) UnregisterContext(ctx context.Context, b *segtable.Buffer, reg segtable.Registration) error {
	if !b.Remote {
		return nil
	}
	// The newest registration of the buffer is the one b holds.
	r := t.regs.newest(b.ID)
	if r == nil {
		return fmt.Errorf("tcp: unregister buffer %d: %w", b.ID, segtable.ErrNotFound)
	}
	// Out of the table first: a drain that gives up reopens the region to
	// references, and it must not be found by new frames then (they were
	// served with the old key for as long as the transport lived).
	t.mu.Lock()
	t.regs.remove(r)
	t.mu.Unlock()
	if err := r.ref.Drain(ctx); err != nil {
		return fmt.Errorf("tcp: unregister buffer %d: %w", b.ID, err)
	}
	return nil
}
