package nvlink

import (
	"bytes"
	"errors"
	"testing"
	"unsafe"
)

func TestStager(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	st, err := p.init.NewStager(0, 4096, 3)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Arena()) != 3*4096 || st.Chunk() != 4096 {
		t.Fatalf("arena %d bytes, chunk %d", len(st.Arena()), st.Chunk())
	}
	var got []*Staging
	for i := 0; i < 3; i++ {
		b := st.Get()
		if b == nil {
			t.Fatalf("Get %d of 3: nil", i)
		}
		got = append(got, b)
	}
	if st.Get() != nil {
		t.Fatal("a fourth buffer from a pool of three")
	}
	// The buffers tile the arena, without overlap.
	seen := map[uintptr]bool{}
	for _, b := range got {
		off := uintptr(unsafe.Pointer(unsafe.SliceData(b.Bytes()))) - uintptr(unsafe.Pointer(unsafe.SliceData(st.Arena())))
		if off%4096 != 0 || off >= 3*4096 || seen[off] || len(b.Bytes()) != 4096 || cap(b.Bytes()) != 4096 {
			t.Fatalf("buffer at arena offset %d, %d bytes, cap %d", off, len(b.Bytes()), cap(b.Bytes()))
		}
		seen[off] = true
	}
	dev, err := p.init.Alloc(8192, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := range dev {
		dev[i] = byte(i*3 + 1) // fake device memory is Go memory
	}
	b := got[0]
	if err := b.CopyFromDevice(unsafe.Pointer(&dev[100]), 4000); err != nil {
		t.Fatal(err)
	}
	if err := b.CopyFromDevice(unsafe.Pointer(&dev[0]), 10); !errors.Is(err, ErrStagingBusy) {
		t.Errorf("a second copy while one is in flight: %v, want ErrStagingBusy", err)
	}
	if err := st.Put(b); !errors.Is(err, ErrStagingBusy) {
		t.Errorf("Put with a copy in flight: %v, want ErrStagingBusy", err)
	}
	polls := 0
	for {
		done, err := b.Done()
		if err != nil {
			t.Fatal(err)
		}
		if done {
			break
		}
		polls++
		if polls > 100 {
			t.Fatal("the copy never finished")
		}
	}
	if polls == 0 {
		t.Errorf("Done reported the copy finished at the first poll: the fake's copies are asynchronous, so Done did not query")
	}
	if !bytes.Equal(b.Bytes()[:4000], dev[100:4100]) {
		t.Fatal("DtoH staging: bytes differ")
	}
	for i := range b.Bytes() {
		b.Bytes()[i] = byte(255 - i)
	}
	if err := b.CopyToDevice(unsafe.Pointer(&dev[4096]), 4096); err != nil {
		t.Fatal(err)
	}
	for done := false; !done; {
		if done, err = b.Done(); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(dev[4096:], b.Bytes()) {
		t.Fatal("HtoD staging: bytes differ")
	}
	for _, bad := range []int{0, -1, 4097} {
		if err := b.CopyToDevice(unsafe.Pointer(&dev[0]), bad); err == nil {
			t.Errorf("a copy of %d bytes into a 4096-byte buffer was accepted", bad)
		}
	}
	for _, b := range got {
		if err := st.Put(b); err != nil {
			t.Fatal(err)
		}
	}
	if st.Get() == nil {
		t.Fatal("Get after Put: nil")
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if st.Get() != nil {
		t.Error("Get after Close handed out a buffer")
	}
	// A second stager is left to the transport's Close (leaks are checked
	// at cleanup).
	if _, err := p.init.NewStager(0, 1024, 2); err != nil {
		t.Fatal(err)
	}
	if _, err := p.init.NewStager(1, 1024, 2); !errors.Is(err, ErrNoDevice) {
		t.Errorf("stager on GPU 1 of 1: %v, want ErrNoDevice", err)
	}
}

func TestStagerAsyncFailure(t *testing.T) {
	fake := newFake(1)
	p := newPair(t, fake, Config{})
	st, err := p.init.NewStager(0, 4096, 1)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := p.init.Alloc(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	fake.mu.Lock()
	fake.asyncLen = 77
	fake.mu.Unlock()
	b := st.Get()
	if err := b.CopyFromDevice(unsafe.Pointer(&dev[0]), 77); err != nil {
		t.Fatal(err)
	}
	var derr error
	for done := false; !done; {
		done, derr = b.Done()
	}
	if !errors.Is(derr, ErrDriver) {
		t.Errorf("a failing staging copy: Done's error %v, want ErrDriver", derr)
	}
}
