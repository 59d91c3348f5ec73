// retry.go holds the retries of a call's requests to etcd: a request that
// etcd could not serve now (no leader, a leader change, a timeout of its
// own, a member unavailable, no answer within the attempt's share of the
// call's time) is sent again with backoff while the call's time lasts; a
// refusal is never sent again.

package etcd

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// attemptShare is the share of a call's time (Config.DialTimeout) that one
// attempt of a request may wait for its answer: a write forwarded to a
// leader that has just died is lost with it, and etcd answers it only at
// its own request timeout (seven seconds with its defaults), so an attempt
// that waited for the whole call would leave no time for the one that
// reaches the new leader.
const attemptShare = 3

// do runs op, one request to etcd, under ctx, the context of a call
// (e.call: it ends with the call's time), giving each attempt at most
// e.attempt of it. It sends it again, after a backoff from etcdRetryMin
// doubling to etcdRetryMax, while the attempt failed with an error that
// means try again ([again], or the attempt's own deadline) and ctx
// allows. It returns op's last error (with the count of attempts when
// there were several) and whether an attempt before the last failed after
// it may have reached etcd: a write may then have taken effect already.
func (e *Store) do(ctx context.Context, op func(ctx context.Context) error) (retried bool, err error) {
	delay := etcdRetryMin
	for n := 1; ; n++ {
		actx, cancel := context.WithTimeout(ctx, e.attempt)
		err = op(actx)
		expired := actx.Err() != nil
		cancel()
		if err == nil {
			return n > 1, nil
		}
		if ctx.Err() != nil || !(expired || again(err)) {
			if n > 1 {
				err = fmt.Errorf("%w (attempt %d)", err, n)
			}
			return n > 1, err
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return true, fmt.Errorf("%w (attempt %d, the call's time ran out before the next)", err, n)
		case <-t.C:
		}
		delay = min(2*delay, etcdRetryMax)
	}
}

// again reports whether err, the failure of one attempt, means that etcd
// could not serve the request now (a retry can help), not that it refused
// it: no leader or a leader change, a timeout of etcd's own, a member
// stopped or unhealthy, a connection unavailable (gRPC's Unavailable), too
// many requests, a deadline. Refusals (an epoch held by another, auth, a
// request too large, a lease not found) are not.
func again(err error) bool {
	switch {
	case err == nil:
		return false
	case errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, rpctypes.ErrTooManyRequests),
		errors.Is(err, rpctypes.ErrNotLeader):
		return true
	}
	switch grpcCode(err) {
	case codes.Unavailable, codes.DeadlineExceeded:
		return true
	}
	return false
}

// grpcCode returns the gRPC code of err: the client turns etcd's errors
// into [rpctypes.EtcdError], which carries it but is no gRPC status.
func grpcCode(err error) codes.Code {
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return ee.Code()
	}
	return status.Code(err)
}

// denied reports whether err is etcd refusing the store's credentials or
// their rights.
func denied(err error) bool {
	switch {
	case errors.Is(err, rpctypes.ErrPermissionDenied), errors.Is(err, rpctypes.ErrAuthFailed),
		errors.Is(err, rpctypes.ErrAuthNotEnabled),
		errors.Is(err, rpctypes.ErrRoleNotGranted), errors.Is(err, rpctypes.ErrPermissionNotGranted):
		return true
	}
	c := grpcCode(err)
	return c == codes.PermissionDenied || c == codes.Unauthenticated
}
