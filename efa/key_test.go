package efa

import (
	"math"
	"testing"
)

func TestKeyRoundTrip(t *testing.T) {
	for _, k := range []remoteKey{
		{0, 0x1000, 1},
		{math.MaxUint64, 0x7f00_0000_0000, 16 << 20},
		{42, 0, math.MaxUint64},
	} {
		got, err := parseKey(k.String())
		if err != nil || got != k {
			t.Errorf("parseKey(%q) = %+v, %v; want %+v", k.String(), got, err, k)
		}
	}
}

func TestKeyRefused(t *testing.T) {
	for _, s := range []string{
		"", "1", "1.2", "1.2.3.4", "1..3", ".1.2", "1.2.", "1.2.0",
		"01.2.3", "A.2.3", "0x1.2.3", "1.2.-3", "+1.2.3", "1.2.3 ",
		"1.ffffffffffffffff.2", // wraps around
		"10000000000000000.1.1",
		"not-a-key-1.2.3-x",
	} {
		if k, err := parseKey(s); err == nil {
			t.Errorf("parseKey(%q) = %+v; want an error", s, k)
		}
	}
}

func TestEndpointRoundTrip(t *testing.T) {
	addr := []byte{0, 1, 2, 0xfe, 0xff}
	s := formatEndpoint("tcp;ofi_rxm", addr)
	prov, got, err := parseEndpoint(s)
	if err != nil || prov != "tcp;ofi_rxm" || string(got) != string(addr) {
		t.Fatalf("parseEndpoint(%q) = %q, %x, %v", s, prov, got, err)
	}
	for _, s := range []string{
		"", "fi1/", "fi1/tcp", "fi1/tcp/", "fi1//00", "fi2/tcp/00", "fi1/tcp/0", "fi1/tcp/0G",
		"fi1/tcp/AB", "fi1/t p/00", "fi1/tcp/00/00", "fi1/" + string(make([]byte, 65)) + "/00",
	} {
		if p, a, err := parseEndpoint(s); err == nil {
			t.Errorf("parseEndpoint(%q) = %q, %x; want an error", s, p, a)
		}
	}
}

// FuzzParseKey: a key is refused or round-trips exactly.
func FuzzParseKey(f *testing.F) {
	f.Add("1.2.3")
	f.Add("ffffffffffffffff.7f0000000000.1000000")
	f.Add("01.2.3")
	f.Fuzz(func(t *testing.T, s string) {
		k, err := parseKey(s)
		if err != nil {
			return
		}
		if k.String() != s || k.length == 0 || k.base+k.length < k.base {
			t.Fatalf("parseKey(%q) = %+v, which formats as %q", s, k, k.String())
		}
	})
}

// FuzzParseEndpoint: an endpoint is refused or round-trips exactly.
func FuzzParseEndpoint(f *testing.F) {
	f.Add("fi1/tcp;ofi_rxm/0200d4a27f000001")
	f.Add("fi1/shm/66695f73686d3a2f2f3100")
	f.Fuzz(func(t *testing.T, s string) {
		prov, addr, err := parseEndpoint(s)
		if err != nil {
			return
		}
		if formatEndpoint(prov, addr) != s || len(addr) == 0 || len(addr) > maxAddrLen {
			t.Fatalf("parseEndpoint(%q) = %q, %x", s, prov, addr)
		}
	})
}
