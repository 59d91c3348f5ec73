// p2p.go holds the [P2P] store: its configuration, the endpoint that serves
// the engine's own descriptor, and the Store methods. How peers are asked
// is in p2p_fetch.go, how they are watched in pollwatch.go, the endpoint's
// connection limits in p2p_limit.go.

package metadata

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/moonring/moonring/internal/netaddr"
	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/segtable"
)

var _ Store = (*P2P)(nil)

// Errors of the p2p store, beside those of [Store].
var (
	// ErrNotOwner reports a Put or Delete under a name other than the
	// store's own ([P2P.Name]): a p2p store publishes only its own
	// engine's segment, whose name is the address it serves it at. A
	// retry does not help.
	ErrNotOwner = errors.New("metadata: not this store's segment")
	// ErrUnreachable reports that a peer's endpoint did not answer with a
	// descriptor or a 404: the connection failed or timed out, or the
	// peer answered another HTTP status (a 500, say). The error also
	// wraps the cause. A retry can help: the peer may be restarting.
	ErrUnreachable = errors.New("metadata: peer unreachable")
)

// Paths served by a [P2P] store.
const (
	p2pSegmentPath = "/moonring/v1/segment"
	p2pHealthPath  = "/moonring/v1/healthz"
)

const (
	// p2pMaxDesc bounds the JSON of a descriptor, served or fetched: a
	// peer's answer is never trusted to be small.
	p2pMaxDesc = 16 << 20
	// p2pGoneAfter is how many polls in a row a remote watch tolerates
	// failing before it reports the segment Deleted: a dead engine's
	// segment must disappear, and one failed poll is not death.
	p2pGoneAfter = 3
	// p2pShutdown bounds how long Close waits for requests in flight.
	p2pShutdown = time.Second
)

// P2PConfig configures [NewP2P]. Its zero value serves on an ephemeral
// loopback port over plain HTTP, with the default bounds on connections
// and their timeouts, and polls watched peers every second.
type P2PConfig struct {
	// Listen is the TCP address the endpoint listens on; default
	// "127.0.0.1:0" (an ephemeral port).
	Listen string
	// Advertise is the host:port peers reach the endpoint at, and so the
	// store's [P2P.Name]. Default: the listener's address, with the
	// port resolved when Listen's port is 0 and, when Listen's host is
	// unspecified (0.0.0.0, [::] or empty), the first non-loopback
	// address of an interface that is up (IPv4 first; IPv6 only when
	// listening on [::]), or loopback if there is none.
	// When Advertise's host is empty or its port empty or 0, the
	// listener's are used for the missing part.
	Advertise string
	// Client fetches peers' descriptors (Get and Watch of other names).
	// Default: a client that dials in 2s, waits 5s for headers, gives up
	// after 10s, follows no redirects, uses no proxy, and dials https
	// with TLS as its client configuration when TLS is set. A Client
	// given here is used as is and not closed.
	Client *http.Client
	// PollInterval is how often a watch of another engine's segment asks
	// the peer for changes; default 1s.
	PollInterval time.Duration
	// Handler, when set, serves every path the store does not (it is
	// mounted at "/"), e.g. metrics, on the same endpoint.
	Handler http.Handler
	// TLS, when set, makes the endpoint serve HTTPS with it (it must hold
	// a certificate) and peers be fetched over https: every engine of a
	// deployment uses TLS or none does.
	TLS *tls.Config

	// The endpoint is unauthenticated and faces whoever can reach it.
	// These bound what a connection may cost it; zero takes the default.

	// MaxConns bounds the endpoint's open connections (default
	// DefaultP2PMaxConns, 256), and MaxConnsPerHost those from one IP
	// address (default DefaultP2PMaxConnsPerHost, 64). A connection past
	// a bound takes the place of the oldest connection within that bound
	// that is between requests (idle, or not done sending its headers),
	// which is closed; when all of them are in a request, the new one is
	// closed at once. [P2P.Stats] counts both.
	MaxConns, MaxConnsPerHost int
	// ReadHeaderTimeout (default 5s), ReadTimeout (10s), WriteTimeout
	// (10s) and IdleTimeout (1m) bound a connection's reading of a
	// request's headers, of a whole request, the writing of an answer and
	// the wait between requests, as in [http.Server].
	ReadHeaderTimeout, ReadTimeout, WriteTimeout, IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's headers (default 64 KiB).
	MaxHeaderBytes int
	// Logf, when set, hears of connections closed by the bounds (one line
	// a second at most for evictions, one for refusals) and of the HTTP
	// server's errors.
	Logf func(format string, args ...any)
}

// P2P is the default [Store] of a deployment: each engine serves its own
// descriptor at GET /moonring/v1/segment on a small HTTP endpoint, and a
// segment's name is the host:port of that endpoint ([P2P.Name]). There is
// no shared service to run or to lose.
//
// The store publishes one name, its own: Put and Delete of any other fail
// with [ErrNotOwner], with the epoch rules of [Store] otherwise. Get and
// Watch of its own name answer locally, exactly as [Memory] does. Get of
// another name fetches http://name/moonring/v1/segment (https with TLS),
// refusing answers over 16 MiB, that fail validation or that carry another
// name ([segtable.ErrBadDesc]); a 404 is [ErrNotFound], no answer or
// another status [ErrUnreachable]. A name that is not a host:port holds
// nothing ([ErrNotFound]).
//
// Watch of another name fetches once before it returns, so the current
// descriptor, if the peer is reachable and has one, is the first event;
// then one goroutine polls every PollInterval with If-None-Match, so an
// unchanged descriptor costs a 304. It delivers the descriptor whenever
// what the peer serves changes: every Put its ETag shows (polls coalesce
// Puts between them), or other content, a new epoch included. It delivers
// Deleted, carrying the last descriptor, when the peer answers 404, and
// also after three polls in a row fail (no connection, timeout, a bad
// answer): a dead engine cannot Delete its segment, and its segment must
// disappear from its peers, so a peer that cannot be read is treated as
// gone; a peer that comes back is delivered again. The price is that a
// network outage of three polls looks like a restart to watchers. A peer
// that never served a descriptor yields no event. Events are coalesced as
// [Store] says, and the channel is closed when ctx is done or the store is
// closed.
//
// A Chunked descriptor (an engine's, segtable.SegmentDesc.Chunked) is
// also served as a header and chunks, in the format of a metadata
// [Server]'s (GET /moonring/v1/segment/header, and
// /moonring/v1/segment/chunks?epoch=E&seq=S1,S2,.., at most 256 a
// request): a Put encodes only the chunks made since the last one of the
// epoch (kept by seq and chunk pointer) and the header, and makes the
// whole descriptor when a peer first asks for it. A watch of another name
// polls the header, and after a change fetches only the chunks it does not
// hold (same seq, hash and MAC), and hands out a Chunked descriptor that
// shares the others with the descriptors read before, as an [HTTP]
// store's Get and watches do (and so does Get here); it reads a peer that
// serves no header (an older engine: a 404 or 405 without
// Moonring-Chunks) whole, as before.
//
// The endpoint also answers GET /moonring/v1/healthz with 200 "ok", and
// hands any other path to P2PConfig.Handler.
//
// A P2P is safe for concurrent use; its zero value is not usable, and it
// must not be copied. It serves from [NewP2P] until Close, which shuts the
// endpoint down, ends every watch and waits for their goroutines.
type P2P struct {
	name      string
	str       string // "p2p " + name
	scheme    string // "http" or "https"
	client    *http.Client
	ownClient bool // client was made here, so Close closes its connections
	poll      time.Duration

	srv    *http.Server
	lim    *connLimiter  // srv's listener
	served chan struct{} // closed when srv's Serve returns
	// ctx is canceled by Close; remote watches and fetches run under it.
	ctx    context.Context
	cancel context.CancelFunc
	// remote counts remote watch goroutines, and Watch calls setting one
	// up; Add happens under mu while the store is open, so Close's Wait
	// sees them all.
	remote sync.WaitGroup

	mu     sync.Mutex
	closed bool
	desc   *segtable.SegmentDesc // published under name, or nil
	body   []byte                // desc as served
	etag   string                // desc's ETag: "<epoch>-<rev>"
	// pub is desc as a header and chunks when it was published Chunked
	// (p2p_chunks.go), with pre and post, the whole descriptor around its
	// buffers; body is then nil until a peer asks for it whole.
	pub       *chunkPub
	pre, post []byte
	rev       uint64 // counts Puts and Deletes, so ETags never repeat
	// watches holds the local watches (of name); as in Memory, a watch
	// leaves it, and its channel is closed, once, under mu.
	watches map[*watch]struct{}
	// chunks holds, per peer's name, the chunks of the last header read,
	// which Gets and watches share (p2p_chunks.go).
	chunks chunkwire.Cache
}

// NewP2P listens on cfg.Listen and serves the store's endpoint until Close.
// It fails when the listener cannot be opened, Advertise is not a
// host:port, or TLS holds no certificate.
func NewP2P(cfg P2PConfig) (*P2P, error) {
	if cfg.TLS != nil && len(cfg.TLS.Certificates) == 0 && cfg.TLS.GetCertificate == nil && cfg.TLS.GetConfigForClient == nil {
		return nil, errors.New("metadata p2p: TLS config has no certificate to serve")
	}
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = time.Second
	}
	for _, d := range []struct {
		v   *int
		def int
	}{{&cfg.MaxConns, DefaultP2PMaxConns}, {&cfg.MaxConnsPerHost, DefaultP2PMaxConnsPerHost}, {&cfg.MaxHeaderBytes, 64 << 10}} {
		if *d.v <= 0 {
			*d.v = d.def
		}
	}
	for _, d := range []struct {
		v   *time.Duration
		def time.Duration
	}{{&cfg.ReadHeaderTimeout, 5 * time.Second}, {&cfg.ReadTimeout, 10 * time.Second}, {&cfg.WriteTimeout, 10 * time.Second}, {&cfg.IdleTimeout, time.Minute}} {
		if *d.v <= 0 {
			*d.v = d.def
		}
	}
	tl, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("metadata p2p: %w", err)
	}
	lim := &connLimiter{Listener: tl, max: cfg.MaxConns, perHost: cfg.MaxConnsPerHost, logf: cfg.Logf, byHost: map[string]int{}}
	ln := net.Listener(lim)
	name, err := p2pAdvertise(cfg.Advertise, ln.Addr().(*net.TCPAddr))
	if err != nil {
		ln.Close()
		return nil, err
	}
	p := &P2P{
		name:   name,
		str:    "p2p " + name,
		scheme: "http",
		client: cfg.Client,
		poll:   cfg.PollInterval,
		served: make(chan struct{}),
		lim:    lim,
	}
	if cfg.TLS != nil {
		p.scheme = "https"
	}
	if p.client == nil {
		p.client, p.ownClient = p2pClient(cfg.TLS), true
	}
	p.ctx, p.cancel = context.WithCancel(context.Background())

	mux := http.NewServeMux()
	mux.HandleFunc("GET "+p2pSegmentPath, p.serveSegment)
	mux.HandleFunc("GET "+p2pHeaderPath, p.serveHeader)
	mux.HandleFunc("GET "+p2pChunksPath, p.serveChunks)
	mux.HandleFunc("GET "+p2pHealthPath, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok")
	})
	if cfg.Handler != nil {
		mux.Handle("/", cfg.Handler)
	}
	p.srv = &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		ReadTimeout:       cfg.ReadTimeout,
		WriteTimeout:      cfg.WriteTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    cfg.MaxHeaderBytes,
		ConnState:         lim.connState,
	}
	if cfg.Logf != nil {
		p.srv.ErrorLog = log.New(logfWriter(cfg.Logf), "", 0)
	}
	if cfg.TLS != nil {
		p.srv.TLSConfig = cfg.TLS.Clone()
	}
	go func() {
		defer close(p.served)
		defer ln.Close() // Serve closes it, ServeTLS not if it fails early
		if cfg.TLS != nil {
			p.srv.ServeTLS(ln, "", "")
		} else {
			p.srv.Serve(ln)
		}
	}()
	return p, nil
}

// p2pAdvertise returns the name peers reach a listener at; see
// P2PConfig.Advertise.
func p2pAdvertise(advertise string, addr *net.TCPAddr) (string, error) {
	name, err := netaddr.Advertise(advertise, addr)
	if err != nil {
		return "", fmt.Errorf("metadata p2p: %w", err)
	}
	return name, nil
}

// Name returns the host:port peers reach this store's endpoint at: the name
// of the segment it publishes, which the engine uses as its segment name.
func (p *P2P) Name() string { return p.name }

// String returns "p2p " and the store's name.
func (p *P2P) String() string { return p.str }

func (p *P2P) errorf(op, name string, err error) error {
	return fmt.Errorf("metadata %s: %s %q: %w", p, op, name, err)
}

// check returns the error that stops an operation before it starts; p.mu is
// held.
func (p *P2P) check(ctx context.Context, op, name string) error {
	if p.closed {
		return p.errorf(op, name, ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return p.errorf(op, name, err)
	}
	return nil
}

// Get returns a copy of the descriptor under name: the store's own, or
// one fetched from the peer at name; see [P2P] and [Store].
func (p *P2P) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	p.mu.Lock()
	if err := p.check(ctx, "get", name); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	if name == p.name {
		defer p.mu.Unlock()
		if p.desc == nil {
			return nil, p.errorf("get", name, ErrNotFound)
		}
		return p.desc.Clone(), nil
	}
	p.mu.Unlock()

	u, err := p.segmentURL(name)
	if err != nil {
		return nil, p.errorf("get", name, err)
	}
	fctx, stop := p.join(ctx)
	defer stop()
	a, err := p.chunkWatch(u, name).fetch(fctx, "")
	if err != nil {
		return nil, p.errorf("get", name, p.ctxErr(ctx, err))
	}
	if a.desc == nil {
		return nil, p.errorf("get", name, ErrNotFound)
	}
	return a.desc, nil
}

// Put publishes a copy of d, which must carry the store's name, unless
// another epoch holds it; see [P2P] and [Store].
func (p *P2P) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil {
		return p.errorf("put", "", fmt.Errorf("%w: nil descriptor", segtable.ErrBadDesc))
	}
	if err := d.Validate(); err != nil {
		return p.errorf("put", d.Name, err)
	}
	if d.Chunked != nil && d.Chunked.Count() > 0 {
		return p.putChunked(ctx, d)
	}
	body, err := d.Marshal()
	if err != nil {
		return p.errorf("put", d.Name, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err))
	}
	if len(body) > p2pMaxDesc {
		return p.errorf("put", d.Name, fmt.Errorf("%w: %d bytes of JSON, peers accept at most %d", segtable.ErrBadDesc, len(body), p2pMaxDesc))
	}
	return p.publish(ctx, d.Clone(), body, nil, nil, nil)
}

// publish makes d, the store's own copy, the published descriptor: body
// its whole encoding, or (body nil) pub its chunks and header with pre
// and post the whole document's around them (see wholeParts).
func (p *P2P) publish(ctx context.Context, d *segtable.SegmentDesc, body []byte, pub *chunkPub, pre, post []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.check(ctx, "put", d.Name); err != nil {
		return err
	}
	if d.Name != p.name {
		return p.errorf("put", d.Name, fmt.Errorf("%w: a p2p store publishes only its own segment, %q", ErrNotOwner, p.name))
	}
	if p.desc != nil && p.desc.Epoch != d.Epoch {
		return p.errorf("put", d.Name, fmt.Errorf("%w: held by epoch %d, not %d", ErrExists, p.desc.Epoch, d.Epoch))
	}
	p.rev++
	p.desc, p.body, p.etag = d, body, fmt.Sprintf(`"%d-%d"`, d.Epoch, p.rev)
	p.pub, p.pre, p.post = pub, pre, post
	p.notify(d, false)
	return nil
}

// Delete unpublishes the store's descriptor if its epoch matches (0
// matches any); see [P2P] and [Store].
func (p *P2P) Delete(ctx context.Context, name string, epoch uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.check(ctx, "delete", name); err != nil {
		return err
	}
	if name != p.name {
		return p.errorf("delete", name, fmt.Errorf("%w: a p2p store publishes only its own segment, %q", ErrNotOwner, p.name))
	}
	old := p.desc
	if old == nil {
		return p.errorf("delete", name, ErrNotFound)
	}
	if epoch != 0 && old.Epoch != epoch {
		return p.errorf("delete", name, fmt.Errorf("%w: held by epoch %d, not %d", ErrEpoch, old.Epoch, epoch))
	}
	p.rev++
	p.desc, p.body, p.etag = nil, nil, ""
	p.pub, p.pre, p.post = nil, nil, nil
	p.notify(old, true)
	return nil
}

// Watch returns a coalescing channel of the changes of name, closed when
// ctx is done or the store is closed: local for the store's own name,
// polled from the peer for another; see [P2P] and [Store].
func (p *P2P) Watch(ctx context.Context, name string) (<-chan Event, error) {
	p.mu.Lock()
	if err := p.check(ctx, "watch", name); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	if name == p.name {
		defer p.mu.Unlock()
		return p.watchLocal(ctx), nil
	}
	u, err := p.segmentURL(name)
	if err != nil {
		p.mu.Unlock()
		return nil, p.errorf("watch", name, err)
	}
	p.remote.Add(1)
	p.mu.Unlock()

	wctx, stop := p.join(ctx)
	w := &pollWatch{
		fetch: p.chunkWatch(u, name).fetch,
		poll:  p.poll, done: p.remote.Done, ch: make(chan Event, 1),
	}
	w.step(wctx)
	if wctx.Err() != nil {
		stop()
		p.remote.Done()
		return nil, p.errorf("watch", name, p.ctxErr(ctx, wctx.Err()))
	}
	go w.run(wctx, stop)
	return w.ch, nil
}

// watchLocal registers a watch of the store's own name; p.mu is held.
func (p *P2P) watchLocal(ctx context.Context) <-chan Event {
	w := &watch{ch: make(chan Event, 1)}
	if p.desc != nil {
		w.ch <- Event{Desc: p.desc.Clone()}
	}
	if p.watches == nil {
		p.watches = make(map[*watch]struct{})
	}
	p.watches[w] = struct{}{}
	// The function runs in its own goroutine, so it waits for mu if ctx is
	// already done; by then w is registered.
	w.stop = context.AfterFunc(ctx, func() { p.unwatch(w) })
	return w.ch
}

func (p *P2P) unwatch(w *watch) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.watches[w]; !ok {
		return // the store closed first
	}
	delete(p.watches, w)
	close(w.ch)
}

// notify hands every local watcher its own copy of the event; p.mu is held,
// and only holders of p.mu send to local watches, so send cannot block.
func (p *P2P) notify(d *segtable.SegmentDesc, deleted bool) {
	for w := range p.watches {
		SendLatest(w.ch, Event{Desc: d.Clone(), Deleted: deleted})
	}
}

// Close shuts the endpoint down (requests in flight get a second), ends
// every watch, waits for the remote watches' goroutines and makes later
// calls fail with [ErrClosed]. It is idempotent and returns nil.
func (p *P2P) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	for w := range p.watches {
		w.stop()
		close(w.ch)
	}
	p.watches = nil
	p.desc, p.body, p.etag = nil, nil, ""
	p.pub, p.pre, p.post = nil, nil, nil
	p.mu.Unlock()

	p.cancel()
	p.remote.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), p2pShutdown)
	defer cancel()
	if p.srv.Shutdown(ctx) != nil {
		p.srv.Close()
	}
	<-p.served
	if p.ownClient {
		p.client.CloseIdleConnections()
	}
	return nil
}

// serveSegment answers GET /moonring/v1/segment with the published
// descriptor, or 304 when the asker's copy is current, or 404.
func (p *P2P) serveSegment(w http.ResponseWriter, r *http.Request) {
	body, etag := p.wholeBody() // never modified in place: Put replaces them
	serveBody(w, r, body, etag)
}

// serveBody answers a GET of the segment's descriptor or header: body
// (nil: 404) under etag, or 304 when the asker's copy is current.
func serveBody(w http.ResponseWriter, r *http.Request, body []byte, etag string) {
	h := w.Header()
	h.Set("Cache-Control", "no-cache")
	h.Set(headerChunks, "1")
	if body == nil {
		http.Error(w, "no segment published", http.StatusNotFound)
		return
	}
	h.Set("ETag", etag)
	if etagMatch(r.Header.Get("If-None-Match"), etag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.Write(body)
}

// etagMatch reports whether an If-None-Match header names etag (RFC 9110:
// a list of tags, weak comparison, or "*").
func etagMatch(header, etag string) bool {
	for t := range strings.SplitSeq(header, ",") {
		t = strings.TrimSpace(t)
		if t == "*" || strings.TrimPrefix(t, "W/") == etag {
			return true
		}
	}
	return false
}

// logfWriter hands each line the HTTP server logs to a Logf.
type logfWriter func(format string, args ...any)

func (f logfWriter) Write(p []byte) (int, error) {
	f("metadata p2p: %s", strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
