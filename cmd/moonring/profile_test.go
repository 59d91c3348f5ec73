package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBenchProfiles: --cpuprofile and --trace write a CPU profile
// (gzipped, pprof's format) and an execution trace of the run; a path
// that cannot be created is an error that names its flag and leaves no
// profile running (the next run starts one).
func TestBenchProfiles(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "no", "such", "dir")
	if _, err := kvJSONErr(t, "--protocol", "local", "--cpuprofile", filepath.Join(dir, "cpu"), "--trace", bad); err == nil || !strings.Contains(err.Error(), "--trace") {
		t.Fatalf("a trace into %s: %v; want an error naming --trace", bad, err)
	}
	if _, err := kvJSONErr(t, "--protocol", "local", "--cpuprofile", bad); err == nil || !strings.Contains(err.Error(), "--cpuprofile") {
		t.Fatalf("a profile into %s: %v; want an error naming --cpuprofile", bad, err)
	}
	cpu, tr := filepath.Join(dir, "cpu"), filepath.Join(dir, "trace")
	if _, err := kvJSONErr(t, "--protocol", "local", "--cpuprofile", cpu, "--trace", tr); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(cpu); err != nil || len(b) < 64 || !bytes.HasPrefix(b, []byte{0x1f, 0x8b}) {
		t.Errorf("CPU profile: %d bytes (%v); want a gzipped profile", len(b), err)
	}
	if b, err := os.ReadFile(tr); err != nil || len(b) < 1024 || !bytes.HasPrefix(b, []byte("go 1.")) {
		t.Errorf("trace: %d bytes (%v); want a Go execution trace", len(b), err)
	}
}
