package main

import (
	"bytes"
	"io"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// serve --tls serves TCP as TLS 1.3 with a certificate its descriptor
// pins; bench reaches it over TLS and says so; bench --tls refuses a
// target that serves plain TCP.
func TestServeTLS(t *testing.T) {
	t.Setenv(keyEnv, "a key of the deployment")
	lines, stop := startServe(t, 1, "--listen", "127.0.0.1:0", "--buffer-size", "4M", "--tls", "--no-shm")
	defer stop()
	if !regexp.MustCompile(`tcp TLS 1\.3 certificate sha256 [0-9a-f]{64}$`).MatchString(lines[0]) {
		t.Errorf("serve --tls printed %q; want the certificate's SHA-256", lines[0])
	}
	name := segmentOf(t, lines[0])
	for _, args := range [][]string{nil, {"--tls"}} {
		for _, r := range benchJSON(t, append([]string{"--segment", name}, args...)...) {
			if r.Transport != "tcp/tls" || !r.Verified {
				t.Errorf("%v: row %+v; want tcp/tls, verified", args, r)
			}
		}
	}
	plain, stopPlain := startServe(t, 1, "--listen", "127.0.0.1:0", "--buffer-size", "4M", "--no-shm")
	defer stopPlain()
	err := run([]string{"bench", "--tls", "--segment", segmentOf(t, plain[0]), "--block-size", "4K", "--buffer-size", "4M"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "serves plain TCP") {
		t.Errorf("bench --tls against a plain target: %v; want it refused", err)
	}
	if err := run([]string{"bench", "--tls", "--protocol", "shm"}, io.Discard); err == nil || !strings.Contains(err.Error(), "--tls goes with --protocol tcp") {
		t.Errorf("bench --tls --protocol shm: %v", err)
	}
}

// bench --tls starts its own target with --tls.
func TestBenchTLS(t *testing.T) {
	var args []string
	targetStarted = func(cmd *exec.Cmd, key []byte) { args = slices.Clone(cmd.Args) }
	defer func() { targetStarted = nil }()
	for _, r := range benchJSON(t, "--tls") {
		if r.Transport != "tcp/tls" || !r.Verified {
			t.Errorf("row %+v; want tcp/tls, verified", r)
		}
	}
	if !slices.Contains(args, "--tls") {
		t.Errorf("the target was started with %q; want --tls", args)
	}
}

// -h of serve and bench say what --tls protects.
func TestTLSHelp(t *testing.T) {
	var out bytes.Buffer
	run([]string{"serve", "-h"}, &out)
	for _, want := range []string{"--tls", "TLS 1.3", "pins", "relay", "in the clear"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("serve -h lacks %q", want)
		}
	}
	out.Reset()
	run([]string{"bench", "-h"}, &out)
	if !strings.Contains(out.String(), "-tls") {
		t.Errorf("bench -h lacks --tls")
	}
}
