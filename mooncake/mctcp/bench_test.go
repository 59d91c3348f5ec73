package mctcp_test

// bench_test.go: mooncake-tcp beside moonring's own tcp transport, in one
// run over loopback:
//
//	go test -run '^$' -bench BenchmarkTransports -benchtime 1s -count 3 ./mooncake/mctcp/

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"unsafe"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/mooncake/mctcp"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
	"github.com/moonring/moonring/transport"
)

// BenchmarkTransports moves pipelined WRITEs and READs of 4 KiB, 64 KiB
// and 1 MiB (about 4 MiB in flight, at least 16 slices) over each
// transport with its default rails: mooncake-tcp in versions 2 and 1,
// and tcp. Data is checked after the timed loop.
func BenchmarkTransports(b *testing.B) {
	const arena = 16 << 20
	kinds := []struct {
		name string
		make func(b *testing.B) (transport.Transport, transport.Transport)
	}{
		{"mctcp-v2", func(b *testing.B) (transport.Transport, transport.Transport) {
			return newT(b, mctcp.Config{Version: 2}), newT(b, mctcp.Config{})
		}},
		{"mctcp-v1", func(b *testing.B) (transport.Transport, transport.Transport) {
			return newT(b, mctcp.Config{Version: 1}), newT(b, mctcp.Config{})
		}},
		{"tcp", func(b *testing.B) (transport.Transport, transport.Transport) {
			it, err := tcp.New(tcp.Config{})
			if err != nil {
				b.Fatal(err)
			}
			tt, err := tcp.New(tcp.Config{})
			if err != nil {
				b.Fatal(err)
			}
			return it, tt
		}},
	}
	for _, k := range kinds {
		for _, op := range []transport.Op{transport.Write, transport.Read} {
			for _, size := range []int{4 << 10, 64 << 10, 1 << 20} {
				name := fmt.Sprintf("%s/%s/%dKiB", k.name, map[transport.Op]string{transport.Write: "WRITE", transport.Read: "READ"}[op], size>>10)
				b.Run(name, func(b *testing.B) { benchOne(b, k.make, op, size, arena) })
			}
		}
	}
}

func benchOne(b *testing.B, mk func(b *testing.B) (transport.Transport, transport.Transport), op transport.Op, size, arena int) {
	it, tt := mk(b)
	var ib, tb segtable.Buffers
	local, remote := make([]byte, arena), make([]byte, arena)
	lb, err := ib.Register(local, "", false)
	if err != nil {
		b.Fatal(err)
	}
	lreg, err := it.Register(lb)
	if err != nil {
		b.Fatal(err)
	}
	rb, err := tb.Register(remote, "", true)
	if err != nil {
		b.Fatal(err)
	}
	rreg, err := tt.Register(rb)
	if err != nil {
		b.Fatal(err)
	}
	desc := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "bench", Epoch: 1, Endpoints: map[string]string{tt.Name(): tt.Endpoint()},
		Buffers: []segtable.BufferDesc{{Addr: uint64(rb.Addr), Length: rb.Length, Keys: map[string]string{tt.Name(): rreg.Key}}}}
	ep, err := it.Open(context.Background(), desc)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		ep.Close()
		it.Close()
		tt.Close()
		ib.Unregister(context.Background(), lb.ID)
		tb.Unregister(context.Background(), rb.ID)
	}()
	testpattern.Fill(local, 1)
	testpattern.Fill(remote, 2)
	slots := arena / size
	window := min(slots/2, max(16, (4<<20)/size))
	comp := make(tokenCh, window)
	s := make([]transport.Slice, 1)
	b.SetBytes(int64(size))
	b.ResetTimer()
	posted, done := 0, 0
	for done < b.N {
		for posted-done < window && posted < b.N {
			off := (posted % slots) * size
			s[0] = transport.Slice{Op: op, Rail: uint16(posted), LocalHandle: lreg.Handle, Local: unsafe.Pointer(&local[off]),
				Remote: uint64(rb.Addr) + uint64(off), Length: uint64(size), Token: uint64(posted)}
			if n, err := ep.Post(comp, s); err != nil {
				b.Fatal(err)
			} else if n == 0 {
				break // full: wait for a completion
			}
			posted++
		}
		if tok := <-comp; tok > uint64(b.N) {
			b.Fatalf("slice %d failed", ^tok)
		}
		done++
	}
	b.StopTimer()
	b.ReportMetric(float64(size)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
	if op == transport.Write {
		// Version 1's WRITEs complete before they land: a READ on each
		// rail, served after the WRITEs before it, orders the check.
		var one [1]byte
		for r := range ep.Rails() {
			s[0] = transport.Slice{Op: transport.Read, Rail: uint16(r), LocalHandle: lreg.Handle, Local: unsafe.Pointer(&one[0]), Remote: uint64(rb.Addr), Length: 1, Token: 0}
			if n, err := ep.Post(comp, s); n != 1 || err != nil {
				b.Fatalf("barrier READ: %d, %v", n, err)
			}
			if tok := <-comp; tok != 0 {
				b.Fatal("barrier READ failed")
			}
		}
	}
	touched := min(b.N, slots) * size
	if !bytes.Equal(remote[:touched], local[:touched]) {
		b.Fatalf("the %v slices moved other bytes", op)
	}
}
