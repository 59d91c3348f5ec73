package moonring_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"unsafe"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/rdma"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// devTransport stands for a GPU transport: it serves "cuda:" memory (plain
// host memory here) and records what the engine registers with it.
type devTransport struct {
	regs   map[uintptr]segtable.Location
	allocs map[unsafe.Pointer]bool
}

func (d *devTransport) Name() string      { return "fakedev" }
func (d *devTransport) Endpoint() string  { return "" }
func (d *devTransport) SliceSize() uint64 { return 0 }
func (d *devTransport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	d.regs[b.Addr] = b.Location
	return segtable.Registration{Handle: uint64(b.Addr)}, nil
}
func (d *devTransport) Unregister(b *segtable.Buffer, r segtable.Registration) error {
	delete(d.regs, b.Addr)
	return nil
}
func (d *devTransport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	return nil, transport.ErrUnreachable
}
func (d *devTransport) Close() error { return nil }
func (d *devTransport) Accepts(loc segtable.Location) bool {
	k, _, err := loc.Parse()
	return err == nil && k == "cuda"
}
func (d *devTransport) AllocDevice(size int, loc segtable.Location) ([]byte, error) {
	b := make([]byte, size)
	d.allocs[unsafe.Pointer(&b[0])] = true
	return b, nil
}
func (d *devTransport) FreeDevice(b []byte) error {
	p := unsafe.Pointer(unsafe.SliceData(b))
	if !d.allocs[p] {
		return fmt.Errorf("fakedev: %w", segtable.ErrNotFound)
	}
	delete(d.allocs, p)
	return nil
}

// TestDeviceMemory: GPU memory is allocated and freed through the
// transport that serves it and registered only with it, never with the
// CPU transports (which would copy through device addresses); CPU memory
// is registered with every transport.
func TestDeviceMemory(t *testing.T) {
	e := newEngine(t, t.Name())
	if _, err := e.Alloc(4096, "cuda:0"); !errors.Is(err, transport.ErrNotSupported) {
		t.Fatalf("Alloc on cuda:0 with no GPU transport: %v, want ErrNotSupported", err)
	}
	d := &devTransport{regs: map[uintptr]segtable.Location{}, allocs: map[unsafe.Pointer]bool{}}
	if err := e.InstallTransport(d); err != nil {
		t.Fatal(err)
	}
	g, err := e.Alloc(4096, "cuda:0")
	if err != nil {
		t.Fatal(err)
	}
	if len(d.allocs) != 1 {
		t.Fatalf("Alloc on cuda:0 did not go through the GPU transport")
	}
	h, err := e.Alloc(4096, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.RegisterLocalMemory(g, "cuda:0", true); err != nil {
		t.Fatal(err)
	}
	if _, err := e.RegisterLocalMemory(h, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	if len(d.regs) != 2 {
		t.Fatalf("GPU transport holds %d registrations, want 2", len(d.regs))
	}
	// The in-process transport took the CPU buffer only: a local copy
	// into the GPU buffer finds no transport for it.
	id, err := e.OpenSegment(context.Background(), e.Name())
	if err != nil {
		t.Fatal(err)
	}
	res := e.Transfer(context.Background(), moonring.TransferRequest{Opcode: moonring.Write, Source: uintptr(unsafe.Pointer(&g[0])),
		TargetID: id, TargetOffset: uint64(uintptr(unsafe.Pointer(&h[0]))), Length: 64})
	if !errors.Is(res, moonring.ErrNoTransport) {
		t.Fatalf("in-process copy from GPU memory: %v, want ErrNoTransport", res)
	}
	for _, b := range [][]byte{g, h} {
		if err := e.UnregisterLocalMemory(context.Background(), b); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Free(g); err != nil || len(d.allocs) != 0 {
		t.Fatalf("Free of GPU memory: %v (%d left)", err, len(d.allocs))
	}
	if err := e.Free(h); err != nil {
		t.Fatal(err)
	}
}

// TestOptionalTransportMissing: a transport the configuration asks for but
// this build or machine cannot give (rdma without the tag or a device, efa
// without the tag or an EFA device) is left out with a warning; the engine
// works without it.
func TestOptionalTransportMissing(t *testing.T) {
	var logs strings.Builder
	e, err := moonring.New(moonring.Config{Name: t.Name(), RDMA: &rdma.Config{}, EFA: &efa.Config{},
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if rdma.Available {
		if err == nil {
			e.Close()
		}
		t.Skip("this build has the rdma transport; the missing case is tested without the tag")
	}
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if e.Transport(rdma.Name) != nil {
		t.Fatal("rdma installed in a build without it")
	}
	if e.Transport(efa.Name) != nil {
		t.Fatal("efa installed in a build without it, or on a machine without an EFA device")
	}
	for _, name := range []string{"rdma", "efa"} {
		if !strings.Contains(logs.String(), "transport="+name) {
			t.Fatalf("no warning about %s in the log: %q", name, logs.String())
		}
	}
}
