// Package childproc runs the test binary again as a child process in a
// role (a target that serves memory, a raw peer) and talks to it in lines:
// the child prints one line when ready (a descriptor, an address), answers
// each command line on its stdin with one line, and exits when stdin
// closes. Every wait has a bound, so a hung child fails its test with a
// message rather than hanging the suite until go test's timeout. The
// parent starts the child with Start and talks to it with Ask; the child,
// the role its package's TestMain picks from the environment, speaks its
// side with Serve. Run runs a child to its end instead, one that runs
// tests of its own. Test code only.
//
// The bounds are deadlines on the pipes themselves (pipes take deadlines
// on Unix), so no goroutine reads for the parent and none can outlive the
// child.
package childproc

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// Config says how to start a child and how long to wait for it.
type Config struct {
	// Env is added to this process's environment. It names the role for
	// the child's TestMain ("MOONRING_CHILD=target") and its parameters.
	Env []string
	// Args are the test binary's arguments. Default "-test.run=^$": no
	// test or example runs, so TestMain's role is all the child does.
	Args []string
	// Program, when set, is run instead of the test binary (a raw
	// baseline built for the test), with Args as they are; it speaks the
	// same protocol.
	Program string
	// Wrapper, when set, runs the child through a command that execs its
	// arguments, such as "ip netns exec NS". The process started is then
	// the test binary itself, so Kill ends the child and not a shell.
	Wrapper []string
	// Name is the child in failure messages; default Env's first entry.
	Name string
	// Ready bounds the wait for the first line; default 1 minute.
	Ready time.Duration
	// Answer bounds Ask's send and its wait for the answer; default 1
	// minute.
	Answer time.Duration
	// StopWait bounds Stop's wait for the child to exit before it kills
	// it; default 10 seconds.
	StopWait time.Duration
	// StopSignal, when set, is sent by Stop besides closing stdin, for a
	// child that ends on a signal rather than on stdin's end.
	StopSignal os.Signal
}

// PinWrapper returns the wrapper that pins a child to the CPUs named by
// MOONRING_BENCH_CHILD_CPUS (a taskset list), or nil when it is unset.
// Benchmark runs that compare placements set it (scripts/bench-latency.sh);
// Start uses it for children that have no wrapper of their own.
func PinWrapper() []string {
	if cpus := os.Getenv("MOONRING_BENCH_CHILD_CPUS"); cpus != "" {
		return []string{"taskset", "-c", cpus}
	}
	return nil
}

// Proc is a running child. Ask is for one goroutine at a time, the test's,
// since it fails the test; Stop, Kill, KillWait, Wait and Pid are safe from
// any goroutine, any number of times. The child lives until Stop or a
// kill, at the latest until the test's cleanup, which Stops it.
type Proc struct {
	// Line is the first line the child printed, without its line end.
	Line string

	cfg   Config
	cmd   *exec.Cmd
	stdin *os.File // our end of the child's stdin
	out   *os.File // our end of the child's stdout
	br    *bufio.Reader

	waitOnce sync.Once
	waitErr  error
}

// Start starts the test binary (or cfg.Program) as a child with cfg,
// registers its Stop with tb.Cleanup and returns once the child printed
// its first line. It fails tb, the child killed, when the child prints
// nothing within cfg.Ready or exits first. Call it from the test's
// goroutine.
func Start(tb testing.TB, cfg Config) *Proc {
	tb.Helper()
	if cfg.Args == nil && cfg.Program == "" {
		cfg.Args = []string{"-test.run=^$"}
	}
	if cfg.Name == "" {
		cfg.Name = "child"
		if len(cfg.Env) > 0 {
			cfg.Name = cfg.Env[0]
		}
	}
	cfg.Ready = orDefault(cfg.Ready, time.Minute)
	cfg.Answer = orDefault(cfg.Answer, time.Minute)
	cfg.StopWait = orDefault(cfg.StopWait, 10*time.Second)

	if cfg.Wrapper == nil {
		cfg.Wrapper = PinWrapper()
	}
	argv := cfg.argv()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), cfg.Env...)
	cmd.Stderr = os.Stderr
	// Our own pipes rather than StdinPipe and StdoutPipe: an *os.File
	// from os.Pipe takes deadlines.
	inR, inW, err := os.Pipe()
	if err != nil {
		tb.Fatalf("child %s: %v", cfg.Name, err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		tb.Fatalf("child %s: %v", cfg.Name, err)
	}
	cmd.Stdin, cmd.Stdout = inR, outW
	err = cmd.Start()
	// The child holds its ends now; ours would keep stdout from ending
	// when it exits.
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		tb.Fatalf("child %s: %v", cfg.Name, err)
	}
	p := &Proc{cfg: cfg, cmd: cmd, stdin: inW, out: outR, br: bufio.NewReader(outR)}
	tb.Cleanup(func() { p.Stop() })
	line, err := p.readLine(cfg.Ready)
	if err != nil {
		tb.Fatalf("child %s printed no first line: %v", cfg.Name, err)
	}
	p.Line = line
	return p
}

// argv is the command line: the wrapper, the program, the arguments.
func (cfg *Config) argv() []string {
	prog := cfg.Program
	if prog == "" {
		prog = os.Args[0]
	}
	return append(append(append([]string(nil), cfg.Wrapper...), prog), cfg.Args...)
}

func orDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

// Ask sends the command format and args make, as one line, and returns the
// child's one-line answer without its line end. It fails tb, the child
// killed, when the send or the answer takes longer than the Answer bound
// or the child exits first. Call it from the test's goroutine.
func (p *Proc) Ask(tb testing.TB, format string, args ...any) string {
	tb.Helper()
	q := fmt.Sprintf(format, args...)
	p.stdin.SetWriteDeadline(time.Now().Add(p.cfg.Answer))
	if _, err := io.WriteString(p.stdin, q+"\n"); err != nil {
		tb.Fatalf("child %s: send %q: %v", p.cfg.Name, q, p.failed(err))
	}
	a, err := p.readLine(p.cfg.Answer)
	if err != nil {
		tb.Fatalf("child %s: no answer to %q: %v", p.cfg.Name, q, err)
	}
	return a
}

// readLine returns the child's next line, or, the child killed, why there
// is none within d.
func (p *Proc) readLine(d time.Duration) (string, error) {
	p.out.SetReadDeadline(time.Now().Add(d))
	s, err := p.br.ReadString('\n')
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			err = fmt.Errorf("nothing within %v", d)
		}
		return "", p.failed(err)
	}
	return strings.TrimSuffix(strings.TrimSuffix(s, "\n"), "\r"), nil
}

// failed kills the child, so a failing test leaves nothing running, and
// returns err with how the child ended.
func (p *Proc) failed(err error) error {
	p.Kill()
	if werr := p.Wait(); werr != nil {
		return fmt.Errorf("%w (child: %v)", err, werr)
	}
	return err
}

// Stop asks the child to end, closing its stdin (and sending StopSignal),
// waits up to the StopWait bound and kills it after. It returns how the
// child exited: nil for a clean exit, an error when it had to be killed.
func (p *Proc) Stop() error {
	p.stdin.Close()
	if p.cfg.StopSignal != nil {
		p.cmd.Process.Signal(p.cfg.StopSignal)
	}
	done := make(chan struct{})
	go func() { p.Wait(); close(done) }()
	select {
	case <-done:
		return p.Wait()
	case <-time.After(p.cfg.StopWait):
		p.Kill()
		<-done
		return fmt.Errorf("child %s did not exit within %v of Stop; killed", p.cfg.Name, p.cfg.StopWait)
	}
}

// Kill ends the child at once, as a crash would, without waiting.
func (p *Proc) Kill() {
	p.cmd.Process.Kill()
}

// KillWait kills the child and waits until it is gone: its sockets are
// closed by then, and nothing it served can move another byte.
func (p *Proc) KillWait() {
	p.Kill()
	p.Wait()
}

// Wait waits for the child to exit, once however often it is called, then
// closes the pipes to it, and returns how it exited.
func (p *Proc) Wait() error {
	p.waitOnce.Do(func() {
		p.waitErr = p.cmd.Wait()
		p.stdin.Close()
		p.out.Close()
	})
	return p.waitErr
}

// Pid is the child's process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Serve is the child's side of the protocol: it prints ready as its first
// line, then reads commands from stdin, one a line, and prints answer's
// one line for each (line ends in an answer become spaces, so an answer
// stays one line), until stdin ends. With answer nil the child takes no
// commands: it reads and drops what comes and waits for stdin's end. It
// returns nil at stdin's end, else the read's or the write's error.
func Serve(ready string, answer func(cmd string) string) error {
	if _, err := fmt.Println(oneLine(ready)); err != nil {
		return err
	}
	if answer == nil {
		_, err := io.Copy(io.Discard, os.Stdin)
		return err
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(nil, 1<<20)
	for in.Scan() {
		if _, err := fmt.Println(oneLine(answer(in.Text()))); err != nil {
			return err
		}
	}
	return in.Err()
}

func oneLine(s string) string {
	return strings.NewReplacer("\r\n", " ", "\n", " ", "\r", " ").Replace(s)
}

// Run runs the test binary (or cfg.Program) as a child to its end, with
// cfg's Env, Args (default "-test.run=^$") and Wrapper, and returns what it wrote to
// stdout and stderr together and how it exited. A child still running
// after limit (default 10 minutes) is killed, and the error says so: the
// bound for a child that runs tests of its own (against a model library,
// under other settings) rather than a role.
func Run(cfg Config, limit time.Duration) ([]byte, error) {
	if cfg.Args == nil && cfg.Program == "" {
		cfg.Args = []string{"-test.run=^$"}
	}
	if cfg.Wrapper == nil {
		cfg.Wrapper = PinWrapper()
	}
	limit = orDefault(limit, 10*time.Minute)
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	argv := cfg.argv()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), cfg.Env...)
	// A grandchild holding the output pipe must not keep Run waiting.
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		err = fmt.Errorf("child still running after %v; killed (%v)", limit, err)
	}
	return out, err
}
