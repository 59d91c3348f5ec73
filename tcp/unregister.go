package tcp

import (
	"context"
	"fmt"
	"slices"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

var _ transport.ContextUnregisterer = (*Transport)(nil)

// UnregisterContext is Unregister with its wait bounded by ctx: it stops
// new frames from taking the buffer and waits for those moving its bytes,
// each of which FrameTimeout bounds, until ctx ends. It then returns an
// error wrapping ctx's and leaves the buffer registered: peers already
// inside it may go on until Close, which closes their connections and
// waits for their goroutines, so the memory may be reused only after
// Close. Safe for concurrent use.
func (t *Transport) UnregisterContext(ctx context.Context, b *segtable.Buffer, reg segtable.Registration) error {
	if !b.Remote {
		return nil
	}
	var r *region
	for _, x := range *t.regs.Load() {
		if x.id == uint32(b.ID) {
			r = x
		}
	}
	if r == nil {
		return fmt.Errorf("tcp: unregister buffer %d: %w", b.ID, segtable.ErrNotFound)
	}
	if err := r.ref.Drain(ctx); err != nil {
		return fmt.Errorf("tcp: unregister buffer %d: %w", b.ID, err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	rs := slices.DeleteFunc(slices.Clone(*t.regs.Load()), func(x *region) bool { return x == r })
	t.regs.Store(&rs)
	return nil
}
