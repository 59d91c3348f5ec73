package sq_test

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"

	"github.com/moonring/moonring/internal/mpsc"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/sq"
)

func TestEntrySize(t *testing.T) {
	if got := unsafe.Sizeof(sq.Entry{}); got != sq.EntrySize || sq.EntrySize != 64 {
		t.Fatalf("Sizeof(Entry) = %d, EntrySize = %d; want 64", got, sq.EntrySize)
	}
	var e sq.Entry
	for _, f := range []struct {
		name     string
		off, len uintptr
	}{
		{"Segment", unsafe.Offsetof(e.Segment), 4},
		{"Buffer", unsafe.Offsetof(e.Buffer), 8},
		{"Local", unsafe.Offsetof(e.Local), 16},
		{"Remote", unsafe.Offsetof(e.Remote), 24},
		{"Length", unsafe.Offsetof(e.Length), 32},
		{"UserData", unsafe.Offsetof(e.UserData), 40},
		{"Timeout", unsafe.Offsetof(e.Timeout), 48},
	} {
		if f.off != f.len {
			t.Errorf("Offsetof(%s) = %d, want %d", f.name, f.off, f.len)
		}
	}
}

func randEntry(r *rand.Rand) sq.Entry {
	return sq.Entry{
		Op:       sq.Op(r.Uint32()),
		Flags:    sq.Flags(r.Uint32()),
		Segment:  segtable.SegmentID(r.Uint32()),
		Buffer:   segtable.BufferID(r.Uint32()),
		Local:    r.Uint64(),
		Remote:   r.Uint64(),
		Length:   r.Uint64(),
		UserData: r.Uint64(),
		Timeout:  r.Uint64(),
	}
}

func littleEndian() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}

func TestEntryRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, sq.EntrySize)
	for range 1000 {
		e := randEntry(r)
		if err := e.MarshalTo(b); err != nil {
			t.Fatal(err)
		}
		// The encoding is the in-memory layout on a little-endian machine,
		// so the two cannot drift apart unnoticed.
		if littleEndian() {
			mem := unsafe.Slice((*byte)(unsafe.Pointer(&e)), sq.EntrySize)
			if !bytes.Equal(mem, b) {
				t.Fatalf("MarshalTo(%+v) = %x, memory holds %x", e, b, mem)
			}
		}
		var d sq.Entry
		if err := d.UnmarshalFrom(b); err != nil {
			t.Fatalf("UnmarshalFrom(MarshalTo(%+v)): %v", e, err)
		}
		if d != e {
			t.Fatalf("round trip: %+v became %+v", e, d)
		}
	}
}

func TestMarshalClearsBuffer(t *testing.T) {
	b := bytes.Repeat([]byte{0xff}, sq.EntrySize)
	e := sq.Entry{Op: sq.Write, Length: 1}
	if err := e.MarshalTo(b); err != nil {
		t.Fatal(err)
	}
	var d sq.Entry
	if err := d.UnmarshalFrom(b); err != nil || d != e {
		t.Fatalf("MarshalTo over a dirty buffer: %x decodes to %+v, %v", b, d, err)
	}
}

var reservedBytes = []int{3, 12, 13, 14, 15}

func TestEntryReservedRefused(t *testing.T) {
	e := sq.Entry{Op: sq.Read, Segment: 3, Buffer: 4, Local: 5, Remote: 6, Length: 7, UserData: 8, Timeout: 9}
	for _, i := range reservedBytes {
		b := make([]byte, sq.EntrySize)
		if err := e.MarshalTo(b); err != nil {
			t.Fatal(err)
		}
		b[i] = 0x80
		d := sq.Entry{UserData: 42}
		if err := d.UnmarshalFrom(b); !errors.Is(err, sq.ErrReserved) {
			t.Errorf("byte %d set: UnmarshalFrom = %v, want ErrReserved", i, err)
		}
		if d.UserData != 42 {
			t.Errorf("byte %d set: a refused decode changed the entry to %+v", i, d)
		}
	}
}

// TestEntryTransportHint: byte 2 carries the transport slot of a hint,
// and round-trips with its flags.
func TestEntryTransportHint(t *testing.T) {
	for _, fl := range []sq.Flags{sq.FlagTransportOnly, sq.FlagTransportPrefer} {
		e := sq.Entry{Op: sq.Read, Flags: fl, Transport: 5, Segment: 3, Buffer: 4, Length: 7}
		b := make([]byte, sq.EntrySize)
		if err := e.MarshalTo(b); err != nil {
			t.Fatal(err)
		}
		if b[2] != 5 || b[1] != byte(fl) {
			t.Fatalf("hint encoded as flags %#x transport %d", b[1], b[2])
		}
		var d sq.Entry
		if err := d.UnmarshalFrom(b); err != nil || d != e {
			t.Fatalf("round trip: %+v, %v; want %+v", d, err, e)
		}
		if fl&sq.FlagsTransport == 0 || fl&^sq.FlagsMask != 0 {
			t.Fatalf("flag %#x is not a known transport flag", fl)
		}
	}
}

func TestEntryWrongLength(t *testing.T) {
	var e sq.Entry
	for _, n := range []int{0, 1, 63, 65, 128} {
		if err := e.MarshalTo(make([]byte, n)); !errors.Is(err, sq.ErrShort) {
			t.Errorf("MarshalTo(%d bytes) = %v, want ErrShort", n, err)
		}
		if err := e.UnmarshalFrom(make([]byte, n)); !errors.Is(err, sq.ErrShort) {
			t.Errorf("UnmarshalFrom(%d bytes) = %v, want ErrShort", n, err)
		}
	}
}

func FuzzEntryDecode(f *testing.F) {
	f.Add(make([]byte, sq.EntrySize))
	f.Add(make([]byte, sq.EntrySize-1))
	f.Add(make([]byte, sq.EntrySize+1))
	f.Add([]byte{})
	r := rand.New(rand.NewPCG(3, 4))
	for range 4 {
		b := make([]byte, sq.EntrySize)
		e := randEntry(r)
		if err := e.MarshalTo(b); err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	b := make([]byte, sq.EntrySize)
	b[0], b[60] = byte(sq.Write), 1
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		var e sq.Entry
		err := e.UnmarshalFrom(b)
		switch {
		case len(b) != sq.EntrySize:
			if !errors.Is(err, sq.ErrShort) {
				t.Fatalf("%d bytes: err %v, want ErrShort", len(b), err)
			}
			return
		case reservedSet(b):
			if !errors.Is(err, sq.ErrReserved) {
				t.Fatalf("reserved bytes set in %x: err %v, want ErrReserved", b, err)
			}
			return
		case err != nil:
			t.Fatalf("valid encoding %x refused: %v", b, err)
		}
		out := make([]byte, sq.EntrySize)
		if err := e.MarshalTo(out); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(out, b) {
			t.Fatalf("round trip: %x became %x", b, out)
		}
	})
}

func reservedSet(b []byte) bool {
	for _, i := range reservedBytes {
		if b[i] != 0 {
			return true
		}
	}
	return false
}

func TestOp(t *testing.T) {
	for op, name := range map[sq.Op]string{sq.Nop: "nop", sq.Read: "read", sq.Write: "write", sq.Cancel: "cancel"} {
		if op.String() != name || !op.Valid() {
			t.Errorf("%d: String %q Valid %v", uint8(op), op.String(), op.Valid())
		}
	}
	for _, op := range []sq.Op{sq.Cancel + 1, 200, 255} {
		if op.Valid() || op.String() != fmt.Sprintf("op(%d)", uint8(op)) {
			t.Errorf("%d: String %q Valid %v", uint8(op), op.String(), op.Valid())
		}
	}
}

func TestDeadline(t *testing.T) {
	e := sq.Entry{}
	if got := e.Deadline(time.Second); got != time.Second {
		t.Errorf("Timeout 0: Deadline = %v, want the default", got)
	}
	e.Timeout = uint64(5 * time.Millisecond)
	if got := e.Deadline(time.Second); got != 5*time.Millisecond {
		t.Errorf("Timeout 5ms: Deadline = %v", got)
	}
	for _, to := range []uint64{1 << 63, 1<<64 - 1} {
		e.Timeout = to
		if got := e.Deadline(time.Second); got <= 0 {
			t.Errorf("Timeout %d: Deadline = %v, want the longest (it wrapped negative: the request ended at once)", to, got)
		}
	}
}

func TestNewSize(t *testing.T) {
	for _, size := range []int{0, 3, 1 << 31} {
		if _, err := sq.New(size, nil); !errors.Is(err, mpsc.ErrSize) {
			t.Errorf("New(%d) = %v, want ErrSize", size, err)
		}
	}
	q, err := sq.New(16, nil)
	if err != nil || q.Cap() != 16 || q.Len() != 0 || !q.Empty() {
		t.Fatalf("New(16) = %v; Cap %d Len %d", err, q.Cap(), q.Len())
	}
}

// rung reports whether the doorbell holds a wakeup, and takes it.
func rung(d *sq.Doorbell) bool {
	select {
	case <-d.C():
		return true
	default:
		return false
	}
}

func TestDoorbell(t *testing.T) {
	d := sq.NewDoorbell()
	d.Ring()
	if rung(d) {
		t.Error("Ring while not armed sent a wakeup")
	}
	d.Arm()
	d.Ring()
	if !rung(d) {
		t.Error("Arm+Ring sent no wakeup")
	}
	d.Ring()
	if rung(d) {
		t.Error("a second Ring after one Arm sent another wakeup")
	}
	d.Arm()
	d.Disarm()
	d.Ring()
	if rung(d) {
		t.Error("Ring after Disarm sent a wakeup")
	}
	// Several goroutines ringing one armed bell wake the poller once.
	d.Arm()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(d.Ring)
	}
	wg.Wait()
	if !rung(d) || rung(d) {
		t.Error("eight concurrent Rings of an armed bell did not wake exactly once")
	}
}

func TestPushRings(t *testing.T) {
	d := sq.NewDoorbell()
	q, err := sq.New(2, d)
	if err != nil {
		t.Fatal(err)
	}
	es := []sq.Entry{{UserData: 1}, {UserData: 2}}
	if q.Push(es) != 2 || rung(d) {
		t.Fatal("Push to a disarmed bell: want 2 entries and no wakeup")
	}
	d.Arm()
	if q.Push(es) != 0 || rung(d) {
		t.Fatal("Push to a full queue: want 0 entries and no wakeup")
	}
	if q.Pop(make([]sq.Entry, 1)) != 1 {
		t.Fatal("Pop found nothing")
	}
	// The failed Push left the bell armed: the next one that adds rings it.
	if q.Push(es) != 1 || !rung(d) {
		t.Fatal("Push after a failed one: want 1 entry and a wakeup")
	}
}

// sqOp is one step of the sequential model test of Queue.
type sqOp struct {
	Kind int // 0 push one, 1 push a batch, 2 pop, 3 peek and advance
	N    int
	K    int
}

func (o sqOp) String() string {
	return fmt.Sprintf("%s(n=%d,k=%d)", [...]string{"PushOne", "Push", "Pop", "Peek+Advance"}[o.Kind], o.N, o.K)
}

// entry returns the distinct entry number v of a test.
func entry(v uint64) sq.Entry {
	return sq.Entry{Op: sq.Op(v % 4), Segment: segtable.SegmentID(v), Buffer: segtable.BufferID(^v), Local: v * 3, Remote: ^v, Length: v + 1, UserData: v, Timeout: v << 7}
}

func runSQOps(ops []sqOp) string {
	const size = 8
	d := sq.NewDoorbell()
	q, err := sq.New(size, d)
	if err != nil {
		return err.Error()
	}
	var model []sq.Entry
	next := uint64(0)
	for i, o := range ops {
		fail := func(format string, args ...any) string {
			return fmt.Sprintf("step %d %v: %s", i, o, fmt.Sprintf(format, args...))
		}
		switch o.Kind {
		case 0, 1:
			n := 1
			if o.Kind == 1 {
				n = 1 + o.N%10
			}
			es := make([]sq.Entry, n)
			for j := range es {
				es[j] = entry(next + uint64(j))
			}
			want := min(n, size-len(model))
			d.Arm()
			got := q.Push(es)
			if got != want {
				return fail("Push(%d) = %d, want %d", n, got, want)
			}
			if rung(d) != (want > 0) {
				return fail("armed bell: Push of %d rang %v", got, !(want > 0))
			}
			d.Disarm()
			model = append(model, es[:got]...)
			next += uint64(got)
		case 2:
			dst := make([]sq.Entry, o.N)
			want := min(o.N, len(model))
			got := q.Pop(dst)
			if got != want || !slices.Equal(dst[:got], model[:want]) {
				return fail("Pop = %d %v, want %d %v", got, dst[:got], want, model[:want])
			}
			model = model[want:]
		case 3:
			pos, n := q.Peek(o.N)
			if want := min(o.N, len(model)); n != want {
				return fail("Peek = %d, want %d", n, want)
			}
			for j := range n {
				if e := q.Entry(pos + uint64(j)); *e != model[j] {
					return fail("Entry(pos+%d) = %+v, want %+v", j, *e, model[j])
				}
			}
			k := min(o.K, n)
			q.Advance(k)
			model = model[k:]
		}
		if q.Len() != len(model) || q.Empty() != (len(model) == 0) {
			return fail("Len %d Empty %v, model holds %d", q.Len(), q.Empty(), len(model))
		}
	}
	return ""
}

func TestQueueModel(t *testing.T) {
	props := properties(t, 300)
	props.Property("8-slot queue matches a FIFO", prop.ForAll(runSQOps,
		gen.SliceOf(gen.Struct(reflect.TypeOf(sqOp{}), map[string]gopter.Gen{
			"Kind": gen.IntRange(0, 3),
			"N":    gen.IntRange(0, 10),
			"K":    gen.IntRange(0, 10),
		}))))
	props.TestingRun(t)
}

// wakeRun is one concurrent run of producers against a parking poller.
type wakeRun struct {
	Producers int
	PerProd   int
	Batch     int
	SizeLog   int
	Queues    int  // queues sharing the poller's doorbell
	Ack       bool // each producer waits until its batch is taken before the next
}

const hang = 30 * time.Second // hang detector only; never reached when the code is right

// runWake runs producers that push tagged entries into queues sharing one
// doorbell and a poller that drains them and parks with Arm, recheck, wait.
// A lost wakeup leaves the poller parked while entries wait: with Ack set
// every batch's producer then waits for it, so the run hangs, and the hang
// detector reports it.
func runWake(r wakeRun) string {
	bell := sq.NewDoorbell()
	qs := make([]*sq.Queue, r.Queues)
	for i := range qs {
		var err error
		if qs[i], err = sq.New(1<<r.SizeLog, bell); err != nil {
			return err.Error()
		}
	}
	taken := make([]atomic.Int64, r.Producers)
	var abort atomic.Bool
	var wg sync.WaitGroup
	for p := range r.Producers {
		wg.Go(func() {
			q := qs[p%len(qs)]
			buf := make([]sq.Entry, r.Batch)
			for i := 0; i < r.PerProd && !abort.Load(); {
				n := min(r.Batch, r.PerProd-i)
				for j := range n {
					buf[j] = sq.Entry{Op: sq.Nop, UserData: uint64(p)<<32 | uint64(i+j)}
				}
				for sent := 0; sent < n && !abort.Load(); {
					got := q.Push(buf[sent:n])
					if got == 0 {
						runtime.Gosched()
					}
					sent += got
				}
				i += n
				for r.Ack && taken[p].Load() < int64(i) && !abort.Load() {
					runtime.Gosched()
				}
			}
		})
	}
	defer wg.Wait()
	defer abort.Store(true)

	next := make([]int, r.Producers)
	dst := make([]sq.Entry, 4)
	total := r.Producers * r.PerProd
	timer := time.NewTimer(hang)
	defer timer.Stop()
	for seen := 0; seen < total; {
		drained := 0
		for _, q := range qs {
			n := q.Pop(dst)
			for _, e := range dst[:n] {
				p, i := int(e.UserData>>32), int(uint32(e.UserData))
				if p >= r.Producers || i != next[p] {
					return fmt.Sprintf("got producer %d entry %d, want %d", p, i, next[min(p, r.Producers-1)])
				}
				next[p]++
				taken[p].Add(1)
			}
			drained += n
		}
		seen += drained
		if drained > 0 || seen == total {
			continue
		}
		bell.Arm()
		empty := true
		for _, q := range qs {
			empty = empty && q.Empty()
		}
		if !empty {
			bell.Disarm()
			continue
		}
		timer.Reset(hang)
		select {
		case <-bell.C():
		case <-timer.C:
			queued := 0
			for _, q := range qs {
				queued += q.Len()
			}
			return fmt.Sprintf("lost wakeup: poller parked %v with %d entries queued, %d of %d taken", hang, queued, seen, total)
		}
	}
	return ""
}

func TestNoLostWakeup(t *testing.T) {
	props := properties(t, 30)
	props.Property("a parking poller sees every entry", prop.ForAll(runWake,
		gen.Struct(reflect.TypeOf(wakeRun{}), map[string]gopter.Gen{
			"Producers": gen.IntRange(1, 4),
			"PerProd":   gen.IntRange(1, 400),
			"Batch":     gen.IntRange(1, 10),
			"SizeLog":   gen.IntRange(1, 4),
			"Queues":    gen.IntRange(1, 3),
			"Ack":       gen.Bool(),
		})))
	props.TestingRun(t)
}

func TestPushNoAlloc(t *testing.T) {
	d := sq.NewDoorbell()
	q, err := sq.New(8, d)
	if err != nil {
		t.Fatal(err)
	}
	es := make([]sq.Entry, 4)
	dst := make([]sq.Entry, 4)
	for _, armed := range []bool{false, true} {
		allocs := testing.AllocsPerRun(100, func() {
			if armed {
				d.Arm()
			}
			q.Push(es)
			rung(d)
			pos, n := q.Peek(2)
			_ = q.Entry(pos)
			q.Advance(n)
			q.Pop(dst)
		})
		if allocs != 0 {
			t.Errorf("armed %v: Push+Peek+Advance+Pop allocate %v times per run", armed, allocs)
		}
	}
}
