package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"os/exec"
	"strings"
	"testing"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/cq"
)

// checkStatuses fails t unless every request r counts ended in exactly
// one terminal status, and the FAILED ones by code add up.
func checkStatuses(t *testing.T, what string, r result) {
	t.Helper()
	c := r.Statuses
	if c.Submitted == 0 || c.Completed+c.Failed+c.Timeout+c.Canceled != c.Submitted {
		t.Errorf("%s: statuses %+v: want requests, each ended once", what, c)
	}
	by := 0
	for _, n := range c.FailedBy {
		by += n
	}
	if by != c.Failed {
		t.Errorf("%s: statuses %+v: FAILED by code adds up to %d", what, c, by)
	}
}

// A step whose target dies under it: with --keep-going its requests are
// counted and it goes on to its end, its row (printed, parsed with the
// rest of the JSON) says how they ended and what the check left out, and
// bench fails after it, saying so; through the batch API, the Ring API,
// and the KV pattern against two targets of which one dies.
func TestBenchKeepGoing(t *testing.T) {
	for _, c := range []struct {
		name  string
		args  []string
		kill  int // the target process to kill (the order bench starts them)
		wantN int // rows: the first step's, and the failed one's
	}{
		{"batch", []string{"bench", "--json", "--keep-going", "--operation", "write", "--block-size", "4K,64K", "--buffer-size", "4M", "--duration", "1s"}, 0, 2},
		{"ring", []string{"bench", "--json", "--keep-going", "--ring", "--operation", "read", "--block-size", "4K,64K", "--buffer-size", "4M", "--duration", "1s"}, 0, 2},
		{"kv", append(append([]string{}, kvArgs...), "--keep-going", "--targets", "2", "--duration", "1s"), 1, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			started := make(chan *exec.Cmd, 2)
			targetStarted = func(cmd *exec.Cmd, key []byte) { started <- cmd }
			defer func() { targetStarted = nil }()
			pr, pw := io.Pipe()
			done := make(chan error, 1)
			go func() {
				done <- run(c.args, pw)
				pw.Close()
			}()
			var victim *exec.Cmd
			for i := 0; i <= c.kill; i++ {
				victim = <-started
			}
			r := bufio.NewReader(pr)
			var out strings.Builder
			for {
				line, err := r.ReadString('\n')
				out.WriteString(line)
				if err != nil {
					t.Fatalf("bench ended before a row: %v", <-done)
				}
				if strings.HasPrefix(line, "[") {
					break
				}
			}
			// The first step's row is out: the next step begins.
			victim.Process.Kill()
			rest, _ := io.ReadAll(r)
			out.Write(rest)
			err := <-done
			var rerr *requestsError
			if !errors.As(err, &rerr) || exitCode(err) == 0 {
				t.Fatalf("bench after its target died: %v (exit %d); want the step's requests that did not complete", err, exitCode(err))
			}
			for _, want := range []string{"did not complete", "its row counts how its", "FAILED"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("err %q lacks %q", err, want)
				}
			}
			var rs []result
			if jerr := json.Unmarshal([]byte(out.String()), &rs); jerr != nil {
				t.Fatalf("--json output: %v\n%s", jerr, out.String())
			}
			if len(rs) != c.wantN {
				t.Fatalf("%d rows; want %d:\n%s", len(rs), c.wantN, out.String())
			}
			for i, row := range rs {
				checkStatuses(t, "row "+string(rune('0'+i)), row)
				if !row.Verified {
					t.Errorf("row %d: not verified: %+v", i, row)
				}
			}
			first, last := rs[0].Statuses, rs[len(rs)-1]
			if first.Completed != first.Submitted {
				t.Errorf("first row %+v: want every request completed", first)
			}
			if last.Statuses.notCompleted() == 0 || last.Unchecked == 0 {
				t.Errorf("the failed step's row: statuses %+v, %d unchecked; want requests that did not complete, and what they moved unchecked", last.Statuses, last.Unchecked)
			}
			if last.Statuses.notCompleted() != rerr.counts.notCompleted() || last.Statuses.Submitted != rerr.counts.Submitted {
				t.Errorf("the error counts %+v, the row %+v", rerr.counts, last.Statuses)
			}
			if c.name == "kv" && last.Statuses.Completed == 0 {
				t.Errorf("kv row %+v: want the live target's transfers completed", last.Statuses)
			}
			t.Logf("failed step: %s; %d unchecked; note %q", last.Statuses, last.Unchecked, last.Note)
		})
	}
}

// Without --keep-going the first request that does not complete ends the
// step, with no row for it (TestBenchKeepsRowsOnFailure); the rows of
// steps that ran count their requests, each ended once.
func TestBenchStatuses(t *testing.T) {
	for _, api := range []string{"--ring=false", "--ring"} {
		for _, r := range benchJSON(t, "--protocol", "local", "--operation", "write,mix", api) {
			checkStatuses(t, api+" "+r.Op+" "+r.Block, r)
			if r.Statuses.Completed != r.Statuses.Submitted || r.Statuses.Completed < r.Requests {
				t.Errorf("%s %s %s: statuses %+v, %d measured; want every request completed, the measured ones among them", api, r.Op, r.Block, r.Statuses, r.Requests)
			}
		}
	}
	for _, r := range kvJSON(t, "--protocol", "local") {
		checkStatuses(t, "kv "+r.Op+" "+r.Pattern, r)
	}
	var c statusCounts
	c.submitted(5)
	c.ended(moonring.COMPLETED, cq.CodeOK)
	c.ended(moonring.FAILED, cq.CodeTransport)
	c.ended(moonring.FAILED, cq.CodeDenied)
	c.ended(moonring.TIMEOUT, cq.CodeTimeout)
	c.ended(moonring.PENDING, cq.CodeOK) // not terminal: not counted
	var sum statusCounts
	sum.add(c)
	sum.add(statusCounts{Submitted: 1, Canceled: 1})
	if got, want := sum.String(), "6 submitted: 1 COMPLETED, 2 FAILED (denied 1, transport 1), 1 TIMEOUT, 1 CANCELED"; got != want {
		t.Errorf("counts say %q; want %q", got, want)
	}
	if codeName(cq.Code(200)) != "code_200" || codeName(cq.CodeTransportDown) != "transport_down" {
		t.Errorf("code names %q, %q", codeName(cq.Code(200)), codeName(cq.CodeTransportDown))
	}
	if err := run([]string{"bench", "--keep-going", "--segment", "127.0.0.1:1", "--expect-seed", "1"}, io.Discard); err == nil || !strings.Contains(err.Error(), "--keep-going") {
		t.Errorf("--keep-going with --expect-seed: %v; want it refused", err)
	}
}
