package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"image/png"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/metadata/etcdtest"
)

// TestMain lets the test binary stand in for the moonring binary when the
// bench starts a target process (os.Executable is the test binary).
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && (os.Args[1] == "bench" || os.Args[1] == "serve") {
		err := run(os.Args[1:], os.Stdout)
		if err != nil {
			os.Stderr.WriteString(errText(err) + "\n")
		}
		os.Exit(exitCode(err))
	}
	os.Exit(m.Run())
}

func benchJSON(t *testing.T, args ...string) []result {
	t.Helper()
	var out bytes.Buffer
	args = append([]string{"bench", "--json", "--duration", "50ms", "--block-size", "4K,64K", "--buffer-size", "4M"}, args...)
	if err := run(args, &out); err != nil {
		t.Fatalf("moonring %s: %v", strings.Join(args, " "), err)
	}
	var rs []result
	if err := json.Unmarshal(out.Bytes(), &rs); err != nil {
		t.Fatalf("--json output: %v\n%s", err, out.String())
	}
	if len(rs) != 4 {
		t.Fatalf("%d steps; want write and read at 2 sizes", len(rs))
	}
	for _, r := range rs {
		if !r.Verified || r.Requests == 0 || r.GBps <= 0 || r.P50us <= 0 {
			t.Errorf("step %+v: want verified data, requests and figures", r)
		}
		checkStatuses(t, r.Op+" "+r.Block, r)
	}
	return rs
}

func TestBenchLocal(t *testing.T) {
	for _, r := range benchJSON(t, "--protocol", "local") {
		if r.Transport != "local" {
			t.Errorf("transport %q", r.Transport)
		}
	}
}

// --pollers gives the initiator engine that many pollers; two threads'
// rings move and check their blocks on them, and the run says so.
func TestBenchPollers(t *testing.T) {
	for _, r := range benchJSON(t, "--protocol", "local", "--ring", "--threads", "2", "--pollers", "2") {
		if r.Run == nil || r.Run.Pollers != 2 {
			t.Fatalf("row's run %+v; want pollers 2", r.Run)
		}
	}
	if err := run([]string{"bench", "--protocol", "local", "--pollers", "65"}, io.Discard); err == nil || !strings.Contains(err.Error(), "Pollers 65") {
		t.Errorf("--pollers 65: %v; want an error naming Pollers 65", err)
	}
}

// The default: a target in a child process, over TCP.
func TestBenchTCP(t *testing.T) {
	for _, r := range benchJSON(t) {
		if r.Transport != "tcp" {
			t.Errorf("transport %q", r.Transport)
		}
	}
}

// A target in a child process on this host, reached through shm: mapped,
// and through process_vm calls.
func TestBenchSHM(t *testing.T) {
	for _, c := range []struct {
		extra []string
		want  string // the transport the rows name
	}{{nil, "shm"}, {[]string{"--no-map"}, "shm/process_vm"}} {
		for _, r := range benchJSON(t, append([]string{"--protocol", "shm"}, c.extra...)...) {
			if r.Transport != c.want || !r.Verified || r.Run == nil || r.Run.Transport != c.want {
				t.Errorf("%v: transport %q (run %+v), verified %v; want %s", c.extra, r.Transport, r.Run, r.Verified, c.want)
			}
		}
	}
}

func TestBadInput(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"bench", "--protocol", "carrier-pigeon"},
		{"bench", "--batch-size", "0"},
		{"bench", "--threads", "64", "--batch-size", "32"},
		{"bench", "--local-name", "x"},
		{"bench", "--block-size", "4Q"},
		{"bench", "--operation", "erase"},
		{"bench", "--block-size", "8M", "--buffer-size", "4M"},
		{"bench", "--mode", "both"},
		{"bench", "--segment", "127.0.0.1:1", "--duration", "10ms"},
		{"bench", "--block-size", "17592186044416M"}, // wraps to 0 in an int: it divided by zero
		{"bench", "--duration", "0"},
		{"bench", "4K"}, // an argument, not a flag: it ran the default sweep
		{"serve", "extra"},
	} {
		var out bytes.Buffer
		if err := run(args, &out); err == nil {
			t.Errorf("moonring %q: no error", args)
		}
	}
}

func TestInfo(t *testing.T) {
	var out bytes.Buffer
	if err := run([]string{"info"}, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"numa node 0", "tcp", "local", "timeout:"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("info lacks %q:\n%s", want, out.String())
		}
	}
}

// serve as a standing target, driven by bench --segment from "another host".
func TestServeAndBench(t *testing.T) {
	t.Setenv(keyEnv, "a key of the deployment")
	stop := make(chan struct{})
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- serve([]string{"--listen", "127.0.0.1:0", "--buffer-size", "4M"}, pw, stop)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("serve printed nothing: %v", err)
	}
	go io.Copy(io.Discard, pr)
	name := strings.Fields(strings.TrimPrefix(line, "serving segment "))[0]
	name = strings.TrimSuffix(name, ":")
	rs := benchJSON(t, "--segment", name)
	for _, r := range rs {
		if r.Transport != "tcp" {
			t.Errorf("transport %q", r.Transport)
		}
	}
	resp, err := http.Get("http://" + name + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "moonring_buffers_registered 1") {
		t.Errorf("/metrics lacks the buffer gauge:\n%s", body)
	}
	close(stop)
	if err := <-done; err != nil {
		t.Fatalf("serve: %v", err)
	}
}

func TestBenchPlot(t *testing.T) {
	file := t.TempDir() + "/sweep.png"
	benchJSON(t, "--protocol", "local", "--plot", file)
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cfg, err := png.DecodeConfig(f)
	if err != nil || cfg.Width < 500 || cfg.Height < 200 {
		t.Fatalf("plot: %+v, %v; want a PNG of at least 500x200", cfg, err)
	}
}

// A deployment with a metadata server: the bench's target process
// publishes there, the initiator resolves it there. The target's segment
// name is serve's default and a random suffix: a later run's target
// given the same process id (and a key of its own) must not find its
// name held by a killed one's entry (a soak in CI was refused so).
func TestBenchWithMetadataServer(t *testing.T) {
	addr, stop := startMetaServer(t, "--listen", "127.0.0.1:0", "--dir", t.TempDir())
	defer stop()
	rs := benchJSON(t, "--metadata", addr)
	for _, r := range rs {
		if r.Transport != "tcp" {
			t.Errorf("transport %q", r.Transport)
		}
	}
	hn, _ := os.Hostname()
	if run := rs[0].Run; run == nil || !regexp.MustCompile(fmt.Sprintf(`^%s-%d-[0-9a-f]{8}$`, regexp.QuoteMeta(hn), run.TargetPID)).MatchString(run.Target) {
		t.Errorf("run %+v: want the target named <hostname>-<its pid>-<8 hex digits>", run)
	}
}

// A deployment on etcd: the target process publishes its segment under a
// lease there, the initiator resolves it there.
func TestBenchWithEtcd(t *testing.T) {
	etcd := etcdtest.Start(t)
	spec := "etcd://" + strings.TrimPrefix(etcd.Endpoint(), "http://")
	for _, r := range benchJSON(t, "--metadata", spec, "--ttl", "3s") { // --ttl: the target processes take it too
		if r.Transport != "tcp" {
			t.Errorf("transport %q", r.Transport)
		}
	}
}

func TestBenchMix(t *testing.T) {
	rs := benchJSON(t, "--protocol", "local", "--operation", "mix,read")
	if rs[0].Op != "mix" || rs[2].Op != "read" {
		t.Errorf("ops %q, %q; want mix first, then read", rs[0].Op, rs[2].Op)
	}
}

func TestBenchThreads(t *testing.T) {
	for _, r := range benchJSON(t, "--protocol", "local", "--threads", "3", "--batch-size", "4") {
		if r.Threads != 3 || r.Batch != 4 {
			t.Errorf("step %+v: want 3 threads of 4", r)
		}
	}
}

// --batches keeps that many batches in flight per thread, each on blocks
// of its own (the data still checks out, mixed ops included), and is
// reduced, with a note, where the buffer holds too few blocks.
func TestBenchBatches(t *testing.T) {
	for _, api := range []string{"--ring=false", "--ring"} {
		for _, r := range benchJSON(t, "--protocol", "local", "--threads", "2", "--batch-size", "4", "--batches", "3", "--operation", "mix,write", api) {
			if r.Batches != 3 || r.Batch != 4 || r.Threads != 2 {
				t.Errorf("%s: step %+v: want 2 threads of 3 batches of 4", api, r)
			}
		}
	}
	rs := benchJSON(t, "--protocol", "local", "--block-size", "4K,1M", "--batch-size", "2", "--batches", "4")
	if r := rs[1]; r.Batches != 2 || r.Batch != 2 || !strings.Contains(r.Note, "2 batch(es) in flight (asked 4)") {
		t.Errorf("1M step %+v: want 2 batches of 2 (4 blocks in the 4M buffer) and why", r)
	}
	if rs[0].Run == nil || rs[0].Run.Batches != 4 {
		t.Errorf("run %+v: want --batches 4", rs[0].Run)
	}
	var out bytes.Buffer
	for _, args := range [][]string{{"--batches", "0"}, {"--lat", "--batches", "2"}, {"--batch-size", "64", "--batches", "17"}} {
		if err := run(append([]string{"bench", "--protocol", "local"}, args...), &out); err == nil {
			t.Errorf("bench %v: no error", args)
		}
	}
}

// The ring API, and a named initiator on a metadata server.
func TestBenchRingAPIAndLocalName(t *testing.T) {
	for _, r := range benchJSON(t, "--protocol", "local", "--ring") {
		if r.API != "ring" {
			t.Errorf("api %q; want ring", r.API)
		}
	}
	addr, stop := startMetaServer(t, "--listen", "127.0.0.1:0")
	defer stop()
	for _, r := range benchJSON(t, "--metadata", addr, "--local-name", "prefill-7") {
		if r.API != "batch" || r.Transport != "tcp" {
			t.Errorf("step %+v: want the batch API over tcp", r)
		}
	}
}

// serve as its own process, signalled to stop, with bench --mode initiator
// in this one: two processes, as on two hosts.
func TestServeProcess(t *testing.T) {
	t.Setenv(keyEnv, "a key of the deployment") // the child's too
	p := childproc.Start(t, childproc.Config{Args: []string{"serve", "--listen", "127.0.0.1:0", "--buffer-size", "4M"},
		Name: "serve", StopSignal: syscall.SIGTERM, StopWait: 30 * time.Second})
	f := strings.Fields(p.Line)
	if len(f) < 3 {
		t.Fatalf("serve printed %q", p.Line)
	}
	name := strings.TrimSuffix(f[2], ":")
	for _, r := range benchJSON(t, "--mode", "initiator", "--segment", name) {
		if r.Transport != "tcp" {
			t.Errorf("transport %q", r.Transport)
		}
	}
	if err := p.Stop(); err != nil {
		t.Fatalf("serve after SIGTERM: %v; want a clean exit", err)
	}
}
