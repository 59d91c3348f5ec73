//go:build linux

package shm_test

import (
	"os"
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		runChild()
		return
	}
	leakcheck.VerifyTestMain(m)
}

func newPair(cfg shm.Config) func(t *testing.T) (transport.Transport, transport.Transport) {
	return func(t *testing.T) (transport.Transport, transport.Transport) {
		a, err := shm.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		b, err := shm.New(shm.Config{})
		if err != nil {
			a.Close()
			t.Fatal(err)
		}
		return a, b
	}
}

// TestConformance runs the suite on Go memory, which the target serves
// through process_vm_readv/writev (its pages are not a memfd).
func TestConformance(t *testing.T) {
	transporttest.RunWith(t, transporttest.Options{Want: []transporttest.Interface{transporttest.Copier, transporttest.BatchCopier,
		transporttest.InlineCopier, transporttest.Notifier, transporttest.ContextUnregisterer}}, newPair(shm.Config{}))
}
