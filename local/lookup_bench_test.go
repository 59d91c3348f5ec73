package local_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// BenchmarkLookup is what a request's lookups cost without the ring
// around them: Segment.Resolve on the peer's descriptor, as the ring's
// check does, then an 8-byte Copy through an endpoint to the buffer it
// found (the key at the slice's RemoteIndex, the target's region by the
// key's handle), among n buffers of 4 KiB registered with the target, to
// the last buffer and to random ones (a fixed sequence). One goroutine,
// no scheduling: the figures BenchmarkScaleBuffersWaiting (root package)
// gives with a ring's and a machine's noise around them. ns/op is per
// request.
func BenchmarkLookup(b *testing.B) {
	for _, n := range []int{1, 100, 10000, 100000} {
		for _, to := range []string{"last", "random"} {
			b.Run(fmt.Sprintf("buffers=%d/to=%s", n, to), func(b *testing.B) {
				from, tgt := local.New(), local.New()
				defer from.Close()
				defer tgt.Close()
				mem := make([]byte, n*4096)
				var bufs segtable.Buffers
				d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "target", Epoch: 1, Endpoints: map[string]string{local.Name: tgt.Endpoint()}}
				for i := range n {
					buf, err := bufs.Register(mem[i*4096:(i+1)*4096], "", true)
					if err != nil {
						b.Fatal(err)
					}
					defer bufs.Unregister(context.Background(), buf.ID)
					reg, err := tgt.Register(buf)
					if err != nil {
						b.Fatal(err)
					}
					d.Buffers = append(d.Buffers, segtable.BufferDesc{Addr: uint64(buf.Addr), Length: buf.Length, Keys: map[string]string{local.Name: reg.Key}})
				}
				ep, err := from.Open(context.Background(), d)
				if err != nil {
					b.Fatal(err)
				}
				defer ep.Close()
				var segs segtable.Segments[transport.Endpoint]
				seg, err := segs.Open("target", d, 0, 0, ep, nil)
				if err != nil {
					b.Fatal(err)
				}
				cp := ep.(transport.Copier)
				base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem))))
				dst := make([]uint64, 1<<16)
				rng := rand.New(rand.NewPCG(1, 2))
				for i := range dst {
					k := n - 1
					if to == "random" {
						k = rng.IntN(n)
					}
					dst[i] = base + uint64(k)*4096 + 64
				}
				src := make([]byte, 8)
				s := transport.Slice{Op: transport.Write, Local: unsafe.Pointer(unsafe.SliceData(src)), Length: 8}
				i := 0
				b.ReportAllocs()
				for b.Loop() {
					s.Remote = dst[i&(len(dst)-1)]
					ri := seg.Resolve(s.Remote, s.Length)
					if ri < 0 {
						b.Fatal("Resolve found no buffer")
					}
					s.RemoteIndex = uint32(ri)
					if err := cp.Copy(&s); err != nil {
						b.Fatal(err)
					}
					i++
				}
			})
		}
	}
}
