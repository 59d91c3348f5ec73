//go:build rdma && cgo

package rdma

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// childEnv makes the test binary a target process (see childMain).
const childEnv = "MOONRING_RDMA_CHILD"

const childSize = 4 << 20

// childHello is what the target process prints on its first line.
type childHello struct {
	Endpoint string
	Addr     uint64
	Length   uint64
	Key      string
}

func digest(b []byte) string {
	h := fnv.New64a()
	h.Write(b)
	return fmt.Sprintf("%016x", h.Sum64())
}

// childMain is the target process: it registers a buffer filled with
// pattern(seed 1), prints where it is, then answers "sum" with the
// buffer's digest until its stdin ends (internal/childproc's protocol).
func childMain() int {
	tr, err := New(Config{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	defer tr.Close()
	mem := make([]byte, childSize)
	testpattern.Fill(mem, 1)
	var bufs segtable.Buffers
	b, err := bufs.Register(mem, "", true)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	defer bufs.Unregister(context.Background(), b.ID)
	reg, err := tr.Register(b)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	hello, _ := json.Marshal(childHello{tr.Endpoint(), uint64(b.Addr), b.Length, reg.Key})
	err = childproc.Serve(string(hello), func(cmd string) string {
		if cmd == "sum" {
			return digest(mem)
		}
		return "bad command"
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	return 0
}

// Two processes: the test READs the child's buffer and WRITEs it back
// changed, in many sizes, and the child checks what landed.
func TestTwoProcesses(t *testing.T) {
	tr := needDevice(t, Config{})
	defer tr.Close()
	pump(t, tr)
	child := childproc.Start(t, childproc.Config{Env: []string{childEnv + "=1"}, Name: "target", StopWait: 30 * time.Second})
	defer func() {
		if err := child.Stop(); err != nil {
			t.Errorf("child: %v", err)
		}
	}()
	var h childHello
	if err := json.Unmarshal([]byte(child.Line), &h); err != nil {
		t.Fatalf("child's hello %q: %v", child.Line, err)
	}
	mem := make([]byte, childSize)
	var bufs segtable.Buffers
	b, _ := bufs.Register(mem, "", false)
	defer bufs.Unregister(context.Background(), b.ID)
	reg, err := tr.Register(b)
	if err != nil {
		t.Fatal(err)
	}
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "child", Epoch: 1,
		Endpoints: map[string]string{Name: h.Endpoint},
		Buffers:   []segtable.BufferDesc{{Addr: h.Addr, Length: h.Length, Keys: map[string]string{Name: h.Key}}}}
	ep, err := tr.Open(context.Background(), desc)
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	c := newWaiter()
	tok := uint64(0)
	run := func(op transport.Op, size uint64) {
		var s []transport.Slice
		for off := uint64(0); off < childSize; off += size {
			n := min(size, childSize-off)
			tok++
			s = append(s, transport.Slice{Op: op, Rail: uint16(tok), LocalHandle: reg.Handle, Local: unsafe.Pointer(&mem[off]),
				Remote: h.Addr + off, Length: n, Token: tok})
		}
		postAll(t, ep, c, s)
		for i := range s {
			if err := c.wait(t, s[i].Token); err != nil {
				t.Fatalf("%v of %d bytes: %v", op, size, err)
			}
		}
	}
	want := make([]byte, childSize)
	testpattern.Fill(want, 1)
	for i, size := range []uint64{1 << 20, 4096, 65536 + 17, 1000, childSize} {
		clear(mem)
		run(transport.Read, size)
		if d, w := digest(mem), digest(want); d != w {
			t.Fatalf("READ in %d-byte slices: digest %s, want %s", size, d, w)
		}
		testpattern.Fill(want, uint64(i+2))
		copy(mem, want)
		run(transport.Write, size)
		if d, w := child.Ask(t, "sum"), digest(want); d != w {
			t.Fatalf("WRITE in %d-byte slices: the child's digest %s, want %s", size, d, w)
		}
	}
	if c.dup.Load() != 0 {
		t.Errorf("%d duplicate completions", c.dup.Load())
	}
}
