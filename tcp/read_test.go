package tcp

import (
	"bytes"
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// READs of sizes around directMin, pipelined on one connection: each
// response's payload comes partly from the receive buffer and partly
// straight from the socket, or wholly from either, and every byte lands
// where its READ asked and nowhere else.
func TestReadMixedSizes(t *testing.T) {
	const size = 4 << 20
	targ := newSide(t, Config{})
	tm := targ.alloc(t, size, 0)
	for i := range tm {
		tm[i] = byte(i*7 + 3)
	}
	remote := targ.register(t, tm, true)
	init := newSide(t, Config{Rails: 1})
	local := init.alloc(t, size, 0xee)
	ep, err := init.tr.Open(context.Background(), targ.desc("", remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	sizes := []int{1, 100, directMin - 1, directMin, directMin + 1, 70000, 1 << 20, 4096, 32}
	rng := rand.New(rand.NewPCG(1, 2))
	var s []transport.Slice
	want := make([]byte, size)
	copy(want, local)
	off := 0
	for round := 0; round < 3; round++ {
		for _, n := range sizes {
			if off+n+7 > size {
				break
			}
			r := rng.IntN(size - n)
			s = append(s, localSlice(transport.Read, local[off:off+n], remote.addr+uint64(r), uint64(len(s)+1)))
			copy(want[off:off+n], tm[r:r+n])
			off += n + 7 // a gap that no READ may touch
		}
	}
	comp := make(chanCompleter, len(s))
	deadline := time.Now().Add(hang)
	for done := 0; done < len(s); {
		k, err := ep.Post(comp, s[done:])
		if err != nil {
			t.Fatalf("Post: %v", err)
		}
		done += k
		if time.Now().After(deadline) {
			t.Fatalf("hang: %d of %d slices posted", done, len(s))
		}
	}
	for tok, err := range comp.await(t, len(s)) {
		if err != nil {
			t.Errorf("READ %d: %v", tok, err)
		}
	}
	if !bytes.Equal(local, want) {
		for i := range local {
			if local[i] != want[i] {
				t.Fatalf("local byte %d is %#x, want %#x", i, local[i], want[i])
			}
		}
	}
}
