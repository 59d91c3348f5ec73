package tcp_test

import (
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
