//go:build rdma && cgo

package rdma_test

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"os"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/childproc"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/rdma"
)

func init() { rdma.EngineChildMain = engineChild }

const engineChildSize = 4 << 20

type engineHello struct {
	Name string
	Addr uint64
}

func digest(b []byte) string {
	h := fnv.New64a()
	h.Write(b)
	return fmt.Sprintf("%016x", h.Sum64())
}

// engineChild is a target engine in its own process: discovery through
// the p2p store (its segment's name is its host:port), the rdma transport,
// a remote-accessible buffer filled with fill(seed 1). It answers "sum"
// with the buffer's digest and "note" with the next notification
// (internal/childproc's protocol).
func engineChild() int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "engine child:", err); return 1 }
	store, err := metadata.NewP2P(metadata.P2PConfig{PollInterval: 50 * time.Millisecond})
	if err != nil {
		return fail(err)
	}
	defer store.Close()
	e, err := moonring.New(moonring.Config{Metadata: store})
	if err != nil {
		return fail(err)
	}
	defer e.Close()
	tr, err := rdma.New(rdma.Config{})
	if err != nil {
		return fail(err)
	}
	if err := e.InstallTransport(tr); err != nil {
		tr.Close()
		return fail(err)
	}
	mem := make([]byte, engineChildSize)
	testpattern.Fill(mem, 1)
	if _, err := e.RegisterLocalMemory(mem, "cpu:0", true); err != nil {
		return fail(err)
	}
	hello, _ := json.Marshal(engineHello{e.Name(), uint64(moonring.AddressOf(mem))})
	err = childproc.Serve(string(hello), func(cmd string) string {
		switch cmd {
		case "sum":
			return digest(mem)
		case "note":
			select {
			case n := <-e.Notifications():
				return fmt.Sprintf("%s %d %s", n.From, n.Tag, n.Msg)
			case <-time.After(20 * time.Second):
				return "none"
			}
		}
		return "bad command"
	})
	if err != nil {
		return fail(err)
	}
	return 0
}

// Two engines in two processes, joined by the rdma transport alone and
// found through the p2p store: READ and WRITE of many sizes with the data
// checked on both sides, and a write-with-notify.
func TestEnginesTwoProcesses(t *testing.T) {
	store, err := metadata.NewP2P(metadata.P2PConfig{PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() }) // after the engine's Close
	a := rdmaEngineStore(t, moonring.Config{Metadata: store, Transports: []string{rdma.Name}})
	c := childproc.Start(t, childproc.Config{Env: []string{"MOONRING_RDMA_CHILD=engine"}, Name: "engine child", StopWait: 30 * time.Second})
	defer func() {
		if err := c.Stop(); err != nil {
			t.Errorf("engine child: %v", err)
		}
	}()
	var h engineHello
	if err := json.Unmarshal([]byte(c.Line), &h); err != nil {
		t.Fatalf("engine child's hello %q: %v", c.Line, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	seg, err := a.OpenSegment(ctx, h.Name)
	if err != nil {
		t.Fatal(err)
	}
	mem := make([]byte, engineChildSize)
	if _, err := a.RegisterLocalMemory(mem, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, engineChildSize)
	testpattern.Fill(want, 1)
	for i, n := range []uint64{engineChildSize, 4096, 100 << 10} {
		clear(mem)
		var reqs []moonring.TransferRequest
		for off := uint64(0); off < engineChildSize; off += n {
			reqs = append(reqs, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(mem[off:]),
				TargetID: seg, TargetOffset: h.Addr + off, Length: min(n, engineChildSize-off)})
		}
		if err := a.Transfer(ctx, reqs...); err != nil {
			t.Fatalf("READ in %d-byte requests: %v", n, err)
		}
		if digest(mem) != digest(want) {
			t.Fatalf("READ in %d-byte requests: data differs", n)
		}
		testpattern.Fill(want, uint64(i+2))
		copy(mem, want)
		for j := range reqs {
			reqs[j].Opcode = moonring.Write
		}
		if err := a.Transfer(ctx, reqs...); err != nil {
			t.Fatalf("WRITE in %d-byte requests: %v", n, err)
		}
		if got := c.Ask(t, "sum"); got != digest(want) {
			t.Fatalf("WRITE in %d-byte requests: the child's digest %s, want %s", n, got, digest(want))
		}
	}
	if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(mem), TargetID: seg,
		TargetOffset: h.Addr, Length: 4096, Notify: &moonring.Notify{Tag: 11, Msg: []byte("layer 3 ready")}}); err != nil {
		t.Fatalf("WRITE with notify: %v", err)
	}
	if got, want := c.Ask(t, "note"), a.Name()+" 11 layer 3 ready"; got != want {
		t.Fatalf("the child's notification %q, want %q", got, want)
	}
}
