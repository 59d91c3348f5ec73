package moonring_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
)

// TestChurnGarbageFlat: a register/unregister cycle of one buffer
// beside 20,000 held leaves about the garbage it leaves beside one
// (BenchmarkScaleChurn's kinds: local-only, remote-accessible below the
// held buffers, remote-accessible in a gap in the middle of them). The
// collector's cost a cycle is that garbage times the cost of marking the
// heap the held buffers make, so garbage that grew with them made churn
// grow with them. Allowed beside many: for remote in the middle, 2 KiB (a
// copy of half a descriptor chunk, 17 BufferDescs of 56 bytes, of half a
// page of chunks and the array of pages, 8 bytes per 2,048 buffers: 1.7
// KiB); half a KiB else. It was 1.9x / 1.3x / 3.6x (local, remote,
// remote in the middle: 2.6 / 5.3 / 15.0 KB a cycle against 1.4 / 4.2 /
// 4.2): copies of the three address indexes' leaves and of the nodes above
// them, of a descriptor chunk, of its page and of the array of pages, at
// the unregistration as at the registration.
func TestChurnGarbageFlat(t *testing.T) {
	const n, block, cycles = 20000, 256, 2000
	for _, kind := range []string{"local", "remote", "remote-mid"} {
		t.Run(kind, func(t *testing.T) {
			perCycle := func(held int) float64 {
				e, err := moonring.New(moonring.Config{Name: fmt.Sprintf("churn-%s-%d", kind, held), Metadata: metadata.NewMemory()})
				if err != nil {
					t.Fatal(err)
				}
				defer e.Close()
				mem, err := e.Alloc((held+1)*block, "cpu:0")
				if err != nil {
					t.Fatal(err)
				}
				defer e.Free(mem)
				hole := held / 2
				specs := make([]moonring.BufferSpec, 0, held)
				for i := range held + 1 {
					if i != hole {
						specs = append(specs, moonring.BufferSpec{Buf: mem[i*block : (i+1)*block], Location: "cpu:0", Remote: true})
					}
				}
				if _, err := e.RegisterLocalMemoryBatch(specs); err != nil {
					t.Fatal(err)
				}
				buf := make([]byte, block) // Go memory: below every held buffer
				if kind == "remote-mid" {
					buf = mem[hole*block : (hole+1)*block]
				}
				ctx := context.Background()
				cycle := func() {
					if _, err := e.RegisterLocalMemory(buf, "cpu:0", kind != "local"); err != nil {
						t.Fatal(err)
					}
					if err := e.UnregisterLocalMemory(ctx, buf); err != nil {
						t.Fatal(err)
					}
				}
				for range 100 {
					cycle()
				}
				var m0, m1 runtime.MemStats
				runtime.ReadMemStats(&m0)
				for range cycles {
					cycle()
				}
				runtime.ReadMemStats(&m1)
				return float64(m1.TotalAlloc-m0.TotalAlloc) / cycles
			}
			one, many := perCycle(1), perCycle(n)
			slack := 512.0
			if kind == "remote-mid" {
				slack = 2048
			}
			t.Logf("bytes a cycle beside 1 buffer %.0f, beside %d %.0f (%.2fx)", one, n, many, many/one)
			if many > one+slack {
				t.Errorf("%.0f bytes a cycle beside %d buffers, %.0f beside one: want at most %.0f more", many, n, one, slack)
			}
		})
	}
}
