package mooncake

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

var _ metadata.Store = (*HTTPStore)(nil)

// HTTPConfig configures [NewHTTPStore]. URL is required.
type HTTPConfig struct {
	// URL is the metadata endpoint exactly as Mooncake engines are given
	// it, path included: "http://10.0.0.1:8080/metadata". Requests go to
	// URL?key=<key>; it may carry no query of its own.
	URL string
	// Keys names the entries; its ClusterID must be the one the Mooncake
	// engines use (their MC_METADATA_CLUSTER_ID).
	Keys Keys
	// Client makes the requests. Default: dials in 2s, waits 5s for
	// headers, gives up after 10s, follows no redirect, uses no proxy.
	Client *http.Client
	// PollInterval is how often a watch asks the server; default 1s.
	PollInterval time.Duration
}

// HTTPStore is a [metadata.Store] that keeps descriptors in Mooncake's
// schema on a Mooncake HTTP metadata server (Mooncake's example servers,
// the one in mooncake_master, or anything that speaks the protocol; see
// FORMATS.md), so that Mooncake engines read what moonring publishes and
// moonring engines read what Mooncake engines publish.
//
// Put writes the rpc_meta entry (when the descriptor names a Mooncake RPC
// or TCP endpoint) and then the descriptor, converted by [FromSegtable];
// Delete removes both; Get converts with [ToSegtable]. A descriptor that a
// Mooncake engine published reads with epoch 0.
//
// Where it differs from the [metadata.Store] contract, because the
// protocol has no conditional writes and no change notification:
//
//   - The epoch checks of Put and Delete read the entry and then write it:
//     two stores writing one name at once can both pass the check. Writes
//     through one HTTPStore are serialized, so a single writer per name (the
//     engine that owns it) keeps the contract.
//   - Put refuses ([metadata.ErrExists]) a name that holds a descriptor a
//     Mooncake engine published, or a document it cannot read, whatever
//     the epoch; Delete with epoch 0 removes them.
//   - Watch polls: changes between two polls coalesce, and a change of the
//     rpc_meta entry alone is not seen. A poll that fails is skipped; the
//     segment is not reported gone until the server answers 404.
//   - Nothing expires: an engine that dies leaves its entries behind, as
//     Mooncake's own engines do.
type HTTPStore struct {
	base   url.URL
	str    string
	client *http.Client
	keys   Keys
	poll   time.Duration

	ctx    context.Context // canceled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // watches; Add under mu while open

	mu     sync.Mutex
	closed bool
	wmu    sync.Mutex // serializes Put and Delete
}

// NewHTTPStore returns a store on the server at cfg.URL. It sends no
// request.
func NewHTTPStore(cfg HTTPConfig) (*HTTPStore, error) {
	u, err := url.Parse(cfg.URL)
	switch {
	case err != nil:
		return nil, fmt.Errorf("mooncake http: %w", err)
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("mooncake http: URL %q is not http or https", cfg.URL)
	case u.Host == "":
		return nil, fmt.Errorf("mooncake http: URL %q has no host", cfg.URL)
	case u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("mooncake http: URL %q has a query or fragment", cfg.URL)
	}
	s := &HTTPStore{base: *u, str: "mooncake-http " + cfg.URL, client: cfg.Client, keys: cfg.Keys, poll: cfg.PollInterval}
	if s.client == nil {
		s.client = &http.Client{
			Timeout: 10 * time.Second,
			Transport: &http.Transport{
				DialContext:           (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
				ResponseHeaderTimeout: 5 * time.Second,
				MaxIdleConnsPerHost:   4,
			},
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		}
	}
	if s.poll <= 0 {
		s.poll = time.Second
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s, nil
}

// String names the store: "mooncake-http <URL>".
func (s *HTTPStore) String() string { return s.str }

// Close ends every watch and waits for them. Later calls return nil.
func (s *HTTPStore) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.cancel()
	s.mu.Unlock()
	s.wg.Wait()
	if s.client != nil {
		s.client.CloseIdleConnections()
	}
	return nil
}

func (s *HTTPStore) check(ctx context.Context, name string) error {
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

// do sends one request for key and reads up to max bytes of the answer.
func (s *HTTPStore) do(ctx context.Context, method, key string, body []byte, max int64) (int, []byte, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(s.ctx, cancel)
	defer stop()
	u := s.base
	u.RawQuery = url.Values{"key": {key}}.Encode()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := s.client.Do(req)
	if err != nil {
		if s.ctx.Err() != nil {
			return 0, nil, metadata.ErrClosed
		}
		if ctx.Err() != nil {
			return 0, nil, err // wraps the context's error
		}
		return 0, nil, fmt.Errorf("%w: %w", metadata.ErrUnreachable, err)
	}
	defer resp.Body.Close()
	if resp.ContentLength > max {
		return resp.StatusCode, nil, fmt.Errorf("%w: an answer of %d bytes", ErrBadDoc, resp.ContentLength)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, max+1))
	if err != nil {
		return resp.StatusCode, nil, fmt.Errorf("%w: reading the answer: %w", metadata.ErrUnreachable, err)
	}
	if int64(len(b)) > max {
		return resp.StatusCode, nil, fmt.Errorf("%w: an answer of more than %d bytes", ErrBadDoc, max)
	}
	return resp.StatusCode, b, nil
}

// unexpected describes an answer the protocol does not have.
func unexpected(method, key string, code int, body []byte) error {
	if len(body) > 200 {
		body = body[:200]
	}
	return fmt.Errorf("%w: %s %s: status %d: %q", metadata.ErrUnreachable, method, key, code, body)
}

// fetchDoc reads and decodes the descriptor under name; nil, nil, nil when
// the server has none.
func (s *HTTPStore) fetchDoc(ctx context.Context, name string) (*SegmentDesc, []byte, error) {
	key := s.keys.Segment(name)
	code, body, err := s.do(ctx, http.MethodGet, key, nil, MaxDocBytes)
	switch {
	case err != nil:
		return nil, nil, err
	case code == http.StatusNotFound:
		return nil, nil, nil
	case code != http.StatusOK:
		return nil, nil, unexpected("GET", key, code, body)
	}
	d, err := Decode(body)
	return d, body, err
}

// fetchRPC reads the rpc_meta entry of name; nil, nil when there is none.
func (s *HTTPStore) fetchRPC(ctx context.Context, name string) (*RPCMeta, []byte, error) {
	key := s.keys.RPCMeta(name)
	code, body, err := s.do(ctx, http.MethodGet, key, nil, MaxRPCMetaBytes)
	switch {
	case err != nil:
		return nil, nil, err
	case code == http.StatusNotFound:
		return nil, nil, nil
	case code != http.StatusOK:
		return nil, nil, unexpected("GET", key, code, body)
	}
	r, err := DecodeRPCMeta(body)
	return r, body, err
}

// read returns the moonring form of the descriptor under name, nil when
// there is none, and the body it came from.
func (s *HTTPStore) read(ctx context.Context, name string) (*segtable.SegmentDesc, []byte, error) {
	d, body, err := s.fetchDoc(ctx, name)
	if err != nil || d == nil {
		return nil, nil, err
	}
	var rpc *RPCMeta
	if d.Moonring == nil {
		if rpc, _, err = s.fetchRPC(ctx, name); err != nil {
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
func (s *HTTPStore) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	if err := s.check(ctx, name); err != nil {
		return nil, err
	}
	if name == "" {
		return nil, fmt.Errorf("%s: segment %q: %w", s.str, name, metadata.ErrNotFound)
	}
	d, _, err := s.read(ctx, name)
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: segment %q: %w", s.str, name, err)
	case d == nil:
		return nil, fmt.Errorf("%s: segment %q: %w", s.str, name, metadata.ErrNotFound)
	}
	return d, nil
}

// current returns the epoch of what name holds: found false when nothing,
// ours false when a Mooncake engine's descriptor or a document this store
// cannot read.
func (s *HTTPStore) current(ctx context.Context, name string) (epoch uint64, found, ours bool, err error) {
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
func (s *HTTPStore) Put(ctx context.Context, d *segtable.SegmentDesc) error {
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
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if err := s.put(ctx, d, rpc, body); err != nil {
		return fmt.Errorf("%s: segment %q: %w", s.str, d.Name, err)
	}
	return nil
}

func (s *HTTPStore) put(ctx context.Context, d *segtable.SegmentDesc, rpc *RPCMeta, body []byte) error {
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
	key := s.keys.Segment(d.Name)
	code, ans, err := s.do(ctx, http.MethodPut, key, body, MaxRPCMetaBytes)
	switch {
	case err != nil:
		return err
	case code == http.StatusBadRequest:
		return fmt.Errorf("%w: the server refused the descriptor: %q", segtable.ErrBadDesc, ans)
	case code != http.StatusOK:
		return unexpected("PUT", key, code, ans)
	}
	return nil
}

// putRPC makes the rpc_meta entry say rpc. Mooncake's servers refuse to
// overwrite an rpc_meta entry (400), so a different one is deleted first;
// an equal one is left alone. With rpc nil, a stale entry of ours
// (hadOurs: the name held our descriptor) is removed.
func (s *HTTPStore) putRPC(ctx context.Context, name string, rpc *RPCMeta, hadOurs bool) error {
	key := s.keys.RPCMeta(name)
	cur, _, err := s.fetchRPC(ctx, name)
	if err != nil && !errors.Is(err, ErrBadDoc) {
		return err
	}
	if rpc != nil && cur != nil && *cur == *rpc {
		return nil
	}
	if (cur != nil || err != nil) && (rpc != nil || hadOurs) {
		if err := s.del(ctx, key); err != nil {
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
	code, ans, err := s.do(ctx, http.MethodPut, key, body, MaxRPCMetaBytes)
	switch {
	case err != nil:
		return err
	case code == http.StatusBadRequest:
		return fmt.Errorf("%w: the server refused the rpc_meta entry: %q", metadata.ErrExists, ans)
	case code != http.StatusOK:
		return unexpected("PUT", key, code, ans)
	}
	return nil
}

// del deletes key; a 404 is no error.
func (s *HTTPStore) del(ctx context.Context, key string) error {
	code, ans, err := s.do(ctx, http.MethodDelete, key, nil, MaxRPCMetaBytes)
	switch {
	case err != nil:
		return err
	case code != http.StatusOK && code != http.StatusNotFound:
		return unexpected("DELETE", key, code, ans)
	}
	return nil
}

// Delete removes the descriptor under name and its rpc_meta entry, if its
// epoch is epoch (any, when 0).
func (s *HTTPStore) Delete(ctx context.Context, name string, epoch uint64) error {
	if err := s.check(ctx, name); err != nil {
		return err
	}
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
		key := s.keys.Segment(name)
		code, ans, err := s.do(ctx, http.MethodDelete, key, nil, MaxRPCMetaBytes)
		switch {
		case err != nil:
			return err
		case code == http.StatusNotFound:
			return metadata.ErrNotFound
		case code != http.StatusOK:
			return unexpected("DELETE", key, code, ans)
		}
		return s.del(ctx, s.keys.RPCMeta(name))
	}()
	if err != nil {
		return fmt.Errorf("%s: segment %q: %w", s.str, name, err)
	}
	return nil
}

// Watch polls name every PollInterval; see [HTTPStore] for how it differs
// from a store that is told of changes.
func (s *HTTPStore) Watch(ctx context.Context, name string) (<-chan metadata.Event, error) {
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
