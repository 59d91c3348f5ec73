package moonring_test

import (
	"bytes"
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/moonring/moonring"
)

// SubmitAndWait over TCP between two engines: READs and WRITEs of small
// blocks land right, one at a time, as the caller reads its own answers;
// a Cancel from another goroutine racing each request ends it once, OK or
// CANCELED, and never hangs the caller; and a request costs no allocation.
func TestSubmitAndWaitTCP(t *testing.T) {
	p := newTCPPair(t, 1<<20)
	loc := make([]byte, 1<<20)
	lid, err := p.ini.RegisterLocalMemory(loc, "cpu:0", false)
	if err != nil {
		t.Fatal(err)
	}
	r, err := p.ini.NewRing(moonring.RingConfig{Entries: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	base := uint64(moonring.AddressOf(p.remote))
	for i := range p.remote {
		p.remote[i] = byte(i*13 + 1)
	}
	ctx := context.Background()
	one := func(e moonring.Entry) *moonring.Completion {
		t.Helper()
		if k, err := r.SubmitAndWait(ctx, []moonring.Entry{e}, 1); k != 1 || err != nil {
			t.Fatalf("SubmitAndWait: %d, %v", k, err)
		}
		c := r.Peek()
		if c == nil {
			t.Fatal("SubmitAndWait returned with no completion")
		}
		return c
	}
	for i := range 200 {
		off := uint64(i * 64)
		e := moonring.Entry{Op: moonring.OpRead, Segment: p.seg, Buffer: lid, Local: off, Remote: base + off, Length: 64, UserData: uint64(i)}
		if c := one(e); c.Err() != nil || c.UserData != uint64(i) {
			t.Fatalf("READ %d: %+v", i, *c)
		}
		r.Advance(1)
		if !bytes.Equal(loc[off:off+64], p.remote[off:off+64]) {
			t.Fatalf("READ %d: bytes differ", i)
		}
	}
	for i := range loc[:4096] {
		loc[i] = byte(i * 7)
	}
	e := moonring.Entry{Op: moonring.OpWrite, Segment: p.seg, Buffer: lid, Remote: base + 512<<10, Length: 4096, UserData: 1}
	if c := one(e); c.Err() != nil {
		t.Fatalf("WRITE: %v", c.Err())
	}
	r.Advance(1)
	if !bytes.Equal(p.remote[512<<10:512<<10+4096], loc[:4096]) {
		t.Fatal("WRITE: bytes differ")
	}

	// Cancels racing the requests.
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ud := uint64(0); ; ud = (ud + 1) % 50 {
			select {
			case <-stop:
				return
			default:
			}
			r.Cancel(1000 + ud)
			time.Sleep(time.Duration(ud%5) * time.Microsecond)
		}
	}()
	for i := range 300 {
		ud := 1000 + uint64(i%50)
		// A canceled READ's payload may still be landing: each request
		// reads into a block of its own among 256, and the ring keeps at
		// most 16 requests (canceled ones included) out at once.
		e := moonring.Entry{Op: moonring.OpRead, Segment: p.seg, Buffer: lid, Local: uint64(i%256) * 4096, Remote: base, Length: 4096, UserData: ud}
		done := make(chan *moonring.Completion, 1)
		go func() {
			for {
				k, err := r.SubmitAndWait(ctx, []moonring.Entry{e}, 1)
				if k == 0 && errors.Is(err, moonring.ErrSQFull) {
					// The canceller's entries fill the 16-entry SQ at
					// times: a full SQ is the caller's to wait out.
					runtime.Gosched()
					continue
				}
				if k != 1 || err != nil {
					t.Errorf("SubmitAndWait: %d, %v", k, err)
					done <- nil
					return
				}
				done <- r.Peek()
				return
			}
		}()
		var c *moonring.Completion
		select {
		case c = <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("request %d: SubmitAndWait hangs", i)
		}
		if c == nil {
			t.FailNow()
		}
		if c.UserData != ud || (c.Err() != nil && c.Status != moonring.CANCELED) {
			t.Fatalf("request %d: %+v, want %d OK or CANCELED", i, *c, ud)
		}
		r.Advance(1)
		if r.Peek() != nil {
			t.Fatalf("request %d: a second completion", i)
		}
	}
	close(stop)
	wg.Wait()

	if raceEnabled {
		// make test runs it again without the race detector.
		t.Log("allocations not counted under the race detector (its sync.Pool drops the tcp target's buffers at random)")
		return
	}
	e = moonring.Entry{Op: moonring.OpRead, Segment: p.seg, Buffer: lid, Remote: base, Length: 8}
	es := []moonring.Entry{e}
	allocs := testing.AllocsPerRun(100, func() {
		if _, err := r.SubmitAndWait(ctx, es, 1); err != nil {
			t.Fatal(err)
		}
		r.Advance(1)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per SubmitAndWait", allocs)
	}
}
