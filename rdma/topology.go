package rdma

import "github.com/moonring/moonring/segtable"

// preferDevices orders device indexes for memory at loc, given each
// device's NUMA node: the devices on the memory's node first, then the
// others as fallback, each group in index order. near is how many lead.
// Memory of no known node (or GPU memory) prefers no device: near is 0.
func preferDevices(devNodes []int, loc segtable.Location) (order []int, near int) {
	node := -1
	if kind, idx, err := loc.Parse(); err == nil && kind == "cpu" {
		node = idx
	}
	for i, n := range devNodes {
		if node >= 0 && n == node {
			order = append(order, i)
		}
	}
	near = len(order)
	for i, n := range devNodes {
		if node < 0 || n != node {
			order = append(order, i)
		}
	}
	return order, near
}

// railFor maps the engine's rail r onto the endpoint's rails (q per local
// device, device-major) so that memory with near preferred devices (the
// first near of order) uses only their queue pairs. With no preference
// (near 0, or every device near) the rail is r itself.
func railFor(r, rails, q int, order []int, near int) int {
	r %= rails
	if near == 0 || near == len(order) {
		return r
	}
	li := r / q
	for _, d := range order[:near] {
		if d == li {
			return r
		}
	}
	return order[li%near]*q + r%q
}
