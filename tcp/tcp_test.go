package tcp_test

import (
	"net"
	"os"
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/internal/uring"
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

// want is what the TCP transport must offer the suite.
var want = transporttest.Options{Want: []transporttest.Interface{transporttest.Notifier, transporttest.ContextUnregisterer}}

func TestConformance(t *testing.T) {
	transporttest.RunWith(t, want, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newTCP(t, tcp.Config{}), newTCP(t, tcp.Config{})
	})
}

func TestConformanceSharedKey(t *testing.T) {
	key := []byte("a deployment's shared secret")
	transporttest.RunWith(t, want, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newTCP(t, tcp.Config{Key: key, Rails: 1, Depth: 4}), newTCP(t, tcp.Config{Key: key})
	})
}

// The io_uring send path passes the same suite: its rails set up rings
// (the poller's non-blocking send moves most small frames itself, so the
// suite submits few SQEs; TestIOUringSender drives the ring). Where
// io_uring is not available it skips, but not in CI, which must test it.
func TestConformanceIOUring(t *testing.T) {
	if err := uring.Available(); err != nil {
		if os.Getenv("MOONRING_CI") == "1" {
			t.Fatalf("io_uring is not available here, and CI must test the io_uring sender: %v", err)
		}
		t.Skipf("SKIP io_uring sender: %v (the netpoller path is what runs here)", err)
	}
	before := uring.Used().Rings
	transporttest.RunWith(t, want, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newTCP(t, tcp.Config{IOUring: true}), newTCP(t, tcp.Config{})
	})
	if uring.Used().Rings == before {
		t.Fatal("no io_uring ring was set up: the suite ran on the netpoller path")
	}
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
