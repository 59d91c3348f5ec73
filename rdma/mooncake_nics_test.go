package rdma

// Tests of Mooncake mode's choice of the peer's NIC (mooncake_nics.go)
// without a device: the pairing of local devices with the peer's NICs,
// and the devices each remote buffer avoids.

import (
	"reflect"
	"testing"

	"github.com/moonring/moonring/mooncake"
)

// TestMCPair: each NIC some location tries first gets a rail, device i
// keeping NIC i where it can; without a matrix, device i modulo the
// peer's count, as before.
func TestMCPair(t *testing.T) {
	m := func(v string, nics int) mooncake.NICMatrix {
		t.Helper()
		x, err := mooncake.ParseNICMatrix(v, nics)
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	for _, tc := range []struct {
		what          string
		nlocal, npeer int
		matrix        mooncake.NICMatrix
		want          []int
	}{
		{"no matrix", 3, 2, nil, []int{0, 1, 0}},
		{"every NIC preferred (what moonring publishes)", 3, 2, m("cpu:0=0,1/", 2), []int{0, 1, 0}},
		{"one NIC preferred", 2, 2, m("cpu:0=1/0", 2), []int{1, 1}},
		{"two locations, two NICs", 2, 2, m("cpu:0=0/1;cpu:1=1/0", 2), []int{0, 1}},
		{"swapped: device i keeps NIC i", 2, 2, m("cpu:0=1/0;cpu:1=0/1", 2), []int{0, 1}},
		{"the preferred NICs first, then in turn", 4, 4, m("cuda:0=3/;cpu:0=2/0", 4), []int{2, 3, 2, 3}},
		{"available only: tried first", 2, 3, m("cpu:0=/2", 3), []int{2, 2}},
		{"one local device", 1, 2, m("cpu:0=1/;cpu:1=0/", 2), []int{0}},
		{"one local device, NIC 0 not wanted", 1, 2, m("cpu:0=1/0", 2), []int{1}},
		{"a matrix of empty rows", 3, 2, m("cpu:0=/", 2), []int{0, 1, 0}},
	} {
		if got := mcPair(tc.nlocal, tc.npeer, tc.matrix); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: %v, want %v", tc.what, got, tc.want)
		}
	}
}

// TestNICPick: a buffer's slices go to the rails whose peer NIC its
// location prefers, else to those reaching a NIC it may use, else
// anywhere; a location without a row takes the wildcard (every NIC the
// matrix names); a buffer spread over NUMA nodes picks per part.
func TestNICPick(t *testing.T) {
	// Peer NICs 0..3; local devices 0..2 paired with NICs 0, 1, 3.
	m, err := mooncake.ParseNICMatrix("cpu:0=0/1;cpu:1=1/;cuda:0=2/3;cuda:1=2/;cuda:2=/;*=3/;cpu:7=3/", 4)
	if err != nil {
		t.Fatal(err)
	}
	np := newNICPicker(m, []int{0, 1, 3})
	const d0, d1, d2 = 1 << 0, 1 << 1, 1 << 2
	for loc, want := range map[string]uint64{
		"cpu:0":  d1 | d2, // NIC 0 preferred: device 0
		"cpu:1":  d0 | d2, // NIC 1: device 1
		"cuda:0": d0 | d1, // NIC 2 preferred, unreached: available NIC 3, device 2
		"cuda:1": 0,       // NIC 2 only, unreached: anywhere
		"cuda:2": 0,       // an empty row: the wildcard, every NIC named
		"cuda:9": 0,       // no row: the wildcard
		"*":      0,       // the wildcard, whatever its row says
		"":       d1 | d2, // moonring's default location, cpu:0
	} {
		if p := np.pick(loc, 1<<20); p.avoids != nil || p.avoid != want || p.at(12345) != want {
			t.Errorf("%q: %+v, want avoid %03b", loc, p, want)
		}
	}
	// The wildcard of a matrix naming NICs 0 and 1 only avoids the device
	// paired with NIC 3.
	small := newNICPicker(mooncake.NICMatrix{"cpu:0": {Preferred: []int{0}, Available: []int{1}}}, []int{0, 1, 3})
	if p := small.pick("cuda:0", 4096); p.avoid != d2 {
		t.Errorf("wildcard over NICs 0 and 1: %+v", p)
	}
	// Spread over NUMA nodes 1, 0, 7: three parts of 1000 bytes (the last
	// taking the tail).
	p := np.pick("segments:4096:1,0,7", 3001)
	for off, want := range map[uint64]uint64{0: d0 | d2, 999: d0 | d2, 1000: d1 | d2, 2000: d0 | d1, 3000: d0 | d1} {
		if got := p.at(off); got != want {
			t.Errorf("segments at %d: %03b, want %03b", off, got, want)
		}
	}
	// Parts that agree collapse to one mask; parts of 0 bytes take the
	// wildcard; a segments name that does not parse is a location without
	// a row.
	if p := np.pick("segments:4096:0,0", 8192); p.avoids != nil || p.avoid != d1|d2 {
		t.Errorf("segments of one node: %+v", p)
	}
	if p := np.pick("segments:4096:0,1,7", 2); p.avoids != nil || p.avoid != 0 {
		t.Errorf("segments of 0-byte parts: %+v", p)
	}
	if p := np.pick("segments:x:0", 8192); p.avoids != nil || p.avoid != 0 {
		t.Errorf("a bad segments name: %+v", p)
	}
	// No matrix: nothing avoided.
	if p := newNICPicker(nil, []int{0, 1}).pick("cpu:0", 4096); p.avoid != 0 || p.avoids != nil {
		t.Errorf("no matrix: %+v", p)
	}
}

// TestNICPickAllocs: finding a slice's mask allocates nothing.
func TestNICPickAllocs(t *testing.T) {
	m := mooncake.NICMatrix{"cpu:0": {Preferred: []int{0}, Available: []int{}}, "cpu:1": {Preferred: []int{1}, Available: []int{}}}
	p := newNICPicker(m, []int{0, 1}).pick("segments:4096:0,1", 1<<20)
	var sink uint64
	if a := testing.AllocsPerRun(1000, func() { sink += p.at(700 << 10) }); a != 0 {
		t.Fatalf("%.1f allocations; want 0", a)
	}
}
