//go:build !(rdma && cgo)

package rdma

import (
	"context"
	"errors"
	"testing"

	"github.com/moonring/moonring/transport"
)

func TestNotBuilt(t *testing.T) {
	if _, err := New(Config{}); !errors.Is(err, transport.ErrNotSupported) {
		t.Fatalf("New: %v, want ErrNotSupported", err)
	}
	if _, err := Devices(); !errors.Is(err, transport.ErrNotSupported) {
		t.Fatalf("Devices: %v, want ErrNotSupported", err)
	}
	var tr Transport
	if _, err := tr.Open(context.Background(), nil); !errors.Is(err, transport.ErrNotSupported) {
		t.Fatalf("Open: %v", err)
	}
	if Available {
		t.Fatal("Available in a build without the rdma tag")
	}
}
