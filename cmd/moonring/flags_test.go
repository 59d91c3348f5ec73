package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/topology"
)

// Sizes take K, M, G, T in either case; errors quote the size as given and
// state the limits in the same units.
func TestParseSize(t *testing.T) {
	for in, want := range map[string]int{"8": 8, "4K": 4 << 10, "4k": 4 << 10, "4KiB": 4 << 10, "4kib": 4 << 10, "64K": 64 << 10,
		"1m": 1 << 20, "16M": 16 << 20, "2g": 2 << 30, "64G": 64 << 30, " 1M ": 1 << 20} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for in, want := range map[string]string{
		"-4K":             `bad size "-4K": want at least 1`,
		"0":               `bad size "0": want at least 1`,
		"65G":             `bad size "65G": above the limit of 64G`,
		"1T":              `bad size "1T": above the limit of 64G`,
		"17592186044416M": `above the limit of 64G`,
		"4Q":              `bad size "4Q": want a whole number`,
		"":                `from 1 to 64G`,
	} {
		if _, err := parseSize(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("parseSize(%q): %v; want %q", in, err, want)
		}
	}
	if got, err := parseSizes("4k,1M,2g"); err != nil || len(got) != 3 || got[2] != 2<<30 {
		t.Errorf("parseSizes = %v, %v", got, err)
	}
	for n, want := range map[int]string{4 << 10: "4K", 64 << 10: "64K", 1 << 20: "1M", 16 << 20: "16M", 2 << 30: "2G", 1 << 40: "1T", 8: "8", 1536: "1536"} {
		if got := fmtSize(n); got != want {
			t.Errorf("fmtSize(%d) = %q; want %q", n, got, want)
		}
	}
}

// Flags that make no sense together, or values out of range, are refused
// before anything runs.
func TestFlagsRefused(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"bench", "--protocol", "tcp", "--no-map"}, "--no-map goes with --protocol shm"},
		{[]string{"bench", "--protocol", "local", "--no-map"}, "--no-map goes with --protocol shm"},
		{[]string{"bench", "--block-size=-4K"}, `"-4K"`},
		{[]string{"bench", "--buffer-size", "1T"}, "64G"},
		{[]string{"serve", "--grace", "-1s"}, "--grace -1s"},
		{[]string{"serve", "--buffer-size", "4x"}, `"4x"`},
		{[]string{"version", "extra"}, "unexpected"},
	} {
		done := make(chan error, 1)
		go func() { done <- run(c.args, io.Discard) }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("moonring %q: %v; want an error with %q", c.args, err, c.want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("moonring %q ran instead of refusing its flags", c.args)
		}
	}
}

// moonring version and --version say which build this is.
func TestVersion(t *testing.T) {
	for _, arg := range []string{"version", "--version", "-version"} {
		var out bytes.Buffer
		if err := run([]string{arg}, &out); err != nil {
			t.Fatalf("%s: %v", arg, err)
		}
		if !strings.HasPrefix(out.String(), "moonring ") || !strings.Contains(out.String(), runtime.Version()) {
			t.Errorf("%s printed %q; want moonring, its version and %s", arg, out.String(), runtime.Version())
		}
	}
	var out bytes.Buffer
	run([]string{"help"}, &out)
	if !strings.Contains(out.String(), "version") {
		t.Errorf("usage lacks the version command:\n%s", out.String())
	}
}

// info -h prints its help and exits 0; info says "unknown" where the
// machine does not say (CPUID's 254 cores per socket on a VM, a NIC speed
// or NUMA node of -1).
func TestInfoHelpAndUnknowns(t *testing.T) {
	var out bytes.Buffer
	err := run([]string{"info", "-h"}, &out)
	if !errors.Is(err, flag.ErrHelp) || exitCode(err) != 0 || !strings.Contains(out.String(), "usage: moonring info") {
		t.Errorf("info -h: %v, %q", err, out.String())
	}
	if got := cpuLine(topology.CPUInfo{Brand: "EPYC", Vendor: "AuthenticAMD", LogicalCores: 254, CacheLine: 64}, 2); strings.Contains(got, "254 logical") || !strings.Contains(got, "logical cores per socket unknown") {
		t.Errorf("cpuLine with 254 cores of 2 CPUs: %q", got)
	}
	if got := cpuLine(topology.CPUInfo{LogicalCores: 16}, 32); !strings.Contains(got, "16 logical cores per socket") {
		t.Errorf("cpuLine with 16 cores of 32 CPUs: %q", got)
	}
	if got := cpuLine(topology.CPUInfo{}, 2); !strings.Contains(got, "logical cores per socket unknown") {
		t.Errorf("cpuLine with no count: %q", got)
	}
	if got, want := nicLine(topology.NIC{Name: "eth0", Node: -1, Speed: -1}), "nic eth0: numa node unknown, speed unknown"; got != want {
		t.Errorf("nicLine = %q; want %q", got, want)
	}
	if got, want := nicLine(topology.NIC{Name: "ens5", Node: 1, Speed: 25000}), "nic ens5: numa node 1, speed 25000 Mb/s"; got != want {
		t.Errorf("nicLine = %q; want %q", got, want)
	}
	out.Reset()
	if err := run([]string{"info"}, &out); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(out.String(), "-1 Mb/s") || strings.Contains(out.String(), "numa node -1") {
		t.Errorf("info prints -1:\n%s", out.String())
	}
}
