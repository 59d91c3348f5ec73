//go:build !(rdma && cgo)

package rdma

import (
	"errors"
	"testing"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/transport"
)

// Without the rdma build, Mooncake mode cannot be made and the stub
// refuses handshakes.
func TestMooncakeStub(t *testing.T) {
	if _, err := New(Config{Mooncake: &MooncakeMode{Server: "a:1", RPC: "127.0.0.1:1"}}); !errors.Is(err, transport.ErrNotSupported) {
		t.Errorf("New: %v", err)
	}
	var tr *Transport
	if _, err := tr.MooncakeHandshake(&mooncake.HandshakeDesc{}); !errors.Is(err, transport.ErrNotSupported) {
		t.Errorf("MooncakeHandshake: %v", err)
	}
	if tr.ExtraEndpoints() != nil {
		t.Error("ExtraEndpoints is not nil")
	}
}
