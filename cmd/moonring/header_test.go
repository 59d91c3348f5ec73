package main

import (
	"bytes"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// The table says what was measured: the settings before the rows, sizes
// as the flags take them, and why a row's batch is not the one asked.
func TestBenchSaysWhatWasMeasured(t *testing.T) {
	var out bytes.Buffer
	if err := run([]string{"bench", "--protocol", "local", "--duration", "50ms", "--block-size", "4K,1M", "--buffer-size", "4M", "--batch-size", "8", "--operation", "write"}, &out); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	host, _ := os.Hostname()
	for _, want := range []string{"# moonring bench: local to ", "buffer 4M", "batch 8", "threads 1", "batch API", "50ms per step",
		"host " + host, "moonring ", time.Now().UTC().Format("2006-01-02"), " 4K ", " 1M ", "batch 4 (asked 8): the 4M buffer holds 4 blocks of 1M"} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q:\n%s", want, text)
		}
	}
	for _, bad := range []string{"4096", "1048576"} {
		if strings.Contains(text, bad) {
			t.Errorf("output has the size %s in bytes:\n%s", bad, text)
		}
	}
	rs := benchJSON(t, "--protocol", "local", "--block-size", "4K,1M", "--batch-size", "8")
	if r := rs[1]; r.Block != "1M" || r.Batch != 4 || r.BatchAsked != 8 || !strings.Contains(r.Note, "asked 8") {
		t.Errorf("row %+v; want block 1M, batch 4 of 8 asked, and why", r)
	}
	if r := rs[0]; r.Run == nil || r.Run.Host != host || r.Run.Batch != 8 || r.Run.Version == "" || r.Run.Date == "" {
		t.Errorf("row's run %+v; want the settings", r.Run)
	}
}

// Progress on a stderr that is no terminal is plain lines, without the
// escape codes that redraw a terminal's line.
func TestBenchProgressNoEscapes(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "bench", "--protocol", "local", "--operation", "write", "--block-size", "64K", "--buffer-size", "4M", "--duration", "1500ms")
	var stderrBuf bytes.Buffer
	cmd.Stderr = &stderrBuf
	if out, err := cmd.Output(); err != nil {
		t.Fatalf("bench: %v\n%s%s", err, out, stderrBuf.String())
	}
	progress := stderrBuf.String()
	if strings.ContainsAny(progress, "\x1b\r") {
		t.Errorf("stderr %q has terminal escapes", progress)
	}
	if !strings.Contains(progress, "GB/s so far") {
		t.Errorf("stderr %q; want a progress line", progress)
	}
}
