package tcp

import (
	"bytes"
	"context"
	"os"
	"testing"

	"github.com/moonring/moonring/internal/uring"
	"github.com/moonring/moonring/transport"
)

// With Config.IOUring the sender writes through io_uring: a WRITE left
// wholly to the sender (senderOnly: on a machine with cores to spare the
// target drains the socket as fast as the poller's non-blocking kick fills
// it, and the kick alone would move all of it) lands intact.
func TestIOUringSender(t *testing.T) {
	if err := uring.Available(); err != nil {
		if os.Getenv("MOONRING_CI") == "1" {
			t.Fatalf("io_uring is not available here, and CI must test the io_uring sender: %v", err)
		}
		t.Skipf("SKIP io_uring sender: %v (the netpoller path is what runs here)", err)
	}
	before := uring.Used().Submitted
	targ := newSide(t, Config{})
	const size = 32 << 20
	remote := targ.register(t, targ.alloc(t, size, 0), true)
	init := newSide(t, Config{Rails: 1, IOUring: true, SliceSize: 16 << 20, senderOnly: true})
	local := init.alloc(t, size, 7)
	for i := range local {
		local[i] = byte(i * 31)
	}
	ep, err := init.tr.Open(context.Background(), targ.desc(targ.tr.Addr(), remote))
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	if c := ep.(*Endpoint).rails[0].Load(); c == nil || c.ur == nil {
		t.Fatal("the rail has no io_uring though io_uring is available")
	}
	comp := make(chanCompleter, 4)
	s := []transport.Slice{
		localSlice(transport.Write, local[:size/2], remote.addr, 1),
		localSlice(transport.Write, local[size/2:], remote.addr+size/2, 2),
	}
	if n, err := ep.Post(comp, s); n != 2 || err != nil {
		t.Fatalf("Post: %d, %v", n, err)
	}
	for tok, err := range comp.await(t, 2) {
		if err != nil {
			t.Fatalf("slice %d: %v", tok, err)
		}
	}
	if !bytes.Equal(remote.mem, local) {
		t.Fatal("data differs after io_uring writes")
	}
	if uring.Used().Submitted == before {
		t.Fatal("the kernel took no SQE: the WRITEs did not go through io_uring")
	}
}
