//go:build efa && cgo

package efa

import (
	"math/rand/v2"
	"testing"

	"github.com/moonring/moonring/segtable"
)

// An endpoint finds the key of a range as a linear scan of the descriptor
// would, whatever the descriptor's order: the buffer that holds all of
// [addr, addr+n), none across two adjacent buffers, none for n == 0, and
// none in a buffer of no bytes (left out of the table).
func TestKeyLookup(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 300 {
		var bufs []segtable.BufferDesc
		addr := uint64(r.IntN(3)) * 4096
		for i := range r.IntN(7) {
			addr += uint64(r.IntN(3)) * 100
			n := uint64(1 + r.IntN(300))
			if r.IntN(8) == 0 {
				n = 0
			}
			k := remoteKey{key: uint64(i + 1), base: addr, length: n}
			bufs = append(bufs, segtable.BufferDesc{Addr: addr, Length: n, Keys: map[string]string{Name: k.String()}})
			addr += n
		}
		r.Shuffle(len(bufs), func(i, j int) { bufs[i], bufs[j] = bufs[j], bufs[i] })
		e := &Endpoint{t: &Transport{virt: true}}
		e.setKeys(&segtable.SegmentDesc{Buffers: bufs})
		kt := e.keys.Load()
		for range 200 {
			a := uint64(r.IntN(int(addr) + 64))
			n := uint64(r.IntN(3))
			if r.IntN(2) == 0 {
				n = uint64(r.IntN(400))
			}
			want := -1
			for j, b := range bufs {
				if n > 0 && b.Addr <= a && a+n <= b.Addr+b.Length {
					want = j
				}
			}
			kr, ok := kt.lookup(a, n)
			switch {
			case want < 0 && ok:
				t.Fatalf("lookup(%d, %d) in %v: buffer at %d, want none", a, n, bufs, kr.addr)
			case want >= 0 && (!ok || !kr.ok || kr.addr != bufs[want].Addr || kr.key != keyOf(t, bufs[want])):
				t.Fatalf("lookup(%d, %d) in %v: %+v %v, want buffer %d", a, n, bufs, kr, ok, want)
			}
		}
	}
}

func keyOf(t *testing.T, b segtable.BufferDesc) uint64 {
	k, err := parseKey(b.Keys[Name])
	if err != nil {
		t.Fatal(err)
	}
	return k.key
}
