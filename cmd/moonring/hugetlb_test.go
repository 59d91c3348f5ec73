package main

import (
	"testing"

	"github.com/moonring/moonring/internal/hugetest"
)

// serve --hugetlb takes its buffer from the kernel's reserved huge pages:
// this process (serve runs in it here) maps the buffer's 4 MiB of them
// while it serves, and none once it stopped.
func TestServeHugeTLB(t *testing.T) {
	if why := hugetest.Need(2); why != "" {
		t.Skip("SKIPPED: " + why)
	}
	before, err := hugetest.Mapped(0)
	if err != nil {
		t.Fatal(err)
	}
	_, stop := startServe(t, 1, "--listen", "127.0.0.1:0", "--buffer-size", "4M", "--hugetlb", "--key-file", writeKey(t, "key A", 0o600))
	kb, _ := hugetest.Mapped(0)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if kb-before != 4<<10 {
		t.Fatalf("serve --hugetlb maps %d KiB of reserved huge pages, want its buffer's %d", kb-before, 4<<10)
	}
	if after, _ := hugetest.Mapped(0); after != before {
		t.Fatalf("%d KiB of reserved huge pages mapped after serve stopped, want %d", after, before)
	}
}
