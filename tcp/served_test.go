package tcp

import (
	"net/netip"
	"testing"
)

// TestServed: the target counts what it served each peer, READs and
// WRITEs and their bytes and the requests it refused, over open
// connections and ended ones.
func TestServed(t *testing.T) {
	ct := newChecksTarget(t)
	a := ct.a
	sum := func() Served {
		var all Served
		n := 0
		ct.tr.Served(func(s Served) {
			n++
			all = s
		})
		if n > 1 {
			t.Fatalf("%d peers, want one (loopback)", n)
		}
		return all
	}
	rc := ct.raw(t)
	rc.do(specReq{op: specRead, id: 1, buffer: a.id, key: a.key, addr: a.addr, length: 100}, nil)
	rc.do(specReq{op: specRead, id: 2, buffer: a.id, key: a.key, addr: a.addr, length: 28}, nil)
	rc.do(specReq{op: specWrite, id: 3, buffer: a.id, key: a.key, addr: a.addr, length: 64}, make([]byte, 64))
	rc.do(specReq{op: specRead, id: 4, buffer: a.id, key: a.key ^ 1, addr: a.addr, length: 8}, nil)
	rc.do(specReq{op: specWrite, id: 5, buffer: a.id, key: a.key ^ 1, addr: a.addr, length: 8}, make([]byte, 8))
	want := Served{Peer: netip.MustParseAddr("127.0.0.1"), Reads: 2, ReadBytes: 128, Writes: 1, WriteBytes: 64, Denied: 2}
	if got := sum(); got != want {
		t.Fatalf("Served %+v, want %+v", got, want)
	}
	rc.c.Close()
	rc2 := ct.raw(t)
	rc2.do(specReq{op: specRead, id: 6, buffer: a.id, key: a.key, addr: a.addr, length: 10}, nil)
	want.Reads, want.ReadBytes = 3, 138
	waitFor(t, "the ended connection's counts kept", func() bool { return sum() == want })
}
