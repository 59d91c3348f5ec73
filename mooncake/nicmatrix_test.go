package mooncake

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/moonring/moonring/segtable"
)

// TestNICMatrixConvert: a Mooncake priority matrix becomes the matrix by
// NIC index: names looked up in devices (not by their order in the
// matrix), unknown names and repeats dropped, a NIC in both lists kept as
// preferred, empty rows dropped; and back through FromSegtable to the same
// matrix of names.
func TestNICMatrixConvert(t *testing.T) {
	d := &SegmentDesc{Name: "10.0.0.1:1", Protocol: ProtoRDMA,
		Devices: []Device{{Name: "m0", GID: "g"}, {Name: "m1", GID: "g"}, {Name: "m2", GID: "g"}},
		PriorityMatrix: map[string]TopologyEntry{
			"cpu:0":             {Preferred: []string{"m2", "m0", "m2"}, Available: []string{"m0", "m1", "nope"}},
			"cpu:1":             {Preferred: []string{"nope"}, Available: []string{"m1"}},
			"cuda:0":            {Preferred: []string{"gone"}, Available: []string{}},
			"segments:4096:0,1": {Preferred: []string{"m1"}, Available: nil},
		},
		Buffers: []Buffer{{Name: "cpu:0", Addr: 4096, Length: 4096, RKey: []uint64{1, 2, 3}, LKey: []uint64{1, 2, 3}}},
	}
	m, err := nicMatrix(d)
	if err != nil {
		t.Fatal(err)
	}
	want := NICMatrix{"cpu:0": {[]int{2, 0}, []int{1}}, "cpu:1": {[]int{}, []int{1}}, "segments:4096:0,1": {[]int{1}, []int{}}}
	if !reflect.DeepEqual(m, want) {
		t.Fatalf("matrix %v, want %v", m, want)
	}
	const text = "cpu:0=2,0/1;cpu:1=/1;segments:4096:0,1=1/"
	if m.String() != text {
		t.Errorf("text %q, want %q", m.String(), text)
	}
	s, err := ToSegtable(d, nil)
	if err != nil || s.Endpoints[EndpointRDMAMatrix] != text {
		t.Fatalf("ToSegtable: %v, %v", s, err)
	}
	back, _, err := FromSegtable(s)
	if err != nil {
		t.Fatal(err)
	}
	wantBack := map[string]TopologyEntry{
		"cpu:0": {[]string{"m2", "m0"}, []string{"m1"}}, "cpu:1": {[]string{}, []string{"m1"}},
		"segments:4096:0,1": {[]string{"m1"}, []string{}},
	}
	if !reflect.DeepEqual(back.PriorityMatrix, wantBack) {
		t.Errorf("published matrix %v, want %v", back.PriorityMatrix, wantBack)
	}
	// Read back, it is the same key: the round trip is stable.
	back.Moonring = nil
	if s2, err := ToSegtable(back, nil); err != nil || s2.Endpoints[EndpointRDMAMatrix] != text {
		t.Errorf("round trip: %v, %v", s2, err)
	}

	// A matrix naming no device, or none at all: no key, and what we
	// publish prefers every NIC for every location (as before).
	for _, pm := range []map[string]TopologyEntry{nil, {"cpu:0": {[]string{"x"}, []string{}}}} {
		d.PriorityMatrix = pm
		s, err := ToSegtable(d, nil)
		if err != nil {
			t.Fatal(err)
		}
		if v, ok := s.Endpoints[EndpointRDMAMatrix]; ok {
			t.Errorf("matrix %v: key %q", pm, v)
		}
		md, _, err := FromSegtable(s)
		if err != nil || !reflect.DeepEqual(md.PriorityMatrix, map[string]TopologyEntry{"cpu:0": {[]string{"m0", "m1", "m2"}, []string{}}}) {
			t.Errorf("matrix %v: published %v, %v", pm, md.PriorityMatrix, err)
		}
	}

	// A key naming no NIC publishes the default too (Mooncake would reach
	// nothing through it).
	s.Endpoints[EndpointRDMAMatrix] = "cpu:0=/"
	if md, _, err := FromSegtable(s); err != nil || !reflect.DeepEqual(md.PriorityMatrix, map[string]TopologyEntry{"cpu:0": {[]string{"m0", "m1", "m2"}, []string{}}}) {
		t.Errorf("a matrix naming no NIC: published %v, %v", md.PriorityMatrix, err)
	}

	// Locations the key cannot carry are refused.
	for _, loc := range []string{"a;b", "a=b", strings.Repeat("x", MaxMatrixLocation+1)} {
		d.PriorityMatrix = map[string]TopologyEntry{loc: {[]string{"m0"}, []string{}}}
		if _, err := ToSegtable(d, nil); !errors.Is(err, ErrBadDoc) {
			t.Errorf("location %.20q: %v", loc, err)
		}
	}
}

// TestParseNICMatrix: the text form is read strictly and bounded.
func TestParseNICMatrix(t *testing.T) {
	m, err := ParseNICMatrix("cuda:0=1/;cpu:0=0/1,2;*=/", 3)
	if err != nil {
		t.Fatal(err)
	}
	want := NICMatrix{"cpu:0": {[]int{0}, []int{1, 2}}, "cuda:0": {[]int{1}, []int{}}, "*": {[]int{}, []int{}}}
	if !reflect.DeepEqual(m, want) {
		t.Fatalf("%v, want %v", m, want)
	}
	if got, err := ParseNICMatrix(m.String(), 3); err != nil || !reflect.DeepEqual(got, m) {
		t.Errorf("round trip of %q: %v, %v", m.String(), got, err)
	}
	if m, err := ParseNICMatrix("", 3); err != nil || m != nil {
		t.Errorf("empty: %v, %v", m, err)
	}
	many := strings.Repeat("c=0/;", MaxMatrix) + "c=0/"
	for _, v := range []string{
		"cpu:0", "cpu:0=0", "cpu:0=0/1/2", "=0/", "cpu:0=3/", "cpu:0=0,0/", "cpu:0=0/0", "cpu:0=-1/",
		"cpu:0=0/;cpu:0=1/", "cpu:0=0/;", "cpu:0=0,/", "cpu:0= 0/", "a=b=0/", many,
		"x=0/" + strings.Repeat(",", MaxMatrixBytes),
		strings.Repeat("x", MaxMatrixLocation+1) + "=0/",
	} {
		if _, err := ParseNICMatrix(v, 3); !errors.Is(err, segtable.ErrBadDesc) {
			t.Errorf("%.40q: %v", v, err)
		}
	}
}

// TestNICMatrixRow: Mooncake's pick of a row for a location: its own when
// it names a NIC, else the wildcard (every NIC named, preferred), also for
// "*" itself; FirstTries is each location's first-try list, merged.
func TestNICMatrixRow(t *testing.T) {
	m := NICMatrix{"cpu:0": {[]int{3}, []int{1}}, "cpu:1": {[]int{}, []int{2}}, "cuda:0": {[]int{}, []int{}}, "*": {[]int{0}, []int{}}}
	for loc, want := range map[string]NICRow{
		"cpu:0":  {[]int{3}, []int{1}},
		"cpu:1":  {[]int{}, []int{2}},
		"cuda:0": {[]int{0, 1, 2, 3}, nil},
		"cuda:9": {[]int{0, 1, 2, 3}, nil},
		"*":      {[]int{0, 1, 2, 3}, nil},
	} {
		if got := m.Row(loc); !reflect.DeepEqual(got, want) {
			t.Errorf("Row(%q) = %v, want %v", loc, got, want)
		}
	}
	if got := m.FirstTries(); !reflect.DeepEqual(got, []int{0, 2, 3}) {
		t.Errorf("FirstTries = %v", got)
	}
	if r := NICMatrix(nil).Row("cpu:0"); len(r.Preferred)+len(r.Available) != 0 {
		t.Errorf("empty matrix: %v", r)
	}
}

func TestSegmentsLocations(t *testing.T) {
	for loc, want := range map[string][]string{
		"segments:4096:1,3":   {"cpu:1", "cpu:3"},
		"segments:4096:0,,2,": {"cpu:0", "cpu:2"},
		"segments:4096:":      nil,
		"segments:x:1":        nil,
		"segments:4096:1,a":   nil,
		"segments:4096":       nil,
		"cpu:0":               nil,
	} {
		if got := SegmentsLocations(loc); !reflect.DeepEqual(got, want) {
			t.Errorf("%q: %v, want %v", loc, got, want)
		}
	}
}
