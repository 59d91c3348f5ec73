//go:build rdma && cgo

package rdma_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/rdma"
)

var engineSeq atomic.Int64

// rdmaEngine starts an engine with the rdma transport installed, or skips
// where there is no RDMA device (fails inside the VM).
func rdmaEngine(t *testing.T, cfg moonring.Config) *moonring.Engine { return rdmaEngineStore(t, cfg) }

// rdmaEngineStore is rdmaEngine; with cfg.Metadata set, the store names
// the engine.
func rdmaEngineStore(t *testing.T, cfg moonring.Config) *moonring.Engine {
	t.Helper()
	tr, err := rdma.New(rdma.Config{})
	if err != nil {
		if errors.Is(err, rdma.ErrNoDevice) && os.Getenv("MOONRING_RDMA_REQUIRE") != "1" {
			t.Skipf("SKIP: no RDMA device here (%v); this test runs against Soft-RoCE in a VM: make test-rdma", err)
		}
		t.Fatal(err)
	}
	if cfg.Metadata == nil {
		cfg.Name = fmt.Sprintf("rdma-engine-%d", engineSeq.Add(1))
	}
	e, err := moonring.New(cfg)
	if err != nil {
		tr.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Errorf("Engine.Close: %v", err)
		}
	})
	if err := e.InstallTransport(tr); err != nil {
		tr.Close()
		t.Fatal(err)
	}
	return e
}

// Two engines joined by the rdma transport alone: WRITE and READ of many
// sizes through the engine's rings and pollers, a write-with-notify, and a
// request outside the target's memory that fails while the next succeed.
func TestEngines(t *testing.T) {
	a := rdmaEngine(t, moonring.Config{Transports: []string{rdma.Name}})
	b := rdmaEngine(t, moonring.Config{})
	const size = 8 << 20
	src, back, dst := make([]byte, size), make([]byte, size), make([]byte, size)
	r := rand.New(rand.NewPCG(5, 6))
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	for _, m := range [][]byte{src, back} {
		if _, err := a.RegisterLocalMemory(m, "cpu:0", false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	base := uint64(moonring.AddressOf(dst))
	off := 0
	for _, n := range []int{1, 7, 4096, 65536 + 3, 1 << 20, 3<<20 + 5} {
		if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src[off:]),
			TargetID: seg, TargetOffset: base + uint64(off), Length: uint64(n)}); err != nil {
			t.Fatalf("WRITE of %d bytes: %v", n, err)
		}
		if !bytes.Equal(dst[off:off+n], src[off:off+n]) {
			t.Fatalf("WRITE of %d bytes: data differs", n)
		}
		if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(back[off:]),
			TargetID: seg, TargetOffset: base + uint64(off), Length: uint64(n)}); err != nil {
			t.Fatalf("READ of %d bytes: %v", n, err)
		}
		if !bytes.Equal(back[off:off+n], src[off:off+n]) {
			t.Fatalf("READ of %d bytes: data differs", n)
		}
		off += n
	}
	if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src),
		TargetID: seg, TargetOffset: base + size - 10, Length: 20}); err == nil {
		t.Fatal("a WRITE past the end of the target's memory succeeded")
	}
	if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src),
		TargetID: seg, TargetOffset: base, Length: 4096, Notify: &moonring.Notify{Tag: 7, Msg: []byte("kv ready")}}); err != nil {
		t.Fatalf("WRITE with notify: %v", err)
	}
	select {
	case n := <-b.Notifications():
		if n.From != a.Name() || n.Tag != 7 || string(n.Msg) != "kv ready" {
			t.Fatalf("notification %+v; want from %s, tag 7, \"kv ready\"", n, a.Name())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no notification arrived")
	}
}
