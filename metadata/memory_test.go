package metadata_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"sort"
	"testing"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/storetest"
	"github.com/moonring/moonring/segtable"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

func TestMemory(t *testing.T) {
	storetest.Run(t, func(t *testing.T) metadata.Store { return metadata.NewMemory() })
}

// The zero Memory is a usable store.
func TestMemoryZeroValue(t *testing.T) {
	storetest.Run(t, func(t *testing.T) metadata.Store { return new(metadata.Memory) })
}

// Republishing shares the key maps of unchanged buffers with the copy it
// replaces: whatever the sequence of Puts (buffers added, removed, keys
// changed), Get returns the last Put's descriptor, and a caller changing
// its maps after a Put changes nothing in the store.
func TestMemoryRepublish(t *testing.T) {
	ctx := context.Background()
	m := metadata.NewMemory()
	defer m.Close()
	rng := rand.New(rand.NewPCG(1, 2))
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "seg", Epoch: 1, Endpoints: map[string]string{"tcp": "127.0.0.1:1"}}
	for round := range 300 {
		switch k := rng.IntN(3); {
		case k == 0 || len(d.Buffers) == 0: // a new buffer somewhere
			addr := uint64(rng.IntN(1000)) << 12
			if d.Find(addr, 1) >= 0 {
				continue
			}
			i := sort.Search(len(d.Buffers), func(i int) bool { return d.Buffers[i].Addr > addr })
			d.Buffers = slices.Insert(d.Buffers, i, segtable.BufferDesc{Addr: addr, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": fmt.Sprint(round)}})
		case k == 1: // one removed
			i := rng.IntN(len(d.Buffers))
			d.Buffers = slices.Delete(d.Buffers, i, i+1)
		default: // one's key changed in place, as a careless caller would
			d.Buffers[rng.IntN(len(d.Buffers))].Keys["tcp"] = fmt.Sprint("changed", round)
		}
		if err := m.Put(ctx, d); err != nil {
			t.Fatal(err)
		}
		want := d.Clone()
		if len(d.Buffers) > 0 { // the caller's maps are its own after Put
			d.Buffers[rng.IntN(len(d.Buffers))].Keys["tcp"] = fmt.Sprint("after put", round)
		}
		got, err := m.Get(ctx, "seg")
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("round %d: Get returned\n%+v\nwant\n%+v", round, got, want)
		}
	}
}
