package topology

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
)

// writeFiles creates files (path -> content) under root; a content of "/dir"
// makes a directory instead.
func writeFiles(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for p, c := range files {
		p = filepath.Join(root, p)
		if c == "/dir" {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestParseCPUList(t *testing.T) {
	good := []struct {
		in   string
		want []int
	}{
		{"", nil},
		{"\n", nil},
		{"0\n", []int{0}},
		{"0-3,8,10-11\n", []int{0, 1, 2, 3, 8, 10, 11}},
		{"5,1-2,2,1", []int{1, 2, 5}},
		{"7-7", []int{7}},
	}
	for _, c := range good {
		got, err := parseCPUList(c.in)
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("parseCPUList(%q) = %v, %v; want %v", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{"a", "1-", "-1", "3-1", "1,,2", "0-4000000000", "65536", "1-2-3", "0x1"} {
		if got, err := parseCPUList(in); !errors.Is(err, ErrBadSysfs) {
			t.Errorf("parseCPUList(%q) = %v, %v; want ErrBadSysfs", in, got, err)
		}
	}
}

func TestDiscoverFromTwoNodes(t *testing.T) {
	root := t.TempDir()
	n := "devices/system/node/"
	writeFiles(t, root, map[string]string{
		n + "node1/cpulist": "4-5,12,14-15\n",
		n + "node1/meminfo": "Node 1 MemTotal:       2048 kB\nNode 1 MemFree:        1024 kB\n",
		n + "node0/cpulist": "0-3,8\n",
		n + "node0/meminfo": "Node 0 MemTotal:       1024 kB\n",
		n + "node2/cpulist": "\n", // memory-only node
		n + "node2/meminfo": "Node 2 MemTotal:       4 kB\n",
		n + "online":        "0-2\n",
		n + "nodefoo/x":     "ignored",
		n + "power":         "/dir",
	})
	topo, err := DiscoverFrom(root)
	if err != nil {
		t.Fatal(err)
	}
	want := []Node{
		{ID: 0, CPUs: []int{0, 1, 2, 3, 8}, MemoryBytes: 1024 << 10},
		{ID: 1, CPUs: []int{4, 5, 12, 14, 15}, MemoryBytes: 2048 << 10},
		{ID: 2, CPUs: nil, MemoryBytes: 4 << 10},
	}
	if !slices.EqualFunc(topo.Nodes, want, func(a, b Node) bool {
		return a.ID == b.ID && slices.Equal(a.CPUs, b.CPUs) && a.MemoryBytes == b.MemoryBytes
	}) {
		t.Fatalf("nodes = %+v, want %+v", topo.Nodes, want)
	}
	for cpu, node := range map[int]int{0: 0, 8: 0, 4: 1, 15: 1, 6: -1, 13: -1, -1: -1} {
		if got := topo.NodeOfCPU(cpu); got != node {
			t.Errorf("NodeOfCPU(%d) = %d, want %d", cpu, got, node)
		}
	}
	n1, ok := topo.Node(1)
	if !ok || n1.ID != 1 {
		t.Fatalf("Node(1) = %+v, %v", n1, ok)
	}
	n1.CPUs[0] = 99 // the copy is the caller's
	if topo.Nodes[1].CPUs[0] != 4 {
		t.Errorf("Node returned the topology's own CPU slice")
	}
	if _, ok := topo.Node(3); ok {
		t.Errorf("Node(3) found a node that does not exist")
	}
}

func TestDiscoverFromMalformed(t *testing.T) {
	for name, files := range map[string]map[string]string{
		"cpulist": {"devices/system/node/node0/cpulist": "0-x\n"},
		"meminfo": {"devices/system/node/node0/meminfo": "Node 0 MemTotal: lots\n"},
	} {
		t.Run(name, func(t *testing.T) {
			root := t.TempDir()
			writeFiles(t, root, files)
			if topo, err := DiscoverFrom(root); !errors.Is(err, ErrBadSysfs) {
				t.Fatalf("DiscoverFrom = %+v, %v; want ErrBadSysfs", topo, err)
			}
		})
	}
}

func TestDiscoverFromMissingNodes(t *testing.T) {
	for name, files := range map[string]map[string]string{
		"no sysfs":   {},
		"empty node": {"devices/system/node/online": "0\n"},
	} {
		t.Run(name, func(t *testing.T) {
			root := t.TempDir()
			writeFiles(t, root, files)
			topo, err := DiscoverFrom(root)
			if err != nil {
				t.Fatal(err)
			}
			if len(topo.Nodes) != 1 || topo.Nodes[0].ID != 0 {
				t.Fatalf("nodes = %+v, want one node 0", topo.Nodes)
			}
			cpus := topo.Nodes[0].CPUs
			if len(cpus) == 0 {
				t.Fatalf("fallback node has CPUs %v", cpus)
			}
			if !slices.IsSorted(cpus) {
				t.Errorf("fallback CPUs not sorted: %v", cpus)
			}
			if runtime.GOOS == "linux" {
				// runtime.NumCPU is the size of the process's affinity mask.
				if len(cpus) != runtime.NumCPU() {
					t.Errorf("fallback node has %d CPUs, runtime.NumCPU = %d", len(cpus), runtime.NumCPU())
				}
				if topo.Nodes[0].MemoryBytes == 0 {
					t.Errorf("fallback node has no memory")
				}
			}
		})
	}
}

func TestDiscoverRealMachine(t *testing.T) {
	topo, err := Discover()
	if err != nil {
		t.Fatal(err)
	}
	if len(topo.Nodes) == 0 {
		t.Fatal("no nodes")
	}
	total := 0
	for _, n := range topo.Nodes {
		total += len(n.CPUs)
		for _, c := range n.CPUs {
			if got := topo.NodeOfCPU(c); got != n.ID {
				t.Errorf("NodeOfCPU(%d) = %d, want %d", c, got, n.ID)
			}
		}
	}
	if total < runtime.NumCPU() {
		t.Errorf("nodes hold %d CPUs, fewer than runtime.NumCPU = %d", total, runtime.NumCPU())
	}
	c := topo.CPU
	if c.CacheLine < 16 || c.CacheLine&(c.CacheLine-1) != 0 {
		t.Errorf("cache line %d is not a plausible power of two", c.CacheLine)
	}
	if !slices.IsSorted(c.Features) {
		t.Errorf("features not sorted")
	}
	if runtime.GOARCH == "amd64" {
		// Every amd64 CPU has SSE2, and the Go toolchain requires it.
		if !c.Has("SSE2") || c.Vendor == "" {
			t.Errorf("amd64 CPU without SSE2 or vendor: %+v", c)
		}
	}
	if c.Has("NO-SUCH-FEATURE") {
		t.Errorf("Has accepted an unknown feature")
	}
	t.Logf("nodes %+v; cpu %q %q, %d logical cores, %d features", topo.Nodes, c.Vendor, c.Brand, c.LogicalCores, len(c.Features))
	nics, err := topo.NICs()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("NICs %+v", nics)
	for _, n := range nics {
		if n.Name == "lo" {
			t.Errorf("loopback listed as a NIC")
		}
	}
}

func TestDiscoverNICs(t *testing.T) {
	root := t.TempDir()
	writeFiles(t, root, map[string]string{
		"class/net/lo/speed":                       "",
		"class/net/veth0/speed":                    "10000\n",
		"class/net/eth1/device/numa_node":          "1\n",
		"class/net/eth1/speed":                     "100000\n",
		"class/net/eth0/device/numa_node":          "-1\n",
		"class/net/eth0/speed":                     "-1\n",
		"class/net/ens5/device/vendor":             "0x1d0f\n", // no numa_node, no speed
		"class/net/bad/device/numa_node":           "x\n",
		"class/infiniband/mlx5_1/device/numa_node": "1\n",
		"class/infiniband/rxe0/ports/1/state":      "4: ACTIVE\n", // no device link
		"class/infiniband/mlx5_0/device/numa_node": "0\n",
	})
	topo := &Topology{sysRoot: root}
	nics, err := topo.NICs()
	if err != nil {
		t.Fatal(err)
	}
	want := []NIC{
		{Name: "bad", Node: -1, Speed: -1},
		{Name: "ens5", Node: -1, Speed: -1},
		{Name: "eth0", Node: -1, Speed: -1},
		{Name: "eth1", Node: 1, Speed: 100000},
	}
	if !slices.Equal(nics, want) {
		t.Errorf("NICs = %+v, want %+v", nics, want)
	}
	devs, err := topo.RDMADevices()
	if err != nil {
		t.Fatal(err)
	}
	wantDevs := []RDMADevice{{Name: "mlx5_0", Node: 0}, {Name: "mlx5_1", Node: 1}}
	if !slices.Equal(devs, wantDevs) {
		t.Errorf("RDMADevices = %+v, want %+v", devs, wantDevs)
	}
}

func TestDiscoverNICsMissingDirs(t *testing.T) {
	root := t.TempDir()
	nics, err := DiscoverNICs(root)
	if err != nil || len(nics) != 0 {
		t.Errorf("DiscoverNICs(empty) = %v, %v; want nothing", nics, err)
	}
	devs, err := DiscoverRDMA(root)
	if err != nil || len(devs) != 0 {
		t.Errorf("DiscoverRDMA(empty) = %v, %v; want nothing", devs, err)
	}
}
