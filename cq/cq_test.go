package cq_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"testing"
	"unsafe"

	"github.com/leanovate/gopter"
	"github.com/leanovate/gopter/gen"
	"github.com/leanovate/gopter/prop"
	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/internal/mpsc"
)

func TestCompletionSize(t *testing.T) {
	if got := unsafe.Sizeof(cq.Completion{}); got != cq.CompletionSize || cq.CompletionSize != 24 {
		t.Fatalf("Sizeof(Completion) = %d, CompletionSize = %d; want 24", got, cq.CompletionSize)
	}
}

var allCodes = []struct {
	code   cq.Code
	err    error
	status cq.Status
}{
	{cq.CodeOK, nil, cq.Completed},
	{cq.CodeInvalid, cq.ErrInvalid, cq.Failed},
	{cq.CodeBadBuffer, cq.ErrBadBuffer, cq.Failed},
	{cq.CodeLocalRange, cq.ErrLocalRange, cq.Failed},
	{cq.CodeBadSegment, cq.ErrBadSegment, cq.Failed},
	{cq.CodeRemoteRange, cq.ErrRemoteRange, cq.Failed},
	{cq.CodeLength, cq.ErrLength, cq.Failed},
	{cq.CodeTimeout, cq.ErrTimeout, cq.Timeout},
	{cq.CodeCanceled, cq.ErrCanceled, cq.Canceled},
	{cq.CodeTransport, cq.ErrTransport, cq.Failed},
	{cq.CodeDenied, cq.ErrDenied, cq.Failed},
	{cq.CodeClosed, cq.ErrClosed, cq.Failed},
	{cq.CodeNoTransport, cq.ErrNoTransport, cq.Failed},
	{cq.CodeQueueFull, cq.ErrQueueFull, cq.Failed},
	{cq.CodeTransportDown, cq.ErrTransportDown, cq.Failed},
}

func TestCodes(t *testing.T) {
	seen := map[error]cq.Code{}
	for _, c := range allCodes {
		comp := cq.Completion{Code: c.code}
		if err := comp.Err(); err != c.err || c.code.Err() != c.err {
			t.Errorf("code %d: Err = %v, want %v", c.code, err, c.err)
		}
		if got := c.code.Status(); got != c.status {
			t.Errorf("code %d: Status = %v, want %v", c.code, got, c.status)
		}
		if got := cq.CodeOf(c.err); got != c.code {
			t.Errorf("CodeOf(%v) = %d, want %d", c.err, got, c.code)
		}
		if c.err != nil {
			if got := cq.CodeOf(fmt.Errorf("layer: %w", c.err)); got != c.code {
				t.Errorf("CodeOf(wrapped %v) = %d, want %d", c.err, got, c.code)
			}
			if prev, dup := seen[c.err]; dup {
				t.Errorf("codes %d and %d share the error %v", prev, c.code, c.err)
			}
			seen[c.err] = c.code
		}
	}
	// Every code below the first unknown one is in the table above.
	if got := cq.Code(len(allCodes)).Err(); got == nil || seen[got] != 0 {
		t.Errorf("unknown code %d: Err = %v, want an error that is no sentinel", len(allCodes), got)
	}
	if got := cq.Code(255).Err(); got == nil || seen[got] != 0 {
		t.Errorf("code 255: Err = %v, want an error that is no sentinel", got)
	}
	if !errors.Is(cq.ErrClosed, os.ErrClosed) {
		t.Error("ErrClosed is not os.ErrClosed")
	}
	if got := cq.CodeOf(errors.New("something else")); got != cq.CodeTransport {
		t.Errorf("CodeOf(other error) = %d, want CodeTransport", got)
	}
	if got := cq.CodeOf(os.ErrClosed); got != cq.CodeClosed {
		t.Errorf("CodeOf(os.ErrClosed) = %d, want CodeClosed", got)
	}
}

func TestStatus(t *testing.T) {
	for s, name := range []string{"WAITING", "PENDING", "COMPLETED", "TIMEOUT", "FAILED", "CANCELED"} {
		st := cq.Status(s)
		if st.String() != name {
			t.Errorf("Status(%d) = %q, want %q", s, st, name)
		}
		if want := st >= cq.Completed; st.Terminal() != want {
			t.Errorf("%v.Terminal() = %v", st, !want)
		}
	}
	if s := cq.Status(6); s.Terminal() || s.String() != "STATUS(6)" {
		t.Errorf("Status(6): %q terminal %v", s, s.Terminal())
	}
}

func TestErrNoAlloc(t *testing.T) {
	ok := cq.Completion{Status: cq.Completed}
	bad := cq.Completion{Status: cq.Failed, Code: cq.CodeDenied}
	if n := testing.AllocsPerRun(100, func() {
		if ok.Err() != nil || bad.Err() == nil {
			panic("wrong error")
		}
	}); n != 0 {
		t.Errorf("Err allocates %v times per run", n)
	}
}

func randCompletion(r *rand.Rand) cq.Completion {
	return cq.Completion{
		UserData: r.Uint64(),
		Bytes:    r.Uint64(),
		Status:   cq.Status(r.IntN(int(cq.Canceled) + 1)),
		Code:     allCodes[r.IntN(len(allCodes))].code,
	}
}

func TestCompletionRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	b := make([]byte, cq.CompletionSize)
	for range 1000 {
		c := randCompletion(r)
		if err := c.MarshalTo(b); err != nil {
			t.Fatal(err)
		}
		var d cq.Completion
		if err := d.UnmarshalFrom(b); err != nil || d != c {
			t.Fatalf("round trip of %+v: %+v, %v", c, d, err)
		}
	}
	for _, n := range []int{0, 23, 25} {
		var c cq.Completion
		if err := c.MarshalTo(make([]byte, n)); !errors.Is(err, cq.ErrEncoding) {
			t.Errorf("MarshalTo(%d bytes) = %v", n, err)
		}
		if err := c.UnmarshalFrom(make([]byte, n)); !errors.Is(err, cq.ErrEncoding) {
			t.Errorf("UnmarshalFrom(%d bytes) = %v", n, err)
		}
	}
	for _, bad := range []struct {
		i int
		v byte
	}{{16, byte(cq.Canceled) + 1}, {16, 255}, {17, byte(len(allCodes))}, {17, 255}, {18, 1}, {20, 1}, {23, 0x80}} {
		b := make([]byte, cq.CompletionSize)
		b[bad.i] = bad.v
		d := cq.Completion{UserData: 9}
		if err := d.UnmarshalFrom(b); !errors.Is(err, cq.ErrEncoding) || d.UserData != 9 {
			t.Errorf("byte %d = %d: UnmarshalFrom = %v, completion %+v", bad.i, bad.v, err, d)
		}
	}
}

// validCompletion reports whether b is an encoding UnmarshalFrom must accept.
func validCompletion(b []byte) bool {
	if len(b) != cq.CompletionSize || b[16] > byte(cq.Canceled) || int(b[17]) >= len(allCodes) {
		return false
	}
	return bytes.Count(b[18:], []byte{0}) == len(b[18:])
}

func FuzzCompletionDecode(f *testing.F) {
	f.Add(make([]byte, cq.CompletionSize))
	f.Add(make([]byte, cq.CompletionSize+1))
	f.Add([]byte{1, 2, 3})
	r := rand.New(rand.NewPCG(7, 8))
	for range 4 {
		b := make([]byte, cq.CompletionSize)
		c := randCompletion(r)
		if err := c.MarshalTo(b); err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var c cq.Completion
		err := c.UnmarshalFrom(b)
		if valid := validCompletion(b); (err == nil) != valid {
			t.Fatalf("UnmarshalFrom(%x) = %v; valid encoding: %v", b, err, valid)
		}
		if err != nil {
			if !errors.Is(err, cq.ErrEncoding) {
				t.Fatalf("UnmarshalFrom(%x) = %v, want ErrEncoding", b, err)
			}
			return
		}
		out := make([]byte, cq.CompletionSize)
		if err := c.MarshalTo(out); err != nil || !bytes.Equal(out, b) {
			t.Fatalf("round trip: %x became %x (%v)", b, out, err)
		}
	})
}

func TestNewSize(t *testing.T) {
	for _, size := range []int{0, 1, 5} {
		if _, err := cq.New(size); !errors.Is(err, mpsc.ErrSize) {
			t.Errorf("New(%d) = %v, want ErrSize", size, err)
		}
	}
}

func newRing(t testing.TB, size int) *cq.Ring {
	t.Helper()
	r, err := cq.New(size)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// readable reports whether fd polls readable right now.
func readable(t testing.TB, fd int) bool {
	t.Helper()
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(pfd, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			t.Fatalf("poll: %v", err)
		}
		return n == 1 && pfd[0].Revents&unix.POLLIN != 0
	}
}

// cqOp is one step of the sequential model test of Ring.
type cqOp struct {
	Kind int // see runCQOps
	N    int
	K    int
}

func (o cqOp) String() string {
	return fmt.Sprintf("%s(n=%d,k=%d)", [...]string{"Post", "PostBatch", "Peek+Advance", "PeekBatch+Advance", "Wait"}[o.Kind], o.N, o.K)
}

func completion(v uint64) cq.Completion {
	return cq.Completion{UserData: v, Bytes: v * 7, Status: cq.Status(v % 6), Code: cq.Code(v % 14)}
}

// runCQOps applies ops to an 8-slot ring with an eventfd and to a FIFO: the
// ring shows the oldest min(len, 8) completions, counts every post that
// found it full, and its eventfd is readable exactly while one is ready.
func runCQOps(t *testing.T, ops []cqOp) string {
	const size = 8
	r := newRing(t, size)
	defer r.Close()
	fd, err := r.EventFD()
	if err != nil {
		return err.Error()
	}
	var model []cq.Completion
	var overflowed uint64
	next := uint64(0)
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for i, o := range ops {
		fail := func(format string, args ...any) string {
			return fmt.Sprintf("step %d %v: %s", i, o, fmt.Sprintf(format, args...))
		}
		switch o.Kind {
		case 0:
			c := completion(next)
			next++
			if len(model) >= size {
				overflowed++
			}
			r.Post(&c)
			model = append(model, c)
		case 1:
			cs := make([]cq.Completion, o.N)
			for j := range cs {
				cs[j] = completion(next)
				next++
				if len(model)+j >= size {
					overflowed++
				}
			}
			r.PostBatch(cs)
			model = append(model, cs...)
		case 2:
			c := r.Peek()
			if len(model) == 0 {
				if c != nil {
					return fail("Peek = %+v on an empty ring", *c)
				}
				r.Advance(0)
				break
			}
			if c == nil || *c != model[0] {
				return fail("Peek = %v, want %+v", c, model[0])
			}
			if o.K%2 == 1 {
				r.Advance(1)
				model = model[1:]
			}
		case 3:
			dst := make([]cq.Completion, o.N)
			n := r.PeekBatch(dst)
			want := min(o.N, len(model), size)
			if n != want || !slices.Equal(dst[:n], model[:want]) {
				return fail("PeekBatch = %v, want %v", dst[:n], model[:want])
			}
			k := min(o.K, n)
			r.Advance(k)
			model = model[k:]
		case 4:
			err := r.Wait(canceled, o.N)
			if want := min(o.N, size) <= len(model); (err == nil) != want {
				return fail("Wait(canceled ctx, %d) = %v with %d ready", o.N, err, len(model))
			}
			if err != nil && !errors.Is(err, context.Canceled) {
				return fail("Wait = %v, want context.Canceled", err)
			}
		}
		if got, want := r.Ready(), min(len(model), size); got != want {
			return fail("Ready = %d, want %d", got, want)
		}
		if got := r.Overflowed(); got != overflowed {
			return fail("Overflowed = %d, want %d", got, overflowed)
		}
		if got, want := readable(t, fd), len(model) > 0; got != want {
			return fail("eventfd readable %v with %d completions waiting", got, len(model))
		}
	}
	return ""
}

func TestRingModel(t *testing.T) {
	props := properties(t, 300)
	props.Property("8-slot ring matches a FIFO, overflow included", prop.ForAll(
		func(ops []cqOp) string { return runCQOps(t, ops) },
		gen.SliceOf(gen.Struct(reflect.TypeOf(cqOp{}), map[string]gopter.Gen{
			"Kind": gen.IntRange(0, 4),
			"N":    gen.IntRange(0, 10),
			"K":    gen.IntRange(0, 10),
		}))))
	props.TestingRun(t)
}
