package topology

import (
	"errors"
	"fmt"
	mbits "math/bits"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"

	"github.com/klauspost/cpuid/v2"
)

// DefaultSysRoot is where the kernel mounts sysfs; [Discover] reads it.
const DefaultSysRoot = "/sys"

// maxCPUs bounds the CPU numbers accepted from a cpulist, so that a corrupt
// range such as "0-4000000000" is refused instead of allocating gigabytes.
// Linux supports at most 8192 CPUs (CONFIG_NR_CPUS).
const maxCPUs = 1 << 16

// ErrBadSysfs reports sysfs content that this package cannot parse: a cpulist
// or meminfo file in an unexpected format. A retry does not help.
var ErrBadSysfs = errors.New("topology: malformed sysfs content")

// Node is one NUMA node: its ID, the CPUs attached to it and the memory it
// holds. A Node is a plain value; it is not safe for concurrent mutation.
type Node struct {
	// ID is the kernel's node number (the N of /sys/devices/system/node/nodeN).
	ID int
	// CPUs are the node's CPU numbers in increasing order. They may include
	// CPUs this process is not allowed to run on, and are empty for a
	// memory-only node.
	CPUs []int
	// MemoryBytes is the node's MemTotal; 0 when the kernel does not say.
	MemoryBytes uint64
}

// CPUInfo describes the processor as CPUID reports it. It is a plain value.
type CPUInfo struct {
	// Brand is the marketing name, e.g. "AMD EPYC 7R13 Processor".
	Brand string
	// Vendor is the raw vendor string, e.g. "GenuineIntel", "AuthenticAMD".
	Vendor string
	// LogicalCores is the number of hardware threads of one package (socket)
	// as CPUID reports it, 0 if undetectable. The number of CPUs of the whole
	// machine is the sum of len(Node.CPUs).
	LogicalCores int
	// Features lists the supported features by their cpuid names, sorted:
	// "AVX2", "AVX512F", "ERMS", "FSRM", ...
	Features []string
	// CacheLine is the cache line size in bytes; 64 when undetectable.
	CacheLine int
}

// Has reports whether the CPU has the named feature (as spelled in
// Features, e.g. "AVX2"). It is safe for concurrent use.
func (c CPUInfo) Has(feature string) bool {
	_, ok := slices.BinarySearch(c.Features, feature)
	return ok
}

// Topology is a snapshot of the machine's NUMA layout and CPU. It is built by
// [Discover] or [DiscoverFrom]; a hand-built Topology works too. Methods only
// read it, so it is safe for concurrent use while nobody modifies it; nothing
// ends its life, and it is never refreshed.
type Topology struct {
	// Nodes are sorted by ID; there is always at least one after discovery.
	Nodes []Node
	// CPU describes the processor this process runs on.
	CPU CPUInfo

	sysRoot string // where NICs and RDMADevices look; "" means DefaultSysRoot
}

// Discover describes this machine from /sys and CPUID. It is safe for
// concurrent use; each call reads sysfs again.
func Discover() (*Topology, error) { return DiscoverFrom(DefaultSysRoot) }

// DiscoverFrom is [Discover] reading a sysfs tree rooted at sysRoot instead of
// /sys: NUMA nodes from sysRoot/devices/system/node/nodeN/{cpulist,meminfo}.
// When that directory has no node entries the result is one node 0 holding the
// CPUs this process may run on, with the machine's total memory. The CPU
// description always comes from the real processor. It is safe for concurrent
// use.
func DiscoverFrom(sysRoot string) (*Topology, error) {
	nodes, err := readNodes(filepath.Join(sysRoot, "devices", "system", "node"))
	if err != nil {
		return nil, err
	}
	if len(nodes) == 0 {
		nodes = []Node{{ID: 0, CPUs: allowedCPUs(), MemoryBytes: totalMemory()}}
	}
	return &Topology{Nodes: nodes, CPU: cpuInfo(), sysRoot: sysRoot}, nil
}

// NodeOfCPU returns the ID of the node that holds cpu, or -1 when no node
// lists it.
func (t *Topology) NodeOfCPU(cpu int) int {
	for _, n := range t.Nodes {
		if _, ok := slices.BinarySearch(n.CPUs, cpu); ok {
			return n.ID
		}
	}
	return -1
}

// Node returns the node with the given ID and whether there is one. The
// returned Node has its own copy of the CPU list.
func (t *Topology) Node(id int) (Node, bool) {
	for _, n := range t.Nodes {
		if n.ID == id {
			n.CPUs = slices.Clone(n.CPUs)
			return n, true
		}
	}
	return Node{}, false
}

// NICs lists the network interfaces backed by a device, read afresh from the
// sysfs tree the topology was discovered from; see [DiscoverNICs].
func (t *Topology) NICs() ([]NIC, error) { return DiscoverNICs(t.root()) }

// RDMADevices lists the RDMA devices, read afresh from the sysfs tree the
// topology was discovered from; see [DiscoverRDMA].
func (t *Topology) RDMADevices() ([]RDMADevice, error) { return DiscoverRDMA(t.root()) }

func (t *Topology) root() string {
	if t.sysRoot == "" {
		return DefaultSysRoot
	}
	return t.sysRoot
}

// readNodes reads every nodeN directory under dir. A missing dir yields no
// nodes and no error.
func readNodes(dir string) ([]Node, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("topology: read %s: %w", dir, err)
	}
	var nodes []Node
	for _, e := range ents {
		id, ok := nodeID(e.Name())
		if !ok {
			continue
		}
		n := Node{ID: id}
		p := filepath.Join(dir, e.Name(), "cpulist")
		if b, err := os.ReadFile(p); err == nil {
			if n.CPUs, err = parseCPUList(string(b)); err != nil {
				return nil, fmt.Errorf("topology: %s: %w", p, err)
			}
		} else if !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("topology: %w", err)
		}
		p = filepath.Join(dir, e.Name(), "meminfo")
		if b, err := os.ReadFile(p); err == nil {
			if n.MemoryBytes, err = parseMemTotal(string(b)); err != nil {
				return nil, fmt.Errorf("topology: %s: %w", p, err)
			}
		} else if !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("topology: %w", err)
		}
		nodes = append(nodes, n)
	}
	slices.SortFunc(nodes, func(a, b Node) int { return a.ID - b.ID })
	return nodes, nil
}

// nodeID parses "node12" as 12; anything else (such as "node_online") is not
// a node directory.
func nodeID(name string) (int, bool) {
	s, ok := strings.CutPrefix(name, "node")
	if !ok || s == "" || strings.TrimLeft(s, "0123456789") != "" {
		return 0, false
	}
	id, err := strconv.Atoi(s)
	return id, err == nil
}

// parseCPUList parses a kernel CPU list such as "0-3,8,10-11\n" into sorted,
// distinct CPU numbers. Blank input is an empty list. Malformed input, a
// reversed range or a CPU number of 65536 or more is an error wrapping
// [ErrBadSysfs].
func parseCPUList(s string) ([]int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	// A set of maxCPUs bits: ranges that repeat or overlap cost nothing
	// (a list of them, 4 KiB of "0-65535," over and over, expanded to
	// hundreds of MB).
	var set [maxCPUs / 64]uint64
	for part := range strings.SplitSeq(s, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := parseCPU(lo)
		if err != nil {
			return nil, fmt.Errorf("%w: cpulist %q", ErrBadSysfs, s)
		}
		b := a
		if isRange {
			if b, err = parseCPU(hi); err != nil || b < a {
				return nil, fmt.Errorf("%w: cpulist %q", ErrBadSysfs, s)
			}
		}
		for c := a; c <= b; c++ {
			set[c/64] |= 1 << (c % 64)
		}
	}
	var cpus []int
	for w, bits := range set {
		for ; bits != 0; bits &= bits - 1 {
			cpus = append(cpus, w*64+mbits.TrailingZeros64(bits))
		}
	}
	return cpus, nil
}

func parseCPU(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || n >= maxCPUs {
		return 0, ErrBadSysfs
	}
	return n, nil
}

// parseMemTotal finds "Node 0 MemTotal:  16384 kB" in a node's meminfo.
func parseMemTotal(s string) (uint64, error) {
	for line := range strings.Lines(s) {
		_, rest, ok := strings.Cut(line, "MemTotal:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			break
		}
		kb, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil || kb > ^uint64(0)/1024 {
			break
		}
		return kb * 1024, nil
	}
	return 0, fmt.Errorf("%w: no MemTotal in meminfo", ErrBadSysfs)
}

func cpuInfo() CPUInfo {
	c := cpuid.CPU
	ci := CPUInfo{
		Brand:        strings.TrimSpace(c.BrandName),
		Vendor:       c.VendorString,
		LogicalCores: c.LogicalCores,
		Features:     c.FeatureSet(),
		CacheLine:    c.CacheLine,
	}
	if ci.Vendor == "" {
		ci.Vendor = c.VendorID.String()
	}
	if ci.CacheLine <= 0 {
		ci.CacheLine = 64
	}
	slices.Sort(ci.Features)
	return ci
}

// allCPUs is the fallback when the process's affinity cannot be read.
func allCPUs() []int {
	cpus := make([]int, runtime.NumCPU())
	for i := range cpus {
		cpus[i] = i
	}
	return cpus
}
