// Package topology describes the machine the engine runs on: its NUMA nodes
// with their CPUs and memory, the features of its CPU, and which NUMA node each
// network and RDMA device hangs off.
//
// The engine uses it to give each NUMA node its own poller, to place rings and
// registered memory near the NIC that moves them, and to publish the devices of
// its host in its segment descriptor. Everything here is read from sysfs
// (/sys/devices/system/node, /sys/class/net, /sys/class/infiniband) and from
// CPUID; [DiscoverFrom] and [DiscoverNICs] take another root so that tests can
// describe a machine with a directory tree.
//
// A machine whose sysfs shows no NUMA nodes (a container with /sys masked, a
// kernel without CONFIG_NUMA) is described as one node 0 holding every CPU the
// process may run on.
//
// # Concurrency
//
// Discovery functions are safe for concurrent use. A [Topology] is a plain
// value: once returned it is only read by this package, so any number of
// goroutines may call its methods as long as none modifies it.
//
// [PinThread] and [CurrentCPU] act on the calling OS thread; a goroutine that
// means to stay pinned must call runtime.LockOSThread first.
//
// # Lifetimes
//
// Nothing here holds a resource: a [Topology] is a snapshot taken at discovery
// and is never refreshed. Hot-plugged CPUs or devices appear in the next
// discovery, not in an old snapshot; [Topology.NICs] and
// [Topology.RDMADevices] read sysfs again on every call.
//
// # Errors
//
// A missing sysfs directory is not an error: it means the machine has no such
// devices (or hides them) and yields a one-node topology or an empty list.
// Malformed sysfs content is an error that wraps [ErrBadSysfs]; a retry does
// not help.
package topology
