package main

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A --plot path that cannot be written fails before the sweep, not after
// it (it measured every step, then failed and printed nothing).
func TestBenchPlotCheckedFirst(t *testing.T) {
	var out bytes.Buffer
	start := time.Now()
	err := run([]string{"bench", "--protocol", "local", "--duration", "1s", "--block-size", "4K,64K", "--buffer-size", "4M",
		"--plot", t.TempDir() + "/no/such/dir/sweep.png"}, &out)
	if took := time.Since(start); took > time.Second {
		t.Errorf("the bad --plot path failed after %v: the sweep ran first", took)
	}
	if err == nil || !strings.Contains(err.Error(), "--plot") {
		t.Errorf("err %v; want one that names --plot", err)
	}
	if out.Len() != 0 {
		t.Errorf("output %q; want none", out.String())
	}
}

// A plot file that was not there and is not drawn is not left behind.
func TestBenchPlotNotLeft(t *testing.T) {
	file := t.TempDir() + "/sweep.png"
	var out bytes.Buffer
	if err := run([]string{"bench", "--protocol", "local", "--block-size", "8M", "--buffer-size", "4M", "--plot", file}, &out); err == nil {
		t.Fatal("no error")
	}
	if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s: %v; want it not created", file, err)
	}
}

// A target that goes away mid-sweep: the rows done were printed as their
// steps ended, and the error says which step failed.
func TestBenchKeepsRowsOnFailure(t *testing.T) {
	t.Setenv(keyEnv, "a key of the deployment")
	lines, stop := startServe(t, 1, "--listen", "127.0.0.1:0", "--buffer-size", "4M", "--grace", "1s")
	defer stop()
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run([]string{"bench", "--segment", segmentOf(t, lines[0]), "--operation", "write", "--block-size", "4K,64K",
			"--buffer-size", "4M", "--duration", "3s"}, pw)
		pw.Close()
	}()
	r := bufio.NewReader(pr)
	var got []string
	for len(got) < 2 || strings.HasPrefix(got[len(got)-1], "#") || strings.HasPrefix(got[len(got)-1], "transport") {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("bench printed %q, then %v (%v): want a row as the first step ends", got, err, <-done)
		}
		got = append(got, line)
	}
	stop() // the target goes, during the second step
	rest, _ := io.ReadAll(r)
	err := <-done
	if err == nil {
		t.Fatal("bench: no error after its target went away")
	}
	if !strings.Contains(err.Error(), "step 2 of 2 (write 64K)") || !strings.Contains(err.Error(), "1 rows above") {
		t.Errorf("err %q; want it to name step 2 of 2 (write 64K) and the row done", err)
	}
	if exitCode(err) == 0 {
		t.Errorf("exit status 0 for %v", err)
	}
	t.Logf("output:\n%s%s\nerr: %v", strings.Join(got, ""), rest, err)
}

// Ctrl-C ends the sweep: the rows done stay, stderr says it was
// interrupted, and the exit status is not 0. (SIGINT killed the process:
// nothing printed.)
func TestBenchInterrupt(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "bench", "--protocol", "local", "--operation", "write", "--block-size", "4K,64K", "--buffer-size", "4M", "--duration", "2s")
	var stderrBuf syncBuffer
	cmd.Stderr = &stderrBuf
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	r := bufio.NewReader(stdout)
	var got []string
	for len(got) < 2 || strings.HasPrefix(got[len(got)-1], "#") || strings.HasPrefix(got[len(got)-1], "transport") {
		line, err := r.ReadString('\n')
		if err != nil {
			cmd.Wait()
			t.Fatalf("bench printed %q, then %v; stderr %q", got, err, stderrBuf.String())
		}
		got = append(got, line)
	}
	cmd.Process.Signal(syscall.SIGINT)
	rest, _ := io.ReadAll(r)
	werr := cmd.Wait()
	var ee *exec.ExitError
	if !errors.As(werr, &ee) || ee.ExitCode() != exitInterrupted {
		t.Errorf("exit %v; want status %d", werr, exitInterrupted)
	}
	if msg := stderrBuf.String(); !strings.Contains(msg, "interrupted during step 2 of 2 (write 64K)") {
		t.Errorf("stderr %q; want it to say the run was interrupted in step 2", msg)
	}
	if !strings.Contains(strings.Join(got, ""), "4K") && !strings.Contains(strings.Join(got, ""), "4096") {
		t.Errorf("stdout %q; want the first step's row", strings.Join(got, ""))
	}
	t.Logf("stdout:\n%s%s", strings.Join(got, ""), rest)
}
