package etcd_test

import (
	"net"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// hang bounds waits for an event in these tests; it is not a speed
// requirement.
const hang = 30 * time.Second

func testDesc(name string, epoch uint64, tag string) *segtable.SegmentDesc {
	return &segtable.SegmentDesc{
		Version:   segtable.DescVersion,
		Name:      name,
		Epoch:     epoch,
		Endpoints: map[string]string{"tcp": tag},
		Buffers:   []segtable.BufferDesc{{Addr: 0x1000, Length: 4096, Location: "cpu:0", Keys: map[string]string{"tcp": "k"}}},
	}
}

func next(t *testing.T, ch <-chan metadata.Event) metadata.Event {
	t.Helper()
	select {
	case ev, ok := <-ch:
		if !ok {
			t.Fatal("watch channel closed")
		}
		return ev
	case <-time.After(hang):
		t.Fatalf("no event within %v", hang)
	}
	return metadata.Event{}
}

// deadAddr returns a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// waitFor waits until cond holds, failing the test after hang.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hang)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %v", what, hang)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
