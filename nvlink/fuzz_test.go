package nvlink

import (
	"strings"
	"testing"
)

// FuzzParseKey: a key from a descriptor is either refused or exactly what
// encode writes for the key parsed.
func FuzzParseKey(f *testing.F) {
	k := grantKey{slot: 3, gen: 7, base: 0x7f0000000000, size: 1 << 30, addr: 0x7f0000001000, length: 4096, bus: "0000:3b:00.0"}
	copy(k.handle.Reserved[:], "handle bytes")
	f.Add(k.encode())
	f.Add(strings.ToUpper(k.encode()))
	f.Add("")
	f.Add(strings.Repeat("0", 2*keyBytes))
	f.Fuzz(func(t *testing.T, s string) {
		k, err := parseKey(s)
		if err != nil {
			return
		}
		if got := k.encode(); got != s {
			t.Fatalf("parseKey accepted %q but encodes it as %q", s, got)
		}
		if k.gen == 0 || k.length == 0 || k.addr < k.base || k.addr+k.length > k.base+k.size || k.addr+k.length < k.addr {
			t.Fatalf("parseKey accepted an inconsistent key %+v", k)
		}
	})
}

// FuzzParseAddr: an endpoint address is either refused or round-trips.
func FuzzParseAddr(f *testing.F) {
	f.Add(peerAddr{boot: "6c1f0a4e-1111-2222-3333-444455556666", pid: 42, table: "/dev/shm/moonring-nvlink-42-00"}.String())
	f.Add("nvl1;;0;")
	f.Add("nvl1;a;-1;b")
	f.Fuzz(func(t *testing.T, s string) {
		a, err := parseAddr(s)
		if err != nil {
			return
		}
		if got := a.String(); got != s {
			t.Fatalf("parseAddr accepted %q but writes it as %q", s, got)
		}
	})
}

func TestKeyRoundTrip(t *testing.T) {
	k := grantKey{slot: 1, gen: 2, base: 4096, size: 8192, addr: 4096 + 100, length: 200, bus: "00000000:3b:00.0"}
	got, err := parseKey(k.encode())
	if err != nil {
		t.Fatal(err)
	}
	if got != k {
		t.Fatalf("round trip: %+v, want %+v", got, k)
	}
	bad := []grantKey{
		{slot: 1, gen: 0, base: 4096, size: 8192, addr: 4096, length: 1, bus: "x"},        // generation 0
		{slot: 1, gen: 1, base: 4096, size: 8192, addr: 4000, length: 1, bus: "x"},        // before the allocation
		{slot: 1, gen: 1, base: 4096, size: 8192, addr: 4096, length: 8193, bus: "x"},     // past its end
		{slot: 1, gen: 1, base: 4096, size: 8192, addr: 4096, length: 0, bus: "x"},        // empty
		{slot: maxSlots, gen: 1, base: 4096, size: 8192, addr: 4096, length: 1, bus: "x"}, // slot out of range
		{slot: 1, gen: 1, base: 4096, size: 8192, addr: 4096, length: 1, bus: ""},         // no bus id
		{slot: 1, gen: 1, base: 1<<64 - 4096, size: 8192, addr: 1<<64 - 4096, length: 1, bus: "x"},
	}
	for _, k := range bad {
		if _, err := parseKey(k.encode()); err == nil {
			t.Errorf("parseKey accepted %+v", k)
		}
	}
}
