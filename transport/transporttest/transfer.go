// transfer.go holds the subtests of bytes moving where addressed and
// nowhere else: Basics, ReadWriteSizes (sizes, offsets, a transfer across
// buffers) and Concurrent (many goroutines, endpoints and rails at once).

package transporttest

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

func testBasics(t *testing.T, su suite) {
	f := newFixture(t, su)
	if f.init.tr.Name() == "" || f.targ.tr.Name() != f.init.tr.Name() {
		t.Fatalf("names %q and %q: want the same non-empty name", f.init.tr.Name(), f.targ.tr.Name())
	}
	if s := f.init.tr.SliceSize(); s != 0 && s < 4096 {
		t.Errorf("SliceSize() = %d: a positive slice size below 4 KiB makes no sense", s)
	}
	ep := f.open(f.desc)
	c := newCollector()
	// An empty post accepts nothing and completes nothing.
	if n, err := ep.Post(c, nil); n != 0 || err != nil {
		t.Fatalf("Post(nil) = %d, %v; want 0, nil", n, err)
	}
	if c.count() != 0 {
		t.Fatalf("Post(nil) completed %d slices", c.count())
	}
}

func testReadWriteSizes(t *testing.T, su suite) {
	f := newFixtureSize(t, su, bigA)
	ep := f.open(f.desc)
	c := newCollector()
	accepted := map[uint64]bool{}
	sizes := []uint64{1, 7, 4 << 10, 64<<10 + 3, 1 << 20, 16 << 20}
	offsets := []uint64{0, 1, 3, 4093, 4097}
	wantT := slices.Clone(f.tarena)
	wantI := slices.Clone(f.iarena)
	aOff := f.tOff(uint64(f.a.Addr))
	lOff := page
	for i, n := range sizes {
		for j, off := range offsets {
			if off+n > bigA {
				continue
			}
			// Only the largest size is expensive; one odd offset suffices.
			if n == 16<<20 && off != 4097 {
				continue
			}
			loff := uint64((j*7 + 5) % 61) // a different odd-ish local offset
			seed := uint64(i*100 + j)

			// WRITE: L[loff:] -> A[off:].
			src := f.iarena[lOff+int(loff) : lOff+int(loff+n)]
			testpattern.Fill(src, seed)
			copy(wantI[lOff+int(loff):], src)
			s := f.cut(ep, transport.Write, loff, uint64(f.a.Addr)+off, n)
			for i, err := range f.run(ep, c, s) {
				if err != nil {
					t.Fatalf("WRITE %d bytes at offset %d, slice %d: %v", n, off, i, err)
				}
				accepted[s[i].Token] = true
			}
			copy(wantT[aOff+int(off):], src)
			expectArena(t, fmt.Sprintf("target after WRITE of %d bytes at A+%d", n, off), f.tarena, wantT)
			expectArena(t, fmt.Sprintf("initiator after WRITE of %d bytes", n), f.iarena, wantI)

			// READ: A[off:] (new content) -> L[loff+1:].
			remote := f.tarena[aOff+int(off) : aOff+int(off+n)]
			testpattern.Fill(remote, seed+7)
			copy(wantT[aOff+int(off):], remote)
			s = f.cut(ep, transport.Read, loff+1, uint64(f.a.Addr)+off, n)
			for i, err := range f.run(ep, c, s) {
				if err != nil {
					t.Fatalf("READ %d bytes at offset %d, slice %d: %v", n, off, i, err)
				}
				accepted[s[i].Token] = true
			}
			copy(wantI[lOff+int(loff+1):], remote)
			expectArena(t, fmt.Sprintf("initiator after READ of %d bytes from A+%d", n, off), f.iarena, wantI)
			expectArena(t, fmt.Sprintf("target after READ of %d bytes", n), f.tarena, wantT)
		}
	}
	// B and C work as well (they are not A's neighbours by accident).
	for _, b := range []*segtable.Buffer{f.b, f.c} {
		n := b.Length
		src := f.iarena[lOff : lOff+int(n)]
		testpattern.Fill(src, uint64(b.Addr))
		copy(wantI[lOff:], src)
		s := f.cut(ep, transport.Write, 0, uint64(b.Addr), n)
		for i, err := range f.run(ep, c, s) {
			if err != nil {
				t.Fatalf("WRITE all of a %d-byte buffer: %v", n, err)
			}
			accepted[s[i].Token] = true
		}
		copy(wantT[f.tOff(uint64(b.Addr)):], src)
		expectArena(t, "target after WRITE of a whole buffer", f.tarena, wantT)
	}
	c.check(t, accepted)
}

func testConcurrent(t *testing.T, su suite) {
	f := newFixture(t, su)
	const (
		workers = 4
		rounds  = 20
		perPost = 8
		region  = 256 << 10 // per worker, in A and in L
	)
	c := newCollector()
	var mu sync.Mutex
	accepted := map[uint64]bool{}
	aOff := f.tOff(uint64(f.a.Addr))
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		// Post is called by one goroutine at a time per endpoint: each
		// worker opens its own, and they share the Completer.
		ep := f.open(f.desc)
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 42))
			base := uint64(w * region)
			for r := 0; r < rounds; r++ {
				// perPost disjoint pieces of the worker's region.
				piece := uint64(region / perPost)
				var ws, rs []transport.Slice
				for i := 0; i < perPost; i++ {
					n := 1 + rng.Uint64N(piece/2-1)
					off := base + uint64(i)*piece + rng.Uint64N(piece/2)
					src := f.iarena[page+int(off) : page+int(off+n)]
					testpattern.Fill(src, uint64(w<<20|r<<8|i))
					ws = append(ws, f.slice(transport.Write, off, uint64(f.a.Addr)+off, n, i%ep.Rails()))
				}
				n, err := post(ep, c, ws)
				mu.Lock()
				for _, s := range ws[:n] {
					accepted[s.Token] = true
				}
				mu.Unlock()
				if err != nil {
					errs <- fmt.Errorf("worker %d: Post: %v", w, err)
					return
				}
				werrs, err := c.await(ws)
				if err != nil {
					errs <- fmt.Errorf("worker %d: %v", w, err)
					return
				}
				for i, err := range werrs {
					if err != nil {
						errs <- fmt.Errorf("worker %d: WRITE: %v", w, err)
						return
					}
					off := ws[i].Remote - uint64(f.a.Addr)
					if !bytes.Equal(f.tarena[aOff+int(off):aOff+int(off+ws[i].Length)], f.iarena[page+int(off):page+int(off+ws[i].Length)]) {
						errs <- fmt.Errorf("worker %d: WRITE of %d bytes at A+%d: data differs", w, ws[i].Length, off)
						return
					}
					// Read it back into the second half of the piece.
					back := off + piece/2
					if back+ws[i].Length > base+uint64(i+1)*piece {
						back = base + uint64(i)*piece + piece/2
					}
					rs = append(rs, f.slice(transport.Read, back, ws[i].Remote, ws[i].Length, i%ep.Rails()))
				}
				n, err = post(ep, c, rs)
				mu.Lock()
				for _, s := range rs[:n] {
					accepted[s.Token] = true
				}
				mu.Unlock()
				if err != nil {
					errs <- fmt.Errorf("worker %d: Post: %v", w, err)
					return
				}
				rerrs, err := c.await(rs)
				if err != nil {
					errs <- fmt.Errorf("worker %d: %v", w, err)
					return
				}
				for i, err := range rerrs {
					if err != nil {
						errs <- fmt.Errorf("worker %d: READ: %v", w, err)
						return
					}
					loff := uint64(uintptr(rs[i].Local) - f.l.Addr)
					roff := rs[i].Remote - uint64(f.a.Addr)
					if !bytes.Equal(f.iarena[page+int(loff):page+int(loff+rs[i].Length)], f.tarena[aOff+int(roff):aOff+int(roff+rs[i].Length)]) {
						errs <- fmt.Errorf("worker %d: READ of %d bytes from A+%d: data differs", w, rs[i].Length, roff)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	c.check(t, accepted)
	// Nothing outside the workers' regions of A was written.
	for i := aOff + workers*region; i < len(f.tarena); i++ {
		if f.tarena[i] != canary {
			t.Fatalf("target byte %d outside every addressed range changed", i)
		}
	}
	for i := 0; i < aOff; i++ {
		if f.tarena[i] != canary {
			t.Fatalf("target byte %d before A changed", i)
		}
	}
}
