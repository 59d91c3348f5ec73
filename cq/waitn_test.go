package cq

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// TestWaitWakesOnceForN: a Wait for 4 is not woken by the three Posts
// before the fourth (nothing is sent on wake), and returns once the fourth
// lands.
func TestWaitWakesOnceForN(t *testing.T) {
	r, err := New(64)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- r.Wait(context.Background(), 4) }()
	deadline := time.Now().Add(10 * time.Second)
	for !r.waiting.Load() {
		if time.Now().After(deadline) {
			t.Fatal("hang: Wait never slept")
		}
		time.Sleep(time.Millisecond)
	}
	for i := range 3 {
		r.Post(&Completion{UserData: uint64(i)})
		if len(r.wake) != 0 {
			t.Fatalf("Post %d of 3 woke a Wait for 4", i+1)
		}
	}
	select {
	case err := <-done:
		t.Fatalf("Wait(4) returned with 3 ready: %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	r.Post(&Completion{UserData: 3})
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("hang: the fourth Post did not wake Wait(4)")
	}
}

// TestWaitNProducers: producers post one by one and in batches, at once,
// while the reader waits for counts of its choosing and reaps: no wakeup is
// lost (each Wait returns within the bound) and every completion is read
// once.
func TestWaitNProducers(t *testing.T) {
	const producers, each = 4, 3000
	r, err := New(256)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(p), 1))
			cs := make([]Completion, 8)
			for i := 0; i < each; {
				k := min(1+rng.IntN(len(cs)), each-i)
				for j := range k {
					cs[j] = Completion{UserData: uint64(p)<<32 | uint64(i+j)}
				}
				r.PostBatch(cs[:k])
				i += k
			}
		}()
	}
	seen := make([]int, producers)
	buf := make([]Completion, 64)
	rng := rand.New(rand.NewPCG(99, 2))
	for got := 0; got < producers*each; {
		n := min(1+rng.IntN(48), producers*each-got)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := r.Wait(ctx, n)
		cancel()
		if err != nil {
			t.Fatalf("Wait(%d) with %d of %d read: %v (a lost wakeup)", n, got, producers*each, err)
		}
		k := r.PeekBatch(buf)
		if k < n && k < len(buf) {
			t.Fatalf("Wait(%d) returned with %d ready", n, k)
		}
		for _, c := range buf[:k] {
			p, i := int(c.UserData>>32), int(c.UserData&0xffffffff)
			if i != seen[p] {
				t.Fatalf("producer %d: read %d, want %d", p, i, seen[p])
			}
			seen[p]++
		}
		r.Advance(k)
		got += k
	}
	wg.Wait()
}
