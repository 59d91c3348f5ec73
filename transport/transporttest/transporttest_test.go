package transporttest_test

// The suite's own tests: what a transport's test declares and which
// variants run. A failing suite fails its *testing.T, so each scenario runs
// in a child (the test binary again, through internal/childproc) and the
// test reads the child's verbose output.

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

const roleEnv = "TRANSPORTTEST_ROLE"

// roles are the scenarios a child runs as its only test, TestRole.
var roles = map[string]func(t *testing.T){
	// local behind wrappers that hide its optional interfaces, wanting
	// none: only the Post variant runs.
	"plain": func(t *testing.T) {
		transporttest.Run(t, func(t *testing.T) (transport.Transport, transport.Transport) {
			return plain{local.New()}, plain{local.New()}
		})
	},
	// The same, wanting what local has: the run fails before any subtest.
	"missing": func(t *testing.T) {
		transporttest.RunWith(t, transporttest.Options{Want: []transporttest.Interface{transporttest.Copier, transporttest.HoldingCopier, transporttest.Notifier}},
			func(t *testing.T) (transport.Transport, transport.Transport) {
				return plain{local.New()}, plain{local.New()}
			})
	},
}

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		testing.Main(func(string, string) (bool, error) { return true, nil },
			[]testing.InternalTest{{Name: "TestRole", F: roles[role]}}, nil, nil)
	}
	leakcheck.VerifyTestMain(m)
}

// plain is a transport with none of the optional interfaces, whatever the
// one inside implements; its endpoints are plain too.
type plain struct{ transport.Transport }

func (p plain) Open(ctx context.Context, d *segtable.SegmentDesc) (transport.Endpoint, error) {
	ep, err := p.Transport.Open(ctx, d)
	if err != nil {
		return nil, err
	}
	return plainEndpoint{ep}, nil
}

type plainEndpoint struct{ transport.Endpoint }

func runRole(t *testing.T, role string) (string, error) {
	t.Helper()
	out, err := childproc.Run(childproc.Config{Env: []string{roleEnv + "=" + role}, Args: []string{"-test.v"}}, 5*time.Minute)
	return string(out), err
}

// A transport without Copier or a holding copier runs the Post variant
// only: the Copy and Hold variants neither run nor skip.
func TestVariantsThatCannotApply(t *testing.T) {
	out, err := runRole(t, "plain")
	if err != nil {
		t.Fatalf("the suite on a plain transport: %v\n%s", err, out)
	}
	for _, want := range []string{"--- PASS: TestRole/Post/Basics", "--- PASS: TestRole/Post/UnregisterTarget",
		"no Copy variant: the endpoints do not implement transport.Copier", "no Hold variant"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the output:\n%s", want, out)
		}
	}
	for _, bad := range []string{"TestRole/Copy", "TestRole/Hold", "SKIP"} {
		if strings.Contains(out, bad) {
			t.Errorf("%q in the output:\n%s", bad, out)
		}
	}
}

// A transport that lacks an interface its test wants fails, naming each
// one, and runs no subtest.
func TestWantMissing(t *testing.T) {
	out, err := runRole(t, "missing")
	if err == nil {
		t.Fatalf("the suite passed a transport that lacks what its test wants:\n%s", out)
	}
	for _, want := range []string{"--- FAIL: TestRole",
		"local does not implement transport.Copier, which its test wants",
		"local does not implement transport.HoldingCopier, which its test wants",
		"local does not implement transport.Notifier, which its test wants"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the output:\n%s", want, out)
		}
	}
	if strings.Contains(out, "TestRole/") {
		t.Errorf("subtests ran:\n%s", out)
	}
}
