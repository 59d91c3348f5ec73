package mooncake

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

var _ metadata.Store = (*Store)(nil)

// KV is a key-value store that holds Mooncake's metadata (the HTTP
// metadata server: [HTTPKV]; etcd or redis through an adapter). Values are
// the JSON documents as they are. Implementations are safe for concurrent
// use and fail with an error wrapping the context's when it is done.
type KV interface {
	// Get returns the value of key and whether there is one, refusing
	// (with [ErrBadDoc]) a value of more than max bytes.
	Get(ctx context.Context, key string, max int64) (value []byte, found bool, err error)
	// Put stores value under key; [ErrRefused] when the store refuses it.
	Put(ctx context.Context, key string, value []byte) error
	// Delete removes key and reports whether it was there (a store that
	// cannot tell says true).
	Delete(ctx context.Context, key string) (found bool, err error)
	// Close releases what the KV holds.
	Close() error
	// String names the store in errors.
	String() string
}

// ErrRefused reports a write the metadata store refused: an HTTP server's
// 400 (a key already taken by an rpc_meta entry, a missing key).
var ErrRefused = errors.New("mooncake: the metadata store refused the write")

// StoreConfig configures [NewStore].
type StoreConfig struct {
	// Keys names the entries; its ClusterID must be the one the Mooncake
	// engines use (their MC_METADATA_CLUSTER_ID).
	Keys Keys
	// PollInterval is how often a watch reads the entry; default 1s.
	PollInterval time.Duration
}

// Store is a [metadata.Store] that keeps descriptors in Mooncake's schema
// and keys in a [KV] (a Mooncake HTTP metadata server: [NewHTTPStore]), so
// that Mooncake engines read what moonring publishes and moonring engines
// read what Mooncake engines publish.
//
// Put writes the rpc_meta entry (when the descriptor names a Mooncake RPC
// or TCP endpoint) and then the descriptor, converted by [FromSegtable];
// Delete removes both; Get converts with [ToSegtable] (without an rpc_meta
// entry, the segment name's host serves the TCP endpoint and no RPC
// endpoint is known). A descriptor that a Mooncake engine published reads
// with epoch 0.
//
// Where it differs from the [metadata.Store] contract, because Mooncake's
// stores are used with no conditional writes and no change notification:
//
//   - The epoch checks of Put and Delete read the entry and then write it:
//     two stores writing one name at once can both pass the check. Writes
//     through one Store are serialized, so a single writer per name (the
//     engine that owns it) keeps the contract.
//   - Put refuses ([metadata.ErrExists]) a name that holds a descriptor a
//     Mooncake engine published, or a document it cannot read, whatever
//     the epoch; Delete with epoch 0 removes them. A name with a slash
//     (which Mooncake takes for a key path) is neither put nor deleted.
//   - Watch polls: changes between two polls coalesce, and a change of the
//     rpc_meta entry alone is not seen. A poll that fails is skipped; the
//     segment is not reported gone until the store says it is absent.
//   - Nothing expires: an engine that dies leaves its entries behind, as
//     Mooncake's own engines do.
type Store struct {
	kv   KV
	str  string
	keys Keys
	poll time.Duration

	ctx    context.Context // canceled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // watches; Add under mu while open

	mu     sync.Mutex
	closed bool
	wmu    sync.Mutex // serializes Put and Delete
}

// NewStore returns a Store over kv, which it closes with itself.
func NewStore(kv KV, cfg StoreConfig) *Store {
	s := &Store{kv: kv, str: kv.String(), keys: cfg.Keys, poll: cfg.PollInterval}
	if s.poll <= 0 {
		s.poll = time.Second
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s
}

// String names the store: its KV's name.
func (s *Store) String() string { return s.str }

// Close ends every watch, waits for them and closes the KV. Later calls
// return nil.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.cancel()
	s.mu.Unlock()
	s.wg.Wait()
	return s.kv.Close()
}

func (s *Store) check(ctx context.Context, name string) error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return fmt.Errorf("%s: segment %q: %w", s.str, name, metadata.ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%s: segment %q: %w", s.str, name, err)
	}
	return nil
}

// bound returns a context that ends with ctx or with the store.
func (s *Store) bound(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.ctx, cancel)
	return ctx, func() { stop(); cancel() }
}

// closedErr turns the failure of a call that Close interrupted into
// ErrClosed.
func (s *Store) closedErr(err error) error {
	if err != nil && s.ctx.Err() != nil {
		return metadata.ErrClosed
	}
	return err
}

// fetchDoc reads and decodes the descriptor under name; nil, nil, nil when
// the store has none.
func (s *Store) fetchDoc(ctx context.Context, name string) (*SegmentDesc, []byte, error) {
	body, found, err := s.kv.Get(ctx, s.keys.Segment(name), MaxDocBytes)
	if err != nil || !found {
		return nil, nil, err
	}
	d, err := Decode(body)
	return d, body, err
}

// fetchRPC reads the rpc_meta entry of name; nil, nil when there is none.
func (s *Store) fetchRPC(ctx context.Context, name string) (*RPCMeta, error) {
	body, found, err := s.kv.Get(ctx, s.keys.RPCMeta(name), MaxRPCMetaBytes)
	if err != nil || !found {
		return nil, err
	}
	return DecodeRPCMeta(body)
}

// read returns the moonring form of the descriptor under name, nil when
// there is none, and the body it came from.
func (s *Store) read(ctx context.Context, name string) (*segtable.SegmentDesc, []byte, error) {
	d, body, err := s.fetchDoc(ctx, name)
	if err != nil || d == nil {
		return nil, nil, err
	}
	var rpc *RPCMeta
	if d.Moonring == nil {
		if rpc, err = s.fetchRPC(ctx, name); err != nil {
			return nil, nil, err
		}
		if rpc == nil {
			// Outside P2PHANDSHAKE the name's port (if any) is not the RPC
			// port: without an entry, the host alone is known.
			host, _, _ := SplitServerName(name)
			rpc = &RPCMeta{IPOrHostName: host}
		}
	}
	sd, err := ToSegtable(d, rpc)
	if err != nil {
		return nil, nil, err
	}
	if sd.Name != name {
		return nil, nil, fmt.Errorf("%w: the entry of %q describes %q", ErrBadDoc, name, sd.Name)
	}
	return sd, body, nil
}

// Get returns the descriptor published under name.
func (s *Store) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	if err := s.check(ctx, name); err != nil {
		return nil, err
	}
	if name == "" {
		return nil, fmt.Errorf("%s: segment %q: %w", s.str, name, metadata.ErrNotFound)
	}
	ctx, done := s.bound(ctx)
	defer done()
	d, _, err := s.read(ctx, name)
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: segment %q: %w", s.str, name, s.closedErr(err))
	case d == nil:
		return nil, fmt.Errorf("%s: segment %q: %w", s.str, name, metadata.ErrNotFound)
	}
	return d, nil
}

// current returns the epoch of what name holds: found false when nothing,
// ours false when a Mooncake engine's descriptor or a document this store
// cannot read.
func (s *Store) current(ctx context.Context, name string) (epoch uint64, found, ours bool, err error) {
	d, _, err := s.fetchDoc(ctx, name)
	if errors.Is(err, ErrBadDoc) {
		return 0, true, false, nil
	}
	if err != nil || d == nil {
		return 0, false, false, err
	}
	if d.Moonring == nil {
		return 0, true, false, nil
	}
	sd, err := ToSegtable(d, nil)
	if err != nil || sd.Name != name {
		return 0, true, false, nil
	}
	return sd.Epoch, true, true, nil
}

// Put publishes d in Mooncake's schema, with its rpc_meta entry.
func (s *Store) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil {
		return fmt.Errorf("%s: %w: nil descriptor", s.str, segtable.ErrBadDesc)
	}
	if err := s.check(ctx, d.Name); err != nil {
		return err
	}
	if strings.Contains(d.Name, "/") {
		// Mooncake would take it for a key path (into rpc_meta/, say).
		return fmt.Errorf("%s: segment %q: %w: a name with a slash", s.str, d.Name, segtable.ErrBadDesc)
	}
	md, rpc, err := FromSegtable(d)
	if err != nil {
		return fmt.Errorf("%s: %w", s.str, err)
	}
	md.Timestamp = TimestampNow()
	body, err := md.Encode()
	if err != nil {
		return fmt.Errorf("%s: segment %q: %w", s.str, d.Name, err)
	}
	if len(body) > MaxDocBytes {
		return fmt.Errorf("%s: segment %q: %w: %d bytes encoded", s.str, d.Name, segtable.ErrBadDesc, len(body))
	}
	ctx, done := s.bound(ctx)
	defer done()
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if err := s.put(ctx, d, rpc, body); err != nil {
		return fmt.Errorf("%s: segment %q: %w", s.str, d.Name, s.closedErr(err))
	}
	return nil
}

func (s *Store) put(ctx context.Context, d *segtable.SegmentDesc, rpc *RPCMeta, body []byte) error {
	epoch, found, ours, err := s.current(ctx, d.Name)
	switch {
	case err != nil:
		return err
	case found && !ours:
		return fmt.Errorf("%w: a Mooncake engine's descriptor (or an unreadable one) holds the name", metadata.ErrExists)
	case found && epoch != d.Epoch:
		return fmt.Errorf("%w: epoch %d holds the name", metadata.ErrExists, epoch)
	}
	if err := s.putRPC(ctx, d.Name, rpc, found); err != nil {
		return err
	}
	if err := s.kv.Put(ctx, s.keys.Segment(d.Name), body); err != nil {
		if errors.Is(err, ErrRefused) {
			return fmt.Errorf("%w: %w", segtable.ErrBadDesc, err)
		}
		return err
	}
	return nil
}

// putRPC makes the rpc_meta entry say rpc. Mooncake's HTTP servers refuse
// to overwrite an rpc_meta entry, so a different one is deleted first; an
// equal one is left alone. With rpc nil, a stale entry of ours (hadOurs:
// the name held our descriptor) is removed.
func (s *Store) putRPC(ctx context.Context, name string, rpc *RPCMeta, hadOurs bool) error {
	key := s.keys.RPCMeta(name)
	cur, err := s.fetchRPC(ctx, name)
	if err != nil && !errors.Is(err, ErrBadDoc) {
		return err
	}
	if rpc != nil && cur != nil && *cur == *rpc {
		return nil
	}
	if (cur != nil || err != nil) && (rpc != nil || hadOurs) {
		if _, err := s.kv.Delete(ctx, key); err != nil {
			return err
		}
	}
	if rpc == nil {
		return nil
	}
	body, err := rpc.Encode()
	if err != nil {
		return err
	}
	if err := s.kv.Put(ctx, key, body); err != nil {
		if errors.Is(err, ErrRefused) {
			return fmt.Errorf("%w: %w", metadata.ErrExists, err)
		}
		return err
	}
	return nil
}

// Delete removes the descriptor under name and its rpc_meta entry, if its
// epoch is epoch (any, when 0).
func (s *Store) Delete(ctx context.Context, name string, epoch uint64) error {
	if err := s.check(ctx, name); err != nil {
		return err
	}
	ctx, done := s.bound(ctx)
	defer done()
	s.wmu.Lock()
	defer s.wmu.Unlock()
	err := func() error {
		cur, found, ours, err := s.current(ctx, name)
		switch {
		case err != nil:
			return err
		case !found || name == "" || strings.Contains(name, "/"):
			return metadata.ErrNotFound // a slash: never ours to delete
		case epoch != 0 && (!ours || cur != epoch):
			return fmt.Errorf("%w: the name holds epoch %d (ours: %v)", metadata.ErrEpoch, cur, ours)
		}
		if found, err := s.kv.Delete(ctx, s.keys.Segment(name)); err != nil {
			return err
		} else if !found {
			return metadata.ErrNotFound
		}
		_, err = s.kv.Delete(ctx, s.keys.RPCMeta(name))
		return err
	}()
	if err != nil {
		return fmt.Errorf("%s: segment %q: %w", s.str, name, s.closedErr(err))
	}
	return nil
}

// Watch polls name every PollInterval; see [Store] for how it differs from
// a store that is told of changes.
func (s *Store) Watch(ctx context.Context, name string) (<-chan metadata.Event, error) {
	if err := s.check(ctx, name); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("%s: segment %q: %w", s.str, name, metadata.ErrClosed)
	}
	s.wg.Add(1)
	s.mu.Unlock()
	wctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.ctx, cancel)
	ch := make(chan metadata.Event, 1)
	go func() {
		defer s.wg.Done()
		defer close(ch)
		defer stop()
		defer cancel()
		var last *segtable.SegmentDesc
		var lastBody []byte
		t := time.NewTicker(s.poll)
		defer t.Stop()
		for {
			d, body, err := s.read(wctx, name)
			switch {
			case wctx.Err() != nil:
				return
			case err != nil:
				// skipped: the next poll tells
			case d == nil:
				if last != nil {
					metadata.SendLatest(ch, metadata.Event{Desc: last, Deleted: true})
					last, lastBody = nil, nil
				}
			case !bytes.Equal(body, lastBody):
				last, lastBody = d.Clone(), body
				metadata.SendLatest(ch, metadata.Event{Desc: d})
			}
			select {
			case <-wctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return ch, nil
}
