//go:build linux

package shm_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/shm"
	"github.com/moonring/moonring/transport"
)

const childEnv = "MOONRING_SHM_CHILD"

// runChild is the target process: it registers two memfd buffers (mapped
// by peers) and one Go buffer (reached by process_vm calls), prints its
// descriptor, then answers commands on stdin until it closes:
//
//	sum ADDR LEN      -> crc32 of the range
//	fill ADDR LEN S   -> fills the range from seed S, prints "ok"
func runChild() {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "child:", err)
		os.Exit(1)
	}
	tr, err := shm.New(shm.Config{})
	if err != nil {
		fail(err)
	}
	var bufs segtable.Buffers
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "child", Epoch: 1,
		Endpoints: map[string]string{shm.Name: tr.Endpoint()}}
	var mems [][]byte
	for i := range 3 {
		var m []byte
		if i < 2 {
			if m, err = mem.AllocShared(8<<20, 0); err != nil {
				fail(err)
			}
		} else {
			m = make([]byte, 4<<20)
		}
		mems = append(mems, m)
		b, err := bufs.Register(m, segtable.CPU(0), true)
		if err != nil {
			fail(err)
		}
		r, err := tr.Register(b)
		if err != nil {
			fail(err)
		}
		desc.Buffers = append(desc.Buffers, segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length,
			Keys: map[string]string{shm.Name: r.Key}})
	}
	slicesSortDesc(desc)
	j, _ := json.Marshal(desc)
	find := func(addr, n uint64) []byte {
		for _, m := range mems {
			a := uint64(uintptr(unsafePointer(m)))
			if addr >= a && addr+n <= a+uint64(len(m)) {
				return m[addr-a : addr-a+n]
			}
		}
		return nil
	}
	err = childproc.Serve(string(j), func(cmd string) string {
		f := strings.Fields(cmd)
		if len(f) < 3 {
			return "bad"
		}
		addr, _ := strconv.ParseUint(f[1], 10, 64)
		n, _ := strconv.ParseUint(f[2], 10, 64)
		b := find(addr, n)
		if b == nil {
			return "bad"
		}
		switch f[0] {
		case "sum":
			return strconv.FormatUint(uint64(crc32.ChecksumIEEE(b)), 10)
		case "fill":
			if len(f) < 4 {
				return "bad"
			}
			seed, _ := strconv.ParseUint(f[3], 10, 64)
			testpattern.Fill(b, seed)
			return "ok"
		}
		return "bad"
	})
	tr.Close()
	if err != nil {
		fail(err)
	}
}

// child is a running target process.
type child struct {
	*childproc.Proc
	desc *segtable.SegmentDesc
}

func startChild(t *testing.T) *child {
	t.Helper()
	c := &child{Proc: childproc.Start(t, childproc.Config{Env: []string{childEnv + "=1"}})}
	// Killed at the end, as before, not stopped: a graceful exit checks
	// nothing here and costs a second under -race. Cleanups run last
	// first, so this precedes Start's Stop.
	t.Cleanup(c.KillWait)
	var err error
	if c.desc, err = segtable.UnmarshalDesc([]byte(c.Line)); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestTwoProcesses moves random batches to and from a target process,
// through its mapped buffers and its process_vm one, and checks every
// range by checksum on the other side.
func TestTwoProcesses(t *testing.T) {
	c := startChild(t)
	w := newWorld(t, shm.Config{})
	ep, err := w.init.Open(context.Background(), c.desc)
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	if mp, v := ep.(*shm.Endpoint).Granted(); mp != 2 || v != 1 {
		t.Fatalf("granted %d mapped, %d vm; want 2 and 1", mp, v)
	}
	lm := w.local.Bytes()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	for i := range 60 {
		bd := c.desc.Buffers[i%3]
		n := 1 + (seed*uint64(i+1)*2654435761)%(2<<20)
		roff := (seed * uint64(i+7)) % (bd.Length - n)
		loff := (seed * uint64(i+3)) % (uint64(len(lm)) - n)
		// A batch of up to 4 MiB cut into the transport's slices.
		var batch []transport.Slice
		op := transport.Op(1 + i%2)
		if op == transport.Read {
			if got := c.Ask(t, "fill %d %d %d", bd.Addr+roff, n, seed+uint64(i)); got != "ok" {
				t.Fatalf("child fill: %s", got)
			}
		} else {
			testpattern.Fill(lm[loff:loff+n], seed+uint64(i))
		}
		for off := uint64(0); off < n; off += 256 << 10 {
			k := min(256<<10, n-off)
			batch = append(batch, w.slice(op, loff+off, bd.Addr+roff+off, k))
		}
		for j := range batch {
			if err := ep.(transport.Copier).Copy(&batch[j]); err != nil {
				t.Fatalf("batch %d slice %d: %v", i, j, err)
			}
		}
		want := strconv.FormatUint(uint64(crc32.ChecksumIEEE(lm[loff:loff+n])), 10)
		if got := c.Ask(t, "sum %d %d", bd.Addr+roff, n); got != want {
			t.Fatalf("batch %d (%v of %d bytes to buffer %d): checksum %s on the target, %s here", i, op, n, i%3, got, want)
		}
	}
}

// TestNoKey: a process that holds the descriptor but not the keys maps and
// reaches nothing of the target.
func TestNoKey(t *testing.T) {
	c := startChild(t)
	w := newWorld(t, shm.Config{})
	for _, key := range []string{"", "00000000000000000000000000000000", "nothex"} {
		d := c.desc.Clone()
		for i := range d.Buffers {
			d.Buffers[i].Keys[shm.Name] = key
		}
		ep, err := w.init.Open(context.Background(), d)
		if err != nil {
			t.Fatal(err)
		}
		if mp, v := ep.(*shm.Endpoint).Granted(); mp+v != 0 {
			t.Fatalf("key %q: granted %d mapped, %d vm", key, mp, v)
		}
		for _, bd := range d.Buffers {
			s := w.slice(transport.Read, 0, bd.Addr, 64)
			if err := ep.(transport.Copier).Copy(&s); !errors.Is(err, transport.ErrDenied) {
				t.Fatalf("key %q: read: %v, want ErrDenied", key, err)
			}
		}
		ep.Close()
	}
}

// TestTargetKilled kills the target while slices run: they end in errors
// (never a crash), the mappings go, and no slice succeeds once the
// endpoint saw the death.
func TestTargetKilled(t *testing.T) {
	c := startChild(t)
	w := newWorld(t, shm.Config{})
	ep, err := w.init.Open(context.Background(), c.desc)
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	var (
		wg     sync.WaitGroup
		stop   atomic.Bool
		ok     atomic.Int64
		failed atomic.Int64
	)
	for g := range 2 {
		wg.Go(func() {
			for i := 0; !stop.Load(); i++ {
				bd := c.desc.Buffers[(g+i)%3]
				s := w.slice(transport.Op(1+i%2), uint64(g)<<20, bd.Addr+uint64(i%64)*4096, 64<<10)
				if err := ep.(transport.Copier).Copy(&s); err != nil {
					if !errors.Is(err, transport.ErrPeer) && !errors.Is(err, transport.ErrDenied) {
						t.Errorf("copy: %v", err)
					}
					failed.Add(1)
				} else {
					ok.Add(1)
				}
			}
		})
	}
	for ok.Load() < 200 {
		time.Sleep(time.Millisecond)
	}
	c.KillWait()
	deadline := time.Now().Add(10 * time.Second)
	for {
		mp, v := ep.(*shm.Endpoint).Granted()
		if mp+v == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("still %d mapped, %d vm 10 s after the target died", mp, v)
		}
		time.Sleep(time.Millisecond)
	}
	n := ok.Load()
	for failed.Load() < 100 {
		time.Sleep(time.Millisecond)
	}
	stop.Store(true)
	wg.Wait()
	if late := ok.Load() - n; late > 2 {
		t.Fatalf("%d slices succeeded after the endpoint dropped its mappings", late)
	}
	t.Logf("%d slices before the kill, %d failed after", n, failed.Load())
}
