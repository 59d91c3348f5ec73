package leakcheck_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/leakcheck"
)

const childEnv = "LEAKCHECK_TEST_CHILD"

func TestMain(m *testing.M) {
	switch os.Getenv(childEnv) {
	case "leak": // a goroutine that never ends
		leakcheck.Grace = 300 * time.Millisecond
		block := make(chan struct{})
		go func() { <-block }()
	case "late": // one that ends a second after the tests, past goleak's own retries
		go func() { time.Sleep(time.Second) }()
	}
	leakcheck.VerifyTestMain(m)
}

// A goroutine that outlives the tests fails the run, after Grace; one
// that ends within Grace does not.
func TestVerifyTestMain(t *testing.T) {
	if os.Getenv(childEnv) != "" {
		return
	}
	run := func(kind string) (string, error) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestVerifyTestMain$")
		cmd.Env = append(os.Environ(), childEnv+"="+kind)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := run("leak")
	if err == nil || !strings.Contains(out, "leakcheck: goroutines outlived the tests") {
		t.Fatalf("a leaked goroutine: exit %v, output %q; want a failure naming it", err, out)
	}
	if out, err := run("late"); err != nil {
		t.Fatalf("a goroutine ending within Grace: %v, output %q; want success", err, out)
	}
}
