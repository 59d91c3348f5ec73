//go:build rdma && cgo

package rdma

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// addRXE1 binds a second Soft-RoCE device, rxe1, to veth1 (10.0.0.2), the
// rig's peer of rxe0's veth0, for the length of the test, and lets queue
// pairs connect across the two devices: both addresses are the guest's
// own, so the move to RTR of a queue pair on rxe0 towards 10.0.0.2 (bound
// to veth0, which skips veth1's local route) ARPs for it over veth0, and
// veth1 drops a request from an address of its own host (a martian
// source) unless accept_local is set; without it the kernel's address
// resolution times out after 1 s and RTR fails with ETIMEDOUT.
func addRXE1(t *testing.T) {
	if os.Getenv("RDMA_VM_DEV") != "rxe0" {
		t.Skip("SKIP: adds a second Soft-RoCE device: runs only inside the rdma VM (make test-rdma)")
	}
	for _, dev := range []string{"veth0", "veth1"} {
		p := "/proc/sys/net/ipv4/conf/" + dev + "/accept_local"
		old, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("accept_local of %s: %v", dev, err)
		}
		if err := os.WriteFile(p, []byte("1\n"), 0o644); err != nil {
			t.Fatalf("accept_local of %s: %v", dev, err)
		}
		t.Cleanup(func() { os.WriteFile(p, old, 0o644) })
		// An address that failed to resolve before is not asked again
		// at once: forget it.
		exec.Command("/usr/sbin/ip", "neigh", "flush", "dev", dev).Run()
	}
	if out, err := exec.Command("/usr/sbin/rdma", "link", "add", "rxe1", "type", "rxe", "netdev", "veth1").CombinedOutput(); err != nil {
		t.Fatalf("rdma link add rxe1: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("/usr/sbin/rdma", "link", "delete", "rxe1").CombinedOutput(); err != nil {
			t.Errorf("rdma link delete rxe1: %v: %s", err, out)
		}
	})
	waitFor(t, "rxe1 ACTIVE with the GID of 10.0.0.2", func() bool {
		st, _ := os.ReadFile("/sys/class/infiniband/rxe1/ports/1/state")
		if !strings.Contains(string(st), "ACTIVE") {
			return false
		}
		devs, err := Devices()
		if err != nil {
			return false
		}
		for _, d := range devs {
			if d.Name == "rxe1" && len(d.Ports) > 0 && d.Ports[0].Chosen >= 0 {
				return d.Ports[0].GIDs[d.Ports[0].Chosen].Addr().Unmap().String() == "10.0.0.2"
			}
		}
		return false
	})
}

// Two devices on each side: the endpoint's rails span both (queue pairs
// rxe0 -> rxe0 and rxe1 -> rxe1, device i to the peer's device i), data
// moves on all of them; with one device
// marked down (what its port-down event does), its queue pairs fail and
// the slices aimed at its rails move to the other device's.
func TestTwoDevices(t *testing.T) {
	addRXE1(t)
	w := newWorld(t, Config{QPsPerDevice: 2}, 64<<12)
	if n := len(w.init.devs); n != 2 {
		t.Fatalf("the transport opened %d devices, want rxe0 and rxe1", n)
	}
	ep := w.open(t)
	if ep.Rails() != 4 {
		t.Fatalf("Rails() = %d, want 4 (2 devices x 2 queue pairs)", ep.Rails())
	}
	c := newWaiter()
	for i := range w.lmem {
		w.lmem[i] = byte(i*5 + 3)
	}
	var s []transport.Slice
	for i := uint64(0); i < 64; i++ {
		sl := w.slice(transport.Write, i<<12, 1<<12, i+1)
		sl.Rail = uint16(i)
		s = append(s, sl)
	}
	postAll(t, ep, c, s)
	for i := range s {
		if err := c.wait(t, s[i].Token); err != nil {
			t.Fatalf("WRITE on rail %d: %v", s[i].Rail%4, err)
		}
	}
	if string(w.rmem) != string(w.lmem) {
		t.Fatal("WRITEs over both devices: data differs")
	}
	e := ep.(*Endpoint)
	perDev := map[string]int{}
	e.postMu.Lock()
	for _, r := range e.rails {
		if r.q != nil {
			perDev[r.q.dev.name+"->"+e.t.devs[r.ri].name]++
		}
	}
	e.postMu.Unlock()
	if perDev["rxe0->rxe0"] != 2 || perDev["rxe1->rxe1"] != 2 {
		t.Fatalf("queue pairs by device pair %v; want 2 rxe0->rxe0 and 2 rxe1->rxe1", perDev)
	}
	// rxe1 goes down on the initiator's side.
	d := w.init.devs[1]
	d.down.Store(true)
	w.init.failDevice(d)
	clear(w.lmem)
	var r []transport.Slice
	for i := uint64(0); i < 64; i++ {
		sl := w.slice(transport.Read, i<<12, 1<<12, 100+i)
		sl.Rail = uint16(i)
		r = append(r, sl)
	}
	postAll(t, ep, c, r)
	for i := range r {
		if err := c.wait(t, r[i].Token); err != nil {
			t.Fatalf("READ aimed at rail %d with rxe1 down: %v", r[i].Rail%4, err)
		}
	}
	if string(w.rmem) != string(w.lmem) {
		t.Fatal("READs with rxe1 down: data differs")
	}
	e.postMu.Lock()
	for i, rl := range e.rails {
		if rl.q != nil && rl.q.dev == d && rl.q.state.Load() == qpLive {
			t.Errorf("rail %d still has a live queue pair on the down device", i)
		}
	}
	e.postMu.Unlock()
	d.down.Store(false)
	time.Sleep(0) // the device is back: its rails reconnect on the next Post
	postAll(t, ep, c, []transport.Slice{w.slice(transport.Write, 0, 4096, 500)})
	if err := c.wait(t, 500); err != nil {
		t.Fatal(err)
	}
}
