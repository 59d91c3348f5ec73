package local_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/leakcheck"
	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
	"github.com/moonring/moonring/transport/transporttest"
)

func TestMain(m *testing.M) { leakcheck.VerifyTestMain(m) }

// TestConformance: Post, Copy and Hold variants; losing Copier,
// HoldingCopier or Notifier fails it.
func TestConformance(t *testing.T) {
	want := []transporttest.Interface{transporttest.Copier, transporttest.HoldingCopier, transporttest.Notifier}
	transporttest.RunWith(t, transporttest.Options{Want: want}, func(t *testing.T) (transport.Transport, transport.Transport) {
		return local.New(), local.New()
	})
}

// TestCopyHold: a copy that leaves its reference in a Holds keeps the
// target region from being unregistered until the holds are released, and
// later copies to the same region take no second reference.
func TestCopyHold(t *testing.T) {
	tr := local.New()
	defer tr.Close()
	var bufs segtable.Buffers
	src, dst := make([]byte, 8192), make([]byte, 8192)
	for i := range src {
		src[i] = byte(i * 7)
	}
	bs, err := bufs.Register(src, "", false)
	if err != nil {
		t.Fatal(err)
	}
	bd, err := bufs.Register(dst, "", false)
	if err != nil {
		t.Fatal(err)
	}
	defer bufs.Unregister(context.Background(), bs.ID)
	defer bufs.Unregister(context.Background(), bd.ID)
	rd, err := tr.Register(bd)
	if err != nil {
		t.Fatal(err)
	}
	ep := tr.Self().(transport.HoldingCopier)
	var h transport.Holds
	for i := range 2 {
		s := transport.Slice{Op: transport.Write, Local: bs.Pointer(uint64(i) * 4096), Remote: uint64(bd.Addr) + uint64(i)*4096, Length: 4096}
		if err := ep.CopyHold(&s, &h); err != nil {
			t.Fatal(err)
		}
	}
	if h.Len() != 1 || !bytes.Equal(src, dst) {
		t.Fatalf("%d references held (want 1), data equal %v", h.Len(), bytes.Equal(src, dst))
	}
	done := make(chan error, 1)
	go func() { done <- tr.Unregister(bd, rd) }()
	select {
	case err := <-done:
		t.Fatalf("Unregister returned while a copy's reference was held: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	h.Release()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Unregister still waits after the holds were released")
	}
	s := transport.Slice{Op: transport.Write, Local: bs.Pointer(0), Remote: uint64(bd.Addr), Length: 1}
	if err := ep.CopyHold(&s, &h); err == nil {
		t.Fatal("a copy to an unregistered region succeeded")
	}
}
