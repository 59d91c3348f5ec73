// Package mcetcd keeps Mooncake's metadata in etcd: a [mooncake.KV] over
// etcd's client, so that a [mooncake.Store] reads and writes the keys a
// Mooncake engine started with an etcd metadata server uses
// (mooncake/[cluster/]ram/<name>, mooncake/[cluster/]rpc_meta/<name>).
//
// It is a package of its own because etcd's client pulls in gRPC: the
// engine and the mooncake package do not depend on it, and only a program
// that wants Mooncake's etcd mode imports this one.
//
// Keys and values are written as Mooncake's engine writes them: the key
// as it is (no leading slash), the JSON document verbatim, no lease.
// Mooncake's entries therefore outlive a dead engine, and so do ours (see
// [mooncake.Store] for what that means for the Store contract).
//
// # Concurrency
//
// A [KV] is safe for concurrent use. It holds an etcd client from [NewKV]
// until Close.
package mcetcd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/etcd"
	"github.com/moonring/moonring/mooncake"
)

var _ mooncake.KV = (*KV)(nil)

// KV is the [mooncake.KV] of an etcd cluster. Each call waits at most
// Config.DialTimeout for etcd; one that takes longer, or that etcd answers
// with an error, fails with [metadata.ErrUnreachable].
type KV struct {
	cli     *clientv3.Client
	str     string
	timeout time.Duration
	once    sync.Once
	err     error
}

// Endpoints splits the metadata connection string a Mooncake engine is
// given for etcd ("etcd://10.0.0.1:2379;10.0.0.2:2379", or the same
// without the scheme, which Mooncake takes for etcd) into the endpoints of
// Config.Endpoints. Empty parts are left out.
func Endpoints(conn string) []string {
	conn = strings.TrimPrefix(conn, "etcd://")
	var eps []string
	for _, p := range strings.Split(conn, ";") {
		if p = strings.TrimSpace(p); p != "" {
			eps = append(eps, p)
		}
	}
	return eps
}

// NewKV returns the KV of the etcd cluster cfg describes. Of cfg it uses
// Endpoints, TLS, Username, Password and DialTimeout, as [etcd.New] does
// (so [etcd.ParseURL] makes it too); Prefix and TTL are not used: the keys
// are Mooncake's, and Mooncake writes no lease. Without a Username it sends
// no request, so an etcd that is down shows in the first call; with one it
// authenticates at once, and credentials etcd refuses are
// [metadata.ErrDenied].
func NewKV(cfg etcd.Config) (*KV, error) {
	switch {
	case len(cfg.Endpoints) == 0:
		return nil, errors.New("mooncake etcd: no endpoints")
	case slices.Contains(cfg.Endpoints, ""):
		return nil, fmt.Errorf("mooncake etcd: empty endpoint in %q", cfg.Endpoints)
	case (cfg.Password == "") != (cfg.Username == ""):
		return nil, errors.New("mooncake etcd: Username and Password go together")
	case cfg.DialTimeout < 0:
		return nil, fmt.Errorf("mooncake etcd: negative DialTimeout %v", cfg.DialTimeout)
	}
	if cfg.TLS != nil {
		for _, ep := range cfg.Endpoints {
			if strings.HasPrefix(ep, "http://") {
				return nil, fmt.Errorf("mooncake etcd: endpoint %q is plain http, but TLS is configured", ep)
			}
		}
		cfg.TLS = cfg.TLS.Clone()
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = etcd.DefaultDialTimeout
	}
	str := "mooncake-etcd " + strings.Join(cfg.Endpoints, ",")
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            slices.Clone(cfg.Endpoints),
		DialTimeout:          cfg.DialTimeout,
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: cfg.DialTimeout,
		TLS:                  cfg.TLS,
		Username:             cfg.Username,
		Password:             cfg.Password,
		Logger:               zap.NewNop(),
	})
	if err != nil {
		if errors.Is(err, rpctypes.ErrAuthFailed) || errors.Is(err, rpctypes.ErrPermissionDenied) ||
			status.Code(err) == codes.Unauthenticated || status.Code(err) == codes.PermissionDenied {
			return nil, fmt.Errorf("%s: %w: %v", str, metadata.ErrDenied, err)
		}
		if cfg.Username != "" {
			return nil, fmt.Errorf("%s: %w: authenticating: %v", str, metadata.ErrUnreachable, err)
		}
		return nil, fmt.Errorf("%s: %w", str, err)
	}
	return &KV{cli: cli, str: str, timeout: cfg.DialTimeout}, nil
}

// NewStore returns a [mooncake.Store] over a new KV of cfg.
func NewStore(cfg etcd.Config, sc mooncake.StoreConfig) (*mooncake.Store, error) {
	kv, err := NewKV(cfg)
	if err != nil {
		return nil, err
	}
	return mooncake.NewStore(kv, sc), nil
}

// String is "mooncake-etcd " and the endpoints.
func (k *KV) String() string { return k.str }

// Close closes the etcd client. Later calls return the first's result.
func (k *KV) Close() error {
	k.once.Do(func() { k.err = k.cli.Close() })
	return k.err
}

// call returns the context of one call: ctx bounded by the timeout.
func (k *KV) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, k.timeout)
}

// fail wraps etcd's error of a call under ctx, the caller's context.
func (k *KV) fail(ctx context.Context, op, key string, err error) error {
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("%s: %s %s: %w", k.str, op, key, ctx.Err())
	case errors.Is(err, rpctypes.ErrRequestTooLarge), status.Code(err) == codes.ResourceExhausted:
		return fmt.Errorf("%s: %s %s: %w: too large for etcd: %v", k.str, op, key, mooncake.ErrRefused, err)
	}
	return fmt.Errorf("%s: %s %s: %w: %w", k.str, op, key, metadata.ErrUnreachable, err)
}

// Get returns the value of key, refusing one over max bytes with
// [mooncake.ErrBadDoc].
func (k *KV) Get(ctx context.Context, key string, max int64) ([]byte, bool, error) {
	cctx, cancel := k.call(ctx)
	defer cancel()
	resp, err := k.cli.Get(cctx, key)
	if err != nil {
		return nil, false, k.fail(ctx, "get", key, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, false, nil
	}
	v := resp.Kvs[0].Value
	if int64(len(v)) > max {
		return nil, false, fmt.Errorf("%s: get %s: %w: %d bytes", k.str, key, mooncake.ErrBadDoc, len(v))
	}
	return v, true, nil
}

// Put stores value under key, without a lease; a value larger than etcd
// takes is [mooncake.ErrRefused].
func (k *KV) Put(ctx context.Context, key string, value []byte) error {
	cctx, cancel := k.call(ctx)
	defer cancel()
	if _, err := k.cli.Put(cctx, key, string(value)); err != nil {
		return k.fail(ctx, "put", key, err)
	}
	return nil
}

// Delete removes key and reports whether it was there.
func (k *KV) Delete(ctx context.Context, key string) (bool, error) {
	cctx, cancel := k.call(ctx)
	defer cancel()
	resp, err := k.cli.Delete(cctx, key)
	if err != nil {
		return false, k.fail(ctx, "delete", key, err)
	}
	return resp.Deleted > 0, nil
}
