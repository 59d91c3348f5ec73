package topology

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// NIC is a network interface backed by a device (a PCI function, a virtio
// device), with the NUMA node that device is attached to. It is a plain value.
type NIC struct {
	// Name is the interface name, e.g. "eth0".
	Name string
	// Node is the device's NUMA node, -1 when the kernel does not know (as
	// on single-node machines and most virtual devices).
	Node int
	// Speed is the link speed in Mb/s, -1 when unknown (link down, virtual
	// device).
	Speed int
}

// RDMADevice is an RDMA device (an ibverbs device such as "mlx5_0", "rxe0" or
// an EFA device) with the NUMA node it is attached to. It is a plain value.
type RDMADevice struct {
	// Name is the device name under /sys/class/infiniband.
	Name string
	// Node is the device's NUMA node, -1 when unknown.
	Node int
}

// DiscoverNICs lists the interfaces under sysRoot/class/net that have a
// device link, sorted by name. Interfaces without one (lo, bridges, veth,
// tunnels) are left out: they are not hardware a transport can be placed
// near. A missing class/net directory yields an empty list. It is safe for
// concurrent use.
func DiscoverNICs(sysRoot string) ([]NIC, error) {
	dir := filepath.Join(sysRoot, "class", "net")
	names, err := deviceNames(dir)
	if err != nil {
		return nil, err
	}
	nics := make([]NIC, 0, len(names))
	for _, name := range names {
		nics = append(nics, NIC{
			Name:  name,
			Node:  readInt(filepath.Join(dir, name, "device", "numa_node")),
			Speed: readInt(filepath.Join(dir, name, "speed")),
		})
	}
	return nics, nil
}

// DiscoverRDMA lists the devices under sysRoot/class/infiniband that have a
// device link, sorted by name. A missing directory (no RDMA stack loaded)
// yields an empty list. It is safe for concurrent use.
func DiscoverRDMA(sysRoot string) ([]RDMADevice, error) {
	dir := filepath.Join(sysRoot, "class", "infiniband")
	names, err := deviceNames(dir)
	if err != nil {
		return nil, err
	}
	devs := make([]RDMADevice, 0, len(names))
	for _, name := range names {
		devs = append(devs, RDMADevice{
			Name: name,
			Node: readInt(filepath.Join(dir, name, "device", "numa_node")),
		})
	}
	return devs, nil
}

// deviceNames returns the sorted entries of a sysfs class directory that have
// a "device" entry.
func deviceNames(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("topology: read %s: %w", dir, err)
	}
	var names []string
	for _, e := range ents {
		// Stat follows the class entry's symlink and the device link.
		if _, err := os.Stat(filepath.Join(dir, e.Name(), "device")); err == nil {
			names = append(names, e.Name())
		}
	}
	slices.Sort(names)
	return names, nil
}

// readInt reads a one-number sysfs attribute, -1 when it is missing,
// unreadable (reading the speed of a down link fails with EINVAL) or not a
// number. The kernel itself writes -1 for "unknown" in both attributes read
// here.
func readInt(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || n < -1 {
		return -1
	}
	return n
}
