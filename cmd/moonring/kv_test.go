package main

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"
)

// kvArgs is a KV run small enough for a test: 2 layers, 4 KiB blocks, 64
// tokens (4 blocks: 16 transfers, 64 KiB) per request, 1 MiB pools.
var kvArgs = []string{"bench", "--json", "--pattern", "kv", "--layers", "2", "--block-size", "4K", "--tokens", "64", "--pool", "1M", "--duration", "200ms"}

// kvJSONErr runs the small KV run with args added and returns its output.
func kvJSONErr(t *testing.T, args ...string) (*bytes.Buffer, error) {
	t.Helper()
	var out bytes.Buffer
	return &out, run(append(append([]string{}, kvArgs...), args...), &out)
}

func kvJSON(t *testing.T, args ...string) []result {
	t.Helper()
	out, err := kvJSONErr(t, args...)
	if err != nil {
		t.Fatalf("moonring %s: %v", strings.Join(args, " "), err)
	}
	var rs []result
	if err := json.Unmarshal(out.Bytes(), &rs); err != nil {
		t.Fatalf("--json output: %v\n%s", err, out.String())
	}
	want := []struct{ op, pattern string }{{"write", "contig"}, {"write", "kv"}, {"read", "contig"}, {"read", "kv"}}
	if len(rs) != len(want) {
		t.Fatalf("%d rows; want %d: %s", len(rs), len(want), out.String())
	}
	for i, r := range rs {
		if r.Op != want[i].op || r.Pattern != want[i].pattern {
			t.Errorf("row %d: %s %s; want %s %s", i, r.Op, r.Pattern, want[i].op, want[i].pattern)
		}
		if !r.Verified || r.Requests == 0 || r.GBps <= 0 || r.P50us <= 0 || r.RequestBytes != 64<<10 || r.Check == "" {
			t.Errorf("row %d %+v: want verified data, requests, figures, 64K requests and what was checked", i, r)
		}
		switch r.Pattern {
		case "kv":
			if r.Transfers != 16 || r.BlockSize != 4<<10 || r.Ratio <= 0 {
				t.Errorf("kv row %d: %d transfers of %d, ratio %v; want 16 of 4K and a ratio to the contig row", i, r.Transfers, r.BlockSize, r.Ratio)
			}
		case "contig":
			if r.Transfers != 1 || r.BlockSize != 64<<10 {
				t.Errorf("contig row %d: %d transfers of %d; want the request's 64K in one", i, r.Transfers, r.BlockSize)
			}
		}
		checkStatuses(t, r.Op+" "+r.Pattern, r)
		if r.Run == nil || r.Run.Pattern != "kv" || r.Run.Layout == "" {
			t.Errorf("row %d: run %+v; want the KV layout", i, r.Run)
		}
	}
	return rs
}

// The KV pattern runs and checks its bytes in-process, through the batch
// API and the ring API, with two targets.
func TestBenchKVLocal(t *testing.T) {
	for _, r := range kvJSON(t, "--protocol", "local", "--targets", "2", "--inflight", "3") {
		if r.Transport != "local" || r.Run.Targets != 2 || r.Run.Inflight != 3 {
			t.Errorf("transport %q, %d targets, %d in flight; want local, 2, 3", r.Transport, r.Run.Targets, r.Run.Inflight)
		}
	}
	for _, r := range kvJSON(t, "--protocol", "local", "--ring") {
		if r.API != "ring" {
			t.Errorf("api %q; want ring", r.API)
		}
	}
}

// --lists moves each request as a prepared list, in entries (or batch
// tasks) of N blocks (the last one shorter), in process and over TCP,
// every transfer's bytes checked.
func TestBenchKVLists(t *testing.T) {
	for _, proto := range []string{"local", "tcp"} {
		for _, api := range []string{"ring", "batch"} {
			args := []string{"--protocol", proto, "--lists", "5", "--kv-sample", "1"}
			if api == "ring" {
				args = append(args, "--ring")
			}
			for _, r := range kvJSON(t, args...) {
				if r.API != api+"+lists" || r.Run.Lists != 5 || !strings.Contains(r.Check, "every transfer") {
					t.Errorf("%s: api %q, lists %d, check %q; want %s+lists, 5, every transfer checked", proto, r.API, r.Run.Lists, r.Check, api)
				}
			}
		}
	}
}

// Over TCP to target processes it starts: WRITEs read back a sample, and
// every pool is read back after a WRITE step; with --cpu both sides' CPU
// per GB is positive.
func TestBenchKVTCP(t *testing.T) {
	for _, r := range kvJSON(t, "--targets", "2", "--ring", "--kv-sample", "2") {
		if r.Transport != "tcp" || r.Run.Targets != 2 {
			t.Errorf("transport %q, %d targets; want tcp, 2", r.Transport, r.Run.Targets)
		}
		if !strings.Contains(r.Check, "1 in 2") {
			t.Errorf("check %q; want 1 in 2", r.Check)
		}
	}
	for _, r := range kvJSON(t, "--cpu", "--duration", "500ms", "--operation", "write,read") {
		if r.CPUIni <= 0 || r.CPUTgt <= 0 || r.CPUIniUtil <= 0 || r.CPUTgtUtil <= 0 {
			t.Errorf("%s %s: cpu s/GB %v here, %v at the target (util %v, %v); want both positive", r.Op, r.Pattern, r.CPUIni, r.CPUTgt, r.CPUIniUtil, r.CPUTgtUtil)
		}
		if r.Op == "write" && !strings.Contains(r.Check, "read back") {
			t.Errorf("WRITE check %q; want a read back", r.Check)
		}
	}
}

// --cpu on the block sweep: positive seconds per GB on both sides, in the
// JSON and in the table.
func TestBenchCPU(t *testing.T) {
	var out bytes.Buffer
	if err := run([]string{"bench", "--json", "--cpu", "--block-size", "1M", "--buffer-size", "8M", "--batch-size", "4", "--duration", "500ms"}, &out); err != nil {
		t.Fatal(err)
	}
	var rs []result
	if err := json.Unmarshal(out.Bytes(), &rs); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, r := range rs {
		if r.CPUIni <= 0 || r.CPUTgt <= 0 {
			t.Errorf("%s %s: cpu s/GB %v here, %v at the target; want both positive", r.Op, r.Block, r.CPUIni, r.CPUTgt)
		}
		if !r.Run.CPU {
			t.Errorf("run %+v: want cpu set", r.Run)
		}
	}
	out.Reset()
	if err := run([]string{"bench", "--cpu", "--protocol", "local", "--operation", "write", "--block-size", "1M", "--buffer-size", "4M", "--batch-size", "2", "--duration", "200ms"}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "cpu s/GB") || !strings.Contains(out.String(), "the target is in this process") {
		t.Errorf("table:\n%s\nwant the cpu columns and a note that the target is in this process", out.String())
	}
}

// The layout flags are checked before anything starts.
func TestBenchKVFlagsRefused(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--pattern", "kv", "--layers", "0"}, "--layers 0"},
		{[]string{"--pattern", "kv", "--block-size", "100"}, "multiple of 64"},
		{[]string{"--pattern", "kv", "--block-size", "4K,8K"}, "one --block-size"},
		{[]string{"--pattern", "kv", "--tokens", "0"}, "--tokens 0"},
		{[]string{"--pattern", "kv", "--block-tokens", "0"}, "--block-tokens 0"},
		{[]string{"--pattern", "kv", "--inflight", "0"}, "--inflight 0"},
		{[]string{"--pattern", "kv", "--targets", "0"}, "--targets 0"},
		{[]string{"--pattern", "kv", "--kv-sample", "-1"}, "--kv-sample -1"},
		{[]string{"--pattern", "kv", "--ring", "--lists", "-1"}, "--lists -1"},
		{[]string{"--pattern", "kv", "--ring", "--lists", "65537"}, "--lists 65537"},
		{[]string{"--lists", "256"}, "--lists goes with --pattern kv"},
		{[]string{"--pattern", "kv", "--lists", "256", "--tokens", "65536", "--pool", "64G"}, "more than a list holds"},
		{[]string{"--pattern", "kv", "--pool", "64M"}, "grow --pool"},
		{[]string{"--pattern", "kv", "--inflight", "5"}, "grow --pool"},
		{[]string{"--pattern", "kv", "--pool", "0"}, "--pool"},
		{[]string{"--pattern", "kv", "--batch-size", "4"}, "--batch-size does not go with --pattern kv"},
		{[]string{"--pattern", "kv", "--lat"}, "--lat does not go"},
		{[]string{"--pattern", "kv", "--buffer-size", "1G"}, "--buffer-size does not go"},
		{[]string{"--pattern", "kv", "--segment", "a:1,b:2", "--targets", "3"}, "--targets 3 but --segment names 2"},
		{[]string{"--pattern", "kv", "--protocol", "local", "--operation", "mix", "--layers", "1", "--tokens", "16", "--block-size", "4K", "--pool", "64K"}, "write and read, not mix"},
		{[]string{"--layers", "4"}, "--layers goes with --pattern kv"},
		{[]string{"--targets", "2"}, "--targets goes with --pattern kv"},
		{[]string{"--segment", "a:1,b:2"}, "go with --pattern kv"},
		{[]string{"--pattern", "pages"}, `--pattern "pages"`},
	} {
		var out bytes.Buffer
		err := run(append([]string{"bench"}, c.args...), &out)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("bench %s: %v; want an error with %q", strings.Join(c.args, " "), err, c.want)
		}
	}
}

// A block's stamp shows a byte changed, and the free list hands out each
// unit once.
func TestKVStampsAndFreeList(t *testing.T) {
	b := make([]byte, 4096)
	fillSlot(b, 42)
	if !slotHolds(b, 42) || slotHolds(b, 43) {
		t.Fatal("a block does not hold its own stamp only")
	}
	b[4000] ^= 1
	if slotHolds(b, 42) {
		t.Error("a flipped byte not seen")
	}
	var f freeList
	f.reset(8)
	rng := rand.New(rand.NewPCG(1, 2))
	got := append(f.take(rng, 5), f.take(rng, 3)...)
	seen := map[int]bool{}
	for _, u := range got {
		if seen[u] || u < 0 || u >= 8 {
			t.Fatalf("units %v: want 0..7 once each", got)
		}
		seen[u] = true
	}
	f.give(got[:2])
	if len(f.units) != 2 {
		t.Errorf("%d free after giving 2 back; want 2", len(f.units))
	}
	l, err := newKVLayout(32, 32<<10, 16, 4096, 2<<30, 2)
	if err != nil {
		t.Fatal(err)
	}
	if l.transfers() != 16384 || l.reqBytes() != 512<<20 || l.blocks != 1024 || l.chunk != 1<<20 {
		t.Errorf("the default layout: %d transfers, %d bytes, %d blocks, chunk %d; want 16,384 of 512 MiB, 1,024 blocks, 1 MiB", l.transfers(), l.reqBytes(), l.blocks, l.chunk)
	}
}
