//go:build !efa || !cgo

package efa_test

import (
	"errors"
	"testing"

	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/transport"
)

// Without the efa tag (or cgo) New says the transport is not supported, so
// that an engine can install transports optimistically.
func TestNotSupported(t *testing.T) {
	tr, err := efa.New(efa.Config{Providers: []string{"tcp"}})
	if tr != nil || !errors.Is(err, transport.ErrNotSupported) {
		t.Fatalf("New = %v, %v; want nil and an error wrapping ErrNotSupported", tr, err)
	}
	if _, err := efa.New(efa.Config{Depth: -1}); err == nil || errors.Is(err, transport.ErrNotSupported) {
		t.Fatalf("New with a bad Config = %v; want a config error", err)
	}
}
