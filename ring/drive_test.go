package ring

// Tests of SubmitDriven and SubmitAndWait (drive.go).

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moonring/moonring/cq"
	"github.com/moonring/moonring/sq"
	"github.com/moonring/moonring/transport"
)

// driveEP is a fakeEP (holding every slice) that is a transport.Driver.
// Its Drive either answers the held slices itself (answer set), as a
// transport reading its answers on the caller's goroutine would, or waits
// for Interrupt and returns with them still held.
type driveEP struct {
	*fakeEP
	answer      bool
	drives      atomic.Int32
	driving     chan struct{} // receives when a waiting Drive starts
	interrupted chan struct{}
}

func (d *driveEP) Drive(w transport.Until, deadline int64) {
	d.drives.Add(1)
	if d.answer {
		d.release(-1, nil)
		if !w.Done() {
			panic("Drive answered everything and the wait is not over")
		}
		return
	}
	d.driving <- struct{}{}
	select {
	case <-d.interrupted:
	case <-time.After(hang):
		panic("a driver was never interrupted")
	}
}

func (d *driveEP) Interrupt() {
	select {
	case d.interrupted <- struct{}{}:
	default:
	}
}

func newDriveHarness(t *testing.T, cfg Config, answer bool) (*harness, *driveEP) {
	ep := &fakeEP{hold: true}
	h := newHarnessPoller(t, cfg, ep, false, PollerConfig{})
	d := &driveEP{fakeEP: ep, answer: answer, driving: make(chan struct{}, 1), interrupted: make(chan struct{}, 1)}
	h.seg.Path().Endpoint = d
	return h, d
}

// SubmitAndWait on an idle ring of a parked poller posts its entry with
// Driven set and drives the endpoint once, which answers it on the
// caller's goroutine; the completion is in when it returns. Submit marks
// nothing Driven and drives nothing.
func TestSubmitAndWaitDrives(t *testing.T) {
	h, d := newDriveHarness(t, Config{}, true)
	for i := uint64(1); i <= 20; i++ {
		parked(t, h.p)
		before := len(d.postsCopy())
		k, err := h.r.SubmitAndWait(context.Background(), []sq.Entry{h.write(i, 0, 0, 100)}, 1)
		if k != 1 || err != nil {
			t.Fatalf("SubmitAndWait: %d, %v", k, err)
		}
		if c := h.r.Peek(); c == nil || c.UserData != i || c.Code != cq.CodeOK {
			t.Fatalf("completion %+v, want %d OK", c, i)
		}
		h.r.Advance(1)
		posts := d.postsCopy()
		if len(posts) != before+1 || !posts[before].Driven {
			t.Fatalf("posts %+v: want one more, Driven", posts[before:])
		}
		if got := d.drives.Load(); got != int32(i) {
			t.Fatalf("%d drives after %d calls", got, i)
		}
	}
	parked(t, h.p)
	before := len(d.postsCopy())
	h.submit(h.write(99, 0, 0, 100))
	waitFor(t, "the post", func() bool { return len(d.postsCopy()) > before })
	if d.postsCopy()[before].Driven {
		t.Fatal("Submit posted a Driven slice")
	}
	d.release(-1, nil)
	h.one(99)
	if d.drives.Load() != 20 {
		t.Fatal("Submit drove")
	}
}

// A driver waiting for an answer that does not come is interrupted when
// the ring ends its request otherwise: a Cancel, the request's timeout,
// or Close. SubmitAndWait then returns with that completion.
func TestSubmitAndWaitInterrupted(t *testing.T) {
	for _, how := range []string{"cancel", "timeout", "close"} {
		t.Run(how, func(t *testing.T) {
			cfg := Config{}
			if how == "timeout" {
				cfg.Timeout = 50 * time.Millisecond
			}
			h, d := newDriveHarness(t, cfg, false)
			parked(t, h.p)
			type result struct {
				k   int
				err error
			}
			res := make(chan result, 1)
			go func() {
				k, err := h.r.SubmitAndWait(context.Background(), []sq.Entry{h.write(7, 0, 0, 100)}, 1)
				res <- result{k, err}
			}()
			select {
			case <-d.driving:
			case <-time.After(hang):
				t.Fatal("SubmitAndWait never drove")
			}
			switch how {
			case "cancel":
				if err := h.r.Cancel(7); err != nil {
					t.Fatal(err)
				}
			case "close":
				h.r.Close()
			}
			var r result
			select {
			case r = <-res:
			case <-time.After(hang):
				t.Fatal("SubmitAndWait hangs")
			}
			want := map[string]cq.Code{"cancel": cq.CodeCanceled, "timeout": cq.CodeTimeout, "close": cq.CodeClosed}[how]
			if how == "close" {
				if r.k != 1 {
					t.Fatalf("SubmitAndWait: %d, %v", r.k, r.err)
				}
				return // the wait may end with ErrClosed or the completion
			}
			if r.k != 1 || r.err != nil {
				t.Fatalf("SubmitAndWait: %d, %v", r.k, r.err)
			}
			if c := h.r.Peek(); c == nil || c.UserData != 7 || c.Code != want {
				t.Fatalf("completion %+v, want code %v", c, want)
			}
			h.r.Advance(1)
		})
	}
}

// A ctx that can be canceled and has no deadline is waited on without
// driving.
func TestSubmitAndWaitCancelableCtx(t *testing.T) {
	h, d := newDriveHarness(t, Config{}, true)
	parked(t, h.p)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		waitFor(t, "the post", func() bool { return len(d.postsCopy()) > 0 })
		d.release(-1, nil)
	}()
	if k, err := h.r.SubmitAndWait(ctx, []sq.Entry{h.write(1, 0, 0, 100)}, 1); k != 1 || err != nil {
		t.Fatalf("SubmitAndWait: %d, %v", k, err)
	}
	if d.drives.Load() != 0 || d.postsCopy()[0].Driven {
		t.Fatal("drove under a cancelable ctx")
	}
}
