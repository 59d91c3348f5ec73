//go:build rdma && cgo

package rdma

import (
	"math/rand/v2"
	"testing"

	"github.com/moonring/moonring/segtable"
)

// An endpoint finds the remote buffer of a range as a linear scan of the
// descriptor would, whatever the descriptor's order: the buffer that holds
// all of [addr, addr+n), none across two adjacent buffers, and for n == 0
// the buffer addr lies in.
func TestBufferFind(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for range 300 {
		bufs, end := randomBuffers(r)
		ep := &Endpoint{nrdev: 1}
		ep.setBuffers(&segtable.SegmentDesc{Buffers: bufs})
		rb := ep.bufs.Load()
		for range 200 {
			a := uint64(r.IntN(int(end) + 64))
			n := uint64(r.IntN(3))
			if r.IntN(2) == 0 {
				n = uint64(r.IntN(400))
			}
			want := -1
			for j, b := range bufs {
				if b.Addr <= a && a < b.Addr+b.Length && a+n <= b.Addr+b.Length {
					want = j
				}
			}
			got := rb.find(a, n)
			switch {
			case want < 0 && got != nil:
				t.Fatalf("find(%d, %d) in %v: buffer at %d, want none", a, n, bufs, got.addr)
			case want >= 0 && (got == nil || got.addr != bufs[want].Addr || got.rkeys == nil || formatKey(got.rkeys) != bufs[want].Keys[Name]):
				t.Fatalf("find(%d, %d) in %v: %+v, want buffer %d", a, n, bufs, got, want)
			}
		}
	}
}

// randomBuffers returns up to 6 disjoint buffers, some adjacent, in random
// order, each with a key of its own, and the end of the last.
func randomBuffers(r *rand.Rand) ([]segtable.BufferDesc, uint64) {
	var bufs []segtable.BufferDesc
	addr := uint64(r.IntN(3)) * 4096
	for i := range r.IntN(7) {
		addr += uint64(r.IntN(3)) * 100
		n := uint64(1 + r.IntN(300))
		bufs = append(bufs, segtable.BufferDesc{Addr: addr, Length: n, Keys: map[string]string{Name: formatKey([]uint32{uint32(i + 1)})}})
		addr += n
	}
	r.Shuffle(len(bufs), func(i, j int) { bufs[i], bufs[j] = bufs[j], bufs[i] })
	return bufs, addr
}
