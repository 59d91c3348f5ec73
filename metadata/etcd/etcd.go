package etcd

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/segtable"
)

var _ metadata.Store = (*Store)(nil)

// Defaults of [Config]; the TTL's is [metadata.DefaultTTL].
const (
	// DefaultPrefix is the prefix of the keys an [Store] store keeps
	// descriptors under when Config.Prefix is empty.
	DefaultPrefix = "/moonring/segments/"
	// DefaultDialTimeout is how long an [Store] store's call waits for
	// etcd when Config.DialTimeout is zero.
	DefaultDialTimeout = 5 * time.Second
)

const (
	// etcdRetryMin and etcdRetryMax bound the backoff of a watch that
	// reads etcd again after its watch failed, of a store that writes a
	// descriptor again after etcd lost its lease, and of the client's
	// reconnections: an etcd that restarts is found again within
	// etcdRetryMax of answering.
	etcdRetryMin = 100 * time.Millisecond
	etcdRetryMax = 2 * time.Second
	// etcdPingInterval is how often the client pings an idle connection,
	// so that a peer gone without a reset (a partition, a dead host) is
	// noticed. etcd refuses pings more often than every 5s by default.
	etcdPingInterval = 10 * time.Second
)

// Config configures [New]. Endpoints is required.
type Config struct {
	// Endpoints are the client URLs of the etcd cluster's members,
	// "http://10.0.0.1:2379", "https://10.0.0.1:2379" or "10.0.0.1:2379";
	// the client balances between them and fails over. [ParseURL]
	// makes them, and the fields below, from the etcd:// form of the
	// command's --metadata flag.
	Endpoints []string
	// TLS, when set, is the TLS configuration of the connections to
	// etcd: RootCAs the CA of etcd's server certificates (nil: the
	// system's roots), Certificates a client certificate for an etcd that
	// requires one (--client-cert-auth). Endpoints must then be https://
	// or bare host:port: New refuses http:// ones, which etcd's client
	// would reach in the clear. An https:// endpoint without TLS is
	// reached with the system's roots. The store keeps a copy.
	TLS *tls.Config
	// Username and Password, set together, authenticate the store to
	// etcd (etcd's auth; the user needs read and write access to Prefix).
	// New then authenticates at once, waiting up to DialTimeout: an
	// etcd that refuses them fails it with [ErrDenied], one that does not
	// answer with [ErrUnreachable]. Without TLS the password travels in
	// the clear. An etcd that authenticates clients by their certificate
	// needs neither.
	Username string
	Password string
	// Prefix is prepended to a segment's name to make its key; default
	// [DefaultPrefix]. Stores that should see each other's segments
	// use the same prefix; nothing else under it may be written.
	Prefix string
	// TTL is how long a descriptor this store Puts outlives the store's
	// last keepalive: how soon a crashed engine's segment disappears.
	// Default [metadata.DefaultTTL]. etcd leases last whole seconds, so TTL is
	// rounded up to one and must be at least a second; etcd raises it to
	// its minimum lease TTL (3s with etcd's default heartbeat and
	// election timeouts).
	TTL time.Duration
	// DialTimeout bounds how long each call waits for etcd, to connect
	// and to answer; a call that takes longer fails with
	// [ErrUnreachable]. Within it a call sends a request again (with
	// backoff, from 100 ms doubling to 2 s) after an answer that means
	// try again (no leader, a leader change, a timeout of etcd's own, a
	// member stopped or unhealthy, a connection unavailable, too many
	// requests) or no answer within a third of DialTimeout (a write
	// forwarded to a leader that just died is lost with it, and only a
	// new attempt reaches the new one); never after a refusal (another
	// epoch holds the name, auth, a descriptor too large). Default
	// [DefaultDialTimeout].
	DialTimeout time.Duration
	// FlatLayout makes Put write every descriptor whole, as one JSON value
	// under the segment's key, as stores before the per-chunk layout did
	// (see [Store]): for a deployment whose readers are older than this
	// store, which refuse a header as a malformed descriptor. Upgrade the
	// readers first, then drop it, as for descriptor signing. A store
	// reads both layouts whatever it is set to. [ParseURL] sets it from
	// layout=flat.
	FlatLayout bool
}

// Store is the [Store] of a deployment that spans machines with an etcd
// cluster: every engine publishes to and reads from etcd, under any names,
// with the semantics of [Store] and of [Memory] otherwise.
//
// A flat descriptor (Buffers) is the JSON value of the key Config.Prefix +
// name (the flat layout, which Mooncake's tools and older stores write
// too). A Chunked one (an engine's: segtable.SegmentDesc.Chunked, its
// buffers in immutable chunks numbered by seq) is written in the per-chunk
// layout, unless Config.FlatLayout: each chunk's buffers, as the flat
// descriptor encodes them (MACs included), under a key of its own,
// Config.Prefix + "\x00chunks/" + len(name) + "/" + name + "/" + epoch +
// "/" + seq, and under the segment's key a header: the descriptor without
// its buffers, the list of its chunks (seq, buffers, MAC when signed) and
// a marker of the layout. A republish writes the chunks it made since the
// store's last publish of the epoch (the store keeps each chunk's encoding
// by seq and chunk), in transactions within etcd's limits (128 operations,
// 1 MiB), then the header, then deletes the chunk keys the header no
// longer lists: a registration beside n buffers writes one or two chunks
// and a header of O(n/32) bytes, not the descriptor (which could not
// exceed etcd's request limit, 1.5 MiB, 7-10k buffers; chunks can). Get
// and Watch read the header and its chunks at one revision of etcd, only
// the chunks the store does not hold yet (same seq, hash and MAC in the
// epoch: a watch's, or those of the name's last read, which its Gets and
// watches share), and hand out a Chunked descriptor that holds the
// buffers the flat layout would hold, its chunks shared, by pointer, with
// the descriptors read before for as long as a header lists them
// unchanged (see [metadata.Store]: readers do not modify them), so that a
// peer's check of a republish (metadata.Signed) and its tables
// (segtable.Mirror) cost the chunks made. A header that lists more
// than 131,072 chunks, a chunk of more than 1,024 buffers or 1 MiB, or a
// listed chunk etcd does not hold, is [segtable.ErrBadDesc]; one that
// lists a chunk of more than segtable.ChunkSize buffers (no engine's) is
// read flat. Names that
// start with a NUL byte are refused (ErrBadDesc): that is where the chunk
// keys live. The first publish of an epoch, and a restore under a new
// lease, write every chunk within the one call's DialTimeout (some 8 MB
// and 0.6 s per 100k buffers against a local etcd).
//
// Put writes the descriptor under a lease of Config.TTL, the name's
// own, which the store keeps alive (etcd's KeepAlive) from the first Put
// of the name that succeeds until Delete of that name or Close. An engine
// that dies stops keeping its leases alive, and etcd deletes its
// descriptors when they expire, within TTL: that is how a crashed engine's
// segment goes away (a descriptor written without a lease would linger).
// Close does not Delete or revoke: the store's descriptors expire within
// TTL. A Put under a name this store already keeps alive writes under the
// same lease. When etcd loses a lease the store keeps alive (it expired
// while etcd could not be reached, or someone revoked it), the store
// writes the descriptor again under a new lease, retrying with backoff,
// unless another epoch has taken the name meanwhile; then it gives the
// name up.
//
// Put and Delete are transactions: they read the stored descriptor and
// write only if the key has not changed since (etcd compares its
// revision), reading again otherwise. So of two engines that race to
// publish one name with different epochs exactly one wins and the other
// gets [ErrExists], and a Delete never removes a descriptor of an epoch it
// did not check. Puts, Deletes and lease renewals of one name by one store
// are serialized. A Put or Delete that fails after reaching etcd (a
// timeout, a done context) may or may not have taken effect; Delete stops
// keeping the name alive whatever its outcome, unless etcd holds another
// epoch ([ErrEpoch]) or the call failed before sending (a closed store, a
// done context), so a Delete that failed midway still lets the descriptor
// expire.
//
// Get reads the key (a value that is not a valid descriptor of that name
// is [segtable.ErrBadDesc]). Watch reads it once before it returns, so the
// current descriptor, if any, is the first event (an etcd that does not
// answer within DialTimeout does not fail Watch: the watch delivers the
// descriptor when etcd answers), then one goroutine
// follows etcd's watch of the key from the revision read: every Put, as
// the new descriptor, and every Delete or lease expiry, as Deleted with
// the descriptor removed (a value that is not a descriptor also shows as
// Deleted). When the watch fails (etcd restarted or lost its leader, or
// compacted the revisions the watch needed) the goroutine reads the key
// again and watches anew, with backoff, delivering the current state if
// it changed meanwhile. While etcd cannot be reached a watch delivers
// nothing: etcd, not its reachability, says whether a segment is alive,
// and leases do not expire while etcd is down.
//
// Errors are those of [Store], and [ErrUnreachable] when etcd does not
// answer within Config.DialTimeout, or answers with an error (no
// leader, say) until then; a retry can help then. Each request of a call
// is retried within DialTimeout (see Config.DialTimeout): Put and Delete
// are transactions conditional on what they read, so one sent again
// after an attempt whose answer was lost writes nothing it did not check
// (a Delete whose lost attempt took effect finds the name gone and
// succeeds), and a lease granted by a lost attempt expires on its own.
// etcd's refusal of the store's credentials or rights is [ErrDenied]. A
// flat descriptor, or a header, larger than etcd accepts (1.5 MiB by
// default) is [segtable.ErrBadDesc].
//
// An Etcd store is safe for concurrent use; its zero value is not usable,
// and it must not be copied. It holds an etcd client from New until
// Close, and its goroutines (one per name kept alive, one per watch) run
// until Delete, the end of the watch or Close, which ends them and waits
// for them.
type Store struct {
	cli     *clientv3.Client
	str     string // "etcd " + endpoints
	prefix  string
	ttl     int64 // lease TTL in seconds
	flat    bool  // Config.FlatLayout
	timeout time.Duration
	attempt time.Duration // the most one attempt of a request waits: timeout/attemptShare

	// ctx is canceled by Close; calls, keepalives and watches run under
	// it.
	ctx    context.Context
	cancel context.CancelFunc
	// wg counts keepalive, watch and revoke goroutines, and Watch calls
	// setting one up; Add happens under mu while the store is open, so
	// Close's Wait sees them all.
	wg sync.WaitGroup

	mu     sync.Mutex
	closed bool
	// names holds the writing state of each name that a Put, Delete or
	// keepalive is using; an entry leaves when its last user does.
	names map[string]*etcdName
	// chunks holds, per name, the chunks of the last header read, which
	// Gets and watches share (chunked.go).
	chunks chunkwire.Cache
}

// etcdName serializes the writes of one name and holds its lease.
type etcdName struct {
	name string
	// sem is held (a value in it) by the Put, Delete or lease restore
	// that is writing the name, which alone touches the fields below.
	sem chan struct{}
	// lease is the lease the store last wrote the name under and keeps
	// alive, 0 when none; stop ends its keepalive goroutine.
	lease clientv3.LeaseID
	stop  context.CancelFunc
	// pub is what the last successful Put wrote, nil when none: what a
	// restore writes again; modRev is the revision at which the store
	// last wrote the key (0: unknown).
	pub    *publication
	modRev int64
	// cache holds the chunk encodings of epoch cacheEpoch by seq: those
	// pub lists, those written by a publish that failed, and those whose
	// deletion failed (value nil).
	cache      map[uint64]*chunkEntry
	cacheEpoch uint64
	// users counts Puts, Deletes and keepalives holding this etcdName;
	// it is guarded by Store.mu.
	users int
}

// New returns a store that keeps descriptors in the etcd cluster at
// cfg.Endpoints. Without a Username it sends no request: an etcd that is
// down shows in the first call, which fails with [ErrUnreachable]. It
// fails when there is no endpoint, TTL is below a second or DialTimeout
// negative, when only one of Username and Password is set, when TLS is set
// with an http:// endpoint, and when authentication fails (see
// Config.Username).
func New(cfg Config) (*Store, error) {
	return newStore(cfg)
}

// newStore is New, with dial options added to the client's (tests add an
// interceptor that fails requests as etcd would).
func newStore(cfg Config, dial ...grpc.DialOption) (*Store, error) {
	switch {
	case len(cfg.Endpoints) == 0:
		return nil, errors.New("metadata etcd: no endpoints")
	case slices.Contains(cfg.Endpoints, ""):
		return nil, fmt.Errorf("metadata etcd: empty endpoint in %q", cfg.Endpoints)
	case (cfg.Password == "") != (cfg.Username == ""):
		return nil, errors.New("metadata etcd: Username and Password go together")
	}
	if cfg.TLS != nil {
		for _, ep := range cfg.Endpoints {
			if strings.HasPrefix(ep, "http://") {
				return nil, fmt.Errorf("metadata etcd: endpoint %q is plain http, but TLS is configured: want https:// or HOST:PORT", ep)
			}
		}
		cfg.TLS = cfg.TLS.Clone()
	}
	str := "etcd " + strings.Join(cfg.Endpoints, ",")
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if cfg.TTL == 0 {
		cfg.TTL = metadata.DefaultTTL
	}
	if cfg.TTL < time.Second {
		return nil, fmt.Errorf("metadata %s: TTL %v below etcd's minimum lease, a second", str, cfg.TTL)
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.DialTimeout < 0 {
		return nil, fmt.Errorf("metadata %s: negative DialTimeout %v", str, cfg.DialTimeout)
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            slices.Clone(cfg.Endpoints),
		DialTimeout:          cfg.DialTimeout,
		DialKeepAliveTime:    etcdPingInterval,
		DialKeepAliveTimeout: cfg.DialTimeout,
		DialOptions: append([]grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  etcdRetryMin,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   etcdRetryMax,
			},
			MinConnectTimeout: cfg.DialTimeout,
		})}, dial...),
		TLS:      cfg.TLS,
		Username: cfg.Username,
		Password: cfg.Password,
		// Failures reach the caller as errors; the client's own log
		// would only repeat them.
		Logger: zap.NewNop(),
	})
	switch {
	case err == nil:
	case errors.Is(err, rpctypes.ErrAuthFailed), errors.Is(err, rpctypes.ErrPermissionDenied), errors.Is(err, rpctypes.ErrAuthNotEnabled),
		status.Code(err) == codes.Unauthenticated, status.Code(err) == codes.PermissionDenied:
		return nil, fmt.Errorf("metadata %s: %w: %v", str, metadata.ErrDenied, err)
	case cfg.Username != "":
		// Only the authentication talks to etcd in New.
		return nil, fmt.Errorf("metadata %s: %w: authenticating: %v", str, metadata.ErrUnreachable, err)
	default:
		return nil, fmt.Errorf("metadata %s: %w", str, err)
	}
	e := &Store{
		cli:     cli,
		str:     str,
		prefix:  cfg.Prefix,
		ttl:     int64((cfg.TTL + time.Second - 1) / time.Second),
		timeout: cfg.DialTimeout,
		flat:    cfg.FlatLayout,
		attempt: cfg.DialTimeout / attemptShare,
		names:   make(map[string]*etcdName),
	}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	return e, nil
}

// String returns "etcd " and the endpoints, separated by commas.
func (e *Store) String() string { return e.str }

func (e *Store) errorf(op, name string, err error) error {
	return fmt.Errorf("metadata %s: %s %q: %w", e, op, name, err)
}

func (e *Store) key(name string) string { return e.prefix + name }

// check returns the error that stops an operation before it starts; e.mu
// is held.
func (e *Store) check(ctx context.Context, op, name string) error {
	if e.closed {
		return e.errorf(op, name, metadata.ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return e.errorf(op, name, err)
	}
	return nil
}

// join returns a context done when ctx is or the store closes.
func (e *Store) join(ctx context.Context) (context.Context, context.CancelFunc) {
	c, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(e.ctx, cancel)
	return c, func() { stop(); cancel() }
}

// call returns the context of one call under ctx: done when ctx is, when
// the store closes, or after the timeout.
func (e *Store) call(ctx context.Context) (context.Context, context.CancelFunc) {
	c, cancel := e.join(ctx)
	c, cancel2 := context.WithTimeout(c, e.timeout)
	return c, func() { cancel2(); cancel() }
}

// ctxErr returns the error of a call under e.call(ctx) that failed with
// err: ErrClosed when the store closed, ctx's error when ctx is done, the
// store's own errors as they are, and otherwise what etcd's error means.
func (e *Store) ctxErr(ctx context.Context, err error) error {
	switch {
	case e.ctx.Err() != nil:
		return metadata.ErrClosed
	case ctx.Err() != nil:
		return ctx.Err()
	case errors.Is(err, metadata.ErrExists), errors.Is(err, metadata.ErrEpoch), errors.Is(err, metadata.ErrNotFound), errors.Is(err, segtable.ErrBadDesc):
		return err
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled), status.Code(err) == codes.DeadlineExceeded:
		// The call's own timeout: not the caller's deadline, so it is
		// not wrapped.
		return fmt.Errorf("%w: no answer from etcd within %v (%v)", metadata.ErrUnreachable, e.timeout, err)
	case errors.Is(err, rpctypes.ErrRequestTooLarge),
		grpcCode(err) == codes.ResourceExhausted && !errors.Is(err, rpctypes.ErrTooManyRequests) && !errors.Is(err, rpctypes.ErrNoSpace):
		return fmt.Errorf("%w: too large for etcd: %v", segtable.ErrBadDesc, err)
	case denied(err):
		return fmt.Errorf("%w: etcd: %w", metadata.ErrDenied, err)
	}
	return fmt.Errorf("%w: etcd: %w", metadata.ErrUnreachable, err)
}

// decode returns the descriptor of name that value, read from etcd,
// holds.
func decode(name string, value []byte) (*segtable.SegmentDesc, error) {
	d, err := segtable.UnmarshalDesc(value)
	if err != nil {
		return nil, fmt.Errorf("etcd's value: %w", err)
	}
	if d.Name != name {
		return nil, fmt.Errorf("%w: etcd holds segment %q under that name", segtable.ErrBadDesc, d.Name)
	}
	return d, nil
}

// Get returns a copy of the descriptor etcd holds under name; see [Store]
// and [Store].
func (e *Store) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	e.mu.Lock()
	err := e.check(ctx, "get", name)
	e.mu.Unlock()
	if err != nil {
		return nil, err
	}
	cctx, stop := e.call(ctx)
	defer stop()
	d, err := e.read(cctx, name)
	if err != nil {
		return nil, e.errorf("get", name, e.ctxErr(ctx, err))
	}
	return d, nil
}

// getReads bounds the reads of a header and its chunks by Get: a reader
// that finds a listed chunk missing, or the revision it read at compacted,
// reads again.
const getReads = 3

// read returns the descriptor under name: the key's value, or the header
// it holds and its chunks, read at the revision of the header's read.
func (e *Store) read(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	for i := 1; ; i++ {
		var resp *clientv3.GetResponse
		if _, err := e.do(ctx, func(ctx context.Context) (err error) {
			resp, err = e.cli.Get(ctx, e.key(name))
			return err
		}); err != nil {
			return nil, err
		}
		if len(resp.Kvs) == 0 {
			e.chunks.Store(name, nil)
			return nil, metadata.ErrNotFound
		}
		v := resp.Kvs[0].Value
		if !isHeader(v) {
			e.chunks.Store(name, nil)
			return decode(name, v)
		}
		h, err := parseHeader(name, v)
		if err != nil {
			return nil, err
		}
		d, _, err := e.assemble(ctx, name, h, resp.Header.Revision, e.chunks.Load(name))
		if err == nil {
			return d, nil
		}
		if i < getReads && (errors.Is(err, errMissing) || errors.Is(err, rpctypes.ErrCompacted)) {
			continue
		}
		if errors.Is(err, errMissing) {
			return nil, fmt.Errorf("%w: %w", segtable.ErrBadDesc, err)
		}
		return nil, err
	}
}

// acquire returns the writing state of name with one more user, or an
// error when the store is closed or ctx done; release gives it back.
func (e *Store) acquire(ctx context.Context, op, name string) (*etcdName, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.check(ctx, op, name); err != nil {
		return nil, err
	}
	n := e.names[name]
	if n == nil {
		n = &etcdName{name: name, sem: make(chan struct{}, 1)}
		e.names[name] = n
	}
	n.users++
	return n, nil
}

func (e *Store) release(n *etcdName) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if n.users--; n.users == 0 {
		delete(e.names, n.name)
	}
}

// lock takes n.sem, unless ctx is done or the store closes first.
func (e *Store) lock(ctx context.Context, n *etcdName) error {
	select {
	case n.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-e.ctx.Done():
		return metadata.ErrClosed
	}
}

// Put validates d and publishes a copy in etcd, under a lease the store
// keeps alive until Delete or Close, unless another epoch holds its name;
// see [Store] and [Store].
func (e *Store) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil {
		return e.errorf("put", "", fmt.Errorf("%w: nil descriptor", segtable.ErrBadDesc))
	}
	if err := d.Validate(); err != nil {
		return e.errorf("put", d.Name, err)
	}
	if strings.HasPrefix(d.Name, "\x00") {
		return e.errorf("put", d.Name, fmt.Errorf("%w: a name that starts with NUL (where chunk keys live)", segtable.ErrBadDesc))
	}
	var pub *publication
	if d.Chunked == nil || e.flat {
		body, err := d.Marshal()
		if err != nil {
			return e.errorf("put", d.Name, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err))
		}
		pub = &publication{epoch: d.Epoch, value: body}
	}
	n, err := e.acquire(ctx, "put", d.Name)
	if err != nil {
		return err
	}
	defer e.release(n)
	if err := e.lock(ctx, n); err != nil {
		return e.errorf("put", d.Name, err)
	}
	defer func() { <-n.sem }()

	if pub == nil {
		// Under sem: the encodings of the epoch's chunks are n's.
		if pub, err = e.chunkedPub(n, d); err != nil {
			return e.errorf("put", d.Name, err)
		}
	}
	cctx, stop := e.call(ctx)
	defer stop()
	if err := e.publish(cctx, n, pub, n.lease); err != nil {
		return e.errorf("put", d.Name, e.ctxErr(ctx, err))
	}
	return nil
}

// publish writes pub under n's name with lease, or with a new lease when
// lease is 0 or etcd no longer has it, unless another epoch holds the
// name; then it keeps the lease alive. n.sem is held.
func (e *Store) publish(ctx context.Context, n *etcdName, pub *publication, lease clientv3.LeaseID) error {
	fresh := false
	var rev int64
	stale := n.stale(pub)
	for {
		if lease == 0 {
			var resp *clientv3.LeaseGrantResponse
			if _, err := e.do(ctx, func(ctx context.Context) (err error) {
				resp, err = e.cli.Grant(ctx, e.ttl)
				return err
			}); err != nil {
				e.settle(ctx, n, pub, false)
				return err
			}
			lease, fresh = resp.ID, true
		}
		held, r, wrote, err := e.write(ctx, n, pub, stale, lease)
		if err == nil {
			rev = r
			break
		}
		if errors.Is(err, rpctypes.ErrLeaseNotFound) && !fresh {
			lease = 0 // it expired before the keepalive noticed
			continue
		}
		if errors.Is(err, metadata.ErrExists) && wrote {
			// Chunk keys of this epoch, written before another epoch
			// took the name: nobody reads them.
			e.dropChunks(ctx, n.name, pub.epoch)
			for _, c := range pub.chunks {
				c.lease = 0
			}
		}
		if fresh {
			e.revokeLater(lease)
		}
		e.settle(ctx, n, pub, false)
		if errors.Is(err, metadata.ErrExists) && n.lease != 0 && (n.pub == nil || held != n.pub.epoch) {
			e.forget(n) // what this store kept alive is gone: the name is another's
		}
		return err
	}
	n.pub, n.modRev = pub, rev
	e.settle(ctx, n, pub, true)
	if lease != n.lease {
		e.keep(n, lease)
	}
	return nil
}

// txnOps commits If(cmp).Then(then...).Else(els), retried as [Store.do]
// says; retried reports whether an attempt before the last may have
// committed.
func (e *Store) txnOps(ctx context.Context, cmp clientv3.Cmp, then []clientv3.Op, els clientv3.Op) (resp *clientv3.TxnResponse, retried bool, err error) {
	retried, err = e.do(ctx, func(ctx context.Context) (err error) {
		resp, err = e.cli.Txn(ctx).If(cmp).Then(then...).Else(els).Commit()
		return err
	})
	return resp, retried, err
}

// keep makes lease n's lease and starts its keepalive goroutine, ending
// the previous one's, unless the store is closing. n.sem is held.
func (e *Store) keep(n *etcdName, lease clientv3.LeaseID) {
	if n.stop != nil {
		n.stop()
	}
	n.lease, n.stop = lease, nil
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return // the lease expires on its own
	}
	ctx, stop := context.WithCancel(e.ctx)
	n.stop = stop
	n.users++
	e.wg.Add(1)
	go e.keepAlive(ctx, n, lease)
}

// forget stops keeping n's lease alive; n.sem is held.
func (e *Store) forget(n *etcdName) {
	if n.stop != nil {
		n.stop()
	}
	n.lease, n.stop, n.pub, n.modRev, n.cache = 0, nil, nil, 0, nil
}

// keepAlive keeps lease alive until ctx is done (Delete, a new lease for
// the name, Close). When etcd loses the lease first, it writes n's
// descriptor again under a new lease, retrying with backoff. Starting the
// keepalive fails only once the client is closing: the client's own loop
// sends the keepalives, and opens its stream to etcd again, every half
// second, while it breaks (a leader change, a member down); a lease not
// renewed for its TTL meanwhile closes the channel.
func (e *Store) keepAlive(ctx context.Context, n *etcdName, lease clientv3.LeaseID) {
	defer e.wg.Done()
	defer e.release(n)
	if ch, err := e.cli.KeepAlive(ctx, lease); err == nil {
		for range ch { // the client sends keepalives every TTL/3
		}
	}
	// The channel closes when ctx is done or etcd has lost the lease:
	// it answered that the lease expired, or did not answer for a TTL.
	for delay := etcdRetryMin; ; delay = min(2*delay, etcdRetryMax) {
		if ctx.Err() != nil || e.restore(ctx, n, lease) {
			return
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
}

// restore writes n's descriptor again under a new lease after etcd lost
// lease, n's lease. It reports whether it is done: restored (its
// successor keeps the new lease alive), given up (another epoch holds the
// name) or superseded (a Put or Delete changed n's lease meanwhile).
func (e *Store) restore(ctx context.Context, n *etcdName, lease clientv3.LeaseID) bool {
	select {
	case n.sem <- struct{}{}:
	case <-ctx.Done():
		return true
	}
	defer func() { <-n.sem }()
	if ctx.Err() != nil || n.lease != lease || n.pub == nil {
		return true
	}
	cctx, stop := e.call(ctx)
	defer stop()
	err := e.publish(cctx, n, n.pub, 0)
	return err == nil || errors.Is(err, metadata.ErrExists) || ctx.Err() != nil
}

// revokeLater revokes lease, which holds nothing this store keeps, in the
// background; a lease left unrevoked expires on its own.
func (e *Store) revokeLater(lease clientv3.LeaseID) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		ctx, stop := e.call(context.Background())
		defer stop()
		e.cli.Revoke(ctx, lease) //nolint:errcheck // best effort
	}()
}

// Delete removes the descriptor under name from etcd if its epoch matches
// (0 matches any), and stops keeping it alive; see [Store] and [Store].
func (e *Store) Delete(ctx context.Context, name string, epoch uint64) error {
	n, err := e.acquire(ctx, "delete", name)
	if err != nil {
		return err
	}
	defer e.release(n)
	if err := e.lock(ctx, n); err != nil {
		return e.errorf("delete", name, err)
	}
	defer func() { <-n.sem }()

	cctx, stop := e.call(ctx)
	defer stop()
	err = e.casDelete(cctx, name, epoch)
	if !errors.Is(err, metadata.ErrEpoch) {
		e.forget(n)
	}
	if err != nil {
		return e.errorf("delete", name, e.ctxErr(ctx, err))
	}
	return nil
}

// casDelete deletes the key of name and every chunk key of the name if
// the key holds epoch (any when 0), in a transaction conditional on the
// revision whose epoch it checked (so chunk keys go only with a header:
// those of a publish under way while the name is free stay). When an
// attempt of the delete whose answer was lost may have deleted the key,
// finding it gone is success.
func (e *Store) casDelete(ctx context.Context, name string, epoch uint64) error {
	key := e.key(name)
	var resp *clientv3.GetResponse
	if _, err := e.do(ctx, func(ctx context.Context) (err error) {
		resp, err = e.cli.Get(ctx, key)
		return err
	}); err != nil {
		return err
	}
	kvs := resp.Kvs
	maybeDeleted := false
	del := []clientv3.Op{clientv3.OpDelete(key), clientv3.OpDelete(e.chunkBase(name), clientv3.WithPrefix())}
	for {
		if len(kvs) == 0 {
			if maybeDeleted {
				return nil
			}
			return metadata.ErrNotFound
		}
		if epoch != 0 {
			held, err := valueEpoch(kvs[0].Value)
			switch {
			case err != nil:
				return fmt.Errorf("%w: etcd holds a value that is not a descriptor (%v)", metadata.ErrEpoch, err)
			case held != epoch:
				return fmt.Errorf("%w: held by epoch %d, not %d", metadata.ErrEpoch, held, epoch)
			}
		}
		tresp, retried, err := e.txnOps(ctx, clientv3.Compare(clientv3.ModRevision(key), "=", kvs[0].ModRevision), del, clientv3.OpGet(key))
		if err != nil {
			return err
		}
		maybeDeleted = maybeDeleted || retried
		if tresp.Succeeded {
			return nil
		}
		kvs = tresp.Responses[0].GetResponseRange().GetKvs()
	}
}

// Watch returns a coalescing channel of the changes of name, followed
// through etcd's watch, closed when ctx is done or the store is closed;
// see [Store] and [Store].
func (e *Store) Watch(ctx context.Context, name string) (<-chan metadata.Event, error) {
	e.mu.Lock()
	if err := e.check(ctx, "watch", name); err != nil {
		e.mu.Unlock()
		return nil, err
	}
	e.wg.Add(1)
	e.mu.Unlock()

	wctx, stop := e.join(ctx)
	w := &etcdWatch{e: e, name: name, key: e.key(name), ch: make(chan metadata.Event, 1)}
	synced := w.sync(wctx)
	if wctx.Err() != nil {
		stop()
		e.wg.Done()
		return nil, e.errorf("watch", name, e.ctxErr(ctx, wctx.Err()))
	}
	go w.run(wctx, stop, synced)
	return w.ch, nil
}

// Close ends every watch and keepalive, waits for their goroutines, closes
// the etcd client and makes later calls fail with [ErrClosed]. It neither
// deletes nor revokes what the store published: that expires within TTL.
// It is idempotent and returns nil.
func (e *Store) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	e.cancel()
	e.wg.Wait()
	e.cli.Close() //nolint:errcheck // it reports the cancellation of its own calls
	return nil
}

// etcdWatch is the state of one watch; only its goroutine (or Watch,
// before starting it) touches it.
type etcdWatch struct {
	e         *Store
	name, key string
	ch        chan metadata.Event // only this watch sends, so metadata.SendLatest cannot block
	// last is a private copy of the descriptor last delivered, nil
	// before the first and after a Deleted; lastRev is the revision
	// that wrote it.
	last    *segtable.SegmentDesc
	lastRev int64
	// rev is the revision to watch from: the one after the last read.
	rev int64
	// set holds the chunks that the last header delivered listed, so
	// that a republish fetches only the chunks it made and the
	// descriptors delivered share the others; nil when the last value
	// was no header.
	set *chunkwire.Set
}

func (w *etcdWatch) run(ctx context.Context, stop context.CancelFunc, synced bool) {
	defer w.e.wg.Done()
	defer close(w.ch)
	defer stop()
	delay := etcdRetryMin
	for ctx.Err() == nil {
		if !synced {
			t := time.NewTimer(delay)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			delay = min(2*delay, etcdRetryMax)
			if synced = w.sync(ctx); !synced {
				continue
			}
		}
		if w.follow(ctx) {
			delay = etcdRetryMin
		}
		synced = false
	}
}

// sync reads the key and delivers its value if it is not what was last
// delivered; it reports whether etcd answered.
func (w *etcdWatch) sync(ctx context.Context) bool {
	cctx, stop := context.WithTimeout(ctx, w.e.timeout)
	defer stop()
	resp, err := w.e.cli.Get(cctx, w.key)
	if err != nil {
		return false
	}
	w.rev = resp.Header.Revision + 1
	if len(resp.Kvs) == 0 {
		w.gone()
	} else if w.update(ctx, resp.Kvs[0], resp.Header.Revision) != nil {
		return false
	}
	return true
}

// follow delivers the changes etcd's watch reports from w.rev on, until
// the watch fails or ctx is done. It reports whether the watch delivered
// anything.
func (w *etcdWatch) follow(ctx context.Context) bool {
	// Without a leader, etcd ends the watch rather than leave it silent
	// on a member cut off from the cluster.
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	answered := false
	// Without WithPrevKV: a Deleted event carries the descriptor this
	// watch delivered last, which is the one removed (it follows every
	// write), and etcd would send every write's value twice (a header of
	// O(n/32) bytes, a flat descriptor of O(n)).
	for resp := range w.e.cli.Watch(wctx, w.key, clientv3.WithRev(w.rev)) {
		if resp.Err() != nil || resp.Canceled {
			return answered // compacted, no leader: read the key again
		}
		answered = true
		for _, ev := range resp.Events {
			switch ev.Type {
			case mvccpb.PUT:
				if w.update(ctx, ev.Kv, ev.Kv.ModRevision) != nil {
					return answered // the chunks could not be read: read the key again
				}
			case mvccpb.DELETE:
				w.gone()
			}
			w.rev = ev.Kv.ModRevision + 1
		}
	}
	return answered
}

// update delivers kv, the key's value read at revision rev, unless it
// was delivered already; a value that is not a descriptor of the name is
// delivered as Deleted. A header's chunks are read at rev, those the
// watch does not hold yet; it fails when etcd did not answer that read
// (or compacted rev), and then the key must be read again.
func (w *etcdWatch) update(ctx context.Context, kv *mvccpb.KeyValue, rev int64) error {
	if w.last != nil && kv.ModRevision == w.lastRev {
		return nil
	}
	var d *segtable.SegmentDesc
	var err error
	if isHeader(kv.Value) {
		d, err = w.assemble(ctx, kv.Value, rev)
		if err != nil && !errors.Is(err, segtable.ErrBadDesc) {
			return err
		}
	} else {
		w.set = nil
		w.e.chunks.Store(w.name, nil) // a flat value: no chunk of the name is listed
		d, err = decode(w.name, kv.Value)
	}
	if err != nil {
		w.gone()
		return nil
	}
	w.last, w.lastRev = d.CloneShared(), kv.ModRevision // a Chunked one shares its chunks
	metadata.SendLatest(w.ch, metadata.Event{Desc: d})
	return nil
}

// assemble returns the descriptor of a header, value, read at rev: its
// chunks from those the watch holds (same seq, sum, MAC and number of
// buffers), shared with the descriptors it delivered, and those it
// reads, at rev (Store.assemble). It keeps the chunks the header lists,
// and only those. A header that is not one of the name, or lists a chunk
// etcd does not hold, is segtable.ErrBadDesc.
func (w *etcdWatch) assemble(ctx context.Context, value []byte, rev int64) (*segtable.SegmentDesc, error) {
	h, err := parseHeader(w.name, value)
	if err != nil {
		return nil, err
	}
	base := w.set
	if base == nil {
		base = w.e.chunks.Load(w.name) // a Get's, or another watch's
	}
	cctx, stop := context.WithTimeout(ctx, w.e.timeout)
	defer stop()
	d, next, err := w.e.assemble(cctx, w.name, h, rev, base)
	if errors.Is(err, errMissing) {
		return nil, fmt.Errorf("%w: %w", segtable.ErrBadDesc, err)
	}
	if err != nil {
		return nil, err
	}
	w.set = next
	return d, nil
}

// gone delivers Deleted once for the descriptor last delivered.
func (w *etcdWatch) gone() {
	if w.last == nil {
		return
	}
	metadata.SendLatest(w.ch, metadata.Event{Desc: w.last, Deleted: true})
	w.last, w.lastRev, w.set = nil, 0, nil
	w.e.chunks.Store(w.name, nil) // the store's Gets hold none of its chunks either
}
