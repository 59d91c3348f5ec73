//go:build rdma && cgo

package rdma

import (
	"fmt"
	"testing"
)

// The chain a Post builds, read back from C memory field by field. It needs
// libibverbs' headers, not a device.
func TestBuildChain(t *testing.T) {
	const depth = 8
	st := newStage(depth)
	defer st.free()
	type req struct {
		wrID, laddr, raddr uint64
		n, lkey, rkey      uint32
		op                 uint8
	}
	reqs := []req{
		{1<<32 | 0, 0x7f0000001000, 0x10000, 4096, 0x11, 0x22, 1},
		{1<<32 | 1, 0x7f0000002000, 0x20000, 1 << 20, 0x33, 0x44, 2},
		{7<<32 | 0xffffffff, 0x7f0000003001, 0xffffffffffff0000, 1, 0xdeadbeef, 0xcafef00d, 2},
		{2, 0x7f0000004000, 0x30000, 0, 0x55, 0x66, 1},
	}
	for n := 1; n <= len(reqs); n++ {
		for i, r := range reqs[:n] {
			st.setReq(i, r.wrID, r.laddr, r.raddr, r.n, r.lkey, r.rkey, r.op)
		}
		got := st.buildForTest(n)
		for i, r := range reqs[:n] {
			w := got[i]
			where := fmt.Sprintf("chain of %d, work request %d", n, i)
			wantOp := map[uint8]string{1: "RDMA_READ", 2: "RDMA_WRITE"}[r.op]
			if w.WRID != r.wrID || w.Opcode != wantOp || !w.Signaled {
				t.Errorf("%s: wr_id %#x opcode %s signaled %v; want %#x %s true", where, w.WRID, w.Opcode, w.Signaled, r.wrID, wantOp)
			}
			wantSGE := 1
			if r.n == 0 {
				wantSGE = 0
			}
			if w.NumSGE != wantSGE || w.SGEAddr != r.laddr || w.SGELength != r.n || w.SGELKey != r.lkey {
				t.Errorf("%s: sge n=%d addr %#x len %d lkey %#x; want n=%d %#x %d %#x (and its own entry)", where, w.NumSGE, w.SGEAddr, w.SGELength, w.SGELKey, wantSGE, r.laddr, r.n, r.lkey)
			}
			if w.RemoteAddr != r.raddr || w.RKey != r.rkey {
				t.Errorf("%s: remote %#x rkey %#x; want %#x %#x", where, w.RemoteAddr, w.RKey, r.raddr, r.rkey)
			}
			last := i == n-1
			if last != w.NextIsNil || !last != w.NextIsNext {
				t.Errorf("%s: next nil %v, next is the following %v; want %v, %v", where, w.NextIsNil, w.NextIsNext, last, !last)
			}
		}
	}
}
