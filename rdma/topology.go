// topology.go holds what the NUMA layout says about a buffer's devices:
// which devices are far from its memory, so that their rails get a smaller
// share of its slices (choose.go).

package rdma

import "github.com/moonring/moonring/segtable"

// farDevices returns the devices far from memory at loc, one bit per device
// index, given each device's NUMA node (-1: unknown): the devices on another
// node than the memory's, when at least one device is on the memory's node.
// Memory of no known node (or GPU memory), or on a node with no device,
// has no far device: every device is as good as another for it.
// devNodes has at most 64 devices.
func farDevices(devNodes []int, loc segtable.Location) uint64 {
	kind, node, err := loc.Parse()
	if err != nil || kind != "cpu" || node < 0 {
		return 0
	}
	var near, far uint64
	for i, n := range devNodes {
		if n == node {
			near |= 1 << i
		} else {
			far |= 1 << i
		}
	}
	if near == 0 {
		return 0
	}
	return far
}
