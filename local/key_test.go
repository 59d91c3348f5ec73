package local_test

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/moonring/moonring/local"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// keyFixture is a target transport with buffers of one backing array
// registered, and an initiator transport to open endpoints from.
type keyFixture struct {
	t        *testing.T
	from, to *local.Transport
	bufs     segtable.Buffers
	mem      []byte // the target's memory: every buffer is a piece of it
	src      []byte
}

func newKeyFixture(t *testing.T) *keyFixture {
	f := &keyFixture{t: t, from: local.New(), to: local.New(), mem: make([]byte, 64<<10), src: bytes.Repeat([]byte{0xab}, 64<<10)}
	t.Cleanup(func() { f.from.Close(); f.to.Close() })
	return f
}

// register registers mem[off:off+n] with the target; the buffer and its
// registration.
func (f *keyFixture) register(off, n int, remote bool) (*segtable.Buffer, segtable.Registration) {
	f.t.Helper()
	b, err := f.bufs.Register(f.mem[off:off+n], "", remote)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { f.bufs.Unregister(context.Background(), b.ID) }) // unpins; fails if done already
	reg, err := f.to.Register(b)
	if err != nil {
		f.t.Fatal(err)
	}
	return b, reg
}

func (f *keyFixture) unregister(b *segtable.Buffer, reg segtable.Registration) {
	f.t.Helper()
	if err := f.to.Unregister(b, reg); err != nil {
		f.t.Fatal(err)
	}
	if _, err := f.bufs.Unregister(context.Background(), b.ID); err != nil {
		f.t.Fatal(err)
	}
}

// open returns an endpoint to the target through a descriptor of the
// given buffers (address, length, key), which must be in address order.
func (f *keyFixture) open(bufs ...segtable.BufferDesc) transport.Copier {
	f.t.Helper()
	d := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: "target", Epoch: 1, Endpoints: map[string]string{local.Name: f.to.Endpoint()}, Buffers: bufs}
	if err := d.Validate(); err != nil {
		f.t.Fatal(err)
	}
	ep, err := f.from.Open(context.Background(), d)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(func() { ep.Close() })
	return ep.(transport.Copier)
}

func desc(b *segtable.Buffer, key string) segtable.BufferDesc {
	return segtable.BufferDesc{Addr: uint64(b.Addr), Length: b.Length, Keys: map[string]string{local.Name: key}}
}

// write copies n bytes of src to the target's address addr with the hint
// index and returns the error; on a refusal it checks that the target's
// memory did not change.
func (f *keyFixture) write(ep transport.Copier, addr, n uint64, index uint32) error {
	f.t.Helper()
	before := bytes.Clone(f.mem)
	s := transport.Slice{Op: transport.Write, Local: unsafe.Pointer(unsafe.SliceData(f.src)), Remote: addr, Length: n, RemoteIndex: index}
	err := ep.Copy(&s)
	if err != nil && !bytes.Equal(before, f.mem) {
		f.t.Fatalf("a refused WRITE of %d bytes at %#x (%v) changed the target's memory", n, addr, err)
	}
	clear(f.mem)
	return err
}

// forge returns a key with the given secret and handle.
func forge(secret uint64, h uint64) string {
	return strconv.FormatUint(secret, 16) + "." + strconv.FormatUint(h, 16)
}

// parts returns a key's secret and handle.
func parts(t *testing.T, key string) (uint64, uint64) {
	t.Helper()
	s, h, ok := strings.Cut(key, ".")
	if !ok {
		t.Fatalf("key %q is not SECRET.HANDLE", key)
	}
	secret, err := strconv.ParseUint(s, 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	hv, err := strconv.ParseUint(h, 16, 32)
	if err != nil {
		t.Fatal(err)
	}
	return secret, hv
}

// TestKeyStaleHandle: a key's handle names its registration only until
// it is unregistered. With the same memory registered again, a key made
// of the old handle and the new registration's secret (the handle's
// index reused, its generation not) is refused, and so is the old key;
// the new key works.
func TestKeyStaleHandle(t *testing.T) {
	f := newKeyFixture(t)
	a, ra := f.register(0, 4096, true)
	_, oldH := parts(t, ra.Key)
	if err := f.write(f.open(desc(a, ra.Key)), uint64(a.Addr), 16, 0); err != nil {
		t.Fatalf("WRITE with the live key: %v", err)
	}
	f.unregister(a, ra)
	a2, ra2 := f.register(0, 4096, true)
	secret2, newH := parts(t, ra2.Key)
	if newH&(1<<20-1) != oldH&(1<<20-1) || newH == oldH {
		t.Fatalf("handles %#x then %#x: the index was not reused under a new generation, the test proves nothing", oldH, newH)
	}
	for _, c := range []struct{ what, key string }{
		{"the old key", ra.Key},
		{"the old handle with the new secret", forge(secret2, oldH)},
	} {
		err := f.write(f.open(desc(a2, c.key)), uint64(a2.Addr), 16, 0)
		if !errors.Is(err, transport.ErrDenied) {
			t.Errorf("WRITE with %s after the buffer was registered again: %v; want ErrDenied", c.what, err)
		}
	}
	if err := f.write(f.open(desc(a2, ra2.Key)), uint64(a2.Addr), 16, 0); err != nil {
		t.Fatalf("WRITE with the new key: %v", err)
	}
	// Unregistered and not registered again: nothing holds the range.
	f.unregister(a2, ra2)
	if err := f.write(f.open(desc(a2, ra2.Key)), uint64(a2.Addr), 16, 0); !errors.Is(err, transport.ErrRange) {
		t.Errorf("WRITE with the key of an unregistered buffer: %v; want ErrRange", err)
	}
}

// TestKeyBounds: a key opens its region's bytes and no others. A
// descriptor that claims more than the region (its real key, a longer
// length) gets no byte past the region's end, nor before its start; a
// key's handle with another secret, or the secret with another handle,
// opens nothing; a local-only region's own key opens nothing.
func TestKeyBounds(t *testing.T) {
	f := newKeyFixture(t)
	a, ra := f.register(4096, 4096, true) // [4096, 8192) of mem
	_, rb := f.register(16384, 4096, true)
	l, rl := f.register(32768, 4096, false)
	secretA, hA := parts(t, ra.Key)
	secretB, hB := parts(t, rb.Key)
	base := uint64(a.Addr) - 4096                                                                      // mem[0]
	big := segtable.BufferDesc{Addr: base, Length: 16384, Keys: map[string]string{local.Name: ra.Key}} // [0, 16384): A and more
	ep := f.open(big)
	for _, c := range []struct {
		what    string
		addr, n uint64
	}{
		{"past A's end", uint64(a.Addr) + 4090, 16},
		{"after A", uint64(a.Addr) + 4096, 16},
		{"before A", uint64(a.Addr) - 8, 16},
		{"below A", base, 16},
	} {
		if err := f.write(ep, c.addr, c.n, 0); err == nil {
			t.Errorf("WRITE %s through a descriptor claiming [%#x, +16384) with A's key: succeeded", c.what, base)
		}
	}
	if err := f.write(ep, uint64(a.Addr)+4080, 16, 0); err != nil {
		t.Errorf("WRITE to A's last 16 bytes: %v", err)
	}
	for _, c := range []struct{ what, key string }{
		{"A's handle with B's secret", forge(secretB, hA)},
		{"B's handle with A's secret", forge(secretA, hB)},
		{"A's handle with a secret one off", forge(secretA^1, hA)},
		{"the secret alone (the older form)", strconv.FormatUint(secretA, 16)},
		{"A's secret with handle zero", forge(secretA, 0)},
		{"A's secret with a handle past 32 bits", forge(secretA, hA|1<<32)},
	} {
		if err := f.write(f.open(desc(a, c.key)), uint64(a.Addr), 16, 0); !errors.Is(err, transport.ErrDenied) {
			t.Errorf("WRITE to A with %s: %v; want ErrDenied", c.what, err)
		}
	}
	if err := f.write(f.open(desc(l, rl.Key)), uint64(l.Addr), 16, 0); !errors.Is(err, transport.ErrDenied) {
		t.Errorf("WRITE to a local-only region with its own key: %v; want ErrDenied", err)
	}
}

// TestKeyHint: RemoteIndex changes what a slice costs, never where it
// lands: a hint naming another buffer, past the descriptor, or a buffer
// without a key for this transport is checked against the address and
// the right buffer's key taken (or the slice refused as before).
func TestKeyHint(t *testing.T) {
	f := newKeyFixture(t)
	var ds []segtable.BufferDesc
	var bs []*segtable.Buffer
	for i := range 8 {
		b, reg := f.register(i*8192, 4096, true)
		bs = append(bs, b)
		ds = append(ds, desc(b, reg.Key))
	}
	ds[5].Keys = nil // listed without a key for this transport
	ep := f.open(ds...)
	for want, b := range bs {
		for _, hint := range []uint32{uint32(want), 0, 7, 5, 8, 1 << 31, ^uint32(0)} {
			err := f.write(ep, uint64(b.Addr)+100, 200, hint)
			switch {
			case want == 5 && !errors.Is(err, transport.ErrDenied):
				t.Errorf("buffer %d (no key), hint %d: %v; want ErrDenied", want, hint, err)
			case want != 5 && err != nil:
				t.Errorf("buffer %d, hint %d: %v", want, hint, err)
			}
		}
		// Across the end of the buffer into the gap: refused whatever
		// the hint.
		if err := f.write(ep, uint64(b.Addr)+4000, 200, uint32(want)); err == nil {
			t.Errorf("buffer %d: a WRITE across its end succeeded", want)
		}
	}
	// The bytes land in the buffer addressed: write with a wrong hint
	// and look.
	s := transport.Slice{Op: transport.Write, Local: unsafe.Pointer(unsafe.SliceData(f.src)), Remote: uint64(bs[3].Addr) + 8, Length: 8, RemoteIndex: 6}
	if err := ep.Copy(&s); err != nil {
		t.Fatal(err)
	}
	for i, x := range f.mem {
		want := byte(0)
		if i >= 3*8192+8 && i < 3*8192+16 {
			want = 0xab
		}
		if x != want {
			t.Fatalf("after a WRITE to buffer 3 with hint 6: byte %d (buffer %d's) is %#x; want %#x", i, i/8192, x, want)
		}
	}
}
