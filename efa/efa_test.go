//go:build efa && cgo

package efa_test

import (
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

func TestMain(m *testing.M) {
	if runChild() {
		return
	}
	leakcheck.VerifyTestMain(m)
}

// testConfig is what the tests use: a short timeout so that a peer that
// vanished fails slices well within the suite's hang detector, and a
// progress goroutine that sleeps when idle (the machine is small).
func testConfig(prov string) efa.Config {
	return efa.Config{
		Providers:     []string{prov},
		Timeout:       5 * time.Second,
		Linger:        2 * time.Second,
		Progress:      true,
		ProgressSleep: 20 * time.Microsecond,
	}
}

// newEFA makes a transport on prov, or skips loudly when libfabric or the
// provider is missing; under MOONRING_CI=1 it fails instead, since CI
// installs libfabric (scripts/ensure-deps.sh).
func newEFA(t testing.TB, cfg efa.Config) *efa.Transport {
	t.Helper()
	tr, err := efa.New(cfg)
	if err != nil {
		if errors.Is(err, transport.ErrNotSupported) && os.Getenv("MOONRING_CI") != "1" {
			t.Skipf("SKIP: libfabric provider %v not usable here (install libfabric-dev: scripts/ensure-deps.sh): %v", cfg.Providers, err)
		}
		t.Fatalf("efa.New(%v): %v", cfg.Providers, err)
	}
	return tr
}

// efaWant is what the conformance tests require of the transport.
var efaWant = []transporttest.Interface{transporttest.Poller}

func conformance(t *testing.T, prov string) {
	newEFA(t, testConfig(prov)).Close()
	transporttest.RunWith(t, transporttest.Options{Want: efaWant}, func(t *testing.T) (transport.Transport, transport.Transport) {
		return newEFA(t, testConfig(prov)), newEFA(t, testConfig(prov))
	})
}

// TestConformanceTCP runs the suite over libfabric's tcp provider (with
// ofi_rxm for reliable datagrams), two transports in one process.
func TestConformanceTCP(t *testing.T) { conformance(t, "tcp") }

// TestConformanceSHM runs the suite over libfabric's shared-memory provider.
//
// libfabric 1.17's shm provider lets endpoints of one process share the
// peer's shared-memory region itself: when the target closes, the region
// is unmapped under the initiator, which then crashes on its next
// operation. Two engines of one process use the local transport, never
// this one; so here the target's Close is what a dying peer looks like
// to the initiator until the subtest ends: every registration withdrawn
// and nothing polled. The real Close follows the initiator's. The
// two-process test closes a real shm target under a live initiator.
func TestConformanceSHM(t *testing.T) {
	newEFA(t, testConfig("shm")).Close()
	// Measured here: after the target closes an MR, one READ with its key
	// never completes, and the target's shm command queue takes nothing
	// more from this initiator (every post: -FI_EAGAIN). The transport
	// turns that into errors within Config.Timeout, but the suite's next
	// WRITE to another buffer cannot succeed. The tcp provider passes.
	skip := map[string]string{"UnregisterTarget": "libfabric 1.17's shm provider wedges the peer after an access with the key of a closed MR"}
	transporttest.RunWith(t, transporttest.Options{Want: efaWant, Skip: skip}, func(t *testing.T) (transport.Transport, transport.Transport) {
		target := &lateClose{Transport: newEFA(t, testConfig("shm")), regs: map[*segtable.Buffer]segtable.Registration{}}
		t.Cleanup(func() { target.Transport.Close() })
		return newEFA(t, testConfig("shm")), target
	})
}

// lateClose is a target whose Close withdraws its registrations (so that
// the provider refuses every access) and stops its progress, leaving the
// endpoint open until the test's cleanup closes it.
type lateClose struct {
	*efa.Transport
	mu     sync.Mutex
	regs   map[*segtable.Buffer]segtable.Registration
	closed bool
}

func (l *lateClose) Register(b *segtable.Buffer) (segtable.Registration, error) {
	r, err := l.Transport.Register(b)
	if err == nil {
		l.mu.Lock()
		l.regs[b] = r
		l.mu.Unlock()
	}
	return r, err
}

func (l *lateClose) Unregister(b *segtable.Buffer, r segtable.Registration) error {
	l.mu.Lock()
	delete(l.regs, b)
	l.mu.Unlock()
	return l.Transport.Unregister(b, r)
}

func (l *lateClose) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	for b, r := range l.regs {
		if err := l.Transport.Unregister(b, r); err != nil {
			return err
		}
	}
	l.regs = nil
	l.Transport.StopProgress()
	return nil
}
