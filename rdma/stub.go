//go:build !(rdma && cgo)

package rdma

import (
	"context"
	"fmt"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Available says whether this build carries the ibverbs transport (built
// with cgo and the "rdma" build tag). It is false here.
const Available = false

var errNotBuilt = fmt.Errorf("rdma: built without the rdma tag or cgo: %w", transport.ErrNotSupported)

// Transport is the RDMA transport; in this build it cannot be created.
type Transport struct{}

// New fails in this build with an error wrapping transport.ErrNotSupported.
func New(Config) (*Transport, error) { return nil, errNotBuilt }

// Devices fails in this build with an error wrapping
// transport.ErrNotSupported.
func Devices() ([]DeviceInfo, error) { return nil, errNotBuilt }

// Name returns "rdma".
func (*Transport) Name() string { return Name }

// Endpoint returns "".
func (*Transport) Endpoint() string { return "" }

// SliceSize returns 0.
func (*Transport) SliceSize() uint64 { return 0 }

// Register fails with transport.ErrNotSupported.
func (*Transport) Register(*segtable.Buffer) (segtable.Registration, error) {
	return segtable.Registration{}, errNotBuilt
}

// Unregister fails with transport.ErrNotSupported.
func (*Transport) Unregister(*segtable.Buffer, segtable.Registration) error { return errNotBuilt }

// Open fails with transport.ErrNotSupported.
func (*Transport) Open(context.Context, *segtable.SegmentDesc) (transport.Endpoint, error) {
	return nil, errNotBuilt
}

// MooncakeHandshake refuses every handshake in this build (the error wraps
// transport.ErrNotSupported).
func (*Transport) MooncakeHandshake(*mooncake.HandshakeDesc) (*mooncake.HandshakeDesc, error) {
	return nil, errNotBuilt
}

// ExtraEndpoints returns nil.
func (*Transport) ExtraEndpoints() map[string]string { return nil }

// Close does nothing.
func (*Transport) Close() error { return nil }

// Poll does nothing.
func (*Transport) Poll() int { return 0 }

// Stats returns zeros.
func (*Transport) Stats() Stats { return Stats{} }

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Poller    = (*Transport)(nil)
)
