//go:build rdma && cgo

package rdma

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/moonring/moonring/mooncake"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// TestMooncakeMatrixNICs: two devices on each side, in Mooncake mode; the
// target's priority matrix prefers rxe1 for cpu:0 and rxe0 for cpu:1.
// WRITEs to the cpu:0 buffer all go over the rails to the target's rxe1,
// READs of the cpu:1 buffer over those to its rxe0 (work requests counted
// per rail, and rxe1's own count of packets received), and the bytes land.
// The target republishes a matrix preferring rxe0 alone: the rails to
// rxe1 drop their queue pairs and move to rxe0 (local rxe1's too, a new
// handshake), and all traffic goes there.
func TestMooncakeMatrixNICs(t *testing.T) {
	addRXE1(t)
	rpc, err := mooncake.ListenRPC(mooncake.RPCConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rpc.Close() })
	// Both sides list the devices in one order, so that device i of the
	// initiator is rxe i of the target (mcPair pairs by index; the
	// kernel's order of the two varies) and rxe1's packet count is the
	// target rxe1's until the Update.
	devs := []string{"rxe0", "rxe1"}
	targ := needDevice(t, Config{Devices: devs, Mooncake: &MooncakeMode{Server: rpc.Name(), RPC: rpc.Name()}})
	rpc.SetHandshake(targ.MooncakeHandshake)
	init := needDevice(t, Config{Devices: devs, QPsPerDevice: 2, Mooncake: &MooncakeMode{Server: "initiator:1", RPC: "127.0.0.1:1"}})
	if len(init.devs) != 2 || len(targ.devs) != 2 {
		t.Fatalf("%d and %d devices, want rxe0 and rxe1 on both sides", len(init.devs), len(targ.devs))
	}
	const size = 64 << 12
	w := newWorldWith(t, init, targ, size, true)
	other := make([]byte, size)
	ob, err := w.tbufs.Register(other, "cpu:1", true)
	if err != nil {
		t.Fatal(err)
	}
	oreg, err := targ.Register(ob)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.tbufs.Unregister(context.Background(), ob.ID) })

	nics := targ.ExtraEndpoints()[mooncake.EndpointRDMANICs]
	idx := map[string]int{}
	for i, n := range strings.Split(nics, ",") {
		name, _, _ := strings.Cut(n, "/")
		idx[name] = i
	}
	i0, i1 := strconv.Itoa(idx["rxe0"]), strconv.Itoa(idx["rxe1"])
	desc := func(matrix string) *segtable.SegmentDesc {
		return &segtable.SegmentDesc{Version: segtable.DescVersion, Name: rpc.Name(),
			Endpoints: map[string]string{MooncakeName: rpc.Name(), mooncake.EndpointRDMANICs: nics, mooncake.EndpointRDMAMatrix: matrix},
			Buffers: []segtable.BufferDesc{
				{Addr: uint64(w.r.Addr), Length: w.r.Length, Location: "cpu:0", Keys: map[string]string{MooncakeName: w.rreg.Key}},
				{Addr: uint64(ob.Addr), Length: ob.Length, Location: "cpu:1", Keys: map[string]string{MooncakeName: oreg.Key}},
			}}
	}
	ep0, err := init.Open(context.Background(), desc("cpu:0="+i1+"/"+i0+";cpu:1="+i0+"/"+i1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep0.Close() })
	ep := ep0.(*Endpoint)
	ep.postMu.Lock()
	for i, r := range ep.rails {
		t.Logf("rail %d: local %s to the target's %s", i, init.devs[r.li].name, ep.mc.devs[r.ri])
	}
	ep.postMu.Unlock()

	// work returns, per target NIC, the work requests posted since the
	// last call on the rails to it.
	seen := map[*qp]uint64{}
	work := func() map[string]uint64 {
		ep.postMu.Lock()
		defer ep.postMu.Unlock()
		out := map[string]uint64{}
		for _, r := range ep.rails {
			if r.q == nil {
				continue
			}
			h := r.q.head.Load()
			out[ep.mc.devs[r.ri]] += h - seen[r.q]
			seen[r.q] = h
		}
		return out
	}
	work()
	c := newWaiter()
	run := func(what string, op transport.Op, remote []byte, base uint64, tok uint64) {
		t.Helper()
		var s []transport.Slice
		for i := uint64(0); i < 64; i++ {
			s = append(s, transport.Slice{Op: op, LocalHandle: w.lreg.Handle, Local: unsafe.Pointer(&w.lmem[i<<12]),
				Remote: base + i<<12, Length: 1 << 12, Token: tok + i, Rail: uint16(i)})
		}
		postAll(t, ep, c, s)
		for i := range s {
			if err := c.wait(t, s[i].Token); err != nil {
				t.Fatalf("%s, slice %d: %v", what, i, err)
			}
		}
		if string(remote) != string(w.lmem) {
			t.Fatalf("%s: data differs", what)
		}
	}
	// rxe1's own count of packets received, logged: both engines share
	// the guest's two devices, and how the kernel carries a packet between
	// two addresses of its own (rxe's loopback, the veth pair, lo) decides
	// which device counts it; one clean-clone run counted the READs from
	// rxe0 on rxe1 and the WRITEs to rxe1 nowhere, with every rail's queue
	// pair where the matrix put it and the data right. The rails' own
	// counts (work, by target NIC) are what is asserted.
	rxe1 := func() int {
		v, err := os.ReadFile("/sys/class/infiniband/rxe1/ports/1/hw_counters/rcvd_pkts")
		if err != nil {
			return -1
		}
		n, _ := strconv.Atoi(strings.TrimSpace(string(v)))
		return n
	}
	before := rxe1()

	for i := range w.lmem {
		w.lmem[i] = byte(i*7 + 1)
	}
	run("WRITE to cpu:0", transport.Write, w.rmem, uint64(w.r.Addr), 1)
	if got := work(); got["rxe1"] < 64 || got["rxe0"] != 0 {
		t.Fatalf("WRITEs to cpu:0 (rxe1 preferred) by target NIC: %v", got)
	}
	t.Logf("rxe1 received %d packets before the WRITEs, %d after", before, rxe1())
	before = rxe1()

	copy(other, w.lmem)
	clear(w.lmem)
	run("READ of cpu:1", transport.Read, other, uint64(ob.Addr), 100)
	if got := work(); got["rxe0"] < 64 || got["rxe1"] != 0 {
		t.Fatalf("READs of cpu:1 (rxe0 preferred) by target NIC: %v", got)
	}
	t.Logf("rxe1 received %d packets during the READs from rxe0", rxe1()-before)

	// The target prefers rxe0 alone now: every rail goes there.
	ep.Update(desc("cpu:0=" + i0 + "/"))
	ep.postMu.Lock()
	for i, r := range ep.rails {
		if ep.mc.devs[r.ri] != "rxe0" {
			t.Errorf("after the Update, rail %d goes to %s", i, ep.mc.devs[r.ri])
		}
	}
	ep.postMu.Unlock()
	for i := range w.lmem {
		w.lmem[i] = byte(i*3 + 5)
	}
	for round := range 3 { // the rails that moved reconnect meanwhile
		run("WRITE to cpu:0 after the Update", transport.Write, w.rmem, uint64(w.r.Addr), 1000+uint64(round)*100)
		if got := work(); got["rxe0"] < 64 || got["rxe1"] != 0 {
			t.Fatalf("round %d: WRITEs to cpu:0 (rxe0 alone) by target NIC: %v", round, got)
		}
	}
	// The rails that moved hold no queue pair to rxe1 any more: retired.
	ep.postMu.Lock()
	for i, r := range ep.rails {
		if r.q != nil && r.q.rdev != idx["rxe0"] {
			t.Errorf("rail %d still holds a queue pair to %s", i, ep.mc.devs[r.q.rdev])
		}
		for _, q := range r.retired {
			if q.state.Load() == qpLive {
				t.Errorf("rail %d: a retired queue pair is live", i)
			}
		}
	}
	ep.postMu.Unlock()
	// Both local devices' rails connect to rxe0 (local rxe1 to the
	// target's rxe0 crosses the guest's veth pair: see addRXE1).
	tok := uint64(5000)
	var lastErr error
	waitFor(t, "both local devices' rails connected to rxe0", func() bool {
		tok += 100
		run("WRITE to cpu:0, waiting", transport.Write, w.rmem, uint64(w.r.Addr), tok)
		if got := work(); got["rxe1"] != 0 {
			t.Errorf("WRITEs to cpu:0 (rxe0 alone) by target NIC: %v", got)
		}
		ep.postMu.Lock()
		defer ep.postMu.Unlock()
		live := map[string]bool{}
		for _, r := range ep.rails {
			if r.q != nil && r.q.state.Load() == qpLive && r.q.rdev == idx["rxe0"] {
				live[r.q.dev.name] = true
			}
			if r.connErr != nil && r.connErr != lastErr {
				lastErr = r.connErr
				t.Logf("a moved rail's connect failed: %v", lastErr)
			}
		}
		return live["rxe0"] && live["rxe1"]
	})
}
