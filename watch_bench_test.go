package moonring_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/proccpu"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// BenchmarkPeerRepublish is one register/unregister cycle of a
// remote-accessible buffer at a publisher that holds n others, while a
// second engine of the process has its segment open (through the tcp or
// the local transport, the Memory store, unsigned or signed with
// Config.Key), each step timed until the peer has applied the
// republished descriptor (its watcher took it: the store's hand-out, the
// signing reader's check, every path's Update and the segment's): what
// one registration costs every watching peer. It reports the process's
// CPU time per cycle (cpu-ns/op, getrusage: both engines and the
// store), which other load disturbs less than the wall time (which
// includes the polling's sleeps). MOONRING_SCALE_MAX bounds n.
func BenchmarkPeerRepublish(b *testing.B) {
	for _, n := range scaleCounts(b, 1, 10000, 100000) {
		for _, via := range []string{"tcp", "local"} {
			for _, mode := range []string{"unsigned", "signed"} {
				b.Run(fmt.Sprintf("buffers=%d/%s/%s", n, via, mode), func(b *testing.B) {
					peerRepublish(b, n, via, mode == "signed")
				})
			}
		}
	}
}

func peerRepublish(b *testing.B, n int, via string, signed bool) {
	store := metadata.NewMemory()
	defer store.Close()
	peerRepublishThrough(b, n, via, signed, b.Name()+"-t", store, store, 30*time.Second)
}

// peerRepublishThrough is the cycles of BenchmarkPeerRepublish with the
// publisher on pub and the peer on peer (one store, or two clients of
// one server), the publisher's segment named name; a step that the peer
// has not applied within wait fails.
func peerRepublishThrough(b *testing.B, n int, via string, signed bool, name string, pub, peer metadata.Store, wait time.Duration) {
	var key []byte
	if signed {
		key = []byte("bench key")
	}
	t, err := moonring.New(moonring.Config{Name: name, Metadata: pub, Key: key, TCP: &tcp.Config{Key: key}})
	if err != nil {
		b.Fatal(err)
	}
	defer t.Close()
	mem, err := t.Alloc((n+1)*scaleBlock, "cpu:0")
	if err != nil {
		b.Fatal(err)
	}
	defer t.Free(mem)
	specs := make([]moonring.BufferSpec, n)
	for i := range specs {
		specs[i] = moonring.BufferSpec{Buf: mem[i*scaleBlock : (i+1)*scaleBlock], Location: "cpu:0", Remote: true}
	}
	if _, err := t.RegisterLocalMemoryBatch(specs); err != nil {
		b.Fatal(err)
	}
	a, err := moonring.New(moonring.Config{Name: name + "-a", Metadata: peer, Key: key, TCP: &tcp.Config{Key: key}, Transports: []string{via}})
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	seg, err := a.OpenSegment(b.Context(), name)
	if err != nil {
		b.Fatal(err)
	}
	if got, err := a.SegmentTransport(seg); err != nil || got != via {
		b.Fatalf("segment reached through %q (%v), want %q", got, err, via)
	}
	last := mem[n*scaleBlock:]
	ctx := context.Background()
	// applied waits until the peer has taken a descriptor of want
	// buffers (register and unregister alternate, so each step changes
	// the count; a descriptor's Rev does not always grow unsigned).
	applied := func(want int) {
		deadline := time.Now().Add(wait)
		for spins := 0; moonring.PeerBuffers(a, seg) != want; spins++ {
			if time.Now().After(deadline) {
				b.Fatalf("the peer did not apply a descriptor of %d buffers (has %d)", want, moonring.PeerBuffers(a, seg))
			}
			if spins < 50 {
				runtime.Gosched()
			} else {
				time.Sleep(20 * time.Microsecond)
			}
		}
	}
	applied(n)
	time.Sleep(50 * time.Millisecond) // the watcher's first event, the descriptor as opened
	b.ReportAllocs()
	cpu0 := proccpu.Self()
	for b.Loop() {
		if _, err := t.RegisterLocalMemory(last, "cpu:0", true); err != nil {
			b.Fatal(err)
		}
		applied(n + 1)
		if err := t.UnregisterLocalMemory(ctx, last); err != nil {
			b.Fatal(err)
		}
		applied(n)
	}
	b.ReportMetric(float64((proccpu.Self()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
}
