package mpsc_test

import (
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/internal/mpsc"
)

func TestNewSize(t *testing.T) {
	for _, size := range []int{-8, 0, 1, 3, 6, 12, 1<<30 + 1, 1 << 31} {
		if q, err := mpsc.New[uint64](size); !errors.Is(err, mpsc.ErrSize) || q != nil {
			t.Errorf("New(%d) = %v, %v; want nil, ErrSize", size, q, err)
		}
	}
	for _, size := range []int{2, 4, 8, 1024} {
		q, err := mpsc.New[uint64](size)
		if err != nil {
			t.Fatalf("New(%d): %v", size, err)
		}
		if q.Cap() != size || q.Len() != 0 || !q.Empty() {
			t.Errorf("New(%d): Cap %d Len %d Empty %v", size, q.Cap(), q.Len(), q.Empty())
		}
	}
}

// op is one step of a sequential model test.
type op struct {
	Kind int // see the switch in runOps
	N    int // how many values to push, pop or reserve
	K    int // how many of the readable values to release
}

const (
	opPushOne = iota
	opPush
	opPop
	opPeekRelease
	opReserveCommit
	opKinds
)

func (o op) String() string {
	switch o.Kind {
	case opPushOne:
		return "PushOne"
	case opPush:
		return fmt.Sprintf("Push(%d)", o.N)
	case opPop:
		return fmt.Sprintf("Pop(%d)", o.N)
	case opPeekRelease:
		return fmt.Sprintf("Readable(%d)+Release(<=%d)", o.N, o.K)
	case opReserveCommit:
		return fmt.Sprintf("Reserve(%d)+Commit", o.N)
	}
	return fmt.Sprintf("op(%d)", o.Kind)
}

func genOps() gopter.Gen {
	return gen.SliceOf(gen.Struct(reflect.TypeOf(op{}), map[string]gopter.Gen{
		"Kind": gen.IntRange(0, opKinds-1),
		"N":    gen.IntRange(0, 10),
		"K":    gen.IntRange(0, 10),
	}))
}

// runOps applies ops to an 8-slot queue and to a slice-backed FIFO and
// returns the first difference, or "".
func runOps(ops []op) string {
	const size = 8
	q, err := mpsc.New[uint64](size)
	if err != nil {
		return err.Error()
	}
	var model []uint64
	next := uint64(1)
	values := func(n int) []uint64 {
		vs := make([]uint64, n)
		for i := range vs {
			vs[i] = next
			next++
		}
		return vs
	}
	fits := func(n int) int { return min(n, size-len(model)) }
	for i, o := range ops {
		fail := func(format string, args ...any) string {
			return fmt.Sprintf("step %d %v: %s", i, o, fmt.Sprintf(format, args...))
		}
		switch o.Kind {
		case opPushOne:
			v := values(1)
			want := fits(1) == 1
			if got := q.PushOne(&v[0]); got != want {
				return fail("PushOne = %v, want %v (model len %d)", got, want, len(model))
			}
			if want {
				model = append(model, v[0])
			} else {
				next-- // not taken: reuse the value
			}
		case opPush:
			vs := values(o.N)
			want := fits(o.N)
			if got := q.Push(vs); got != want {
				return fail("Push = %d, want %d (model len %d)", got, want, len(model))
			}
			model = append(model, vs[:want]...)
			next -= uint64(o.N - want)
		case opPop:
			dst := make([]uint64, o.N)
			want := min(o.N, len(model))
			got := q.Pop(dst)
			if got != want || !slices.Equal(dst[:got], model[:want]) {
				return fail("Pop = %d %v, want %d %v", got, dst[:got], want, model[:want])
			}
			model = model[want:]
		case opPeekRelease:
			pos, n := q.Readable(o.N)
			if want := min(o.N, len(model)); n != want {
				return fail("Readable = %d, want %d", n, want)
			}
			for j := 0; j < n; j++ {
				if v := *q.Slot(pos + uint64(j)); v != model[j] {
					return fail("Slot(pos+%d) = %d, want %d", j, v, model[j])
				}
			}
			k := min(o.K, n)
			q.Release(k)
			model = model[k:]
		case opReserveCommit:
			pos, n := q.Reserve(o.N)
			if want := fits(o.N); n != want {
				return fail("Reserve = %d, want %d", n, want)
			}
			if n > 0 {
				vs := values(n)
				for j, v := range vs {
					*q.Slot(pos + uint64(j)) = v
				}
				q.Commit(pos, n)
				model = append(model, vs...)
			}
		}
		if q.Len() != len(model) || q.Empty() != (len(model) == 0) || q.Cap() != size {
			return fail("Len %d Empty %v Cap %d, model len %d", q.Len(), q.Empty(), q.Cap(), len(model))
		}
	}
	// Drain: what is left comes out in order.
	rest := make([]uint64, size+1)
	if n := q.Pop(rest); !slices.Equal(rest[:n], model) {
		return fmt.Sprintf("final Pop = %v, want %v", rest[:n], model)
	}
	return ""
}

func TestQueueModel(t *testing.T) {
	props := properties(t, 300)
	props.Property("8-slot queue matches a FIFO", prop.ForAll(runOps, genOps()))
	props.TestingRun(t)
}

// producerRun describes one concurrent run: how many producers, how many
// values each pushes, the batch limit, the queue size and the consumer's
// batch limit.
type producerRun struct {
	Producers int
	PerProd   int
	Batch     int
	SizeLog   int
	PopBatch  int
}

// tag packs a producer number and its sequence number into one value.
func tag(p, i int) uint64 { return uint64(p)<<32 | uint64(i) }

// runProducers pushes from many goroutines and pops from one; it returns
// the first lost, duplicated or reordered value, or "".
func runProducers(r producerRun) string {
	q, err := mpsc.New[uint64](1 << r.SizeLog)
	if err != nil {
		return err.Error()
	}
	var wg sync.WaitGroup
	for p := range r.Producers {
		wg.Go(func() {
			buf := make([]uint64, r.Batch)
			for i := 0; i < r.PerProd; {
				// Rotate through the three producer paths.
				n := min(1+(i+p)%r.Batch, r.PerProd-i)
				var got int
				switch (i / r.Batch) % 3 {
				case 0:
					for j := range n {
						buf[j] = tag(p, i+j)
					}
					got = q.Push(buf[:n])
				case 1:
					v := tag(p, i)
					if q.PushOne(&v) {
						got = 1
					}
				case 2:
					pos, k := q.Reserve(n)
					for j := range k {
						*q.Slot(pos + uint64(j)) = tag(p, i+j)
					}
					if k > 0 {
						q.Commit(pos, k)
					}
					got = k
				}
				if got == 0 {
					runtime.Gosched()
				}
				i += got
			}
		})
	}
	next := make([]int, r.Producers)
	dst := make([]uint64, r.PopBatch)
	total := r.Producers * r.PerProd
	hang := time.Now().Add(time.Minute)
	for seen, spins := 0, 0; seen < total; spins++ {
		n := q.Pop(dst)
		if n == 0 {
			if spins%1024 == 0 && time.Now().After(hang) {
				wg.Wait()
				return fmt.Sprintf("hang: %d of %d values arrived; queue Len %d", seen, total, q.Len())
			}
			runtime.Gosched()
			continue
		}
		for _, v := range dst[:n] {
			p, i := int(v>>32), int(uint32(v))
			if p >= r.Producers || i != next[p] {
				wg.Wait()
				return fmt.Sprintf("got producer %d value %d, want value %d", p, i, next[min(p, r.Producers-1)])
			}
			next[p]++
		}
		seen += n
	}
	wg.Wait()
	if n := q.Pop(dst); n != 0 || !q.Empty() || q.Len() != 0 {
		return fmt.Sprintf("extra values after all arrived: %v", dst[:n])
	}
	return ""
}

func TestQueueProducers(t *testing.T) {
	props := properties(t, 25)
	props.Property("many producers: nothing lost, duplicated or reordered", prop.ForAll(
		runProducers,
		gen.Struct(reflect.TypeOf(producerRun{}), map[string]gopter.Gen{
			"Producers": gen.IntRange(1, 4),
			"PerProd":   gen.IntRange(1, 3000),
			"Batch":     gen.IntRange(1, 10),
			"SizeLog":   gen.IntRange(1, 6),
			"PopBatch":  gen.IntRange(1, 16),
		}),
	))
	props.TestingRun(t)
}

func TestQueueProducersTiny(t *testing.T) {
	// Fixed runs with a 2-slot and an 8-slot queue and four producers, so the
	// full queue and the wait for an earlier commit are always exercised.
	for _, r := range []producerRun{
		{Producers: 4, PerProd: 5000, Batch: 3, SizeLog: 1, PopBatch: 1},
		{Producers: 4, PerProd: 5000, Batch: 10, SizeLog: 3, PopBatch: 8},
	} {
		if msg := runProducers(r); msg != "" {
			t.Errorf("%+v: %s", r, msg)
		}
	}
}

func TestReserveNothing(t *testing.T) {
	q, _ := mpsc.New[uint64](4)
	for _, n := range []int{-1, 0} {
		if _, got := q.Reserve(n); got != 0 {
			t.Errorf("Reserve(%d) = %d, want 0", n, got)
		}
	}
	if got := q.Push(nil); got != 0 || q.Len() != 0 {
		t.Errorf("Push(nil) = %d, Len %d", got, q.Len())
	}
	q.Release(0)
	if q.Pop(nil) != 0 || q.Len() != 0 {
		t.Errorf("Pop(nil) on empty queue changed it")
	}
}

func TestPushPopNoAlloc(t *testing.T) {
	q, _ := mpsc.New[uint64](8)
	in := []uint64{1, 2, 3}
	out := make([]uint64, 3)
	v := uint64(7)
	allocs := testing.AllocsPerRun(100, func() {
		q.Push(in)
		q.PushOne(&v)
		q.Pop(out)
		q.Pop(out[:1])
	})
	if allocs != 0 {
		t.Errorf("Push+PushOne+Pop allocate %v times per run", allocs)
	}
}

// Grow keeps an empty queue's positions and gives it room for size
// values; it refuses a queue holding a reservation or values, and sizes
// below Cap or not a power of two, changing nothing.
func TestGrow(t *testing.T) {
	q, err := mpsc.New[uint64](4)
	if err != nil {
		t.Fatal(err)
	}
	var out [16]uint64
	for i := range uint64(6) { // positions past a wrap before the growth
		if !q.PushOne(&i) || q.Pop(out[:1]) != 1 || out[0] != i {
			t.Fatalf("value %d: not through the queue (got %d)", i, out[0])
		}
	}
	for _, size := range []int{2, 12, 1<<30 + 1} {
		if err := q.Grow(size); !errors.Is(err, mpsc.ErrSize) || q.Cap() != 4 {
			t.Errorf("Grow(%d) = %v, Cap %d; want ErrSize, 4", size, err, q.Cap())
		}
	}
	pos, n := q.Reserve(1)
	if err := q.Grow(16); !errors.Is(err, mpsc.ErrNotEmpty) || q.Cap() != 4 {
		t.Fatalf("Grow with a reservation = %v, Cap %d; want ErrNotEmpty, 4", err, q.Cap())
	}
	*q.Slot(pos) = 99
	q.Commit(pos, n)
	if err := q.Grow(16); !errors.Is(err, mpsc.ErrNotEmpty) {
		t.Fatalf("Grow with a value = %v; want ErrNotEmpty", err)
	}
	if q.Pop(out[:1]) != 1 || out[0] != 99 {
		t.Fatalf("the value held across a refused Grow: %d", out[0])
	}
	if err := q.Grow(16); err != nil {
		t.Fatal(err)
	}
	if q.Cap() != 16 || q.Len() != 0 || !q.Empty() {
		t.Fatalf("after Grow(16): Cap %d Len %d Empty %v", q.Cap(), q.Len(), q.Empty())
	}
	if pos, n := q.Reserve(1); pos != 7 || n != 1 {
		t.Fatalf("first reservation after Grow: %d, %d; want position 7", pos, n)
	} else {
		*q.Slot(pos) = 100
		q.Commit(pos, n)
	}
	vs := make([]uint64, 16)
	for i := range vs {
		vs[i] = 101 + uint64(i)
	}
	if got := q.Push(vs); got != 15 {
		t.Fatalf("Push after Grow took %d of 16; want the 15 that fit", got)
	}
	if got := q.Pop(out[:]); got != 16 {
		t.Fatalf("Pop after Grow: %d values; want 16", got)
	}
	for i, v := range out {
		if v != 100+uint64(i) {
			t.Fatalf("value %d after Grow is %d; want %d", i, v, 100+i)
		}
	}
}
