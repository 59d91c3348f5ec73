//go:build efa && cgo

package efa_test

// The far end of the two-process test and the benchmarks: the test binary
// re-executes itself with EFA_CHILD=target. The target registers one
// remote-accessible buffer with an efa transport (and, for the
// benchmarks, a tcp transport), prints its segment descriptor as one JSON
// line, and answers commands on stdin, one per line, until stdin closes
// (internal/childproc's protocol):
//
//	sum OFF LEN        -> the SHA-256 of buffer[OFF:OFF+LEN], in hex
//	fill OFF LEN SEED  -> fills buffer[OFF:OFF+LEN] with pattern(SEED), "ok"

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// childKey is the tcp transport's segment key in the benchmarks.
var childKey = []byte("moonring efa benchmark key")

func runChild() bool {
	if os.Getenv("EFA_CHILD") != "target" {
		return false
	}
	if err := childTarget(); err != nil {
		fmt.Fprintln(os.Stderr, "efa child:", err)
		os.Exit(1)
	}
	os.Exit(0)
	return true
}

func childTarget() error {
	size, err := strconv.Atoi(os.Getenv("EFA_SIZE"))
	if err != nil || size <= 0 {
		return fmt.Errorf("bad EFA_SIZE %q", os.Getenv("EFA_SIZE"))
	}
	var ts []transport.Transport
	if prov := os.Getenv("EFA_PROVIDER"); prov != "" {
		sleep, _ := time.ParseDuration(os.Getenv("EFA_PROGRESS_SLEEP"))
		tr, err := efa.New(efa.Config{Providers: []string{prov}, Progress: true, ProgressSleep: sleep})
		if err != nil {
			return err
		}
		defer tr.Close()
		ts = append(ts, tr)
	}
	if os.Getenv("EFA_TCP") == "1" {
		tt, err := tcp.New(tcp.Config{Key: childKey})
		if err != nil {
			return err
		}
		defer tt.Close()
		ts = append(ts, tt)
	}
	var bufs segtable.Buffers
	mem := make([]byte, size)
	testpattern.Fill(mem, 0) // touched, as the raw program's: not the shared zero page
	b, err := bufs.Register(mem, "", true)
	if err != nil {
		return err
	}
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "efa-child", Epoch: 1, Endpoints: map[string]string{}}
	bd := segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length, Keys: map[string]string{}}
	for _, x := range ts {
		reg, err := x.Register(b)
		if err != nil {
			return err
		}
		desc.Endpoints[x.Name()] = x.Endpoint()
		bd.Keys[x.Name()] = reg.Key
	}
	desc.Buffers = []segtable.BufferDesc{bd}
	j, err := json.Marshal(desc)
	if err != nil {
		return err
	}
	return childproc.Serve(string(j), func(cmd string) string {
		f := strings.Fields(cmd)
		var v [3]uint64
		for i := 1; i < len(f) && i <= 3; i++ {
			v[i-1], _ = strconv.ParseUint(f[i], 10, 64)
		}
		if len(f) < 3 || v[0] > uint64(size) || v[1] > uint64(size)-v[0] {
			return "bad command"
		}
		region := mem[v[0] : v[0]+v[1]]
		switch f[0] {
		case "sum":
			s := sha256.Sum256(region)
			return hex.EncodeToString(s[:])
		case "fill":
			testpattern.Fill(region, v[2])
			return "ok"
		}
		return "bad command"
	})
}

// target is a running child target.
type target struct {
	*childproc.Proc
	desc *segtable.SegmentDesc
}

// startTarget starts a child target on prov (none when "") with a buffer
// of size bytes, or skips (fails under MOONRING_CI=1) when the provider is
// missing.
func startTarget(t testing.TB, prov string, size int, env ...string) *target {
	t.Helper()
	if prov != "" {
		newEFA(t, efa.Config{Providers: []string{prov}}).Close() // skips when missing
	}
	tg := &target{Proc: childproc.Start(t, childproc.Config{
		Env:  append([]string{"EFA_CHILD=target", "EFA_PROVIDER=" + prov, "EFA_SIZE=" + strconv.Itoa(size)}, env...),
		Args: []string{"-test.run=^$", "-test.bench=^$"},
		Name: "target"})}
	tg.desc = new(segtable.SegmentDesc)
	if err := json.Unmarshal([]byte(tg.Line), tg.desc); err != nil {
		t.Fatalf("child descriptor %q: %v", tg.Line, err)
	}
	return tg
}
