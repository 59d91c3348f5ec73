package tcp_test

import (
	"net"
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func newTCP(t *testing.T, cfg tcp.Config) *tcp.Transport {
	t.Helper()
	tr, err := tcp.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func TestConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newTCP(t, tcp.Config{}), newTCP(t, tcp.Config{})
	})
}

func TestConformanceSharedKey(t *testing.T) {
	key := []byte("a deployment's shared secret")
	transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newTCP(t, tcp.Config{Key: key, Rails: 1, Depth: 4}), newTCP(t, tcp.Config{Key: key})
	})
}

// The io_uring send path passes the same suite (or, where io_uring is not
// available, the netpoller path it falls back to).
func TestConformanceIOUring(t *testing.T) {
	transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newTCP(t, tcp.Config{IOUring: true}), newTCP(t, tcp.Config{})
	})
}

// A transport listening on all interfaces advertises an interface's
// address, which peers can dial, not the unspecified one.
func TestAdvertiseAllInterfaces(t *testing.T) {
	tr := newTCP(t, tcp.Config{Listen: "0.0.0.0:0"})
	defer tr.Close()
	host, port, err := net.SplitHostPort(tr.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() || port == "0" {
		t.Fatalf("advertised %q: want an interface's address and the port", tr.Addr())
	}
	c, err := net.Dial("tcp", tr.Addr())
	if err != nil {
		t.Fatalf("dial the advertised address: %v", err)
	}
	c.Close()
}
