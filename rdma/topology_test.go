package rdma

import (
	"slices"
	"testing"

	"github.com/moonring/moonring/segtable"
)

func TestPreferDevices(t *testing.T) {
	nodes := []int{1, 0, 1, -1} // four devices: NUMA 1, 0, 1, unknown
	cases := []struct {
		loc   string
		order []int
		near  int
	}{
		{"cpu:1", []int{0, 2, 1, 3}, 2},
		{"cpu:0", []int{1, 0, 2, 3}, 1},
		{"cpu:3", []int{0, 1, 2, 3}, 0},
		{"", []int{0, 1, 2, 3}, 0},
		{"cuda:0", []int{0, 1, 2, 3}, 0},
	}
	for _, c := range cases {
		order, near := preferDevices(nodes, segLoc(c.loc))
		if !slices.Equal(order, c.order) || near != c.near {
			t.Errorf("%q: order %v near %d; want %v %d", c.loc, order, near, c.order, c.near)
		}
	}
}

func TestRailFor(t *testing.T) {
	// Four devices, two queue pairs each: rails 0..7, device d has 2d, 2d+1.
	order, near := preferDevices([]int{1, 0, 1, -1}, segLoc("cpu:1")) // devices 0 and 2 near
	used := map[int]int{}
	for r := 0; r < 64; r++ {
		got := railFor(r, 8, 2, order, near)
		if d := got / 2; d != 0 && d != 2 {
			t.Fatalf("rail %d mapped to %d on device %d, not a NUMA-1 device", r, got, d)
		}
		used[got]++
	}
	if len(used) != 4 {
		t.Errorf("rails used %v; want all four of the near devices", used)
	}
	// No preference: identity modulo the rails.
	order, near = preferDevices([]int{0, 0}, segLoc(""))
	for r := 0; r < 9; r++ {
		if got := railFor(r, 4, 2, order, near); got != r%4 {
			t.Errorf("no preference: rail %d -> %d", r, got)
		}
	}
}

func segLoc(s string) segtable.Location { return segtable.Location(s) }
