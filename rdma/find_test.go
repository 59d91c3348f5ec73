//go:build rdma && cgo

package rdma

import (
	"math/rand/v2"
	"runtime"
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

// After each republish an endpoint finds exactly the buffers of the new
// descriptor, with their keys, flat and chunked (a DescList's, whose
// republishes share the chunks a change did not touch); and a republish
// after one change costs a chunk's entries, not a table of every buffer.
func TestBufferFindRepublish(t *testing.T) {
	const n = 8000
	at := func(i int) (addr, length uint64) { return 0x10_0000 + uint64(i)*0x2000, 0x1000 + uint64(i%5) }
	desc := func(i int) segtable.BufferDesc {
		a, l := at(i)
		return segtable.BufferDesc{Addr: a, Length: l, Keys: map[string]string{Name: formatKey([]uint32{uint32(i + 1)})}}
	}
	r := rand.New(rand.NewPCG(3, 4))
	ep := &Endpoint{nrdev: 1}
	live := make([]bool, n)
	var l segtable.DescList
	// sweep checks every buffer's ranges against the table now.
	sweep := func(round int) {
		t.Helper()
		rb := ep.bufs.Load()
		for i := range n {
			a, ln := at(i)
			for _, c := range []struct {
				addr, n uint64
				in      bool
			}{{a, ln, true}, {a, 0, true}, {a + ln - 1, 1, true}, {a + 8, 16, true}, {a, ln + 1, false}, {a + ln, 1, false}, {a - 1, 2, false}} {
				got := rb.find(c.addr, c.n)
				want := c.in && live[i]
				switch {
				case !want && got != nil:
					t.Fatalf("round %d: find(%#x, %d): buffer at %#x, want none (buffer %d live %v)", round, c.addr, c.n, got.addr, i, live[i])
				case want && (got == nil || got.addr != a || formatKey(got.rkeys) != desc(i).Keys[Name]):
					t.Fatalf("round %d: find(%#x, %d): %+v, want buffer %d", round, c.addr, c.n, got, i)
				}
			}
		}
	}
	for round := range 6 {
		for i := range live {
			if round == 0 || r.IntN(3) == 0 {
				live[i] = !live[i]
				if live[i] {
					l.Put(segtable.BufferID(i+1), desc(i), true)
				} else {
					l.Delete(segtable.BufferID(i+1), desc(i).Addr)
				}
			}
		}
		// Flat, then chunked twice (the second Mirror made from the
		// first's shared tables), and so on; the first round's flat
		// descriptor out of address order.
		d := &segtable.SegmentDesc{Buffers: l.Buffers(true)}
		if round == 0 {
			r.Shuffle(len(d.Buffers), func(i, j int) { d.Buffers[i], d.Buffers[j] = d.Buffers[j], d.Buffers[i] })
		}
		if round%3 != 0 {
			d = &segtable.SegmentDesc{Chunked: l.Remote()}
		}
		ep.setBuffers(d)
		sweep(round)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	flip := live[n/2]
	const runs = 20
	for range runs {
		flip = !flip
		if flip {
			l.Put(segtable.BufferID(n/2+1), desc(n/2), true)
		} else {
			l.Delete(segtable.BufferID(n/2+1), desc(n/2).Addr)
		}
		ep.setBuffers(&segtable.SegmentDesc{Chunked: l.Remote()})
	}
	runtime.ReadMemStats(&after)
	bytes := (after.TotalAlloc - before.TotalAlloc) / runs
	live[n/2] = flip
	sweep(6) // the Mirrors made from shared tables answer as they should
	t.Logf("%d bytes a republish of %d buffers after one change", bytes, l.Len())
	// A table of every buffer takes an rbuf (56 bytes) and a key each.
	if bytes > uint64(l.Len())*16 {
		t.Errorf("%d bytes a republish after one change among %d buffers: the table is built anew", bytes, l.Len())
	}
}
