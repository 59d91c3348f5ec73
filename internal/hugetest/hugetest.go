// Package hugetest reads what tests of reserved huge pages (hugetlbfs)
// check: how many the kernel has free, and how much of them a process
// maps. make test reserves some (scripts/ensure-hugepages.sh).
package hugetest

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// field returns the number after name in a /proc file of "name: value"
// lines (a trailing " kB" dropped).
func field(path, name string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			return strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
		}
	}
	return 0, fmt.Errorf("hugetest: no %s in %s", name, path)
}

// Free is the count of the kernel's free reserved huge pages.
func Free() (int, error) { return field("/proc/meminfo", "HugePages_Free") }

// Total is the count of the kernel's reserved huge pages, free or not.
func Total() (int, error) { return field("/proc/meminfo", "HugePages_Total") }

// Mapped is how many KiB of reserved huge pages process pid maps (its
// status's HugetlbPages); pid 0 is this process.
func Mapped(pid int) (int, error) {
	path := "/proc/self/status"
	if pid != 0 {
		path = fmt.Sprintf("/proc/%d/status", pid)
	}
	return field(path, "HugetlbPages")
}

// Need returns "" when at least n reserved huge pages are free, else why a
// test of them cannot run here.
func Need(n int) string {
	free, err := Free()
	switch {
	case err != nil:
		return fmt.Sprintf("reserved huge pages cannot be tested: %v", err)
	case free < n:
		return fmt.Sprintf("reserved huge pages cannot be tested: %d free, %d needed (make test reserves them as root: scripts/ensure-hugepages.sh; vm.nr_hugepages)", free, n)
	}
	return ""
}
