//go:build efa && cgo

package efa_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// The benchmarks move blocks of 4 KiB, 64 KiB and 1 MiB to (WRITE) or from
// (READ) a child process, 64 in flight (16 at 1 MiB), each on its own
// slot, and report GB/s. Per provider they run three ways in the same run:
//
//	efa  this transport, polled by the benchmark's goroutine as an
//	     engine poller would; the child's progress goroutine spins
//	raw  testdata/fi_bw.c: the same libfabric calls with nothing around
//	     them, client and server both spinning
//	tcp  the TCP transport (tcp.New) to a child serving it, once
//
// make bench-efa runs them; BENCHMARKS.md records the medians.

const benchTarget = 64 << 20 // the child's buffer: 64 slots of 1 MiB

var benchSizes = []struct {
	name   string
	size   int
	window int
}{
	{"4KiB", 4 << 10, 64},
	{"64KiB", 64 << 10, 64},
	{"1MiB", 1 << 20, 16},
}

func BenchmarkEFAWrite(b *testing.B) { benchEFA(b, transport.Write) }
func BenchmarkEFARead(b *testing.B)  { benchEFA(b, transport.Read) }

func benchEFA(b *testing.B, op transport.Op) {
	for _, prov := range []string{"tcp", "shm"} {
		b.Run(prov, func(b *testing.B) {
			// Each size runs the transport and then the raw program,
			// so that both see the same load on a shared machine; the
			// child serves only while the transport runs.
			for _, sz := range benchSizes {
				b.Run(sz.name+"/efa", func(b *testing.B) {
					tg := startTarget(b, prov, benchTarget, "EFA_PROGRESS_SLEEP=0")
					tr := newEFA(b, efa.Config{Providers: []string{prov}})
					defer tr.Close()
					benchTransport(b, tr, tg.desc, op, sz.size, sz.window)
					tg.Stop()
				})
				b.Run(sz.name+"/raw", func(b *testing.B) { benchRaw(b, prov, op, sz.size, sz.window) })
			}
		})
	}
	b.Run("tcptransport", func(b *testing.B) {
		tg := startTarget(b, "", benchTarget, "EFA_TCP=1")
		tr, err := tcp.New(tcp.Config{Key: childKey})
		if err != nil {
			b.Fatal(err)
		}
		defer tr.Close()
		for _, sz := range benchSizes {
			b.Run(sz.name, func(b *testing.B) { benchTransport(b, tr, tg.desc, op, sz.size, sz.window) })
		}
	})
}

// benchCompleter collects the tokens (slot numbers) completed.
type benchCompleter struct {
	mu    sync.Mutex
	ready []uint64
	err   error
}

func (c *benchCompleter) Complete(token uint64, err error) {
	c.mu.Lock()
	c.ready = append(c.ready, token)
	if err != nil && c.err == nil {
		c.err = err
	}
	c.mu.Unlock()
}

// benchTransport moves b.N blocks of size bytes, window in flight.
func benchTransport(b *testing.B, tr transport.Transport, desc *segtable.SegmentDesc, op transport.Op, size, window int) {
	var bufs segtable.Buffers
	mem := make([]byte, size*window)
	testpattern.Fill(mem, 1) // touched, as the raw program's: not the shared zero page
	lb, err := bufs.Register(mem, "", false)
	if err != nil {
		b.Fatal(err)
	}
	defer bufs.Unregister(context.Background(), lb.ID)
	reg, err := tr.Register(lb)
	if err != nil {
		b.Fatal(err)
	}
	defer tr.Unregister(lb, reg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ep, err := tr.Open(ctx, desc)
	if err != nil {
		b.Fatal(err)
	}
	defer ep.Close()
	poller, _ := tr.(transport.Poller)
	base := desc.Buffers[0].Addr
	c := &benchCompleter{ready: make([]uint64, 0, window)}
	// The slices not yet posted wait in pending, in order, as a ring's
	// refused slices wait for the next round: a provider that takes one
	// operation at a time (READs over shm) is offered the same slices
	// again without their being built again.
	pending := make([]transport.Slice, 0, window)
	queue := func(k uint64) {
		pending = append(pending, transport.Slice{Op: op, LocalHandle: reg.Handle, Local: unsafe.Pointer(&mem[int(k)*size]),
			Remote: base + k*uint64(size), Length: uint64(size), Token: k})
	}
	done := 0
	for k := 0; k < window && k < b.N; k++ {
		queue(uint64(k))
	}
	queued := len(pending)
	got := make([]uint64, 0, window)
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for done < b.N {
		if len(pending) > 0 {
			n, err := ep.Post(c, pending)
			if err != nil {
				b.Fatal(err)
			}
			pending = pending[:copy(pending, pending[n:])]
		}
		if poller != nil {
			poller.Poll()
		} else {
			runtime.Gosched()
		}
		c.mu.Lock()
		got, c.ready = c.ready, got[:0]
		err := c.err
		c.mu.Unlock()
		if err != nil {
			b.Fatal(err)
		}
		done += len(got)
		for _, k := range got {
			if queued < b.N {
				queue(k)
				queued++
			}
		}
	}
	el := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)*float64(size)/el.Seconds()/1e9, "GB/s")
}

var fiBW struct {
	once sync.Once
	path string
	err  error
}

// benchRaw runs testdata/fi_bw.c for b.N operations.
func benchRaw(b *testing.B, prov string, op transport.Op, size, window int) {
	fiBW.once.Do(func() {
		dir, err := os.MkdirTemp("", "fi_bw")
		if err != nil {
			fiBW.err = err
			return
		}
		fiBW.path = filepath.Join(dir, "fi_bw")
		out, err := exec.Command("gcc", "-O2", "-o", fiBW.path, "testdata/fi_bw.c", "-lfabric").CombinedOutput()
		if err != nil {
			fiBW.err = fmt.Errorf("gcc: %v: %s", err, out)
		}
	})
	if fiBW.err != nil {
		if os.Getenv("MOONRING_CI") == "1" {
			b.Fatalf("raw baseline: %v", fiBW.err)
		}
		b.Skipf("SKIP: the raw libfabric baseline cannot be built: %v", fiBW.err)
	}
	srv := childproc.Start(b, childproc.Config{Program: fiBW.path, Args: []string{"server", prov, strconv.Itoa(benchTarget)},
		Name: "fi_bw server", Ready: 30 * time.Second})
	defer srv.Stop()
	f := strings.Fields(srv.Line)
	opName := "write"
	if op == transport.Read {
		opName = "read"
	}
	// The program's start and connection cost more than a benchmark's
	// second: it moves at least 512 MiB whatever b.N is, and times
	// itself; ns/op and GB/s are its own figures.
	iters := max(b.N, rawBytes/size)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := exec.CommandContext(ctx, fiBW.path, append([]string{"client", prov, opName, strconv.Itoa(size), strconv.Itoa(window), strconv.Itoa(iters)}, f...)...).Output()
	if err != nil {
		b.Fatalf("fi_bw client: %v", err)
	}
	ns, err := strconv.ParseFloat(strings.TrimSpace(string(res)), 64)
	if err != nil || ns <= 0 {
		b.Fatalf("fi_bw client printed %q", res)
	}
	b.ReportMetric(ns/float64(iters), "ns/op")
	b.ReportMetric(float64(iters)*float64(size)/ns, "GB/s")
}

const rawBytes = 512 << 20
