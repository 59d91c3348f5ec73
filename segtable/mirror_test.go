package segtable

import (
	"fmt"
	"reflect"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/internal/proptest"
)

type mirrorOp struct {
	Kind int
	A, B uint32
}

const (
	mirrorInsert = iota
	mirrorInsertRun
	mirrorDelete
	mirrorReset
	mirrorFlat
)

// mirrorItem is what the test's conv makes of a buffer: its address and
// length, as a transport's entry would hold.
type mirrorItem struct{ addr, length uint64 }

// keepAll keeps every buffer (the engine's and the local transport's);
// keepKeyed only those with a "k" key (tcp's).
func keepAll(b *BufferDesc) (mirrorItem, bool) { return mirrorItem{b.Addr, b.Length}, true }
func keepKeyed(b *BufferDesc) (mirrorItem, bool) {
	return mirrorItem{b.Addr, b.Length}, b.Keys["k"] != ""
}

// TestMirrorProperty: after random registrations, unregistrations,
// resets and flat descriptors, a Mirror updated from the last one equals
// one built from scratch, made tables only for the chunks that changed,
// and answers every lookup as a scan of the buffers does: Floor (with the
// range checked), At of what Floor found, Buffer, Index, Len.
func TestMirrorProperty(t *testing.T) {
	props := proptest.Properties(t, 20)
	props.Property("an updated Mirror is a rebuilt one", prop.ForAll(runMirrorOps,
		gen.SliceOfN(200, gen.Struct(reflect.TypeOf(mirrorOp{}), map[string]gopter.Gen{
			"Kind": gen.Weighted([]gen.WeightedGen{
				{Weight: 8, Gen: gen.Const(mirrorInsert)},
				{Weight: 2, Gen: gen.Const(mirrorInsertRun)},
				{Weight: 6, Gen: gen.Const(mirrorDelete)},
				{Weight: 1, Gen: gen.Const(mirrorReset)},
				{Weight: 1, Gen: gen.Const(mirrorFlat)},
			}),
			"A": gen.UInt32(),
			"B": gen.UInt32(),
		}))))
	props.TestingRun(t)
}

// runMirrorOps runs ops on a ChunkList, a map of its buffers and two
// Mirrors of it updated step by step: "" when they agree.
func runMirrorOps(ops []mirrorOp) string {
	const slots = 4096 // buffer i at i*64, 1-64 bytes
	var l ChunkList
	model := map[uint64]BufferDesc{}
	var all, keyed *Mirror[mirrorItem]
	buf := func(slot uint32, b uint32) BufferDesc {
		d := BufferDesc{Addr: uint64(slot%slots) * 64, Length: uint64(1 + b%64)}
		if b%3 > 0 {
			d.Keys = map[string]string{"k": fmt.Sprint(b)}
		}
		return d
	}
	for step, op := range ops {
		cs := (*BufferChunks)(nil)
		switch op.Kind {
		case mirrorInsert, mirrorInsertRun:
			n := 1
			if op.Kind == mirrorInsertRun {
				n = 1 + int(op.B%200)
			}
			for k := range n {
				b := buf(op.A+uint32(k), op.B+uint32(k))
				if _, ok := model[b.Addr]; ok {
					continue
				}
				if err := l.Insert(b); err != nil {
					return fmt.Sprintf("step %d: Insert: %v", step, err)
				}
				model[b.Addr] = b
			}
		case mirrorDelete:
			addr := uint64(op.A%slots) * 64
			for a := range model { // one near A, else any
				if a >= addr {
					addr = a
					break
				}
			}
			if _, ok := model[addr]; ok {
				l.Delete(addr)
				delete(model, addr)
			}
		case mirrorReset:
			bufs := sortedModel(model)
			if err := l.Reset(bufs); err != nil {
				return fmt.Sprintf("step %d: Reset: %v", step, err)
			}
		case mirrorFlat:
			cs = ChunksOf(&SegmentDesc{Buffers: sortedModel(model)})
		}
		if cs == nil {
			cs = l.Chunks()
		}
		oldAll := all
		all, keyed = NewMirror(all, cs, keepAll), NewMirror(keyed, cs, keepKeyed)
		if why := sameMirror(all, NewMirror(nil, cs, keepAll)); why != "" {
			return fmt.Sprintf("step %d: all: %s", step, why)
		}
		if why := sameMirror(keyed, NewMirror(nil, cs, keepKeyed)); why != "" {
			return fmt.Sprintf("step %d: keyed: %s", step, why)
		}
		if oldAll != nil && op.Kind != mirrorFlat && op.Kind != mirrorReset {
			made := madeChunks(all, oldAll)
			var lo, hi int
			if oldAll != nil {
				lo, hi = cs.Changed(oldAll.src)
			}
			if made > hi-lo {
				return fmt.Sprintf("step %d: %d chunk tables made for %d chunks changed", step, made, hi-lo)
			}
		}
		if why := checkLookups(all, keyed, sortedModel(model), uint64(step)); why != "" {
			return fmt.Sprintf("step %d: %s", step, why)
		}
	}
	return ""
}

func sortedModel(model map[uint64]BufferDesc) []BufferDesc {
	var out []BufferDesc
	for a := uint64(0); a < 4096*64; a += 64 {
		if b, ok := model[a]; ok {
			out = append(out, b)
		}
	}
	return out
}

// sameMirror compares two Mirrors' tables (not their identity).
func sameMirror(a, b *Mirror[mirrorItem]) string {
	if a.n != b.n || len(a.pages) != len(b.pages) || !reflect.DeepEqual(a.firsts, b.firsts) || !reflect.DeepEqual(a.bases, b.bases) {
		return fmt.Sprintf("tops differ: %d/%d buffers, %d/%d pages", a.n, b.n, len(a.pages), len(b.pages))
	}
	for p := range a.pages {
		x, y := a.pages[p], b.pages[p]
		if x.src != y.src || !reflect.DeepEqual(x.firsts, y.firsts) || !reflect.DeepEqual(x.bases, y.bases) || len(x.chunks) != len(y.chunks) {
			return fmt.Sprintf("page %d differs", p)
		}
		for c := range x.chunks {
			if x.chunks[c].src != y.chunks[c].src || !reflect.DeepEqual(x.chunks[c].starts, y.chunks[c].starts) || !reflect.DeepEqual(x.chunks[c].items, y.chunks[c].items) {
				return fmt.Sprintf("page %d chunk %d differs", p, c)
			}
		}
	}
	return ""
}

// madeChunks counts m's chunk tables that old does not hold.
func madeChunks(m, old *Mirror[mirrorItem]) int {
	had := map[*mirrorItem]bool{} // a chunk's table by its entries' array
	for _, p := range old.pages {
		for _, c := range p.chunks {
			had[unsafe.SliceData(c.items)] = true
		}
	}
	n := 0
	for _, p := range m.pages {
		for _, c := range p.chunks {
			if !had[unsafe.SliceData(c.items)] {
				n++
			}
		}
	}
	return n
}

// checkLookups checks every lookup of all (every buffer) and keyed (the
// keyed ones) against bufs, the buffers in address order.
func checkLookups(all, keyed *Mirror[mirrorItem], bufs []BufferDesc, salt uint64) string {
	if all.Len() != len(bufs) || keyed.Len() != len(bufs) {
		return fmt.Sprintf("Len %d, %d, want %d", all.Len(), keyed.Len(), len(bufs))
	}
	for i := range bufs {
		if b := all.Buffer(i); b == nil || b.Addr != bufs[i].Addr {
			return fmt.Sprintf("Buffer(%d) = %v, want %#x", i, b, bufs[i].Addr)
		}
	}
	if all.Buffer(len(bufs)) != nil || all.Buffer(-1) != nil {
		return "Buffer past the end"
	}
	holds := func(v *mirrorItem, addr, n uint64) bool {
		return v != nil && n <= v.length && addr >= v.addr && addr-v.addr <= v.length-n
	}
	for k := uint64(0); k < 64; k++ {
		addr := (k*2654435761 + salt*40503) % (4097 * 64)
		n := 1 + k%8
		want, wantKeyed := -1, -1
		// The last buffer that starts at or below addr holds it, or none.
		if i := sort.Search(len(bufs), func(i int) bool { return bufs[i].Addr > addr }) - 1; i >= 0 {
			if b := bufs[i]; n <= b.Length && addr-b.Addr <= b.Length-n {
				want = i
				if b.Keys["k"] != "" {
					wantKeyed = i
				}
			}
		}
		v, pos := all.Floor(addr)
		got := -1
		if holds(v, addr, n) {
			got = all.Index(pos)
			if all.At(pos) != v {
				return fmt.Sprintf("At(Floor(%#x)) is another entry", addr)
			}
		}
		if got != want {
			return fmt.Sprintf("Floor(%#x, %d) found %d, want %d", addr, n, got, want)
		}
		kv, _ := keyed.Floor(addr)
		if gotKeyed := holds(kv, addr, n); gotKeyed != (wantKeyed >= 0) || gotKeyed && kv.addr != bufs[wantKeyed].Addr {
			return fmt.Sprintf("keyed Floor(%#x, %d) = %v, want index %d", addr, n, kv, wantKeyed)
		}
	}
	return ""
}

// TestMirrorConcurrent: lookups through an atomic pointer to a Mirror,
// as the transports and Resolve do, while another goroutine updates it
// through registrations and unregistrations: every buffer that stays
// registered is found at every moment (run with -race).
func TestMirrorConcurrent(t *testing.T) {
	var l ChunkList
	const stay = 500
	for i := range stay {
		if err := l.Insert(BufferDesc{Addr: uint64(2*i) * 64, Length: 64}); err != nil {
			t.Fatal(err)
		}
	}
	var cur atomic.Pointer[Mirror[mirrorItem]]
	cur.Store(NewMirror(nil, l.Chunks(), keepAll))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var bad atomic.Int64
	for g := range 2 {
		wg.Go(func() {
			var hint Pos
			for k := uint64(g); ; k++ {
				select {
				case <-stop:
					return
				default:
				}
				addr := (k * 7919 % stay) * 2 * 64
				m := cur.Load()
				if v := m.At(hint); v != nil && v.addr == addr {
					continue
				}
				v, pos := m.Floor(addr + 10)
				if v == nil || v.addr != addr {
					bad.Add(1)
				}
				hint = pos
			}
		})
	}
	for i := range 3000 {
		addr := uint64(2*(i%stay)+1) * 64 // between the buffers that stay
		if i/stay%2 == 0 {
			if err := l.Insert(BufferDesc{Addr: addr, Length: 64}); err != nil {
				t.Fatal(err)
			}
		} else if !l.Delete(addr) {
			t.Fatalf("Delete %#x", addr)
		}
		cur.Store(NewMirror(cur.Load(), l.Chunks(), keepAll))
	}
	close(stop)
	wg.Wait()
	if bad.Load() > 0 {
		t.Fatalf("%d lookups missed a buffer that stayed registered", bad.Load())
	}
}

// TestMirrorLookupAllocs: the per-request lookups allocate nothing.
func TestMirrorLookupAllocs(t *testing.T) {
	var l ChunkList
	for i := range 5000 {
		if err := l.Insert(BufferDesc{Addr: uint64(i) * 64, Length: 64}); err != nil {
			t.Fatal(err)
		}
	}
	m := NewMirror(nil, l.Chunks(), keepAll)
	if n := testing.AllocsPerRun(100, func() {
		_, pos := m.Floor(4000*64 + 3)
		m.At(pos)
	}); n != 0 {
		t.Fatalf("%v allocations a lookup", n)
	}
}
