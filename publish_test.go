package moonring_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/tcp"
)

// TestPublishMatchesRebuild: after any sequence of registrations and
// unregistrations, one by one and in batches, remote-accessible and
// local-only, what the store holds lists exactly the remote-accessible
// buffers registered (a full rebuild's list), and, signed, verifies under
// the key with a Rev above the last one, where each republish signed only
// the chunk it changed.
func TestPublishMatchesRebuild(t *testing.T) {
	for _, mode := range []string{"unsigned", "signed"} {
		t.Run(mode, func(t *testing.T) {
			store := metadata.NewMemory()
			key := []byte("publish key")
			cfg := moonring.Config{Name: "pub-" + mode, Metadata: store, TCP: &tcp.Config{Key: key}}
			if mode == "unsigned" {
				cfg.TCP.Key = nil
			}
			e, err := moonring.New(cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			signer, _ := segtable.NewSigner(key)
			const slots, size = 600, 256
			mem := make([]byte, slots*size)
			remote := map[uint64]bool{} // registered: address, remote-accessible
			buf := func(i int) []byte { return mem[i*size : (i+1)*size : (i+1)*size] }
			rng := rand.New(rand.NewPCG(7, uint64(len(mode))))
			ctx := context.Background()
			var rev uint64
			for step := range 1500 {
				i := rng.IntN(slots)
				addr := uint64(moonring.AddressOf(buf(i)))
				if _, ok := remote[addr]; ok {
					if err := e.UnregisterLocalMemory(ctx, buf(i)); err != nil {
						t.Fatal(err)
					}
					delete(remote, addr)
				} else if rng.IntN(10) == 0 { // a batch of a few
					var specs []moonring.BufferSpec
					for j := i; j < min(i+4, slots); j++ {
						a := uint64(moonring.AddressOf(buf(j)))
						if _, ok := remote[a]; !ok {
							specs = append(specs, moonring.BufferSpec{Buf: buf(j), Location: "cpu:0", Remote: rng.IntN(4) > 0})
							remote[a] = specs[len(specs)-1].Remote
						}
					}
					if _, err := e.RegisterLocalMemoryBatch(specs); err != nil {
						t.Fatal(err)
					}
				} else {
					r := rng.IntN(4) > 0
					if _, err := e.RegisterLocalMemory(buf(i), "cpu:0", r); err != nil {
						t.Fatal(err)
					}
					remote[addr] = r
				}
				if step%25 != 0 {
					continue
				}
				d, err := store.Get(ctx, cfg.Name)
				if err != nil {
					t.Fatal(err)
				}
				want := 0
				for _, r := range remote {
					if r {
						want++
					}
				}
				if d.NumBuffers() != want {
					t.Fatalf("step %d: %d buffers published, %d registered remote-accessible", step, d.NumBuffers(), want)
				}
				for _, b := range d.AllBuffers() {
					if r, ok := remote[b.Addr]; !ok || !r || b.Length != size || len(b.Keys) == 0 {
						t.Fatalf("step %d: published %+v, not a registered remote-accessible buffer", step, b)
					}
				}
				if err := d.Validate(); err != nil {
					t.Fatal(err)
				}
				if mode == "signed" {
					if err := signer.Verify(d); err != nil {
						t.Fatalf("step %d: %v", step, err)
					}
					if d.Rev <= rev {
						t.Fatalf("step %d: Rev %d after %d", step, d.Rev, rev)
					}
					rev = d.Rev
				} else if d.MAC != "" || d.Chunks != nil {
					t.Fatalf("unsigned engine published MACs")
				}
			}
		})
	}
}
