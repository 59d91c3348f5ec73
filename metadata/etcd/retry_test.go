package etcd_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/metadata/etcdtest"
	"github.com/moonring/moonring/segtable"
)

// The gRPC methods of the requests the tests fail.
const (
	mTxn   = "/etcdserverpb.KV/Txn"
	mGrant = "/etcdserverpb.Lease/LeaseGrant"
)

// fault is what the interceptor does to one request instead of passing it
// on: fail it with err before it reaches etcd; with lost, send it to etcd
// and then fail it (it took effect, its answer was lost); with hang, hold
// it until its deadline (a proposal lost with a leader that died).
type fault struct {
	err  error
	lost bool
	hang bool
}

// faults fails requests as planned, per method, and counts them.
type faults struct {
	mu    sync.Mutex
	plan  map[string][]fault
	every map[string]error // fail every request of the method
	calls map[string]int
}

func newFaults() *faults {
	return &faults{plan: map[string][]fault{}, every: map[string]error{}, calls: map[string]int{}}
}

// add plans fs for the next requests of method.
func (f *faults) add(method string, fs ...fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.plan[method] = append(f.plan[method], fs...)
}

// always fails every request of method with err (nil: none).
func (f *faults) always(method string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.every[method] = err
}

// count returns the requests of method seen since the last reset, and
// resets the counts.
func (f *faults) count(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.calls[method]
	clear(f.calls)
	return n
}

func (f *faults) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	f.mu.Lock()
	f.calls[method]++
	var ft *fault
	if err := f.every[method]; err != nil {
		ft = &fault{err: err}
	} else if q := f.plan[method]; len(q) > 0 {
		ft, f.plan[method] = &q[0], q[1:]
	}
	f.mu.Unlock()
	switch {
	case ft == nil:
		return invoker(ctx, method, req, reply, cc, opts...)
	case ft.hang:
		<-ctx.Done()
		return status.FromContextError(ctx.Err()).Err()
	case ft.lost:
		if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
			return err
		}
	}
	return ft.err
}

// newFaulty returns a store of the etcd at ep whose requests go through
// f, closed when the test ends.
func newFaulty(t *testing.T, ep, prefix string, f *faults, dial time.Duration) *etcd.Store {
	t.Helper()
	s, err := etcd.NewIntercepted(etcd.Config{Endpoints: []string{ep}, Prefix: prefix, DialTimeout: dial}, f.intercept)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// TestEtcdRetry: a request that etcd could not serve now (its answers
// when a leader dies or changes, a connection gone, no answer at all) is
// sent again within the call's time, and the call succeeds; a write whose
// answer was lost after it took effect is not mistaken for a failure; a
// refusal is never sent again; a call out of time says what etcd
// answered.
func TestEtcdRetry(t *testing.T) {
	srv := etcdtest.Start(t)
	ep := srv.Endpoint()
	f := newFaults()
	prefix := etcdPrefix()
	s := newFaulty(t, ep, prefix, f, 0)
	raw := rawEtcd(t, ep)
	ctx := t.Context()
	mustHold := func(name string, epoch uint64, tag string) {
		t.Helper()
		resp, err := raw.Get(ctx, prefix+name)
		if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
			t.Fatalf("etcd holds %+v (%v) under %s; want one key with a lease", resp, err, name)
		}
		d, err := segtable.UnmarshalDesc(resp.Kvs[0].Value)
		if err != nil || d.Epoch != epoch || d.Endpoints["tcp"] != tag {
			t.Fatalf("etcd holds %+v (%v); want epoch %d, %s", d, err, epoch, tag)
		}
	}

	t.Run("TryAgain", func(t *testing.T) {
		for i, err := range []error{
			rpctypes.ErrGRPCLeaderChanged,
			rpctypes.ErrGRPCNoLeader,
			rpctypes.ErrGRPCTimeout,
			rpctypes.ErrGRPCTimeoutDueToLeaderFail,
			rpctypes.ErrGRPCStopped,
			rpctypes.ErrGRPCRequestTooManyRequests,
			status.Error(codes.Unavailable, "error reading from server: EOF"),
		} {
			name := "again-" + string(rune('a'+i))
			f.count("")
			f.add(mTxn, fault{err: err}, fault{err: err})
			if perr := s.Put(ctx, testDesc(name, 1, "v")); perr != nil {
				t.Fatalf("Put after two requests failed with %q: %v", err, perr)
			}
			if n := f.count(mTxn); n != 3 {
				t.Errorf("%q: %d transactions; want 3 (two failed, then the write)", err, n)
			}
			mustHold(name, 1, "v")
		}
		// The lease's grant too.
		f.add(mGrant, fault{err: rpctypes.ErrGRPCLeaderChanged})
		if err := s.Put(ctx, testDesc("grant", 1, "g")); err != nil {
			t.Fatalf("Put after a grant failed: %v", err)
		}
		if n := f.count(mGrant); n != 2 {
			t.Errorf("%d grants; want 2", n)
		}
		mustHold("grant", 1, "g")
		// A Delete's transaction and a Delete of any epoch.
		f.add(mTxn, fault{err: rpctypes.ErrGRPCNoLeader})
		if err := s.Delete(ctx, "grant", 1); err != nil {
			t.Fatalf("Delete after a failed transaction: %v", err)
		}
		f.add(mTxn, fault{err: rpctypes.ErrGRPCLeaderChanged})
		if err := s.Delete(ctx, "again-a", 0); err != nil {
			t.Fatalf("Delete(0) after a failed request: %v", err)
		}
		for _, name := range []string{"grant", "again-a"} {
			if _, err := s.Get(ctx, name); !errors.Is(err, metadata.ErrNotFound) {
				t.Errorf("Get(%s) after its Delete: %v; want ErrNotFound", name, err)
			}
		}
	})

	t.Run("LostAnswer", func(t *testing.T) {
		f.count("")
		f.add(mTxn, fault{err: rpctypes.ErrGRPCTimeout, lost: true})
		if err := s.Put(ctx, testDesc("lost", 2, "l")); err != nil {
			t.Fatalf("Put whose first answer was lost: %v", err)
		}
		mustHold("lost", 2, "l")
		// A republish by another epoch still fails: the retry checked.
		other := newEtcd(t, ep, prefix, 0)
		if err := other.Put(ctx, testDesc("lost", 3, "x")); !errors.Is(err, metadata.ErrExists) {
			t.Fatalf("Put by another epoch: %v; want ErrExists", err)
		}
		f.add(mTxn, fault{err: rpctypes.ErrGRPCLeaderChanged, lost: true})
		if err := s.Delete(ctx, "lost", 2); err != nil {
			t.Fatalf("Delete whose first answer was lost (it deleted): %v; want nil", err)
		}
		if err := s.Put(ctx, testDesc("lost0", 2, "l")); err != nil {
			t.Fatal(err)
		}
		f.add(mTxn, fault{err: rpctypes.ErrGRPCTimeoutDueToLeaderFail, lost: true})
		if err := s.Delete(ctx, "lost0", 0); err != nil {
			t.Fatalf("Delete(0) whose first answer was lost (it deleted): %v; want nil", err)
		}
		for _, name := range []string{"lost", "lost0"} {
			if resp, err := raw.Get(ctx, prefix+name); err != nil || len(resp.Kvs) != 0 {
				t.Errorf("etcd holds %+v (%v) under %s after its Delete", resp, err, name)
			}
		}
		// Without a lost answer, a Delete of nothing is still ErrNotFound.
		if err := s.Delete(ctx, "lost", 2); !errors.Is(err, metadata.ErrNotFound) {
			t.Errorf("Delete of a name gone: %v; want ErrNotFound", err)
		}
	})

	t.Run("NoAnswer", func(t *testing.T) {
		// A transaction that never answers (a proposal lost with its
		// leader) is given up after a third of DialTimeout and sent
		// again.
		h := newFaulty(t, ep, prefix, f, 3*time.Second)
		f.count("")
		f.add(mTxn, fault{hang: true})
		start := time.Now()
		if err := h.Put(ctx, testDesc("hang", 4, "h")); err != nil {
			t.Fatalf("Put whose first transaction never answered: %v", err)
		}
		t.Logf("Put took %v with its first attempt lost (attempts wait 1s)", time.Since(start).Round(time.Millisecond))
		if n := f.count(mTxn); n != 2 {
			t.Errorf("%d transactions; want 2", n)
		}
		mustHold("hang", 4, "h")
	})

	t.Run("Refused", func(t *testing.T) {
		for _, c := range []struct {
			err  error
			want error
		}{
			{rpctypes.ErrGRPCPermissionDenied, metadata.ErrDenied},
			{rpctypes.ErrGRPCRequestTooLarge, segtable.ErrBadDesc},
			{rpctypes.ErrGRPCNoSpace, metadata.ErrUnreachable},
			{rpctypes.ErrGRPCCompacted, metadata.ErrUnreachable},
		} {
			f.count("")
			f.add(mTxn, fault{err: c.err})
			err := s.Put(ctx, testDesc("refused", 5, "r"))
			if !errors.Is(err, c.want) {
				t.Errorf("Put refused with %q: %v; want %v", c.err, err, c.want)
			}
			if n := f.count(mTxn); n != 1 {
				t.Errorf("Put refused with %q: %d transactions; want 1 (a refusal is not sent again)", c.err, n)
			}
		}
		// Another epoch holds the name: the answer is the refusal.
		if err := s.Put(ctx, testDesc("held", 6, "a")); err != nil {
			t.Fatal(err)
		}
		other := newFaulty(t, ep, prefix, f, 0)
		f.count("")
		if err := other.Put(ctx, testDesc("held", 7, "b")); !errors.Is(err, metadata.ErrExists) {
			t.Fatalf("Put by another epoch: %v; want ErrExists", err)
		}
		if n := f.count(mTxn); n != 1 {
			t.Errorf("Put by another epoch: %d transactions; want 1", n)
		}
		if err := other.Delete(ctx, "held", 7); !errors.Is(err, metadata.ErrEpoch) {
			t.Fatalf("Delete by another epoch: %v; want ErrEpoch", err)
		}
		mustHold("held", 6, "a")
	})

	t.Run("OutOfTime", func(t *testing.T) {
		o := newFaulty(t, ep, prefix, f, time.Second)
		f.always(mTxn, rpctypes.ErrGRPCLeaderChanged)
		defer f.always(mTxn, nil)
		f.count("")
		err := o.Put(ctx, testDesc("late", 8, "x"))
		if !errors.Is(err, metadata.ErrUnreachable) || !strings.Contains(err.Error(), "leader changed") || !strings.Contains(err.Error(), "attempt") {
			t.Errorf("Put while every transaction fails: %v; want ErrUnreachable saying what etcd answered, after attempts", err)
		}
		if n := f.count(mTxn); n < 2 {
			t.Errorf("%d transactions in the call's second; want several", n)
		}
		// The caller's deadline ends the retries, and is reported as such.
		short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		if err := s.Put(short, testDesc("late", 8, "x")); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("Put with a short deadline while every transaction fails: %v; want context.DeadlineExceeded", err)
		}
		f.always(mTxn, nil)
		if resp, err := raw.Get(ctx, prefix+"late"); err != nil || len(resp.Kvs) != 0 {
			t.Errorf("etcd holds %+v (%v) after Puts that failed", resp, err)
		}
	})
}
