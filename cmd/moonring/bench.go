// bench.go holds the bench command: its flags and help, the checks of what
// they ask, and the sweep of ops and block sizes against a target, a row
// reported as each step ends.

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/moonring/moonring"
)

const benchHelp = `usage: moonring bench [flags]

Sweep WRITE and READ over block sizes against a target and print GB/s,
req/s and latency, a row as each step ends (--json: a JSON array, a row
per line, each with the run's settings under "run").

Two modes, as ucx_perftest's *_bw and *_lat tests:
  default  bandwidth: --batches (4) batches of --batch-size (32)
           requests in flight per thread (--ring: as many entries),
           block sizes 4K,64K,1M,16M. A request's latency here is the
           time its whole batch took (or, with --ring, the time it waited
           behind the others in flight): its p50 is queueing latency at
           that depth, not one request's round trip.
  --lat    latency: one request in flight on one thread (batch 1), block
           sizes 8,64,512,4K unless --block-size; each row gives the mean
           and the p50, p99 and p999 of single requests' round trips.

--pattern kv moves a KV cache: a paged pool on each side (--pool, 2G),
--layers (32) of K and V blocks of --block-size (32K) bytes, requests of
--tokens (4096) tokens in --block-tokens (16) token blocks: by default
16,384 scattered 32 KiB transfers of 512 MiB, random source blocks,
--inflight (2) requests in flight to --targets (1) targets, one batch per
request (or with --ring its entries through a ring). Each op gives a
contig row (the same bytes per request as 1 MiB transfers) and a kv row
(with kv/contig), per-request p50/p99/p999 in ms. The bytes are checked
by a stamp per block; each row says which and where (--kv-sample).

Each row counts every request its step submitted (its warm-up's and its
checks' read-backs too) by how it ended: COMPLETED, FAILED (by error
code), TIMEOUT, CANCELED ("statuses" with --json); the four add up to the
requests submitted. A request that does not complete ends its step, and
the sweep, with its error; with --keep-going it is counted and the step
goes on to its end (its block, or KV destinations, set aside), checks the
bytes whose last request completed (the others are "unchecked"), prints
its row, and then fails, ending the sweep.

--cpu adds CPU seconds per GB moved on each side: this process
(getrusage, less the checks) and the target processes it started
(/proc/PID/stat), over each step's measured window.

By default the target is a child process this command
starts on loopback; it gets a random segment key made for the run,
through its environment (never its command line), and the key ends with
the run. With --segment the target is another one (moonring serve, or
bench --mode target), whose key this command must hold:

` + keyHelp + `
With no key, bench --segment reaches only a target serving --insecure.

` + mooncakeHelp + `bench --mooncake starts a target in Mooncake mode (serve --mooncake),
or with --segment reaches a Mooncake engine (or serve --mooncake): its
segment name (with p2p, its RPC port's ip:port) and its first buffer,
into which it first writes the pattern that READs are checked against.

With --metadata http://... or etcd://..., bench publishes its own segment
too (--local-name, default <hostname>-<pid>-<n>-<8 hex digits>), and so do the target
processes it starts: --ttl is their time to live, as serve's:

` + ttlHelp + `
flags:
`

// targetStarted, when set (by tests), is told of each target process
// bench starts and of the key it handed it.
var targetStarted func(cmd *exec.Cmd, key []byte)

func bench(args []string, out io.Writer) (err error) {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	mode := fs.String("mode", "initiator", "initiator, or target (serve a buffer until stdin closes or a signal)")
	protocol := fs.String("protocol", "tcp", "tcp or shm (a target process on this host; shm maps its buffer), or local (engines in this process)")
	noMap := fs.Bool("no-map", false, "with --protocol shm: reach the target through process_vm_readv/writev, not a mapping")
	operation := fs.String("operation", "write,read", "write, read, mix (half of the requests each), comma separated")
	blocks := fs.String("block-size", "4K,64K,1M,16M", "block sizes, comma separated (bytes, or K, M, G suffixes in either case; with --lat the default is 8,64,512,4K)")
	latMode := fs.Bool("lat", false, "latency mode: one request in flight (batch 1, one thread), small blocks; mean, p50, p99, p999")
	batch := fs.Int("batch-size", 32, "requests per batch (with --ring: requests in flight per thread are --batch-size times --batches)")
	batches := fs.Int("batches", 4, "batches in flight per thread, each on blocks of its own: while one is checked the others keep the pipeline full (the default, 4 of 32, is the 128 in flight per thread of Mooncake's transfer_engine_bench, whose threads submit a batch of 128 and wait for it; 1: that too)")
	threads := fs.Int("threads", 1, "goroutines submitting, each with its own ring or batches")
	useRing := fs.Bool("ring", false, "drive the io_uring-style Ring API instead of the Mooncake-style batch API")
	pollers := fs.Int("pollers", 1, "the initiator engine's pollers (Config.Pollers, 1 to 64): with --ring each ring (each --threads goroutine's, or each --inflight kv request's) goes to the one with the fewest")
	duration := fs.Duration("duration", time.Second, "measured time per step (after a warm-up of a fifth of it)")
	bufSize := fs.String("buffer-size", "64M", "the target's buffer (K, M, G suffixes; at most 64G)")
	segment := fs.String("segment", "", "the target's segment (host:port of its p2p endpoint, or its name with --metadata http://...); default: start one")
	localName := fs.String("local-name", "", "the initiator's segment name with --metadata http or etcd (with p2p it is its endpoint's address)")
	meta := fs.String("metadata", "p2p", "p2p, http://HOST:PORT of a metadata-server, or etcd://HOST:PORT[,HOST:PORT...]")
	ttl := addTTLFlag(fs)
	listen := fs.String("listen", "127.0.0.1:0", "target: the p2p metadata endpoint's address (the segment name)")
	verify := fs.Bool("verify", true, "check the data of every step")
	keepGoing := fs.Bool("keep-going", false, "a request that does not complete does not end its step: it is counted and the step runs to its end, checks what it can, prints its row and then fails")
	asJSON := fs.Bool("json", false, "print results as JSON")
	plotPath := fs.String("plot", "", "also draw GB/s and p99 latency against block size into this PNG file")
	keyFile := fs.String("key-file", "", "--segment, --mode target: read the segment key from this file (mode 0600; default: $"+keyEnv+")")
	insecure := fs.Bool("insecure", false, "--mode target: as serve --insecure")
	hugeTLB := fs.Bool("hugetlb", false, "both sides' buffers from the kernel's reserved huge pages (vm.nr_hugepages) while enough are free (Config.HugeTLB; the target bench starts gets it too)")
	pat := fs.String("pattern", "blocks", "blocks (the sweep of equal blocks), or kv: a KV cache's paged pool on each side, requests of scattered blocks (see --layers, --tokens, --pool)")
	layers := fs.Int("layers", 32, "--pattern kv: layers in the pool, each with a K and a V tensor of blocks")
	blockTokens := fs.Int("block-tokens", 16, "--pattern kv: tokens per block (a label: the block's bytes are --block-size, default 32K)")
	tokens := fs.Int("tokens", 4096, "--pattern kv: tokens per request; a request moves tokens/block-tokens blocks of every layer's K and V")
	poolSize := fs.String("pool", "2G", "--pattern kv: the paged pool on each side (this process, and each target)")
	inflight := fs.Int("inflight", 2, "--pattern kv: requests in flight (each a batch of its transfers, or with --ring its entries through a ring of its own)")
	targets := fs.Int("targets", 1, "--pattern kv: targets; requests go to them in turn (the processes this command starts, or the engines in this process; with --segment, the segments given)")
	lists := fs.Int("lists", 0, "--pattern kv: move each request's transfers as a prepared list (Engine.PrepareList, made and freed per request, in the timed window), N blocks an entry (FlagList; with the batch API a task, TransferRequest.List); 0: an entry or task a transfer")
	kvSample := fs.Int("kv-sample", 0, "--pattern kv: check 1 in N transfers of each request at its destination (0: every READ's; a WRITE's, read back from a target process, 1 in 64; every WRITE's in-process); with WRITEs every target's whole pool is also read back and checked after the step")
	baseline := fs.Bool("baseline", true, "--pattern kv: before each kv row, move the same bytes per request as contiguous 1 MiB transfers (the contig row) and give the ratio")
	cpuFlag := fs.Bool("cpu", false, "report CPU seconds per GB moved on each side: this process (getrusage) and the target processes it started (/proc/PID/stat)")
	mc := addMooncakeFlags(fs, false)
	expectSeed := fs.Uint64("expect-seed", 0, "with --segment: instead of a sweep, READ the target's first buffer (--buffer-size bytes) and check that it holds the seeded pattern S (as serve --fill-seed)")
	writeSeed := fs.Uint64("write-seed", 0, "with --segment: instead of a sweep (after --expect-seed's check), WRITE the seeded pattern S over the target's first buffer (for serve --check-seed)")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of this process (pprof's format: go tool pprof) over the whole run into this file")
	traceFile := fs.String("trace", "", "write a Go execution trace of this process (go tool trace) over the whole run into this file")
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
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if err := checkTTL(*ttl, set["ttl"], *meta, *mc.on); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	if *mode == "target" {
		// A target for one initiator: serve until stdin closes (the
		// initiator that started this process ends it so) or a signal.
		stop := make(chan struct{})
		go func() { io.Copy(io.Discard, os.Stdin); close(stop) }()
		sargs := []string{"--listen", *listen, "--buffer-size", *bufSize, "--key-file", *keyFile}
		if *mc.on {
			sargs = append(append(sargs, mc.args()...), "--mooncake-rpc", *mc.rpc)
		} else {
			sargs = append(sargs, "--metadata", *meta)
			if !strings.HasPrefix(*meta, "p2p") {
				sargs = append(sargs, "--name", targetName())
			}
		}
		if set["ttl"] {
			sargs = append(sargs, "--ttl", ttl.String())
		}
		if *insecure {
			sargs = append(sargs, "--insecure")
		}
		if *useTLS {
			sargs = append(sargs, "--tls")
		}
		if *hugeTLB {
			sargs = append(sargs, "--hugetlb")
		}
		return serve(sargs, out, stop)
	}
	if *mode != "initiator" {
		return fmt.Errorf("bad mode %q (want initiator or target)", *mode)
	}
	stopProfiles, err := startProfiles(*cpuProfile, *traceFile)
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	defer func() {
		if perr := stopProfiles(); perr != nil && err == nil {
			err = fmt.Errorf("bench: %w", perr)
		}
	}()
	if err := mc.check(set); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	var mcOn *mooncakeFlags
	if *mc.on {
		if *protocol != "tcp" || set["metadata"] || *useTLS || set["local-name"] {
			return errors.New("bench --mooncake: the bytes go over Mooncake's TCP (or RDMA, --mooncake-rdma) and the metadata through --mooncake-metadata; --protocol, --metadata, --tls and --local-name do not go with it")
		}
		mcOn = mc
	}
	if *latMode {
		if (set["batch-size"] && *batch != 1) || (set["threads"] && *threads != 1) || (set["batches"] && *batches != 1) {
			return fmt.Errorf("bench: --lat keeps one request in flight: --batch-size %d --batches %d --threads %d go without it", *batch, *batches, *threads)
		}
		*batch, *batches, *threads = 1, 1, 1
		if !set["block-size"] {
			*blocks = "8,64,512,4K"
		}
	}
	seedMode := set["expect-seed"] || set["write-seed"]
	if seedMode && (*segment == "" || strings.Contains(*segment, ",")) {
		return errors.New("bench: --expect-seed and --write-seed check one target given with --segment")
	}
	if seedMode && *keepGoing {
		return errors.New("bench: --keep-going is for a sweep's steps; --expect-seed and --write-seed stop at the first request that does not complete")
	}
	kvMode := false
	switch *pat {
	case "blocks":
		for _, f := range []string{"layers", "block-tokens", "tokens", "pool", "inflight", "targets", "kv-sample", "baseline", "lists"} {
			if set[f] {
				return fmt.Errorf("bench: --%s goes with --pattern kv", f)
			}
		}
	case "kv":
		kvMode = true
		for _, f := range []string{"lat", "batch-size", "batches", "threads", "buffer-size"} {
			if set[f] {
				return fmt.Errorf("bench: --%s does not go with --pattern kv (its pools are --pool, its depth --inflight)", f)
			}
		}
		if !set["block-size"] {
			*blocks = "32K"
		}
	default:
		return fmt.Errorf("bench: --pattern %q: want blocks or kv", *pat)
	}
	sizes, err := parseSizes(*blocks)
	if err != nil {
		return fmt.Errorf("bench: --block-size: %w", err)
	}
	var layout kvLayout
	if kvMode {
		if len(sizes) != 1 {
			return fmt.Errorf("bench: --pattern kv takes one --block-size (the bytes of a block of one layer's K or V), not %q", *blocks)
		}
		ps, err := parseSize(*poolSize)
		if err != nil {
			return fmt.Errorf("bench: --pool: %w", err)
		}
		if *targets < 1 || *targets > 64 {
			return fmt.Errorf("bench: --targets %d: want 1 to 64", *targets)
		}
		if *kvSample < 0 {
			return fmt.Errorf("bench: --kv-sample %d: want 0 (the default) or at least 1", *kvSample)
		}
		if *lists < 0 || *lists > moonring.MaxListBlocks {
			return fmt.Errorf("bench: --lists %d: want 0 (no lists) to %d blocks an entry", *lists, moonring.MaxListBlocks)
		}
		if layout, err = newKVLayout(*layers, sizes[0], *blockTokens, *tokens, ps, *inflight); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		if *lists > 0 && (layout.transfers() > moonring.MaxListBlocks || layout.chunk > moonring.MaxBlock) {
			return fmt.Errorf("bench: --lists: a request of %d transfers (contig: of %s) is more than a list holds (%d blocks of at most %s)",
				layout.transfers(), fmtSize(layout.chunk), moonring.MaxListBlocks, fmtSize(moonring.MaxBlock))
		}
		bs[0] = layout.bytes()
		if *segment != "" && set["targets"] && *targets != len(strings.Split(*segment, ",")) {
			return fmt.Errorf("bench: --targets %d but --segment names %d", *targets, len(strings.Split(*segment, ",")))
		}
	} else if strings.Contains(*segment, ",") {
		return errors.New("bench: several segments (--segment a,b) go with --pattern kv")
	}
	if *batch < 1 || *batches < 1 || *threads < 1 || *batch**batches**threads > 1024 {
		return fmt.Errorf("batch-size %d, batches %d, threads %d: want each at least 1 and their product at most 1024", *batch, *batches, *threads)
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
	if !kvMode && !seedMode && slices.Max(sizes) > bs[0] {
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
	var names []string
	if *segment != "" {
		names = strings.Split(*segment, ",")
	}
	switch *protocol {
	case "tcp", "shm":
		var ttlSet time.Duration // 0: the stores' default
		if set["ttl"] {
			ttlSet = *ttl
		}
		tg, err = remoteTarget(ctx, *protocol, *noMap, *useTLS, names, *targets, *meta, *localName, *keyFile, ttlSet, bs[0], *pollers, !kvMode && !seedMode, *hugeTLB, mcOn)
	case "local":
		tg, err = localTarget(ctx, bs[0], *targets, *pollers, !kvMode, *hugeTLB)
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
	if seedMode {
		var expect, write *uint64
		if set["expect-seed"] {
			expect = expectSeed
		}
		if set["write-seed"] {
			write = writeSeed
		}
		return seedCheck(ctx, tg, bs[0], expect, write, out)
	}
	if !*asJSON {
		tg.progress = progressLine
	}
	var rep reporter = &tableReport{w: out, lat: *latMode, kv: kvMode, cpu: *cpuFlag}
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
		Buffer: bs[0], Batch: *batch, Batches: *batches, Threads: *threads, API: api, Mode: runMode, Duration: duration.String(), Verify: *verify,
		Host: hostname, Version: version(), Date: time.Now().UTC().Format(time.RFC3339), CopyWorkers: tg.ini.Config().CopyWorkers, Pollers: tg.ini.Config().Pollers}
	if *protocol == "local" {
		run.Metadata = "in this process"
	}
	run.CPU = *cpuFlag
	if kvMode {
		run.Pattern, run.Layout, run.Inflight, run.Targets = "kv", layout.String(), layout.inflight, len(tg.peers)
		run.Batch, run.Batches, run.Threads = layout.inflight, 0, layout.inflight
		var kb *kvBench
		if !*asJSON {
			fmt.Fprintf(os.Stderr, "filling the pools (%s on each side, %d target(s))\n", fmtSize(layout.bytes()), len(tg.peers))
		}
		if kb, err = newKVBench(ctx, tg, layout, *kvSample, *useRing, *cpuFlag, *keepGoing); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		kb.lists, run.Lists = *lists, *lists
		if err := rep.header(run); err != nil {
			return fmt.Errorf("bench: writing the results: %w", err)
		}
		return kvSweep(ctx, kb, rep, ops, *baseline, *duration)
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
		res, err := tg.step(ctx, st.op, st.size, *batch, *batches, *threads, *duration, *verify, *useRing, *cpuFlag, *keepGoing)
		res.Mode = runMode
		var rerr *requestsError
		if errors.As(err, &rerr) {
			// --keep-going: the step ran to its end; its row says how
			// its requests ended.
			if err := rep.row(res); err != nil {
				return fmt.Errorf("bench: writing the results: %w", err)
			}
		}
		if err != nil {
			what := fmt.Sprintf("step %d of %d (%s %s)", i+1, len(steps), opName(st.op), fmtSize(st.size))
			done := fmt.Sprintf("the %d rows above are complete", len(results))
			if rerr != nil {
				done = fmt.Sprintf("its row counts how its requests ended, and the %d rows before it are complete", len(results))
			}
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

// kvSweep runs, for each op, the contiguous baseline (unless told not to)
// and then the KV pattern, a row each.
func kvSweep(ctx context.Context, kb *kvBench, rep reporter, ops []moonring.Op, baseline bool, d time.Duration) error {
	var sweepErr error
	rows := 0
steps:
	for _, op := range ops {
		if op == opMix {
			sweepErr = errors.New("bench: --pattern kv takes write and read, not mix")
			break
		}
		contig := -1.0
		for _, c := range []bool{true, false} {
			if c && !baseline {
				continue
			}
			res, err := kb.step(ctx, op, c, d)
			res.Mode = "kv"
			var rerr *requestsError
			if errors.As(err, &rerr) {
				// --keep-going: the step ran to its end; its row says how
				// its transfers ended.
				if err := rep.row(res); err != nil {
					return fmt.Errorf("bench: writing the results: %w", err)
				}
			}
			if err != nil {
				what := fmt.Sprintf("%s %s", opName(op), map[bool]string{true: "contig", false: "kv"}[c])
				done := fmt.Sprintf("the %d rows above are complete", rows)
				if rerr != nil {
					done = fmt.Sprintf("its row counts how its transfers ended, and the %d rows before it are complete", rows)
				}
				if ctx.Err() != nil {
					sweepErr = &exitError{code: exitInterrupted, err: fmt.Errorf("bench: interrupted during %s; %s", what, done)}
				} else {
					sweepErr = fmt.Errorf("bench: %s failed: %w; %s", what, err, done)
				}
				break steps
			}
			if c {
				contig = res.GBps
			} else if contig > 0 {
				res.Ratio = res.GBps / contig
			}
			if err := rep.row(res); err != nil {
				return fmt.Errorf("bench: writing the results: %w", err)
			}
			rows++
		}
	}
	if err := rep.end(); err != nil && sweepErr == nil {
		sweepErr = fmt.Errorf("bench: writing the results: %w", err)
	}
	return sweepErr
}
