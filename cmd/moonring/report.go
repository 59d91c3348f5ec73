// report.go holds bench's output: a sweep step's result and the run's
// settings (the header before the rows), and the two reporters that print
// them as each step ends, a table or JSON.

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"time"
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
	BatchAsked int `json:"batch_asked"`
	// Batches is the batches of Batch requests each thread keeps in
	// flight (with the Ring API: Batch*Batches entries in flight).
	Batches   int     `json:"batches"`
	Threads   int     `json:"threads"`
	Note      string  `json:"note,omitempty"`
	API       string  `json:"api"`
	Requests  int     `json:"requests"`
	GBps      float64 `json:"gb_per_s"`
	ReqPerSec float64 `json:"req_per_s"`
	P50us     float64 `json:"p50_us"`
	P99us     float64 `json:"p99_us"`
	P999us    float64 `json:"p999_us"`
	// Verified says that the step's check found every byte it checked
	// as it should be: every byte the step moved, but under --keep-going
	// those of the Unchecked blocks.
	Verified bool `json:"verified"`
	// Statuses counts every request the step submitted (its warm-up's
	// and the read-backs of its checks too; Requests is the measured
	// ones that completed) by how it ended.
	Statuses statusCounts `json:"statuses"`
	// Unchecked is the blocks (with --pattern kv, slots of a pool) the
	// check left out because the last request that moved them did not
	// complete (--keep-going): what they hold is not known.
	Unchecked int `json:"unchecked,omitempty"`
	// Mode is "bw" (requests in flight as --batch-size says) or "lat"
	// (--lat: one in flight).
	Mode   string  `json:"mode"`
	MeanUs float64 `json:"mean_us"`
	// Pattern is "kv" (--pattern kv: scattered blocks of a paged pool),
	// "contig" (the same bytes per request as contiguous transfers of
	// BlockSize, the KV run's baseline) or empty (the block sweep).
	Pattern string `json:"pattern,omitempty"`
	// Transfers and RequestBytes are one KV request's transfers and bytes;
	// a KV row's latencies are whole requests'.
	Transfers    int `json:"transfers_per_request,omitempty"`
	RequestBytes int `json:"request_bytes,omitempty"`
	// Ratio is a kv row's GB/s over its contig row's, of the same op.
	Ratio float64 `json:"kv_over_contig,omitempty"`
	// Check says which bytes of a KV step were checked and where.
	Check string `json:"check,omitempty"`
	// CPUIni and CPUTgt (--cpu) are CPU seconds (user + system) per GB
	// moved in the measured window: this process (getrusage), and the
	// target processes it started (/proc/PID/stat); -1 when unknown (a
	// target in this process or not started by it). CPUIniUtil and
	// CPUTgtUtil are the same as a share of one CPU over the window.
	CPUIni     float64 `json:"cpu_s_per_gb_initiator,omitempty"`
	CPUTgt     float64 `json:"cpu_s_per_gb_target,omitempty"`
	CPUIniUtil float64 `json:"cpu_util_initiator,omitempty"`
	CPUTgtUtil float64 `json:"cpu_util_target,omitempty"`
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
	Batches       int    `json:"batches,omitempty"` // in flight per thread
	Threads       int    `json:"threads"`
	API           string `json:"api"`
	Mode          string `json:"mode"`     // bw or lat
	Duration      string `json:"duration"` // per step, after a warm-up of a fifth of it
	Verify        bool   `json:"verify"`
	Host          string `json:"host"`
	Version       string `json:"version"`
	Date          string `json:"date"` // the sweep's start, RFC 3339, UTC
	// CopyWorkers is the initiator engine's copy workers per poller
	// (moonring.Config.CopyWorkers, as filled in).
	CopyWorkers int `json:"copy_workers"`
	// Pollers is the initiator engine's pollers a NUMA node
	// (moonring.Config.Pollers, as filled in: --pollers).
	Pollers int `json:"pollers"`
	// Pattern is "kv" with --pattern kv, Layout its pools and requests,
	// Inflight its requests in flight and Targets its targets.
	Pattern  string `json:"pattern,omitempty"`
	Layout   string `json:"layout,omitempty"`
	Inflight int    `json:"inflight,omitempty"`
	Targets  int    `json:"targets,omitempty"`
	CPU      bool   `json:"cpu,omitempty"`
	// Lists is --lists: a kv request's transfers go as a prepared list,
	// Lists blocks an entry (0: an entry a transfer).
	Lists int `json:"lists,omitempty"`
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
	mode := fmt.Sprintf("# bandwidth mode: %d batch(es) of %d requests in flight per thread (--batches, --batch-size). A request's latency is the time its batch took", r.Batches, r.Batch)
	if r.API == "ring" {
		mode = fmt.Sprintf("# bandwidth mode: %d requests in flight per thread (--batch-size x --batches). A request's latency includes its wait behind the others in flight", r.Batch*r.Batches)
	}
	mode += fmt.Sprintf(":\n#   the p50 is queueing latency at %d in flight, not one request's round trip (moonring bench --lat measures that)\n", r.Batch*r.Batches)
	if r.Mode == "lat" {
		mode = "# latency mode: one request in flight on one thread; mean and percentiles of single requests' round trips\n"
	}
	if r.Pattern == "kv" {
		mode = fmt.Sprintf("# KV pattern: %s\n# %d requests in flight over %d target(s); a row's latencies are whole requests' (submit to the last transfer's end);\n#   each kv row follows a contig row: the same bytes per request as contiguous transfers, same pools, same run\n", r.Layout, r.Inflight, r.Targets)
		verify = "data checked as each row says"
		if r.Lists > 0 {
			mode += fmt.Sprintf("# --lists %d: a request's transfers go as a prepared list (made and freed per request), %d of its blocks an entry or task\n", r.Lists, r.Lists)
		}
	}
	if r.CPU {
		mode += "# --cpu: CPU seconds (user+system) per GB moved in the measured window: this process (getrusage) and the target processes it started (/proc/PID/stat); checks' CPU left out\n"
	}
	sizes := fmt.Sprintf("buffer %s, batch %d, batches in flight %d, threads %d", fmtSize(r.Buffer), r.Batch, r.Batches, r.Threads)
	if r.Pattern == "kv" {
		sizes = fmt.Sprintf("pool %s per side, %d requests in flight", fmtSize(r.Buffer), r.Inflight)
	}
	return fmt.Sprintf("# moonring bench: %s to %s, metadata %s\n"+
		"# %s, %s API, %s per step after a warm-up of a fifth of it, %s\n"+
		"# host %s, moonring %s, %s; pollers %d, copy workers per poller %d (Config.CopyWorkers default: GOMAXPROCS-1, at most 3)\n%s",
		r.Transport, target, r.Metadata, sizes, r.API, r.Duration, verify, r.Host, r.Version, r.Date, max(r.Pollers, 1), max(r.CopyWorkers, 0), mode)
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
	kv     bool // --pattern kv: the KV columns
	cpu    bool // --cpu: the CPU columns
	titled bool
}

const kvRowFmt = "%-14s %-11s %-5s %-6s %6s %6s %8s %7s %9s %9s %9s %8s%s%s\n"

// cpuCols are the --cpu columns: CPU seconds per GB on each side.
func (t *tableReport) cpuCols(r *result, title bool) string {
	if !t.cpu {
		return ""
	}
	if title {
		return fmt.Sprintf(" %9s %9s", "cpu s/GB", "tgt s/GB")
	}
	f := func(v float64) string {
		if v < 0 {
			return "-"
		}
		return fmt.Sprintf("%.3f", v)
	}
	return fmt.Sprintf(" %9s %9s", f(r.CPUIni), f(r.CPUTgt))
}

func (t *tableReport) kvRow(r result) error {
	if !t.titled {
		t.titled = true
		if _, err := fmt.Fprintf(t.w, kvRowFmt, "transport", "api", "op", "pattern", "xfer", "reqs", "GB/s", "kv/ctg", "p50 ms", "p99 ms", "p999 ms", "verified", t.cpuCols(nil, true), "  check; transfers by status"); err != nil {
			return err
		}
	}
	ratio := ""
	if r.Ratio > 0 {
		ratio = fmt.Sprintf("%.2f", r.Ratio)
	}
	note := "  " + r.Check
	if r.Note != "" {
		note += "; " + r.Note
	}
	note += "; " + r.ends()
	ms := func(us float64) string { return fmt.Sprintf("%.1f", us/1e3) }
	_, err := fmt.Fprintf(t.w, kvRowFmt, r.Transport, r.API, r.Op, r.Pattern, r.Block, strconv.Itoa(r.Requests), fmt.Sprintf("%.2f", r.GBps), ratio,
		ms(r.P50us), ms(r.P99us), ms(r.P999us), strconv.FormatBool(r.Verified), t.cpuCols(&r, false), note)
	return err
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
	if t.kv {
		return t.kvRow(r)
	}
	if !t.titled {
		t.titled = true
		if _, err := fmt.Fprintf(t.w, tableRow, "transport", "api", "op", "block", "batch", "threads", "GB/s", "req/s", "p50 µs", "p99 µs", "p999 µs", "verified", t.cpuCols(nil, true)+"  requests by status; note"); err != nil {
			return err
		}
	}
	note := "  " + r.ends()
	if r.Note != "" {
		note += "; " + r.Note
	}
	_, err := fmt.Fprintf(t.w, tableRow, r.Transport, r.API, r.Op, r.Block, strconv.Itoa(r.Batch), strconv.Itoa(r.Threads),
		fmt.Sprintf("%.2f", r.GBps), fmt.Sprintf("%.0f", r.ReqPerSec), fmt.Sprintf("%.2f", r.P50us), fmt.Sprintf("%.2f", r.P99us), fmt.Sprintf("%.2f", r.P999us), strconv.FormatBool(r.Verified), t.cpuCols(&r, false)+note)
	return err
}

func (t *tableReport) latRow(r result) error {
	if !t.titled {
		t.titled = true
		if _, err := fmt.Fprintf(t.w, latRow, "transport", "api", "op", "block", "requests", "req/s", "mean µs", "p50 µs", "p99 µs", "p999 µs", "verified", "  requests by status"); err != nil {
			return err
		}
	}
	f := func(v float64) string { return fmt.Sprintf("%.2f", v) }
	_, err := fmt.Fprintf(t.w, latRow, r.Transport, r.API, r.Op, r.Block, strconv.Itoa(r.Requests), fmt.Sprintf("%.0f", r.ReqPerSec),
		f(r.MeanUs), f(r.P50us), f(r.P99us), f(r.P999us), strconv.FormatBool(r.Verified), "  "+r.ends())
	return err
}

// ends says how the step's requests ended, and what its check left out.
func (r *result) ends() string {
	s := r.Statuses.String()
	if r.Unchecked > 0 {
		s += fmt.Sprintf(", %d unchecked (the last request that moved them did not complete)", r.Unchecked)
	}
	return s
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

// setLatency sets the row's percentiles and mean from lat (not empty),
// which it sorts.
func (res *result) setLatency(lat []time.Duration) {
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) / 1e3 }
	res.P50us, res.P99us, res.P999us = pct(0.50), pct(0.99), pct(0.999)
	var sum time.Duration
	for _, l := range lat {
		sum += l
	}
	res.MeanUs = float64(sum.Nanoseconds()) / float64(len(lat)) / 1e3
}
