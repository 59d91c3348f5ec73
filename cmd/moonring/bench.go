package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/tcp"
	"golang.org/x/sys/unix"
)

// result is one step of the sweep.
type result struct {
	// Transport is what moved the bytes: tcp, tcp/tls (a target serving
	// --tls), shm (a mapping of the
	// target's buffer), shm/process_vm (--no-map: process_vm_readv and
	// process_vm_writev), local.
	Transport string `json:"transport"`
	Op        string `json:"op"`
	BlockSize int    `json:"block_size"`
	Block     string `json:"block"` // BlockSize as 4K, 64K, 1M, 16M
	Batch     int    `json:"batch"`
	// BatchAsked is --batch-size; Batch is less when the buffer holds
	// fewer blocks per thread, which Note then says.
	BatchAsked int     `json:"batch_asked"`
	Threads    int     `json:"threads"`
	Note       string  `json:"note,omitempty"`
	API        string  `json:"api"`
	Requests   int     `json:"requests"`
	GBps       float64 `json:"gb_per_s"`
	ReqPerSec  float64 `json:"req_per_s"`
	P50us      float64 `json:"p50_us"`
	P99us      float64 `json:"p99_us"`
	P999us     float64 `json:"p999_us"`
	Verified   bool    `json:"verified"`
	// Mode is "bw" (requests in flight as --batch-size says) or "lat"
	// (--lat: one in flight).
	Mode   string  `json:"mode"`
	MeanUs float64 `json:"mean_us"`
	// Run is what the sweep measured against, the same in every row.
	Run *runInfo `json:"run,omitempty"`
}

// runInfo is the sweep's settings, printed before its rows (and with each
// of them with --json).
type runInfo struct {
	Transport string `json:"transport"`
	Target    string `json:"target"`
	// TargetPID is the target's process id when known (a target this
	// command started; a serve that says it on /healthz), else 0.
	TargetPID     int    `json:"target_pid,omitempty"`
	TargetStarted bool   `json:"target_started"` // by this command, on this host
	Metadata      string `json:"metadata"`
	Buffer        int    `json:"buffer_size"`
	Batch         int    `json:"batch_size"`
	Threads       int    `json:"threads"`
	API           string `json:"api"`
	Mode          string `json:"mode"`     // bw or lat
	Duration      string `json:"duration"` // per step, after a warm-up of a fifth of it
	Verify        bool   `json:"verify"`
	Host          string `json:"host"`
	Version       string `json:"version"`
	Date          string `json:"date"` // the sweep's start, RFC 3339, UTC
}

// header is the lines of settings before the table.
func (r *runInfo) header() string {
	target := r.Target
	switch {
	case r.TargetStarted:
		target += fmt.Sprintf(" (pid %d, started by this command)", r.TargetPID)
	case r.TargetPID != 0:
		target += fmt.Sprintf(" (pid %d)", r.TargetPID)
	case r.Transport != "local":
		target += " (pid unknown)"
	}
	verify := "data checked after each step"
	if !r.Verify {
		verify = "data not checked (--verify=false)"
	}
	mode := fmt.Sprintf("# bandwidth mode: %d requests in flight per thread. A request's latency is the time its batch took", r.Batch)
	if r.API == "ring" {
		mode = fmt.Sprintf("# bandwidth mode: %d requests in flight per thread. A request's latency includes its wait behind the others in flight", r.Batch)
	}
	mode += fmt.Sprintf(":\n#   the p50 is queueing latency at batch %d, not one request's round trip (moonring bench --lat measures that)\n", r.Batch)
	if r.Mode == "lat" {
		mode = "# latency mode: one request in flight on one thread; mean and percentiles of single requests' round trips\n"
	}
	return fmt.Sprintf("# moonring bench: %s to %s, metadata %s\n"+
		"# buffer %s, batch %d, threads %d, %s API, %s per step after a warm-up of a fifth of it, %s\n"+
		"# host %s, moonring %s, %s\n%s",
		r.Transport, target, r.Metadata, fmtSize(r.Buffer), r.Batch, r.Threads, r.API, r.Duration, verify, r.Host, r.Version, r.Date, mode)
}

func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := parseSize(f)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	return out, nil
}

// sizeUnits are the suffixes a size may have, in either case, with or
// without "iB": K, M, G, T (powers of 1024).
var sizeUnits = []struct {
	suffix string
	shift  uint
}{{"t", 40}, {"g", 30}, {"m", 20}, {"k", 10}}

// parseSize reads one size: a whole number of bytes, or of KiB, MiB, GiB
// or TiB with a K, M, G or T suffix in either case (4K, 4k, 4KiB), from 1
// byte to 64G. Its error quotes the size as given.
func parseSize(given string) (int, error) {
	f := strings.TrimSpace(given)
	num, mult := f, 1
	low := strings.ToLower(f)
unit:
	for _, u := range sizeUnits {
		for _, form := range []string{u.suffix + "ib", u.suffix} {
			if strings.HasSuffix(low, form) {
				num, mult = f[:len(f)-len(form)], 1<<u.shift
				break unit
			}
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	switch {
	case err != nil && !errors.Is(err, strconv.ErrRange):
		return 0, fmt.Errorf("bad size %q: want a whole number of bytes, or of KiB, MiB, GiB or TiB with a K, M, G or T suffix (either case), from 1 to 64G", given)
	case n <= 0 && err == nil:
		return 0, fmt.Errorf("bad size %q: want at least 1 (sizes go from 1 to 64G)", given)
	case err != nil || n > int64(maxSize/mult):
		if strings.HasPrefix(num, "-") {
			return 0, fmt.Errorf("bad size %q: want at least 1 (sizes go from 1 to 64G)", given)
		}
		return 0, fmt.Errorf("bad size %q: above the limit of 64G", given)
	}
	return int(n) * mult, nil
}

// fmtSize writes a size as the flags take it: 4K, 64K, 1M, 16M, 2G, or
// bytes when it is no whole number of KiB.
func fmtSize(n int) string {
	for _, u := range []struct {
		shift  uint
		suffix string
	}{{40, "T"}, {30, "G"}, {20, "M"}, {10, "K"}} {
		if n >= 1<<u.shift && n%(1<<u.shift) == 0 {
			return strconv.Itoa(n>>u.shift) + u.suffix
		}
	}
	return strconv.Itoa(n)
}

// maxSize bounds a block or buffer size.
const maxSize = 64 << 30

// pattern is what a bench target's buffer holds at offset i before any
// WRITE: the initiator checks READs against it.
func pattern(i int) byte { return byte(i*7 ^ i>>9) }

const benchHelp = `usage: moonring bench [flags]

Sweep WRITE and READ over block sizes against a target and print GB/s,
req/s and latency, a row as each step ends (--json: a JSON array, a row
per line, each with the run's settings under "run").

Two modes, as ucx_perftest's *_bw and *_lat tests:
  default  bandwidth: --batch-size requests in flight per thread (32),
           block sizes 4K,64K,1M,16M. A request's latency here is the
           time its whole batch took (or, with --ring, the time it waited
           behind the others in flight): its p50 is queueing latency at
           that depth, not one request's round trip.
  --lat    latency: one request in flight on one thread (batch 1), block
           sizes 8,64,512,4K unless --block-size; each row gives the mean
           and the p50, p99 and p999 of single requests' round trips.

By default the target is a child process this command
starts on loopback; it gets a random segment key made for the run,
through its environment (never its command line), and the key ends with
the run. With --segment the target is another one (moonring serve, or
bench --mode target), whose key this command must hold:

` + keyHelp + `
With no key, bench --segment reaches only a target serving --insecure.

flags:
`

// targetStarted, when set (by tests), is told of each target process
// bench starts and of the key it handed it.
var targetStarted func(cmd *exec.Cmd, key []byte)

func bench(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	mode := fs.String("mode", "initiator", "initiator, or target (serve a buffer until stdin closes or a signal)")
	protocol := fs.String("protocol", "tcp", "tcp or shm (a target process on this host; shm maps its buffer), or local (engines in this process)")
	noMap := fs.Bool("no-map", false, "with --protocol shm: reach the target through process_vm_readv/writev, not a mapping")
	operation := fs.String("operation", "write,read", "write, read, mix (half of the requests each), comma separated")
	blocks := fs.String("block-size", "4K,64K,1M,16M", "block sizes, comma separated (bytes, or K, M, G suffixes in either case; with --lat the default is 8,64,512,4K)")
	latMode := fs.Bool("lat", false, "latency mode: one request in flight (batch 1, one thread), small blocks; mean, p50, p99, p999")
	batch := fs.Int("batch-size", 32, "requests in flight per thread")
	threads := fs.Int("threads", 1, "goroutines submitting, each with its own ring or batches")
	useRing := fs.Bool("ring", false, "drive the io_uring-style Ring API instead of the Mooncake-style batch API")
	duration := fs.Duration("duration", time.Second, "measured time per step (after a warm-up of a fifth of it)")
	bufSize := fs.String("buffer-size", "64M", "the target's buffer (K, M, G suffixes; at most 64G)")
	segment := fs.String("segment", "", "the target's segment (host:port of its p2p endpoint, or its name with --metadata http://...); default: start one")
	localName := fs.String("local-name", "", "the initiator's segment name with --metadata http or etcd (with p2p it is its endpoint's address)")
	meta := fs.String("metadata", "p2p", "p2p, http://HOST:PORT of a metadata-server, or etcd://HOST:PORT[,HOST:PORT...]")
	listen := fs.String("listen", "127.0.0.1:0", "target: the p2p metadata endpoint's address (the segment name)")
	verify := fs.Bool("verify", true, "check the data of every step")
	asJSON := fs.Bool("json", false, "print results as JSON")
	plotPath := fs.String("plot", "", "also draw GB/s and p99 latency against block size into this PNG file")
	keyFile := fs.String("key-file", "", "--segment, --mode target: read the segment key from this file (mode 0600; default: $"+keyEnv+")")
	insecure := fs.Bool("insecure", false, "--mode target: as serve --insecure")
	useTLS := fs.Bool("tls", false, "--protocol tcp: the target serves TLS 1.3 with a certificate its signed descriptor pins (as serve --tls; the target bench starts gets it too); with --segment, a target without it is refused")
	if err := parseFlags(fs, args, out, benchHelp); err != nil {
		return err
	}
	if *duration <= 0 {
		return fmt.Errorf("bench: duration %v: want more than 0", *duration)
	}
	bs, err := parseSizes(*bufSize)
	if err == nil && len(bs) != 1 {
		err = fmt.Errorf("bad size %q: one size, not a list", *bufSize)
	}
	if err != nil {
		return fmt.Errorf("bench: --buffer-size: %w", err)
	}
	if *useTLS && *protocol != "tcp" && *mode != "target" {
		return fmt.Errorf("bench: --tls goes with --protocol tcp (the protocol is %s)", *protocol)
	}
	if *noMap && *protocol != "shm" {
		return fmt.Errorf("bench: --no-map goes with --protocol shm (it reaches a target on this host through process_vm_readv/writev instead of a mapping); the protocol is %s", *protocol)
	}
	if *mode == "target" {
		// A target for one initiator: serve until stdin closes (the
		// initiator that started this process ends it so) or a signal.
		stop := make(chan struct{})
		go func() { io.Copy(io.Discard, os.Stdin); close(stop) }()
		sargs := []string{"--listen", *listen, "--buffer-size", *bufSize, "--metadata", *meta, "--key-file", *keyFile}
		if *insecure {
			sargs = append(sargs, "--insecure")
		}
		if *useTLS {
			sargs = append(sargs, "--tls")
		}
		return serve(sargs, out, stop)
	}
	if *mode != "initiator" {
		return fmt.Errorf("bad mode %q (want initiator or target)", *mode)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *latMode {
		if (set["batch-size"] && *batch != 1) || (set["threads"] && *threads != 1) {
			return fmt.Errorf("bench: --lat keeps one request in flight: --batch-size %d --threads %d go without it", *batch, *threads)
		}
		*batch, *threads = 1, 1
		if !set["block-size"] {
			*blocks = "8,64,512,4K"
		}
	}
	sizes, err := parseSizes(*blocks)
	if err != nil {
		return fmt.Errorf("bench: --block-size: %w", err)
	}
	if *batch < 1 || *threads < 1 || *batch**threads > 1024 {
		return fmt.Errorf("batch-size %d, threads %d: want both at least 1 and their product at most 1024", *batch, *threads)
	}
	var ops []moonring.Op
	for _, o := range strings.Split(*operation, ",") {
		switch strings.TrimSpace(o) {
		case "write":
			ops = append(ops, moonring.OpWrite)
		case "read":
			ops = append(ops, moonring.OpRead)
		case "mix":
			ops = append(ops, opMix)
		default:
			return fmt.Errorf("bad operation %q (want write, read or mix)", o)
		}
	}
	if slices.Max(sizes) > bs[0] {
		return fmt.Errorf("bench: block size %s above the buffer size %s (--buffer-size)", fmtSize(slices.Max(sizes)), fmtSize(bs[0]))
	}
	// The plot's file is opened before the sweep: a path that cannot be
	// written fails now, not after minutes of measuring.
	var plot *plotFile
	if *plotPath != "" {
		if plot, err = openPlot(*plotPath); err != nil {
			return fmt.Errorf("bench: --plot: %w", err)
		}
		defer plot.abandon()
	}
	// Ctrl-C (or SIGTERM) ends the sweep: the rows done stay printed.
	ctx, stopSignals := signal.NotifyContext(ctxMain, os.Interrupt, syscall.SIGTERM)
	defer stopSignals()
	var tg *target
	switch *protocol {
	case "tcp", "shm":
		tg, err = remoteTarget(ctx, *protocol, *noMap, *useTLS, *segment, *meta, *localName, *keyFile, bs[0])
	case "local":
		tg, err = localTarget(ctx, bs[0])
	default:
		return fmt.Errorf("protocol %q is not in this build (have: tcp, shm, local)", *protocol)
	}
	if err != nil {
		if ctx.Err() != nil {
			return &exitError{code: exitInterrupted, err: errors.New("bench: interrupted before the sweep began")}
		}
		return err
	}
	defer tg.close()
	if !*asJSON {
		tg.progress = progressLine
	}
	var rep reporter = &tableReport{w: out, lat: *latMode}
	if *asJSON {
		rep = &jsonReport{w: out}
	}
	api := "batch"
	if *useRing {
		api = "ring"
	}
	hostname, _ := os.Hostname()
	runMode := "bw"
	if *latMode {
		runMode = "lat"
	}
	run := &runInfo{Transport: tg.transport, Target: tg.name, TargetPID: tg.pid, TargetStarted: tg.started, Metadata: *meta,
		Buffer: bs[0], Batch: *batch, Threads: *threads, API: api, Mode: runMode, Duration: duration.String(), Verify: *verify,
		Host: hostname, Version: version(), Date: time.Now().UTC().Format(time.RFC3339)}
	if *protocol == "local" {
		run.Metadata = "in this process"
	}
	if err := rep.header(run); err != nil {
		return fmt.Errorf("bench: writing the results: %w", err)
	}
	type stepSpec struct {
		op   moonring.Op
		size int
	}
	var steps []stepSpec
	for _, op := range ops {
		for _, size := range sizes {
			steps = append(steps, stepSpec{op, size})
		}
	}
	var results []result
	var sweepErr error
	for i, st := range steps {
		res, err := tg.step(ctx, st.op, st.size, *batch, *threads, *duration, *verify, *useRing)
		res.Mode = runMode
		if err != nil {
			what := fmt.Sprintf("step %d of %d (%s %s)", i+1, len(steps), opName(st.op), fmtSize(st.size))
			done := fmt.Sprintf("the %d rows above are complete", len(results))
			if ctx.Err() != nil {
				sweepErr = &exitError{code: exitInterrupted, err: fmt.Errorf("bench: interrupted during %s; %s", what, done)}
			} else {
				sweepErr = fmt.Errorf("bench: %s failed: %w; %s", what, err, done)
			}
			break
		}
		results = append(results, res)
		if err := rep.row(res); err != nil {
			return fmt.Errorf("bench: writing the results: %w", err)
		}
	}
	if err := rep.end(); err != nil && sweepErr == nil {
		sweepErr = fmt.Errorf("bench: writing the results: %w", err)
	}
	if plot != nil && len(results) > 0 {
		if err := plot.write(results, run); err != nil {
			return errors.Join(sweepErr, fmt.Errorf("bench: --plot %s: %w (the rows above are complete)", *plotPath, err))
		}
	}
	return sweepErr
}

// exitInterrupted is bench's exit status when a signal ended the sweep
// (128 + SIGINT, as a shell reports it).
const exitInterrupted = 130

// opName names an op as the results do.
func opName(op moonring.Op) string {
	if op == opMix {
		return "mix"
	}
	return op.String()
}

// reporter prints the sweep's rows as each step ends; end finishes the
// output (also after a failed step: what was printed stays whole).
type reporter interface {
	header(r *runInfo) error
	row(r result) error
	end() error
}

// tableReport prints a table, a line per step, in columns of fixed width
// (a tabwriter would hold every row until the end).
type tableReport struct {
	w      io.Writer
	lat    bool // --lat: the latency columns
	titled bool
}

const latRow = "%-14s %-5s %-5s %5s %9s %10s %9s %9s %9s %9s %8s%s\n"

const tableRow = "%-14s %-5s %-5s %5s %5s %7s %8s %10s %9s %9s %9s %8s%s\n"

func (t *tableReport) header(r *runInfo) error {
	_, err := io.WriteString(t.w, r.header())
	return err
}

func (t *tableReport) row(r result) error {
	if t.lat {
		return t.latRow(r)
	}
	if !t.titled {
		t.titled = true
		if _, err := fmt.Fprintf(t.w, tableRow, "transport", "api", "op", "block", "batch", "threads", "GB/s", "req/s", "p50 µs", "p99 µs", "p999 µs", "verified", "  note"); err != nil {
			return err
		}
	}
	note := ""
	if r.Note != "" {
		note = "  " + r.Note
	}
	_, err := fmt.Fprintf(t.w, tableRow, r.Transport, r.API, r.Op, r.Block, strconv.Itoa(r.Batch), strconv.Itoa(r.Threads),
		fmt.Sprintf("%.2f", r.GBps), fmt.Sprintf("%.0f", r.ReqPerSec), fmt.Sprintf("%.2f", r.P50us), fmt.Sprintf("%.2f", r.P99us), fmt.Sprintf("%.2f", r.P999us), strconv.FormatBool(r.Verified), note)
	return err
}

func (t *tableReport) latRow(r result) error {
	if !t.titled {
		t.titled = true
		if _, err := fmt.Fprintf(t.w, latRow, "transport", "api", "op", "block", "requests", "req/s", "mean µs", "p50 µs", "p99 µs", "p999 µs", "verified", ""); err != nil {
			return err
		}
	}
	f := func(v float64) string { return fmt.Sprintf("%.2f", v) }
	_, err := fmt.Fprintf(t.w, latRow, r.Transport, r.API, r.Op, r.Block, strconv.Itoa(r.Requests), fmt.Sprintf("%.0f", r.ReqPerSec),
		f(r.MeanUs), f(r.P50us), f(r.P99us), f(r.P999us), strconv.FormatBool(r.Verified), "")
	return err
}

func (t *tableReport) end() error { return nil }

// jsonReport prints a JSON array, an element per line as each step ends;
// end closes it, so that the output parses whatever step failed.
type jsonReport struct {
	w   io.Writer
	n   int
	run *runInfo
}

func (j *jsonReport) header(r *runInfo) error {
	j.run = r
	return nil
}

func (j *jsonReport) row(r result) error {
	r.Run = j.run
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	sep := ",\n  "
	if j.n == 0 {
		sep = "[\n  "
	}
	j.n++
	_, err = fmt.Fprintf(j.w, "%s%s", sep, b)
	return err
}

func (j *jsonReport) end() error {
	if j.n == 0 {
		_, err := io.WriteString(j.w, "[]\n")
		return err
	}
	_, err := io.WriteString(j.w, "\n]\n")
	return err
}

// target is what a sweep runs against: an initiator engine, the target's
// segment and buffer, and what the buffer holds.
type target struct {
	// progress, when set, shows a live line while a step runs; the
	// function it returns ends it.
	progress  func(res result, d time.Duration) func()
	transport string
	name      string // the target's segment
	pid       int    // the target's process, when known
	started   bool   // by this command
	ini       *moonring.Engine
	seg       moonring.SegmentID
	base      uint64 // the remote buffer's address
	model     []byte // what the remote buffer holds
	closers   []func()
	store     metadata.Store  // the initiator's, for asking after the target
	exited    <-chan struct{} // closed when the target process this command started exits
	exit      atomic.Pointer[error]
}

// firstLine is the stdout of a target process: it hands on the first line
// (the target's "serving segment ..." line) and drops the rest.
type firstLine struct {
	line chan string
	buf  []byte
	sent bool
}

func (w *firstLine) Write(p []byte) (int, error) {
	if w.sent {
		return len(p), nil
	}
	w.buf = append(w.buf, p...)
	if i := bytes.IndexByte(w.buf, '\n'); i >= 0 || len(w.buf) > 4096 {
		if i < 0 {
			i = len(w.buf)
		}
		w.line <- string(w.buf[:i])
		w.sent, w.buf = true, nil
	}
	return len(p), nil
}

// openError says why the target's segment could not be opened, naming the
// side that refused and what to check.
func openError(name string, noKey bool, err error) error {
	fix := "check that both sides hold the same key (--key-file FILE or " + keyEnv + ")"
	switch {
	case errors.Is(err, metadata.ErrForged):
		if noKey {
			break
		}
		return &explained{fmt.Sprintf("this process refused the descriptor of segment %s: it is not signed with this process's segment key, so the target runs with another key (or the descriptor was changed on its way); %s", name, fix), err}
	case errors.Is(err, tcp.ErrPinMismatch):
		return &explained{fmt.Sprintf("the target %s answered with a TLS certificate other than the one its descriptor pins (a relay on the path, or a target restarted since its descriptor was read)", name), err}
	case noKey && (errors.Is(err, moonring.ErrDenied) || errors.Is(err, tcp.ErrAuth)):
		return &explained{fmt.Sprintf("the target %s needs the segment key and this process has none: give it with --key-file FILE or %s", name, keyEnv), err}
	case errors.Is(err, moonring.ErrDenied), errors.Is(err, tcp.ErrAuth):
		return &explained{fmt.Sprintf("the target %s refused this process's segment key; %s", name, fix), err}
	}
	if noKey {
		return fmt.Errorf("open segment %s (no segment key given: --key-file FILE or %s): %w", name, keyEnv, err)
	}
	return fmt.Errorf("open segment %s: %w", name, err)
}

// healthPID asks the p2p endpoint addr (a moonring serve) for its
// process id on /healthz; 0 when it does not say.
func healthPID(ctx context.Context, addr string) int {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/healthz", nil)
	if err != nil {
		return 0
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var h healthInfo
	if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&h) != nil || h.Segment != addr {
		return 0
	}
	return h.PID
}

// explained is an error told in the command's words: its text says what
// happened and what to do, and it wraps the library's error for errors.Is
// without printing its chain.
type explained struct {
	msg string
	err error
}

func (e *explained) Error() string { return e.msg }
func (e *explained) Unwrap() error { return e.err }

// stepError says what became of the target when a step's requests failed:
// a connection lost, a process that exited, a buffer withdrawn.
func (t *target) stepError(err error) error {
	if t.exited != nil {
		select {
		case <-t.exited:
			return fmt.Errorf("the target process (pid %d) exited (%v), so the connection to it was lost: %w", t.pid, *t.exit.Load(), err)
		case <-time.After(200 * time.Millisecond):
		}
	}
	gone := ""
	if t.store != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		if _, gerr := t.store.Get(ctx, t.name); gerr != nil {
			gone = fmt.Sprintf(" (its segment is no longer published: %v)", gerr)
		}
		cancel()
	}
	switch {
	case errors.Is(err, moonring.ErrDenied):
		return fmt.Errorf("the target %s refused the requests: it no longer serves the buffer (stopping, or restarted)%s: %w", t.name, gone, err)
	case errors.Is(err, moonring.ErrTransport), errors.Is(err, moonring.ErrTimeout):
		return fmt.Errorf("the connection to the target %s was lost%s: %w", t.name, gone, err)
	}
	return err
}

func (t *target) close() {
	for i := len(t.closers) - 1; i >= 0; i-- {
		t.closers[i]()
	}
}

// localTarget is a second engine of this process.
func localTarget(ctx context.Context, size int) (*target, error) {
	t := &target{transport: "local"}
	ini, err := moonring.New(moonring.Config{})
	if err != nil {
		return nil, err
	}
	t.ini = ini
	t.closers = append(t.closers, func() { ini.Close() })
	tgt, err := moonring.New(moonring.Config{})
	if err != nil {
		t.close()
		return nil, err
	}
	t.closers = append(t.closers, func() { tgt.Close() })
	remote, err := tgt.Alloc(size, "cpu:0")
	if err != nil {
		t.close()
		return nil, err
	}
	for i := range remote {
		remote[i] = pattern(i)
	}
	if _, err := tgt.RegisterLocalMemory(remote, "cpu:0", true); err != nil {
		t.close()
		return nil, err
	}
	if t.seg, err = ini.OpenSegment(ctx, tgt.Name()); err != nil {
		t.close()
		return nil, err
	}
	t.base = uint64(moonring.AddressOf(remote))
	t.model = bytes.Clone(remote)
	t.name, t.pid = tgt.Name(), os.Getpid()
	return t, nil
}

// remoteTarget opens the segment name over TCP or shm (proto), first
// starting a target process on loopback when name is empty: that process
// and this one then share a key made for the run. Otherwise the key comes
// from keyFile or MOONRING_KEY (loadKey).
func remoteTarget(ctx context.Context, proto string, noMap, useTLS bool, name, meta, localName, keyFile string, size int) (*target, error) {
	if localName != "" && meta == "p2p" {
		return nil, errors.New("--local-name needs --metadata http or etcd: with p2p the name is the endpoint's address")
	}
	t := &target{transport: proto}
	var key []byte
	if name == "" {
		self, err := os.Executable()
		if err != nil {
			return nil, err
		}
		key = newKey()
		cmd := exec.Command(self, "bench", "--mode", "target", "--buffer-size", strconv.Itoa(size), "--metadata", meta)
		if useTLS {
			cmd.Args = append(cmd.Args, "--tls")
		}
		// The key through the environment, which only this user can read
		// (/proc/PID/environ), not the command line, which anyone can.
		cmd.Env = append(slices.DeleteFunc(os.Environ(), func(v string) bool { return strings.HasPrefix(v, keyEnv+"=") }),
			keyEnv+"="+string(key))
		cmd.Stderr = os.Stderr
		// Its own process group: a Ctrl-C at the terminal ends the sweep,
		// and the sweep then ends the target (stdin), not the signal.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if targetStarted != nil {
			targetStarted(cmd, key)
		}
		stdin, err := cmd.StdinPipe()
		if err != nil {
			return nil, err
		}
		first := &firstLine{line: make(chan string, 1)}
		cmd.Stdout = first
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("start the target: %w", err)
		}
		exited := make(chan struct{})
		go func() {
			err := cmd.Wait()
			t.exit.Store(&err)
			close(exited)
		}()
		t.exited = exited
		t.closers = append(t.closers, func() { stdin.Close(); <-exited })
		t.pid, t.started = cmd.Process.Pid, true
		var line string
		select {
		case line = <-first.line:
		case <-exited:
		case <-ctx.Done():
		}
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != "serving" || f[1] != "segment" {
			t.close()
			if e := t.exit.Load(); e != nil {
				return nil, fmt.Errorf("the target process (pid %d) did not start: it exited (%v)", t.pid, *e)
			}
			return nil, fmt.Errorf("the target process (pid %d) did not start (it printed %q)", t.pid, line)
		}
		name = strings.TrimSuffix(f[2], ":")
	} else {
		var err error
		if key, err = loadKey(keyFile); err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
	}
	var store metadata.Store
	var err error
	switch {
	case meta == "p2p":
		store, err = metadata.NewP2P(metadata.P2PConfig{})
	case strings.HasPrefix(meta, "etcd://"):
		var ec etcd.Config
		if ec, err = etcd.ParseURL(meta); err == nil {
			store, err = etcd.New(ec)
		}
	default:
		store, err = metadata.NewHTTP(metadata.HTTPConfig{URL: meta, Key: key})
	}
	if err != nil {
		t.close()
		return nil, err
	}
	t.closers = append(t.closers, func() { store.Close() })
	t.store = store
	cfg := moonring.Config{Name: localName, Metadata: store, Transports: []string{proto}, TCP: &tcp.Config{Key: key}}
	if proto == "shm" {
		cfg.SHM = &shm.Config{NoMap: noMap}
	}
	ini, err := moonring.New(cfg)
	if err != nil {
		t.close()
		return nil, err
	}
	t.ini = ini
	t.closers = append(t.closers, func() { ini.Close() })
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	desc, err := store.Get(ctx, name)
	if err != nil {
		t.close()
		return nil, fmt.Errorf("segment %s: %w", name, err)
	}
	if useTLS && !strings.Contains(desc.Endpoints[tcp.Name], "?tls=") {
		t.close()
		return nil, fmt.Errorf("bench --tls: the target %s serves plain TCP (its endpoint %q pins no certificate): start it with serve --tls, or leave out --tls", name, desc.Endpoints[tcp.Name])
	}
	if len(desc.Buffers) == 0 || desc.Buffers[0].Length < uint64(size) {
		t.close()
		return nil, fmt.Errorf("segment %s serves no buffer of %d bytes", name, size)
	}
	if t.seg, err = ini.OpenSegment(ctx, name); err != nil {
		t.close()
		return nil, openError(name, key == nil, err)
	}
	if t.transport, err = ini.SegmentTransport(t.seg); err != nil {
		t.close()
		return nil, err
	}
	if !t.started && meta == "p2p" {
		t.pid = healthPID(ctx, name)
	}
	if t.transport == tcp.Name && strings.Contains(desc.Endpoints[tcp.Name], "?tls=") {
		t.transport = "tcp/tls" // the endpoint pins a certificate: the initiator dials TLS
	}
	if t.transport == "shm" && noMap {
		t.transport = "shm/process_vm"
	}
	t.name = name
	t.base = desc.Buffers[0].Addr
	t.model = make([]byte, size)
	for i := range t.model {
		t.model[i] = pattern(i)
	}
	return t, nil
}

// moved counts the bytes of the step under way, for the progress line.
var moved atomic.Int64

// opMix asks step for WRITEs on even blocks and READs on odd ones.
const opMix = moonring.Op(0xff)

// step runs one op and block size for d: threads goroutines, each with its
// own Ring and depth requests in flight, each request on its own block of
// both buffers; then it checks the bytes.
func (t *target) step(ctx context.Context, op moonring.Op, size, depth, threads int, d time.Duration, verify, useRing bool) (result, error) {
	askedThreads, askedDepth := threads, depth
	blocks := len(t.model) / size
	threads = max(1, min(threads, blocks))
	depth = max(1, min(depth, blocks/threads))
	total := depth * threads
	res := result{Transport: t.transport, Op: op.String(), BlockSize: size, Block: fmtSize(size), Batch: depth, BatchAsked: askedDepth, Threads: threads, API: "batch"}
	switch {
	case threads < askedThreads:
		res.Note = fmt.Sprintf("threads %d, batch %d (asked %d of %d): the %s buffer holds %d blocks of %s", threads, depth, askedThreads, askedDepth, fmtSize(len(t.model)), blocks, res.Block)
	case depth < askedDepth:
		res.Note = fmt.Sprintf("batch %d (asked %d): the %s buffer holds %d blocks of %s", depth, askedDepth, fmtSize(len(t.model)), blocks, res.Block)
		if threads > 1 {
			res.Note += fmt.Sprintf(", %d per thread", blocks/threads)
		}
	}
	if useRing {
		res.API = "ring"
	}
	opOf := func(slot int) moonring.Op {
		switch {
		case op != opMix:
			return op
		case slot%2 == 0:
			return moonring.OpWrite
		}
		return moonring.OpRead
	}
	if op == opMix {
		res.Op = "mix"
	}
	span := size * total
	local, err := t.ini.Alloc(span, "cpu:0")
	if err != nil {
		return res, err
	}
	defer t.ini.Free(local)
	for i := range local {
		local[i] = byte(i*13 + size) // distinct from pattern: a READ that moves nothing shows
	}
	lid, err := t.ini.RegisterLocalMemory(local, "cpu:0", false)
	if err != nil {
		return res, err
	}
	defer t.ini.UnregisterLocalMemory(context.Background(), local)
	rings := make([]*moonring.Ring, threads)
	for k := range rings {
		if rings[k], err = t.ini.NewRing(moonring.RingConfig{Entries: 1024}); err != nil {
			return res, err
		}
		defer rings[k].Close()
	}
	entry := func(slot int, op moonring.Op) *moonring.Entry {
		off := uint64(slot * size)
		return &moonring.Entry{Op: op, Segment: t.seg, Buffer: lid, Local: off, Remote: t.base + off, Length: uint64(size), UserData: uint64(slot)}
	}
	type outcome struct {
		requests int
		elapsed  time.Duration
		lat      []time.Duration
		err      error
	}
	outs := make([]outcome, threads)
	if t.progress != nil {
		stop := t.progress(res, d)
		defer stop()
	}
	var wg sync.WaitGroup
	for k := range threads {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := &outs[k]
			if useRing {
				o.requests, o.elapsed, o.lat, o.err = drive(ctx, rings[k], k*depth, depth, d, func(slot int) *moonring.Entry { return entry(slot, opOf(slot)) })
				return
			}
			o.requests, o.elapsed, o.lat, o.err = driveBatches(ctx, t.ini, k*depth, depth, d, func(slot int) moonring.TransferRequest {
				en := entry(slot, opOf(slot))
				op := moonring.Read
				if en.Op == moonring.OpWrite {
					op = moonring.Write
				}
				return moonring.TransferRequest{Opcode: op, Source: moonring.AddressOf(local) + uintptr(en.Local), TargetID: t.seg, TargetOffset: en.Remote, Length: en.Length}
			})
		}()
	}
	wg.Wait()
	var lat []time.Duration
	for _, o := range outs {
		if o.err != nil {
			return res, t.stepError(o.err)
		}
		res.Requests += o.requests
		res.GBps += float64(o.requests) * float64(size) / o.elapsed.Seconds() / 1e9
		res.ReqPerSec += float64(o.requests) / o.elapsed.Seconds()
		lat = append(lat, o.lat...)
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) / 1e3 }
		res.P50us, res.P99us, res.P999us = pct(0.50), pct(0.99), pct(0.999)
		var sum time.Duration
		for _, l := range lat {
			sum += l
		}
		res.MeanUs = float64(sum.Nanoseconds()) / float64(len(lat)) / 1e3
	}
	// Every written block was written with the same bytes each time.
	written := 0
	for slot := range total {
		if opOf(slot) == moonring.OpWrite {
			b := slot * size
			copy(t.model[b:b+size], local[b:b+size])
			written++
		}
	}
	if !verify {
		return res, nil
	}
	if written > 0 {
		// Read the written blocks back into the local buffer, cleared first.
		r := rings[0]
		for slot := range total {
			if opOf(slot) != moonring.OpWrite {
				continue
			}
			clear(local[slot*size : (slot+1)*size])
			if err := r.SubmitOne(entry(slot, moonring.OpRead)); err != nil {
				return res, err
			}
		}
		cqes := make([]moonring.Completion, written)
		for got := 0; got < written; {
			if err := r.CQ().Wait(ctx, 1); err != nil {
				return res, err
			}
			n := r.PeekBatch(cqes)
			for _, c := range cqes[:n] {
				if err := c.Err(); err != nil {
					return res, fmt.Errorf("reading the written blocks back: %w", t.stepError(err))
				}
			}
			r.Advance(n)
			got += n
		}
	}
	if !bytes.Equal(local, t.model[:span]) {
		return res, errors.New("the data differs from what the step wrote or the target held")
	}
	res.Verified = true
	return res, nil
}

// driveBatches is drive through the batch API, as Mooncake's bench does:
// rounds of one batch of depth requests (AllocateBatchID, SubmitTransfer,
// WaitBatch, every status checked, FreeBatchID) for d after a warm-up of
// d/5. A request's latency is its batch's.
func driveBatches(ctx context.Context, e *moonring.Engine, first, depth int, d time.Duration, req func(slot int) moonring.TransferRequest) (int, time.Duration, []time.Duration, error) {
	reqs := make([]moonring.TransferRequest, depth)
	for i := range reqs {
		reqs[i] = req(first + i)
	}
	st := make([]moonring.TransferStatus, depth)
	lat := make([]time.Duration, 0, 1<<16)
	requests := 0
	t0 := time.Now()
	warm, warmed := d/5, false
	for {
		now := time.Now()
		if !warmed && now.Sub(t0) >= warm {
			warmed, t0 = true, now
			requests, lat = 0, lat[:0]
		}
		if warmed && now.Sub(t0) >= d {
			return requests, time.Since(t0), lat, nil
		}
		id, err := e.AllocateBatchID(depth)
		if err != nil {
			return 0, 0, nil, err
		}
		if err := e.SubmitTransfer(id, reqs); err != nil {
			e.WaitBatch(context.Background(), id) // what was pushed ends within its deadline
			e.FreeBatchID(id)
			return 0, 0, nil, err
		}
		if err := e.WaitBatch(ctx, id); err != nil {
			for i := range reqs {
				e.CancelTransfer(id, i)
			}
			e.WaitBatch(context.Background(), id) // canceled tasks end at once
			e.FreeBatchID(id)
			return 0, 0, nil, err
		}
		took := time.Since(now)
		n, err := e.GetBatchTransferStatus(id, st)
		if err == nil {
			for i := range st[:n] {
				if err = st[i].Err(); err != nil {
					break
				}
			}
		}
		e.FreeBatchID(id)
		if err != nil {
			return 0, 0, nil, err
		}
		requests += depth
		moved.Add(int64(depth) * int64(reqs[0].Length))
		for range depth {
			lat = append(lat, took)
		}
	}
}

// drive keeps depth requests in flight on r over the blocks first ..
// first+depth-1 for d after a warm-up of d/5 (run and then forgotten: the
// first requests pay for cold caches and connections). It returns the
// requests measured, the time they took and their latencies.
func drive(ctx context.Context, r *moonring.Ring, first, depth int, d time.Duration, entry func(slot int) *moonring.Entry) (int, time.Duration, []time.Duration, error) {
	started := make([]time.Time, first+depth)
	lat := make([]time.Duration, 0, 1<<16)
	cqes := make([]moonring.Completion, depth)
	submit := func(slot int) error {
		started[slot] = time.Now()
		return r.SubmitOne(entry(slot))
	}
	requests := 0
	t0 := time.Now()
	warm, warmed := d/5, false
	for slot := first; slot < first+depth; slot++ {
		if err := submit(slot); err != nil {
			return 0, 0, nil, err
		}
	}
	for inflight := depth; inflight > 0; {
		n := r.PeekBatch(cqes)
		if n == 0 {
			if err := r.CQ().Wait(ctx, 1); err != nil {
				return 0, 0, nil, err
			}
			continue
		}
		now := time.Now()
		for _, c := range cqes[:n] {
			if err := c.Err(); err != nil {
				return 0, 0, nil, err
			}
			slot := int(c.UserData)
			lat = append(lat, now.Sub(started[slot]))
			requests++
			moved.Add(int64(c.Bytes))
			inflight--
			if !warmed && now.Sub(t0) >= warm {
				warmed, t0 = true, now
				requests, lat = 0, lat[:0]
			}
			if !warmed || now.Sub(t0) < d {
				if err := submit(slot); err != nil {
					return 0, 0, nil, err
				}
				inflight++
			}
		}
		r.Advance(n)
	}
	return requests, time.Since(t0), lat, nil
}

// progressLine prints, every half second on stderr, the step's bytes and
// GB/s so far and the time left, then clears the line. When stderr is not
// a terminal it prints plain lines, one a second, without escape codes.
func progressLine(res result, d time.Duration) func() {
	if !stderrIsTerminal() {
		return progressPlain(res, d)
	}
	moved.Store(0)
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t0 := time.Now()
		tick := time.NewTicker(500 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				fmt.Fprint(os.Stderr, "\r\033[K")
				return
			case <-tick.C:
				el := time.Since(t0)
				b := moved.Load()
				fmt.Fprintf(os.Stderr, "\r\033[K%s", progressText(res, d, el, b))
			}
		}
	}()
	return func() { close(done); <-exited }
}

// progressText is the progress of a step d long (after its warm-up of d/5)
// that has moved b bytes in el.
func progressText(res result, d, el time.Duration, b int64) string {
	return fmt.Sprintf("%s %s %s: %d MiB, %.2f GB/s so far, %.1f s left",
		res.Transport, res.Op, res.Block, b>>20, float64(b)/el.Seconds()/1e9, max(0, (d+d/5-el).Seconds()))
}

// progressPlain is progressLine for a stderr that is a file or a pipe: a
// line a second.
func progressPlain(res result, d time.Duration) func() {
	moved.Store(0)
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t0 := time.Now()
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				fmt.Fprintln(progressOut, progressText(res, d, time.Since(t0), moved.Load()))
			}
		}
	}()
	return func() { close(done); <-exited }
}

// progressOut takes the progress lines when stderr is no terminal; tests
// replace it.
var progressOut io.Writer = os.Stderr

// stderrIsTerminal reports whether stderr is a terminal, where escape
// codes may redraw the progress line. Tests replace it.
var stderrIsTerminal = func() bool {
	_, err := unix.IoctlGetTermios(int(os.Stderr.Fd()), unix.TCGETS)
	return err == nil
}
