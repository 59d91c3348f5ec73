package moonring_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/tcp"
)

// p2pEngine is an engine whose segment is named by its own HTTP endpoint.
func p2pEngine(t *testing.T, listen string, log ...*slog.Logger) (*moonring.Engine, *metadata.P2P) {
	t.Helper()
	store, err := metadata.NewP2P(metadata.P2PConfig{Listen: listen, PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	cfg := moonring.Config{Metadata: store, Transports: []string{"tcp"}, TCP: &tcp.Config{}}
	if len(log) > 0 {
		cfg.Logger = log[0]
	}
	e, err := moonring.New(cfg)
	if err != nil {
		store.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close(); store.Close() })
	return e, store
}

// Two engines find each other by host:port through the p2p store, and a
// restarted target (same name, new epoch, new TCP port and keys) is used
// again through the same SegmentID, without reopening it.
func TestP2PDiscoveryAndRestart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var logs syncBuffer
	a, _ := p2pEngine(t, "127.0.0.1:0", slog.New(slog.NewTextHandler(&logs, nil)))
	b, bstore := p2pEngine(t, "127.0.0.1:0")
	if b.Name() == "" || b.Name() == a.Name() {
		t.Fatalf("names %q and %q", a.Name(), b.Name())
	}
	src := make([]byte, 1<<20)
	fill(src, 5)
	if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	dst, err := b.Alloc(1<<20, "cpu:0")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	write := func(to []byte) error {
		return a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg,
			TargetOffset: uint64(moonring.AddressOf(to)), Length: uint64(len(src))})
	}
	if err := write(dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("data differs")
	}

	// Restart b: same address, new engine.
	name := b.Name()
	b.UnregisterLocalMemory(ctx, dst)
	b.Close()
	bstore.Close()
	b2, _ := p2pEngine(t, name)
	if b2.Name() != name {
		t.Fatalf("restarted engine is %q, want %q", b2.Name(), name)
	}
	dst2 := make([]byte, 1<<20)
	if _, err := b2.RegisterLocalMemory(dst2, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	// The watch brings the new descriptor; until then requests fail.
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := write(dst2)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the restarted peer is not usable through the old SegmentID: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !bytes.Equal(dst2, src) {
		t.Fatal("data differs after the restart")
	}
	for _, event := range []string{"segment opened", "segment restarted"} {
		if !strings.Contains(logs.String(), event) {
			t.Errorf("the initiator's log lacks %q:\n%s", event, logs.String())
		}
	}
}

// syncBuffer is a bytes.Buffer for a logger written from several
// goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
