package childproc_test

import (
	"bufio"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/leakcheck"
)

const roleEnv = "CHILDPROC_TEST_ROLE"

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		runRole(role)
		os.Exit(0)
	}
	leakcheck.VerifyTestMain(m)
}

// runRole is the child: "echo" answers each line with it upper-cased,
// "mute" reads but never answers, "silent" never prints its first line,
// "crash" exits 3 on its first command, "stubborn" ignores stdin's end
// and ends on SIGTERM; "serve" answers through Serve, each line with it
// upper-cased and doubled on two lines, and "wait" serves no commands;
// "fail" exits 3 at once.
func runRole(role string) {
	switch role {
	case "serve":
		if err := childproc.Serve("ready\nserve", func(cmd string) string { return strings.ToUpper(cmd) + "\n" + cmd }); err != nil {
			os.Exit(4)
		}
		return
	case "wait":
		if err := childproc.Serve("ready wait", nil); err != nil {
			os.Exit(4)
		}
		return
	case "fail":
		os.Exit(3)
	}
	signalled := make(chan os.Signal, 1)
	if role == "stubborn" {
		signal.Notify(signalled, syscall.SIGTERM)
	}
	if role != "silent" {
		fmt.Println("ready " + role)
	}
	if role == "stubborn" {
		<-signalled
		return
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		switch role {
		case "echo":
			fmt.Println(strings.ToUpper(in.Text()))
		case "crash":
			os.Exit(3)
		}
	}
}

// fakeTB records a failure instead of failing the test, and runs the
// cleanups when asked, so the failure paths can be checked.
type fakeTB struct {
	testing.TB
	failure  string
	cleanups []func()
}

func (f *fakeTB) Helper()           {}
func (f *fakeTB) Cleanup(fn func()) { f.cleanups = append(f.cleanups, fn) }
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.failure = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// run runs fn as a test would: in its own goroutine, then the cleanups.
func (f *fakeTB) run(fn func(tb testing.TB)) {
	done := make(chan struct{})
	go func() { defer close(done); fn(f) }()
	<-done
	for i := len(f.cleanups) - 1; i >= 0; i-- {
		f.cleanups[i]()
	}
}

func role(r string) []string { return []string{roleEnv + "=" + r} }

func TestAsk(t *testing.T) {
	p := childproc.Start(t, childproc.Config{Env: role("echo")})
	if p.Line != "ready echo" {
		t.Fatalf("first line %q", p.Line)
	}
	if got := p.Ask(t, "sum %d %d", 4096, 17); got != "SUM 4096 17" {
		t.Fatalf("answer %q", got)
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
}

// failure runs fn against a fake TB and returns its failure message.
func failure(t *testing.T, fn func(tb testing.TB)) string {
	t.Helper()
	f := &fakeTB{TB: t}
	f.run(fn)
	if f.failure == "" {
		t.Fatal("no failure")
	}
	t.Log(f.failure)
	return f.failure
}

func TestAskDeadline(t *testing.T) {
	var p *childproc.Proc
	msg := failure(t, func(tb testing.TB) {
		p = childproc.Start(tb, childproc.Config{Env: role("mute"), Answer: 200 * time.Millisecond})
		p.Ask(tb, "sum")
	})
	if !strings.Contains(msg, `no answer to "sum": nothing within 200ms`) || !strings.Contains(msg, "killed") {
		t.Fatalf("message %q", msg)
	}
	if err := syscall.Kill(p.Pid(), 0); err == nil {
		t.Fatal("the child still runs")
	}
}

func TestAskExited(t *testing.T) {
	msg := failure(t, func(tb testing.TB) {
		p := childproc.Start(tb, childproc.Config{Env: role("crash")})
		p.Ask(tb, "sum")
	})
	if !strings.Contains(msg, "EOF") || !strings.Contains(msg, "exit status 3") {
		t.Fatalf("message %q", msg)
	}
}

func TestReadyDeadline(t *testing.T) {
	msg := failure(t, func(tb testing.TB) {
		childproc.Start(tb, childproc.Config{Env: role("silent"), Ready: 200 * time.Millisecond, Name: "quiet"})
	})
	if !strings.HasPrefix(msg, "child quiet printed no first line: nothing within 200ms") {
		t.Fatalf("message %q", msg)
	}
}

func TestStop(t *testing.T) {
	p := childproc.Start(t, childproc.Config{Env: role("stubborn"), StopWait: 200 * time.Millisecond})
	if err := p.Stop(); err == nil || !strings.Contains(err.Error(), "killed") {
		t.Fatalf("stop of a child that ignores stdin: %v", err)
	}
	p = childproc.Start(t, childproc.Config{Env: role("stubborn"), StopSignal: syscall.SIGTERM})
	if err := p.Stop(); err != nil {
		t.Fatalf("stop with SIGTERM: %v", err)
	}
}

// Serve keeps the protocol's lines: the first line and each answer one
// line, however the role writes them, and the child ends with stdin.
func TestServe(t *testing.T) {
	p := childproc.Start(t, childproc.Config{Env: role("serve")})
	if p.Line != "ready serve" {
		t.Fatalf("first line %q", p.Line)
	}
	for _, q := range []string{"sum 1 2", "fill 3"} {
		if got, want := p.Ask(t, "%s", q), strings.ToUpper(q)+" "+q; got != want {
			t.Fatalf("answer to %q: %q, want %q", q, got, want)
		}
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	w := childproc.Start(t, childproc.Config{Env: role("wait"), StopWait: 5 * time.Second})
	if w.Line != "ready wait" {
		t.Fatalf("first line %q", w.Line)
	}
	if err := w.Stop(); err != nil {
		t.Fatalf("stop of a child serving no commands: %v", err)
	}
}

// Run returns a child's output and bounds its run.
func TestRun(t *testing.T) {
	out, err := childproc.Run(childproc.Config{Env: role("stubborn")}, 200*time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "still running after 200ms; killed") {
		t.Fatalf("run of a child that does not end: %v", err)
	}
	if !strings.Contains(string(out), "ready stubborn") {
		t.Fatalf("output %q", out)
	}
	out, err = childproc.Run(childproc.Config{Env: role("echo")}, 0)
	if err != nil || string(out) != "ready echo\n" {
		t.Fatalf("run of a child that ends: %q, %v", out, err)
	}
	if _, err = childproc.Run(childproc.Config{Env: role("fail")}, 0); err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("run of a child that failed: %v", err)
	}
}

// A Program other than the test binary speaks the same protocol.
func TestProgram(t *testing.T) {
	p := childproc.Start(t, childproc.Config{Program: "/bin/sh", Args: []string{"-c", `echo ready; while read x; do echo "got $x"; done`}, Name: "sh"})
	if p.Line != "ready" {
		t.Fatalf("first line %q", p.Line)
	}
	if got := p.Ask(t, "one"); got != "got one" {
		t.Fatalf("answer %q", got)
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	out, err := childproc.Run(childproc.Config{Program: "/bin/echo", Args: []string{"hi"}}, time.Minute)
	if err != nil || string(out) != "hi\n" {
		t.Fatalf("run /bin/echo: %q, %v", out, err)
	}
}
