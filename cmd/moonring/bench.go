package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/moonring/moonring"
)

// result is one step of the sweep.
type result struct {
	Transport string  `json:"transport"`
	Op        string  `json:"op"`
	BlockSize int     `json:"block_size"`
	Batch     int     `json:"batch"`
	Requests  int     `json:"requests"`
	GBps      float64 `json:"gb_per_s"`
	ReqPerSec float64 `json:"req_per_s"`
	P50us     float64 `json:"p50_us"`
	P99us     float64 `json:"p99_us"`
	P999us    float64 `json:"p999_us"`
	Verified  bool    `json:"verified"`
}

func parseSizes(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		mult := 1
		switch {
		case strings.HasSuffix(f, "K"), strings.HasSuffix(f, "KiB"):
			mult, f = 1<<10, strings.TrimSuffix(strings.TrimSuffix(f, "KiB"), "K")
		case strings.HasSuffix(f, "M"), strings.HasSuffix(f, "MiB"):
			mult, f = 1<<20, strings.TrimSuffix(strings.TrimSuffix(f, "MiB"), "M")
		}
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("bad block size %q", f)
		}
		out = append(out, n*mult)
	}
	return out, nil
}

func bench(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	protocol := fs.String("protocol", "local", "transport: local (engines in this process)")
	operation := fs.String("operation", "write,read", "write, read or both, comma separated")
	blocks := fs.String("block-size", "4K,64K,1M,16M", "block sizes, comma separated (K, M suffixes)")
	batch := fs.Int("batch-size", 32, "requests in flight")
	duration := fs.Duration("duration", time.Second, "measured time per step (after a warm-up of a fifth of it)")
	verify := fs.Bool("verify", true, "check the data of every step")
	asJSON := fs.Bool("json", false, "print results as JSON")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *protocol != "local" {
		return fmt.Errorf("protocol %q is not in this build yet (have: local)", *protocol)
	}
	sizes, err := parseSizes(*blocks)
	if err != nil {
		return err
	}
	if *batch < 1 || *batch > 1024 {
		return fmt.Errorf("batch-size %d out of range [1, 1024]", *batch)
	}
	var ops []moonring.Op
	for _, o := range strings.Split(*operation, ",") {
		switch strings.TrimSpace(o) {
		case "write":
			ops = append(ops, moonring.OpWrite)
		case "read":
			ops = append(ops, moonring.OpRead)
		default:
			return fmt.Errorf("bad operation %q (want write or read)", o)
		}
	}
	var results []result
	for _, op := range ops {
		for _, size := range sizes {
			res, err := step(op, size, *batch, *duration, *verify)
			if err != nil {
				return err
			}
			if !*asJSON {
				fmt.Fprintf(out, "%s %s %d: %.2f GB/s\n", res.Transport, res.Op, res.BlockSize, res.GBps)
			}
			results = append(results, res)
		}
	}
	if *asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(results)
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "transport\top\tblock\tbatch\tGB/s\treq/s\tp50 µs\tp99 µs\tp999 µs\tverified\t")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.2f\t%.0f\t%.2f\t%.2f\t%.2f\t%v\t\n", r.Transport, r.Op, r.BlockSize, r.Batch, r.GBps, r.ReqPerSec, r.P50us, r.P99us, r.P999us, r.Verified)
	}
	return tw.Flush()
}

// step runs one op and block size between two engines of this process.
func step(op moonring.Op, size, depth int, d time.Duration, verify bool) (result, error) {
	res := result{Transport: "local", Op: op.String(), BlockSize: size, Batch: depth}
	ini, err := moonring.New(moonring.Config{})
	if err != nil {
		return res, err
	}
	defer ini.Close()
	tgt, err := moonring.New(moonring.Config{})
	if err != nil {
		return res, err
	}
	defer tgt.Close()
	// One block per request slot, so requests in flight never share bytes.
	span := size * depth
	local, err := ini.Alloc(span, "cpu:0")
	if err != nil {
		return res, err
	}
	defer ini.Free(local)
	remote, err := tgt.Alloc(span, "cpu:0")
	if err != nil {
		return res, err
	}
	defer tgt.Free(remote)
	src, dst := local, remote
	if op == moonring.OpRead {
		src, dst = remote, local
	}
	rng := rand.New(rand.NewPCG(uint64(size), 7))
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	for i := range dst {
		dst[i] = 0xA5 // fault the pages in before the clock starts
	}
	lid, err := ini.RegisterLocalMemory(local, "cpu:0", false)
	if err != nil {
		return res, err
	}
	if _, err := tgt.RegisterLocalMemory(remote, "cpu:0", true); err != nil {
		return res, err
	}
	seg, err := ini.OpenSegment(ctxMain, tgt.Name())
	if err != nil {
		return res, err
	}
	r, err := ini.NewRing(moonring.RingConfig{Entries: 1024})
	if err != nil {
		return res, err
	}
	defer r.Close()
	base := uint64(moonring.AddressOf(remote))
	started := make([]time.Time, depth)
	lat := make([]time.Duration, 0, 1<<16)
	cqes := make([]moonring.Completion, depth)
	submit := func(slot int) error {
		started[slot] = time.Now()
		off := uint64(slot * size)
		return r.SubmitOne(&moonring.Entry{Op: op, Segment: seg, Buffer: lid, Local: off, Remote: base + off, Length: uint64(size), UserData: uint64(slot)})
	}
	// A warm-up of a fifth of the step is run and then forgotten: the
	// first requests pay for cold caches and the runtime's own start.
	t0 := time.Now()
	warm := d / 5
	warmed := false
	for slot := range depth {
		if err := submit(slot); err != nil {
			return res, err
		}
	}
	inflight := depth
	for inflight > 0 {
		n := r.PeekBatch(cqes)
		now := time.Now()
		for _, c := range cqes[:n] {
			if err := c.Err(); err != nil {
				return res, fmt.Errorf("%s %d: %w", res.Op, size, err)
			}
			slot := int(c.UserData)
			lat = append(lat, now.Sub(started[slot]))
			res.Requests++
			inflight--
			if !warmed && now.Sub(t0) >= warm {
				warmed, t0 = true, now
				res.Requests, lat = 0, lat[:0]
			}
			if !warmed || now.Sub(t0) < d {
				if err := submit(slot); err != nil {
					return res, err
				}
				inflight++
			}
		}
		r.Advance(n)
	}
	el := time.Since(t0)
	res.GBps = float64(res.Requests) * float64(size) / el.Seconds() / 1e9
	res.ReqPerSec = float64(res.Requests) / el.Seconds()
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) / 1e3 }
	res.P50us, res.P99us, res.P999us = pct(0.50), pct(0.99), pct(0.999)
	if verify {
		if !bytes.Equal(src, dst) {
			return res, fmt.Errorf("%s %d: data differs after the step", res.Op, size)
		}
		res.Verified = true
	}
	return res, nil
}
