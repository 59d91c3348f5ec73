package moonring_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"testing"
	"time"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

func newEngine(t testing.TB, name string) *moonring.Engine {
	t.Helper()
	e, err := moonring.New(moonring.Config{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// fill fills b with testpattern's pattern of seed (the root tests' short
// name for it).
var fill = testpattern.Fill

func TestTransferBetweenEngines(t *testing.T) {
	a := newEngine(t, t.Name()+"-a")
	b := newEngine(t, t.Name()+"-b")
	src := make([]byte, 3<<20+17)
	dst := make([]byte, len(src))
	back := make([]byte, len(src))
	fill(src, 1)
	if _, err := a.RegisterLocalMemory(src, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := a.RegisterLocalMemory(back, "cpu:0", false); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RegisterLocalMemory(dst, "cpu:0", true); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	seg, err := a.OpenSegment(ctx, b.Name())
	if err != nil {
		t.Fatal(err)
	}
	n := uint64(len(src))
	if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Write, Source: moonring.AddressOf(src), TargetID: seg, TargetOffset: uint64(moonring.AddressOf(dst)), Length: n}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, dst) {
		t.Fatal("write: data differs")
	}
	if err := a.Transfer(ctx, moonring.TransferRequest{Opcode: moonring.Read, Source: moonring.AddressOf(back), TargetID: seg, TargetOffset: uint64(moonring.AddressOf(dst)), Length: n}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, back) {
		t.Fatal("read: data differs")
	}
}

// TestEngineAfterClose: calls on a closed engine return errors, never
// panic (SegmentTransport used to call a transport Close had removed); a
// nil transport is refused, and an unknown segment is ErrBadSegment.
func TestEngineAfterClose(t *testing.T) {
	e := newEngine(t, t.Name())
	if err := e.InstallTransport(nil); !errors.Is(err, moonring.ErrInvalid) {
		t.Fatalf("InstallTransport(nil): %v; want ErrInvalid", err)
	}
	if err := e.CloseSegment(context.Background(), 12345); !errors.Is(err, moonring.ErrBadSegment) {
		t.Fatalf("CloseSegment of an unknown ID: %v; want ErrBadSegment", err)
	}
	if name, err := e.SegmentTransport(moonring.LocalSegmentID); err != nil || name == "" {
		t.Fatalf("SegmentTransport of the local segment: %q, %v", name, err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.SegmentTransport(moonring.LocalSegmentID); !errors.Is(err, moonring.ErrClosed) {
		t.Fatalf("SegmentTransport after Close: %v; want ErrClosed", err)
	}
}

// slowStore is a metadata store whose Get waits for release.
type slowStore struct {
	metadata.Store
	entered chan struct{}
	release chan struct{}
}

func (s *slowStore) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	close(s.entered)
	<-s.release
	return s.Store.Get(ctx, name)
}

// TestOpenSegmentUnlocked: an OpenSegment waiting on the store (or the
// peer) does not hold the engine: registration and other calls go on. It
// held the engine's lock across both, unbounded without a deadline.
func TestOpenSegmentUnlocked(t *testing.T) {
	store := &slowStore{Store: metadata.NewMemory(), entered: make(chan struct{}), release: make(chan struct{})}
	e, err := moonring.New(moonring.Config{Name: t.Name(), Metadata: store})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	opened := make(chan error, 1)
	go func() {
		_, err := e.OpenSegment(context.Background(), "nobody")
		opened <- err
	}()
	<-store.entered
	registered := make(chan error, 1)
	go func() {
		_, err := e.RegisterLocalMemory(make([]byte, 4096), "cpu:0", false)
		registered <- err
	}()
	select {
	case err := <-registered:
		if err != nil {
			t.Fatalf("RegisterLocalMemory: %v", err)
		}
	case <-time.After(30 * time.Second):
		close(store.release)
		t.Fatal("hang: RegisterLocalMemory behind an OpenSegment waiting on the store")
	}
	close(store.release)
	if err := <-opened; err == nil {
		t.Fatal("OpenSegment of a segment nobody published: no error")
	}
}

// An engine without a Name is named <hostname>-<pid>-<n>-<8 hex digits>:
// the random part keeps apart engines of one host name and pid (containers
// on the host's network, a restarted process with a dead one's pid), and
// a name never repeats in a process.
func TestDefaultName(t *testing.T) {
	hn, _ := os.Hostname()
	re := regexp.MustCompile(fmt.Sprintf(`^%s-%d-([0-9]+)-([0-9a-f]{8})$`, regexp.QuoteMeta(hn), os.Getpid()))
	seen := map[string]bool{}
	suffixes := map[string]bool{}
	for range 4 {
		e, err := moonring.New(moonring.Config{Metadata: metadata.NewMemory()})
		if err != nil {
			t.Fatal(err)
		}
		name := e.Name()
		e.Close()
		m := re.FindStringSubmatch(name)
		if m == nil {
			t.Fatalf("default name %q: want <hostname>-<pid>-<n>-<8 hex digits>", name)
		}
		if seen[name] {
			t.Fatalf("default name %q given twice", name)
		}
		seen[name] = true
		suffixes[m[2]] = true
	}
	if len(suffixes) < 2 {
		t.Fatalf("four engines, one random suffix: %v", suffixes)
	}
}
