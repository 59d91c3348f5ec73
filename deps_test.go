package moonring_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoHeavyDeps: importing the engine does not pull in etcd's client,
// gRPC or zap; a user who wants the etcd store imports metadata/etcd.
func TestNoHeavyDeps(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/moonring/moonring").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, p := range strings.Fields(string(out)) {
		for _, heavy := range []string{"google.golang.org/grpc", "go.etcd.io/", "go.uber.org/zap"} {
			if strings.HasPrefix(p, heavy) {
				t.Errorf("the root package depends on %s", p)
			}
		}
	}
}
