package local_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
		return local.New(), local.New()
	})
}
