package rdma

import (
	"testing"

	"github.com/moonring/moonring/segtable"
)

// TestFarDevices: the devices on another node than the memory's are far,
// when one is on its node; memory of no node, GPU memory, memory on a node
// with no device, and every device on the memory's node: none is far.
func TestFarDevices(t *testing.T) {
	nodes := []int{1, 0, 1, -1} // four devices: NUMA 1, 0, 1, unknown
	cases := []struct {
		loc string
		far uint64
	}{
		{"cpu:1", 0b1010},
		{"cpu:0", 0b1101},
		{"cpu:3", 0},
		{"cpu", 0},
		{"", 0},
		{"cuda:0", 0},
		{"bogus", 0},
	}
	for _, c := range cases {
		if got := farDevices(nodes, segtable.Location(c.loc)); got != c.far {
			t.Errorf("%q: far %04b; want %04b", c.loc, got, c.far)
		}
	}
	if got := farDevices([]int{0, 0}, "cpu:0"); got != 0 {
		t.Errorf("every device on the memory's node: far %b, want none", got)
	}
	if got := farDevices([]int{-1, -1}, ""); got != 0 {
		t.Errorf("devices and memory of unknown nodes: far %b, want none", got)
	}
}
