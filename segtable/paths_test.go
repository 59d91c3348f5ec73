package segtable_test

import (
	"sync"
	"sync/atomic"
	"testing"

	"github.com/moonring/moonring/segtable"
)

// TestPathFail: a failure marks a path down only when another is up, the
// current path moves to the first one up, and Repick brings back the
// preferred path once it is marked up.
func TestPathFail(t *testing.T) {
	var ss segtable.Segments[endpoint]
	s, err := ss.Open("a", desc("a"), 1, 0, endpoint{"shm"}, endpoint{})
	if err != nil {
		t.Fatal(err)
	}
	one := s.Path()
	if next, marked := s.Fail(one); next != one || marked || one.Down() {
		t.Fatalf("the only path: Fail = %v, %v; down %v (want it kept)", next, marked, one.Down())
	}
	two := &segtable.Path[endpoint]{Endpoint: endpoint{"tcp"}, Transport: 2}
	s.SetPaths([]*segtable.Path[endpoint]{one, two})
	if s.Path() != one || s.PathOf(2) != two || s.PathOf(3) != nil {
		t.Fatal("SetPaths: the preferred path is not current, or PathOf misses")
	}
	next, marked := s.Fail(one)
	if next != two || !marked || !one.Down() || s.Path() != two {
		t.Fatalf("Fail(preferred) = %v, %v; current %v", next, marked, s.Path())
	}
	if next, marked := s.Fail(one); next != two || marked {
		t.Fatalf("a second Fail of a down path = %v, %v", next, marked)
	}
	// The other fails too: nothing else is up, it stays.
	if next, marked := s.Fail(two); next != two || marked || two.Down() {
		t.Fatalf("Fail(last up) = %v, %v", next, marked)
	}
	one.MarkUp()
	if s.Repick() != one || s.Path() != one {
		t.Fatal("Repick after MarkUp does not fail back")
	}
}

// TestPathFailConcurrent: rings of several pollers failing the same path
// at once mark it down once, and all find the other path.
func TestPathFailConcurrent(t *testing.T) {
	var ss segtable.Segments[endpoint]
	s, err := ss.Open("a", desc("a"), 1, 0, endpoint{"shm"}, endpoint{})
	if err != nil {
		t.Fatal(err)
	}
	one := s.Path()
	two := &segtable.Path[endpoint]{Endpoint: endpoint{"tcp"}, Transport: 2}
	s.SetPaths([]*segtable.Path[endpoint]{one, two})
	const n = 8
	var wg sync.WaitGroup
	var marks atomic.Int32
	for range n {
		wg.Go(func() {
			next, marked := s.Fail(one)
			if marked {
				marks.Add(1)
			}
			if next != two {
				t.Errorf("Fail returned %v, want the other path", next)
			}
		})
	}
	wg.Wait()
	if marks.Load() != 1 || s.Path() != two {
		t.Fatalf("%d marks, current %v; want one mark and the other path", marks.Load(), s.Path())
	}
}
