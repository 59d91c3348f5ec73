package metadata

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/segtable"
)

var _ Store = (*HTTP)(nil)

// Errors of the HTTP store, beside those of [Store] and [ErrUnreachable].
var (
	// ErrDenied reports that a store's server refused the caller's
	// credentials. From an [HTTP] store: a Put or Delete that the metadata
	// server refused: it answered 401 (no owner token: the store has no
	// HTTPConfig.Key and the server needs one) or 403 (a wrong token:
	// another key, or a name that a server without the key bound to
	// another owner; or, from a server with the key, a descriptor not
	// signed with it: wrap the store in [Signed]); the server's message
	// says which, and nothing changed on the server. From
	// [github.com/moonring/moonring/metadata/etcd.New]: etcd refused the
	// user and password. A retry does not help until the configuration is
	// fixed or (HTTP) the other owner's entry goes (see [Server]).
	ErrDenied = errors.New("metadata: server denied the change")
	// ErrQuota reports a Put that the metadata server refused (429)
	// because it holds as many names or bytes of descriptors as it
	// keeps. A retry can help once others delete theirs or they expire.
	ErrQuota = errors.New("metadata: server quota exceeded")
)

// httpLogInterval is the least time between two log lines about the
// failing renewals of one name.
const httpLogInterval = time.Minute

// HTTPConfig configures [NewHTTP]. URL is required.
type HTTPConfig struct {
	// URL is the metadata server's base address, "http://host:port" (or
	// https, or with a path prefix when the server is mounted under one).
	URL string
	// TTL is how long a descriptor this store Puts lives on the server
	// without renewal; default [DefaultTTL], at least [MinTTL] (and at
	// most the server's MaxTTL, or Puts fail with [segtable.ErrBadDesc]).
	// The store renews every TTL/3 while it is open.
	TTL time.Duration
	// Client makes the requests. Default: a client that dials in 2s,
	// waits 5s for headers, gives up after 10s, follows no redirects and
	// uses no proxy. A Client given here is used as is and not closed.
	Client *http.Client
	// PollInterval is how often a watch asks the server for changes;
	// default 1s.
	PollInterval time.Duration
	// Key is the deployment's segment key (MOONRING_KEY; the engines'
	// tcp.Config.Key). When set, every PUT and DELETE carries the owner
	// token the key derives for its name (see [Server]), which a server
	// requires for names it bound to it and, when it has the key itself,
	// for every name. Without it the store works with servers that have
	// no key, and its names stay open to anyone (ErrDenied from a server
	// that has one). Over http:// the token travels in the clear: use
	// https:// beyond a trusted network. The store keeps a derived key,
	// not Key.
	Key []byte
	// TLS, when set, is the TLS configuration of the default Client for
	// an https:// URL (a private CA's pool, say); ignored when Client is
	// given.
	TLS *tls.Config
	// Logger is told, at most once a minute per name, when the renewals
	// of a name fail (denied, over quota, the name taken by another
	// epoch, the server unreachable) and when they succeed again; and,
	// once, when Key would be sent over plain http to a host that is not
	// loopback. Default [slog.Default].
	Logger *slog.Logger
}

// HTTP is the [Store] of a deployment that runs a metadata server ([Server],
// `moonring metadata-server`): every engine publishes to and reads from the
// server at HTTPConfig.URL, under any names, with the semantics of [Store]
// and of [Memory] otherwise.
//
// Put sends the descriptor with its time to live (HTTPConfig.TTL), and
// from the first Put of a name that succeeds until Delete of that name or
// Close, one goroutine per name renews it every TTL/3 (a PUT marked as a
// renewal, which restarts the time to live and changes nothing watchers
// see, or stores the descriptor again if the server lost it). An engine
// that dies stops renewing, and its descriptor disappears from the server
// within TTL: that is how a crashed engine's segment goes away. Renewal
// stops, and is not retried, when the server answers that another epoch
// holds the name (the name expired and was taken) or refuses the
// descriptor; it goes on through failed requests otherwise, refusals of
// its owner token ([ErrDenied]) and quotas ([ErrQuota]) included, since
// the name may come free again, and says so in HTTPConfig.Logger at most
// once a minute per name (and once more when renewals succeed again). Puts, Deletes and renewals of one name are
// serialized, so a renewal never lands after a Delete it raced. Close does
// not Delete: the store's descriptors expire within TTL unless another
// store renews them.
//
// A Put or Delete that fails after reaching the server (a timeout, a done
// context) may or may not have taken effect there. Delete stops the
// renewal of the name whatever its outcome, unless the server answered
// [ErrEpoch] (the name is not the caller's to give up) or the call failed
// before sending (a closed store, a done context), so a Delete that failed
// midway still lets the descriptor expire. The renewal sends what the last
// Put that succeeded stored.
//
// A Chunked descriptor (an engine's) goes to a server that takes chunks
// (see [Server]) as its chunks and a header: each chunk once per epoch
// (the store keeps, per name, the chunks it sent, by seq and chunk, so a
// republish after one registration sends one or two chunks and the
// header, O(chunks) bytes of it, whatever the buffers), then the header,
// and again the chunks the server says it lacks. A renewal sends the
// header. A server that answers a chunk request 404 or 405 without the
// Moonring-Chunks header (an older one) gets whole descriptors from this
// store from then on. The whole descriptor is at most 16 MiB of JSON, a
// header or a chunk too.
//
// Get fetches the header and the chunks (256 a request) and assembles the
// descriptor, or the whole descriptor from a server that serves no header
// (at most 16 MiB; a larger, malformed or misnamed answer is
// [segtable.ErrBadDesc]). A descriptor assembled of chunks is Chunked:
// the buffers of the whole document, in chunks shared, by pointer, with
// the descriptors this store handed out before for as long as headers
// list them unchanged (the store keeps, per name, the chunks of the last
// header read, which its Gets and watches share; see [Store]: readers do
// not modify them), so that a peer's check and tables of a republish cost
// the chunks it made; a whole document is flat, the one
// [segtable.UnmarshalDesc] decodes. Watch fetches once before it
// returns, so the current descriptor, if any, is the first event, then one
// goroutine polls every PollInterval with If-None-Match, as a [P2P] watch
// of a peer does, the header where the server serves one, then only the
// chunks the watch does not hold (same seq, hash and MAC): it delivers
// every change the server's ETag shows (polls
// coalesce changes between them), Deleted when the server answers 404 (a
// Delete or an expiry), and Deleted also after three polls in a row fail,
// since a store that cannot be read cannot show the segment alive; the
// descriptor comes back when the server does.
//
// With HTTPConfig.Key, every PUT and DELETE proves the name's ownership to
// the server with its owner token (see [Server] for what that protects and
// what it does not).
//
// Errors are those of [Store] (the server's 404 is [ErrNotFound], its 409
// [ErrExists] for a Put and [ErrEpoch] for a Delete, its 400 and 413
// [segtable.ErrBadDesc]), [ErrDenied] for its 401 and 403, [ErrQuota] for
// its 429, and [ErrUnreachable] when the server does not
// answer, or answers another status (a 503 from a closed server, say); a
// retry can help then. A name the server would refuse (see [Server]) holds
// nothing: Get, Delete and Watch of it fail with [ErrNotFound], Put with
// [segtable.ErrBadDesc], without a request.
//
// An HTTP store is safe for concurrent use; its zero value is not usable,
// and it must not be copied. Its goroutines (renewals, watches) run from
// NewHTTP until Close, which ends them and waits for them.
type HTTP struct {
	base      string // URL without a trailing slash
	str       string // "http " + base
	client    *http.Client
	ownClient bool
	ttl       time.Duration
	ttlHeader string
	poll      time.Duration
	ownerKey  []byte // nil without HTTPConfig.Key
	log       *slog.Logger

	// ctx is canceled by Close; requests, renewals and watches run under
	// it.
	ctx    context.Context
	cancel context.CancelFunc
	// wg counts renewal and watch goroutines, and Watch calls setting one
	// up; Add happens under mu while the store is open, so Close's Wait
	// sees them all.
	wg sync.WaitGroup

	// flat is set once the server answered a chunk request as a server
	// that does not know them: Puts send whole descriptors from then on.
	flat atomic.Bool
	// flatReads is set once the server answered a header GET as a server
	// that does not know it: Gets and new watches ask for whole
	// descriptors from then on.
	flatReads atomic.Bool
	// chunks holds, per name, the chunks of the last header read, which
	// Gets and watches share (http_chunks.go).
	chunks chunkwire.Cache

	mu     sync.Mutex
	closed bool
	// names holds the writing state of each name that a Put, Delete or
	// renewal is using; an entry leaves when its last user does.
	names map[string]*httpName
}

// httpName serializes the writes of one name and holds its renewal.
type httpName struct {
	name string
	// sem is held (a value in it) by the Put, Delete or renewal that is
	// writing the name, which alone touches the fields below.
	sem chan struct{}
	// desc and body are what the last successful Put stored: what a
	// renewal sends.
	desc *segtable.SegmentDesc
	body []byte
	// pub is, instead of body, the header and chunks of a Chunked
	// descriptor that the last Put stored as chunks; sent holds the
	// chunks sent to the server in epoch sentEpoch, by seq.
	pub       *chunkPub
	sent      map[uint64]*sentChunk
	sentEpoch uint64
	// stop is the running renewal's, closed to end it; nil when none
	// runs. A renewal that finds another stop (or nil) has been ended.
	stop chan struct{}
	// users counts Puts, Deletes and renewals holding this httpName; it
	// is guarded by HTTP.mu.
	users int
	// failing counts the renewals failed in a row; logged is when the
	// last line about them was logged, quiet how many failed since
	// without a line. Only the renewal touches them.
	failing, quiet int
	logged         time.Time
}

// NewHTTP returns a store that uses the metadata server at cfg.URL. It sends
// no request: a server that is down shows in the first call. It fails when
// URL is not an http or https URL or TTL is below [MinTTL].
func NewHTTP(cfg HTTPConfig) (*HTTP, error) {
	u, err := url.Parse(cfg.URL)
	switch {
	case err != nil:
		return nil, fmt.Errorf("metadata http: %w", err)
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("metadata http: URL %q: want http:// or https://", cfg.URL)
	case u.Host == "":
		return nil, fmt.Errorf("metadata http: URL %q has no host", cfg.URL)
	case u.User != nil || u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("metadata http: URL %q: want no user, query or fragment", cfg.URL)
	}
	if cfg.TTL == 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.TTL < MinTTL {
		return nil, fmt.Errorf("metadata http: TTL %v below the minimum, %v", cfg.TTL, MinTTL)
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = time.Second
	}
	base := strings.TrimRight(u.String(), "/")
	h := &HTTP{
		base:      base,
		str:       "http " + base,
		client:    cfg.Client,
		ttl:       cfg.TTL,
		ttlHeader: strconv.FormatFloat(cfg.TTL.Seconds(), 'f', -1, 64),
		poll:      cfg.PollInterval,
		ownerKey:  newOwnerKey(cfg.Key),
		log:       cfg.Logger,
		names:     make(map[string]*httpName),
	}
	if h.log == nil {
		h.log = slog.Default()
	}
	if h.client == nil {
		h.client, h.ownClient = p2pClient(cfg.TLS), true
	}
	if h.ownerKey != nil && u.Scheme == "http" && !loopbackHost(u.Hostname()) {
		h.log.Warn("metadata http: owner tokens go to the metadata server in the clear; an observer on the path can replay them: use https://", "server", base)
	}
	h.ctx, h.cancel = context.WithCancel(context.Background())
	return h, nil
}

// loopbackHost reports whether host is "localhost" or a loopback IP.
func loopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// owner sets the owner token of name in hdr, when the store has a key.
func (h *HTTP) owner(hdr http.Header, name string) {
	if h.ownerKey != nil {
		hdr.Set(headerOwner, encodeToken(ownerToken(h.ownerKey, name)))
	}
}

// String returns "http " and the server's URL.
func (h *HTTP) String() string { return h.str }

func (h *HTTP) errorf(op, name string, err error) error {
	return fmt.Errorf("metadata %s: %s %q: %w", h, op, name, err)
}

// check returns the error that stops an operation before it starts; h.mu
// is held.
func (h *HTTP) check(ctx context.Context, op, name string) error {
	if h.closed {
		return h.errorf(op, name, ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return h.errorf(op, name, err)
	}
	return nil
}

// join returns a context done when ctx is or the store closes.
func (h *HTTP) join(ctx context.Context) (context.Context, context.CancelFunc) {
	c, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(h.ctx, cancel)
	return c, func() { stop(); cancel() }
}

// ctxErr returns the error of a request under h.join(ctx): ErrClosed when
// the store closed, ctx's error when ctx is done, else err.
func (h *HTTP) ctxErr(ctx context.Context, err error) error {
	switch {
	case h.ctx.Err() != nil:
		return ErrClosed
	case ctx.Err() != nil:
		return ctx.Err()
	}
	return err
}

func (h *HTTP) segmentURL(name string) string {
	return h.base + serverSegmentsPath + url.PathEscape(name)
}

// do sends a request about name and returns the response, whose body the
// caller closes, or an error wrapping ErrUnreachable.
func (h *HTTP) do(ctx context.Context, method, name, query string, header http.Header, body []byte) (*http.Response, error) {
	u := h.segmentURL(name)
	if query != "" {
		u += "?" + query
	}
	return h.doURL(ctx, method, u, header, body)
}

// doURL sends a request to u and returns the response, whose body the
// caller closes, or an error wrapping ErrUnreachable.
func (h *HTTP) doURL(ctx context.Context, method, u string, header http.Header, body []byte) (*http.Response, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	return resp, nil
}

// answer reads the (short) text of an error response and closes its body.
func answer(resp *http.Response) string {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	io.Copy(io.Discard, io.LimitReader(resp.Body, 4<<10)) // lets the connection be reused
	msg := strings.TrimSpace(string(b))
	if msg == "" {
		msg = resp.Status
	}
	return msg
}

// deniedErr maps a 401 or 403 to ErrDenied, and any other status as
// statusErr does.
func deniedErr(resp *http.Response) error {
	if resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden {
		return fmt.Errorf("%w: server answered HTTP %s: %s", ErrDenied, resp.Status, answer(resp))
	}
	return statusErr(resp)
}

// statusErr maps an unexpected answer to ErrUnreachable.
func statusErr(resp *http.Response) error {
	return fmt.Errorf("%w: server answered HTTP %s: %s", ErrUnreachable, resp.Status, answer(resp))
}

// Get returns a copy of the descriptor the server holds under name; see
// [HTTP] and [Store].
func (h *HTTP) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	h.mu.Lock()
	err := h.check(ctx, "get", name)
	h.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if err := checkName(name); err != nil {
		return nil, h.errorf("get", name, fmt.Errorf("%w: %v", ErrNotFound, err))
	}
	fctx, stop := h.join(ctx)
	defer stop()
	cw := h.chunkWatch(name)
	a, err := cw.fetch(fctx, "")
	if err != nil {
		return nil, h.errorf("get", name, h.ctxErr(ctx, err))
	}
	if a.desc == nil {
		return nil, h.errorf("get", name, ErrNotFound)
	}
	return a.desc, nil
}

// fetch asks the server for the descriptor of name, sending ifNoneMatch
// when not empty. It reads at most 16 MiB and returns a validated
// descriptor of that name, not-modified, nothing (a 404), or an error.
func (h *HTTP) fetch(ctx context.Context, name, ifNoneMatch string) (peerAnswer, error) {
	hdr := http.Header{"Accept": {"application/json"}}
	if ifNoneMatch != "" {
		hdr.Set("If-None-Match", ifNoneMatch)
	}
	resp, err := h.do(ctx, http.MethodGet, name, "", hdr, nil)
	if err != nil {
		return peerAnswer{}, err
	}
	switch {
	case resp.StatusCode == http.StatusOK:
	case resp.StatusCode == http.StatusNotModified && ifNoneMatch != "":
		resp.Body.Close()
		return peerAnswer{notModified: true}, nil
	case resp.StatusCode == http.StatusNotFound:
		answer(resp)
		return peerAnswer{}, nil
	default:
		return peerAnswer{}, statusErr(resp)
	}
	defer resp.Body.Close()
	return readDesc(resp, name, serverMaxDesc, "server")
}

// acquire returns the writing state of name with one more user, or an
// error when the store is closed or ctx done; release gives it back.
func (h *HTTP) acquire(ctx context.Context, op, name string) (*httpName, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := h.check(ctx, op, name); err != nil {
		return nil, err
	}
	n := h.names[name]
	if n == nil {
		n = &httpName{name: name, sem: make(chan struct{}, 1)}
		h.names[name] = n
	}
	n.users++
	return n, nil
}

func (h *HTTP) release(n *httpName) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if n.users--; n.users == 0 {
		delete(h.names, n.name)
	}
}

// lock takes n.sem, unless ctx is done or the store closes first.
func (h *HTTP) lock(ctx context.Context, n *httpName) error {
	select {
	case n.sem <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-h.ctx.Done():
		return ErrClosed
	}
}

// Put validates d and publishes a copy on the server unless another epoch
// holds its name, then keeps it alive until Delete or Close; see [HTTP]
// and [Store].
func (h *HTTP) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil {
		return h.errorf("put", "", fmt.Errorf("%w: nil descriptor", segtable.ErrBadDesc))
	}
	if err := d.Validate(); err != nil {
		return h.errorf("put", d.Name, err)
	}
	if err := checkName(d.Name); err != nil {
		return h.errorf("put", d.Name, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err))
	}
	if d.Chunked != nil && d.Chunked.Count() > 0 && !h.flat.Load() {
		err := h.putChunked(ctx, d)
		if !errors.Is(err, errNoChunks) {
			return err
		}
		h.flat.Store(true) // an older server: whole descriptors from now on
	}
	body, err := d.Marshal()
	if err != nil {
		return h.errorf("put", d.Name, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err))
	}
	if len(body) > serverMaxDesc {
		return h.errorf("put", d.Name, fmt.Errorf("%w: %d bytes of JSON, the server accepts at most %d", segtable.ErrBadDesc, len(body), serverMaxDesc))
	}
	d = d.Clone()
	n, err := h.acquire(ctx, "put", d.Name)
	if err != nil {
		return err
	}
	defer h.release(n)
	if err := h.lock(ctx, n); err != nil {
		return h.errorf("put", d.Name, err)
	}
	defer func() { <-n.sem }()

	rctx, stop := h.join(ctx)
	defer stop()
	if err := h.put(rctx, d.Name, body, false); err != nil {
		return h.errorf("put", d.Name, h.ctxErr(ctx, err))
	}
	n.desc, n.body, n.pub = d, body, nil
	if n.stop == nil {
		h.startRenewal(n)
	}
	return nil
}

// putChunked publishes d, a Chunked descriptor, as chunks and a header
// (http_chunks.go), then keeps it alive as Put does. It returns
// errNoChunks, unwrapped, when the server does not take chunks.
func (h *HTTP) putChunked(ctx context.Context, d *segtable.SegmentDesc) error {
	n, err := h.acquire(ctx, "put", d.Name)
	if err != nil {
		return err
	}
	defer h.release(n)
	if err := h.lock(ctx, n); err != nil {
		return h.errorf("put", d.Name, err)
	}
	defer func() { <-n.sem }()
	pub, err := h.chunkedPub(n, d)
	if err != nil {
		return h.errorf("put", d.Name, err)
	}
	rctx, stop := h.join(ctx)
	defer stop()
	if err := h.publishChunks(rctx, n, pub, false); err != nil {
		if errors.Is(err, errNoChunks) {
			return errNoChunks
		}
		return h.errorf("put", d.Name, h.ctxErr(ctx, err))
	}
	n.desc, n.body, n.pub = d.CloneShared(), nil, pub
	if n.stop == nil {
		h.startRenewal(n)
	}
	return nil
}

// put sends one PUT of body under name, a renewal when renew is set.
func (h *HTTP) put(ctx context.Context, name string, body []byte, renew bool) error {
	hdr := http.Header{"Content-Type": {"application/json"}}
	hdr.Set(headerTTL, h.ttlHeader)
	if renew {
		hdr.Set(headerRenew, "1")
	}
	h.owner(hdr, name)
	resp, err := h.do(ctx, http.MethodPut, name, "", hdr, body)
	if err != nil {
		return err
	}
	return putErr(resp)
}

// startRenewal starts n's renewal goroutine, unless the store is closing;
// n.sem is held.
func (h *HTTP) startRenewal(n *httpName) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return
	}
	stop := make(chan struct{})
	n.stop = stop
	n.users++
	h.wg.Add(1)
	go h.renew(n, stop)
}

// renew re-PUTs n's descriptor every TTL/3 until stop is closed or
// replaced, the store closes, or the server says another epoch holds the
// name.
func (h *HTTP) renew(n *httpName, stop chan struct{}) {
	defer h.wg.Done()
	defer h.release(n)
	t := time.NewTicker(h.ttl / 3)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-h.ctx.Done():
			return
		case <-t.C:
		}
		select {
		case n.sem <- struct{}{}:
		case <-stop:
			return
		case <-h.ctx.Done():
			return
		}
		if n.stop != stop {
			<-n.sem
			return
		}
		// A renewal that takes longer than the TTL is late anyway; one
		// that fails is tried again at the next tick.
		ctx, cancel := context.WithTimeout(h.ctx, max(h.ttl, time.Second))
		var err error
		if n.pub != nil {
			err = h.publishChunks(ctx, n, n.pub, true)
			if errors.Is(err, errNoChunks) && n.desc != nil {
				// The server was replaced by one that takes no chunks.
				h.flat.Store(true)
				if body, merr := n.desc.Marshal(); merr == nil {
					n.pub, n.body = nil, body
					err = h.put(ctx, n.name, n.body, true)
				}
			}
		} else {
			err = h.put(ctx, n.name, n.body, true)
		}
		cancel()
		if h.ctx.Err() != nil {
			<-n.sem
			return // closing: the failure is the store's own
		}
		h.renewed(n, err)
		if errors.Is(err, ErrExists) || errors.Is(err, segtable.ErrBadDesc) {
			n.stop, n.desc, n.body, n.pub, n.sent = nil, nil, nil, nil, nil // lost the name: stop for good
			<-n.sem
			return
		}
		<-n.sem
	}
}

// renewed logs the outcome of one renewal of n: every failure that ends
// the renewal, the first of a row of others and then one a minute with how
// many were left out, and a success after failures. n.sem is held.
func (h *HTTP) renewed(n *httpName, err error) {
	if err == nil {
		if n.failing > 0 {
			h.log.Info("metadata http: renewals succeed again", "server", h.base, "segment", n.name, "failed", n.failing)
		}
		n.failing, n.quiet = 0, 0
		return
	}
	n.failing++
	final := errors.Is(err, ErrExists) || errors.Is(err, segtable.ErrBadDesc)
	if !final && n.failing > 1 && time.Since(n.logged) < httpLogInterval {
		n.quiet++
		return
	}
	msg := "metadata http: renewal failed; the descriptor expires on the server unless a renewal succeeds"
	switch {
	case final:
		msg = "metadata http: renewal refused; renewing no more: the descriptor expires on the server"
	case errors.Is(err, ErrDenied):
		msg = "metadata http: renewal denied: the server does not take this store's owner token for the name (another key, or another owner bound it); the descriptor expires unless that changes"
	}
	h.log.Warn(msg, "server", h.base, "segment", n.name, "err", err, "failed", n.failing, "unlogged", n.quiet)
	n.logged, n.quiet = time.Now(), 0
}

// Delete removes the descriptor under name on the server if its epoch
// matches (0 matches any), and stops renewing it; see [HTTP] and [Store].
func (h *HTTP) Delete(ctx context.Context, name string, epoch uint64) error {
	n, err := h.acquire(ctx, "delete", name)
	if err != nil {
		return err
	}
	defer h.release(n)
	if err := checkName(name); err != nil {
		return h.errorf("delete", name, fmt.Errorf("%w: %v", ErrNotFound, err))
	}
	if err := h.lock(ctx, n); err != nil {
		return h.errorf("delete", name, err)
	}
	defer func() { <-n.sem }()

	rctx, stop := h.join(ctx)
	defer stop()
	err = h.delete(rctx, name, epoch)
	if !errors.Is(err, ErrEpoch) && n.stop != nil {
		close(n.stop)
		n.stop, n.desc, n.body, n.pub, n.sent = nil, nil, nil, nil, nil
	}
	if err != nil {
		return h.errorf("delete", name, h.ctxErr(ctx, err))
	}
	return nil
}

func (h *HTTP) delete(ctx context.Context, name string, epoch uint64) error {
	hdr := http.Header{}
	h.owner(hdr, name)
	resp, err := h.do(ctx, http.MethodDelete, name, "epoch="+strconv.FormatUint(epoch, 10), hdr, nil)
	if err != nil {
		return err
	}
	switch resp.StatusCode {
	case http.StatusOK, http.StatusNoContent:
		answer(resp)
		return nil
	case http.StatusNotFound:
		answer(resp)
		return ErrNotFound
	case http.StatusConflict:
		return fmt.Errorf("%w: %s", ErrEpoch, answer(resp))
	}
	return deniedErr(resp)
}

// Watch returns a coalescing channel of the changes of name, polled from
// the server, closed when ctx is done or the store is closed; see [HTTP]
// and [Store].
func (h *HTTP) Watch(ctx context.Context, name string) (<-chan Event, error) {
	h.mu.Lock()
	if err := h.check(ctx, "watch", name); err != nil {
		h.mu.Unlock()
		return nil, err
	}
	if err := checkName(name); err != nil {
		h.mu.Unlock()
		return nil, h.errorf("watch", name, fmt.Errorf("%w: %v", ErrNotFound, err))
	}
	h.wg.Add(1)
	h.mu.Unlock()

	wctx, stop := h.join(ctx)
	cw := h.chunkWatch(name)
	w := &pollWatch{
		fetch: cw.fetch,
		poll:  h.poll, done: h.wg.Done, ch: make(chan Event, 1),
	}
	w.step(wctx)
	if wctx.Err() != nil {
		stop()
		h.wg.Done()
		return nil, h.errorf("watch", name, h.ctxErr(ctx, wctx.Err()))
	}
	go w.run(wctx, stop)
	return w.ch, nil
}

// Close ends every watch and renewal, waits for their goroutines and makes
// later calls fail with [ErrClosed]. It does not delete what the store
// published: that expires on the server within TTL. It is idempotent and
// returns nil.
func (h *HTTP) Close() error {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	h.mu.Unlock()
	h.cancel()
	h.wg.Wait()
	if h.ownClient {
		h.client.CloseIdleConnections()
	}
	return nil
}
