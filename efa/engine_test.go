//go:build efa && cgo

package efa_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/metadata"
)

// TestEngines: two engines of this process configured with Config.EFA
// (libfabric's tcp provider, with the progress goroutine the software
// provider needs) open each other's segment over efa alone and move data
// both ways through the batch API.
func TestEngines(t *testing.T) { testEngines(t, true) }

// TestEnginesEnginePolls: the same without the transport's progress
// goroutine: the target engine, which has no ring, still polls the
// transport (the engine starts a poller for it), so its peer's bytes move.
func TestEnginesEnginePolls(t *testing.T) { testEngines(t, false) }

func testEngines(t *testing.T, progress bool) {
	newEFA(t, testConfig("tcp")).Close() // skips loudly where libfabric is missing
	store := metadata.NewMemory()
	mk := func(name string) *moonring.Engine {
		cfg := testConfig("tcp")
		cfg.Progress = progress
		e, err := moonring.New(moonring.Config{Name: name, Metadata: store, Transports: []string{efa.Name}, EFA: &cfg})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		return e
	}
	a, b := mk(t.Name()+"-a"), mk(t.Name()+"-b")
	ctx := context.Background()
	src, err := a.Alloc(4<<20, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Free(src)
	dst, err := b.Alloc(4<<20, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free(dst)
	for i := range src {
		src[i] = byte(i * 13)
	}
	if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	if name, _ := a.SegmentTransport(seg); name != efa.Name {
		t.Fatalf("segment opened over %q, want efa", name)
	}
	base := uint64(moonring.AddressOf(dst))
	if err := a.Transfer(ctx,
		moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg, TargetOffset: base, Length: 3 << 20},
		moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src[3<<20:]), TargetID: seg, TargetOffset: base + 3<<20, Length: 100},
	); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst[:3<<20+100], src[:3<<20+100]) {
		t.Fatal("WRITE over efa: data differ")
	}
	clear(src[:1<<20])
	if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(src), TargetID: seg, TargetOffset: base + 7, Length: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src[:1<<20], dst[7:7+1<<20]) {
		t.Fatal("READ over efa: data differ")
	}
}
