package moonring_test

import (
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
)

func TestMain(m *testing.M) {
	if runChild() {
		return
	}
	leakcheck.VerifyTestMain(m)
}
