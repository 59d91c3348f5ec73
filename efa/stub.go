//go:build !efa || !cgo

package efa

import (
	"context"
	"errors"

	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// errNoBuild says how to get the real transport.
var errNoBuild = errors.New("efa: built without libfabric (build with cgo and -tags efa)")

var notSupported = errors.Join(transport.ErrNotSupported, errNoBuild)

// Transport is the EFA transport; in this build (without the efa tag or
// without cgo) it cannot be made: New fails with an error wrapping
// transport.ErrNotSupported.
type Transport struct{}

var (
	_ transport.Transport = (*Transport)(nil)
	_ transport.Poller    = (*Transport)(nil)
)

// New fails: this build has no libfabric.
func New(cfg Config) (*Transport, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	return nil, notSupported
}

// Name returns "efa".
func (t *Transport) Name() string { return Name }

// Provider returns "".
func (t *Transport) Provider() string { return "" }

// Endpoint returns "".
func (t *Transport) Endpoint() string { return "" }

// SliceSize returns 0.
func (t *Transport) SliceSize() uint64 { return 0 }

// Depth returns 0.
func (t *Transport) Depth() int { return 0 }

// Register fails with ErrNotSupported.
func (t *Transport) Register(*segtable.Buffer) (segtable.Registration, error) {
	return segtable.Registration{}, notSupported
}

// Unregister fails with ErrNotSupported.
func (t *Transport) Unregister(*segtable.Buffer, segtable.Registration) error { return notSupported }

// Open fails with ErrNotSupported.
func (t *Transport) Open(context.Context, *segtable.SegmentDesc) (transport.Endpoint, error) {
	return nil, notSupported
}

// Poll does nothing.
func (t *Transport) Poll() int { return 0 }

// Close does nothing.
func (t *Transport) Close() error { return nil }
