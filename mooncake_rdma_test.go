package moonring_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/rdma"
	"github.com/moonring/moonring/transport"
)

// Mooncake mode with RDMA asked for: Config.String says so, and where the
// rdma transport cannot run (this build without the tag, or no device)
// New fails rather than serve Mooncake peers over TCP alone. The engine
// with a device is tested in the Soft-RoCE guest (rdma.TestMooncakeRDMAEngines).
func TestMooncakeRDMAConfig(t *testing.T) {
	cfg := moonring.Config{Mooncake: &moonring.MooncakeConfig{RDMA: &rdma.Config{Devices: []string{"no-such-device"}}}}
	if s := cfg.String(); !strings.Contains(s, "rdma (handshake on the rpc port) devices [no-such-device]") {
		t.Errorf("Config.String:\n%s", s)
	}
	e, err := moonring.New(cfg)
	if err == nil {
		e.Close()
		t.Fatal("New with Mooncake RDMA on a device that does not exist succeeded")
	}
	if !errors.Is(err, transport.ErrNotSupported) {
		t.Errorf("New: %v; want an error wrapping transport.ErrNotSupported", err)
	}
}
