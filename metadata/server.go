// server.go holds the metadata [Server]: the protocol's constants, its
// configuration and counts, and the entries it keeps (in memory, and in Dir
// through server_dir.go) with their expiry. Its HTTP handlers are in
// server_handlers.go, owner tokens in server_auth.go, the limits on
// connections in server_limit.go.

package metadata

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moonring/moonring/segtable"
)

// The HTTP protocol of a metadata server ([Server], spoken by [HTTP]).
const (
	// serverSegmentsPath prefixes a segment's resource:
	// /moonring/v1/segments/{name}.
	serverSegmentsPath = "/moonring/v1/segments/"
	serverHealthPath   = "/moonring/v1/healthz"
	// headerTTL carries a PUT's time to live in decimal seconds ("30",
	// "0.2").
	headerTTL = "Moonring-TTL"
	// headerRenew marks a PUT as a renewal ("1"): see Server.
	headerRenew = "Moonring-Renew"
)

const (
	// DefaultTTL is the time to live of a descriptor whose PUT names none,
	// and of an [HTTP] store's Puts unless HTTPConfig.TTL says otherwise.
	DefaultTTL = 30 * time.Second
	// MinTTL is the shortest time to live a [Server] accepts.
	MinTTL = 10 * time.Millisecond
	// DefaultMaxTTL is the longest time to live a [Server] accepts unless
	// ServerConfig.MaxTTL says otherwise: how long, at most, a descriptor
	// nobody renews is kept.
	DefaultMaxTTL = 10 * time.Minute
	// serverMaxDesc bounds the descriptors an [HTTP] store sends and
	// reads, as p2pMaxDesc bounds a peer's answer; a server's own bound
	// is ServerConfig.MaxDescriptor.
	serverMaxDesc = p2pMaxDesc
	// serverMaxName bounds a segment name.
	serverMaxName = 255
	// serverLogInterval is the least time between two log lines of one
	// kind of refusal.
	serverLogInterval = 10 * time.Second
	// serverReadingDescs bounds the bodies of PUTs being read at once, in
	// MaxDescriptors (32 MiB by default): what a crowd of clients that
	// need no credential (a server without the key creating free names)
	// can make the server hold before it has looked at any of it.
	serverReadingDescs = 32
)

// Defaults of the limits of [ServerConfig].
const (
	// DefaultMaxDescriptor is the largest descriptor, in bytes of JSON, a
	// [Server] accepts unless ServerConfig.MaxDescriptor says otherwise.
	DefaultMaxDescriptor = 1 << 20
	// DefaultMaxNames is how many names a [Server] holds at most unless
	// ServerConfig.MaxNames says otherwise.
	DefaultMaxNames = 10000
	// DefaultMaxBytes is how many bytes of descriptors a [Server] holds at
	// most unless ServerConfig.MaxBytes says otherwise.
	DefaultMaxBytes = 256 << 20
	// DefaultMaxChunked is the most bytes a [Server] holds for one name's
	// descriptor sent as chunks (header and chunks, those uploaded and not
	// yet listed included) unless ServerConfig.MaxChunked says otherwise.
	DefaultMaxChunked = 64 << 20
	// DefaultMaxConns is how many connections [Server.LimitListener]
	// keeps open at once unless ServerConfig.MaxConns says otherwise.
	DefaultMaxConns = 512
	// DefaultMaxConnsPerHost is how many of them one source may hold.
	DefaultMaxConnsPerHost = 64
	// DefaultMaxHeaderBytes bounds the header of a request to
	// [Server.HTTPServer] unless ServerConfig.MaxHeaderBytes says
	// otherwise (net/http allows 4 KiB more; past that it answers 431).
	DefaultMaxHeaderBytes = 8 << 10
	// DefaultReadHeaderTimeout, DefaultReadTimeout, DefaultWriteTimeout
	// and DefaultIdleTimeout are the timeouts of [Server.HTTPServer]
	// unless ServerConfig says otherwise.
	DefaultReadHeaderTimeout = 5 * time.Second
	DefaultReadTimeout       = 30 * time.Second
	DefaultWriteTimeout      = 30 * time.Second
	DefaultIdleTimeout       = 2 * time.Minute
)

// ServerConfig configures [NewServer]. Its zero value keeps descriptors in
// memory only, binds names to their creators' owner tokens on first use
// (see [Server]), and applies the default limits. A limit of zero takes its
// default; a negative one is refused by NewServer.
type ServerConfig struct {
	// Dir, when not empty, is the directory (created if missing) where
	// the server keeps its descriptors, one file each (and a file per
	// chunk of one sent as chunks), written atomically
	// at every change of that descriptor and read back by NewServer, so
	// that a restarted server still holds them (see [Server]). One
	// server at a time may use a Dir.
	Dir string
	// MaxTTL is the longest time to live a PUT may ask for; default
	// [DefaultMaxTTL]. A longer one is refused (400).
	MaxTTL time.Duration
	// Key, when set, is the deployment's segment key (MOONRING_KEY, what
	// the engines have as tcp.Config.Key and [HTTPConfig].Key): every
	// PUT and DELETE must then carry the owner token that this key
	// derives for its name, so that nobody without the key can create,
	// change, renew or delete any name. Without it the server binds each
	// name to the token of the PUT that created it (trust on first use).
	// With the key the server also keeps only descriptors signed with it
	// (see [Signed]; 403 otherwise), as every engine with the key checks
	// what it reads: of a republish sent as chunks, the chunks it had not
	// checked (for that it holds each such descriptor's chunks decoded
	// too, a few times their encoding's bytes, which MaxBytes does not
	// count). The server keeps a copy.
	Key []byte
	// RequireOwner, for a server without Key, refuses (401) a PUT that
	// creates a name without an owner token, and any change of such a
	// name: without it, a name created without a token (by an [HTTP]
	// store without a Key) stays open to anyone, as before owner tokens.
	// A server with Key always requires them.
	RequireOwner bool
	// MaxDescriptor is the largest descriptor, in bytes of JSON, a PUT
	// may send (413 beyond); default [DefaultMaxDescriptor].
	MaxDescriptor int
	// MaxNames is how many names the server holds at most: a PUT that
	// would create one more is refused (429); default [DefaultMaxNames].
	MaxNames int
	// MaxBytes is how many bytes of descriptors (their JSON) the server
	// holds at most: a PUT that would take it past is refused (429);
	// default [DefaultMaxBytes]. It must be at least MaxDescriptor.
	MaxBytes int64
	// MaxChunked is the most bytes of one name's descriptor sent as
	// chunks (its header and every chunk held for the name, uploaded and
	// not yet listed included): a chunk or header PUT past it is refused
	// (413); default [DefaultMaxChunked]. MaxDescriptor bounds each
	// chunk and header; MaxBytes counts every chunk too.
	MaxChunked int64
	// MaxConns caps the connections a listener from
	// [Server.LimitListener] keeps open, and MaxConnsPerHost those from
	// one source (an IPv6 one counted by its /64); defaults
	// [DefaultMaxConns] and [DefaultMaxConnsPerHost]. Past either, a new
	// connection takes the place of the oldest idle one in its way, so
	// that idle connections cannot lock peers out.
	MaxConns        int
	MaxConnsPerHost int
	// MaxHeaderBytes, ReadHeaderTimeout, ReadTimeout, WriteTimeout and
	// IdleTimeout are those of the http.Server from [Server.HTTPServer];
	// defaults [DefaultMaxHeaderBytes], [DefaultReadHeaderTimeout],
	// [DefaultReadTimeout], [DefaultWriteTimeout] and
	// [DefaultIdleTimeout].
	MaxHeaderBytes    int
	ReadHeaderTimeout time.Duration
	ReadTimeout       time.Duration
	WriteTimeout      time.Duration
	IdleTimeout       time.Duration
	// Logf, when set, is told of what happens beside answers: a
	// descriptor that expired, a file that could not be written after an
	// expiry, and refusals (of credentials, sizes, quotas, connections),
	// each kind at most once every ten seconds with a count of those it
	// left out. It may be called from any goroutine, with the server's
	// lock held: it must not call the server back.
	Logf func(format string, args ...any)
}

// ServerStats are a [Server]'s counts, from [Server.Stats]: how much it
// holds and how many requests and connections it refused, by reason, since
// NewServer. Each refusal is also logged (ServerConfig.Logf) at a bounded
// rate.
type ServerStats struct {
	// Names and Bytes are what the server holds: names, and bytes of
	// their descriptors' JSON.
	Names int
	Bytes int64
	// Chunks counts the chunks held (their bytes are in Bytes): those
	// the descriptors sent as chunks list, and those uploaded and not
	// listed yet.
	Chunks int
	// Conns counts the connections open through [Server.LimitListener].
	Conns int
	// Unauthenticated counts changes refused for want of an owner token
	// (401), Forbidden those refused for a wrong or malformed one (403).
	Unauthenticated uint64
	Forbidden       uint64
	// TooLarge counts PUTs refused for a descriptor over MaxDescriptor
	// (413).
	TooLarge uint64
	// TooManyNames and TooManyBytes count PUTs refused because the server
	// held MaxNames names or would hold more than MaxBytes bytes (429).
	TooManyNames uint64
	TooManyBytes uint64
	// ConnsRefused counts connections closed at accept because MaxConns
	// (or MaxConnsPerHost) were open and every one in the way was in a
	// request; ConnsEvicted idle connections closed to make room for a
	// new one.
	ConnsRefused uint64
	ConnsEvicted uint64
	// Busy counts PUTs refused (503, Retry-After: 1) because the bodies
	// of others being read at once already added up to 32
	// MaxDescriptors.
	Busy uint64
}

// Server is the metadata server of a deployment (`moonring
// metadata-server`): an [http.Handler] that keeps the descriptors of many
// segments, one per name, for [HTTP] stores to publish and read. It serves:
//
//   - GET /moonring/v1/segments/{name}: the descriptor as JSON (200), with
//     an ETag ("<epoch>-<revision>", new at every change) and honouring
//     If-None-Match (304), so pollers pay little for an unchanged
//     descriptor; 404 when the name holds none. HEAD likewise. Anyone who
//     reaches the server may read every descriptor.
//   - PUT /moonring/v1/segments/{name}: stores the descriptor in the body
//     (at most ServerConfig.MaxDescriptor bytes; 413 beyond), which must
//     be valid and carry name (else 400), under the epoch rules of
//     [Store]: 409 when the name is held by another epoch, 204 with the
//     new ETag otherwise. The header Moonring-TTL gives the descriptor's
//     time to live in decimal seconds (default 30, or MaxTTL if less;
//     from [MinTTL] to ServerConfig.MaxTTL, else 400). A PUT with the
//     header "Moonring-Renew: 1" is a renewal: when the name holds the
//     same epoch it only restarts the time to live (the descriptor, its
//     ETag and its file are left alone, so watchers see nothing); when the
//     name holds nothing it stores the body as any PUT does. A PUT that
//     would create a name past ServerConfig.MaxNames, or hold more than
//     ServerConfig.MaxBytes bytes of descriptors, is refused with 429
//     (Too Many Requests: a quota, which a retry can pass once names are
//     deleted or expire). While the bodies of the PUTs being read add up
//     to 32 MaxDescriptors, another is refused with 503 and Retry-After:
//     1 before its body is read: strangers who may create names (on a
//     server without the key) cannot make it hold more.
//   - DELETE /moonring/v1/segments/{name}?epoch=N: removes the descriptor
//     if its epoch is N, whatever it is when N is 0 or absent (204); 404
//     when the name holds none, 409 when the epochs differ, 400 when N is
//     not a number.
//   - GET /moonring/v1/healthz: 200 "ok".
//
// A descriptor whose buffers come as chunks (an engine's, see
// segtable.SegmentDesc.Chunked) may instead travel as its chunks and a
// header that lists them, so that a republish after one registration
// moves one or two chunks, not every buffer ([HTTP] stores do so with a
// server that answers these requests; every answer of this server
// carries "Moonring-Chunks: 1"):
//
//   - PUT /moonring/v1/segments/{name}/chunks/{epoch}/{seq}: one chunk's
//     buffers, a JSON array of 1 to 1,024, valid, sorted, not
//     overlapping, encoded as Go's json.Marshal encodes them (else 400),
//     with the owner token a PUT of the name needs (401, 403) and 409 when
//     another epoch holds the name. The server keeps it under (epoch, seq,
//     the first 64 bits of its SHA-256) until a header lists it, for a
//     minute at most, and as long as the name's entry lists it. 204.
//   - PUT /moonring/v1/segments/{name}/header: the header, JSON
//     {"layout":"moonring-chunks/1","signed":..,"desc":<the descriptor
//     without buffers>,"chunks":[{"s":seq,"n":buffers,"h":hash,"m":MAC}]}
//     in address order, at most 131,072 chunks, with the headers and the
//     answers of a PUT (TTL, renewal, owner token, epochs, quotas, 204
//     with the ETag). It replaces the entry, atomically, only when the
//     server holds every chunk listed; else 412 with
//     {"missing":[seq,...]}, and the client sends those and tries again.
//     The chunks the new entry does not list are dropped.
//   - GET /moonring/v1/segments/{name}/header: the header (a whole
//     descriptor when the entry was PUT whole), with the ETag and
//     If-None-Match of a GET.
//   - GET /moonring/v1/segments/{name}/chunks?epoch=E&seq=S1,S2,..: at
//     most 256 chunks the entry lists, a JSON array of their encodings in
//     the order asked; 404 when the entry lists none of that epoch and
//     seq (a republish came between: read the header again).
//
// A GET of the name serves an entry sent as chunks whole, byte for byte
// the descriptor's Marshal, so readers of whole descriptors see no
// difference. Chunks count against MaxBytes; one name's header and chunks
// (those not listed yet included) against ServerConfig.MaxChunked (413);
// MaxDescriptor bounds each chunk and header (413); the names holding
// chunks against MaxNames, and those not yet listed are at most 131,072 a
// name and 1,048,576 in all (429). A server with the key checks the
// descriptor a header assembles as a PUT's, whole (O(buffers) on the
// server per republish).
//
// A name is 1 to 255 bytes of letters, digits and ".-_:@[]%+~", and not "."
// or "..": nothing that could be a path or need escaping in one (400).
//
// # Owners
//
// A PUT or DELETE proves that it comes from the owner of its name with the
// header Moonring-Owner: the owner token, HMAC-SHA256(HMAC-SHA256(key,
// "moonring metadata owner v1"), name) of the deployment's segment key,
// base64url without padding, which [HTTP] stores with HTTPConfig.Key send.
// A change without the header that needs one is answered 401 (with
// WWW-Authenticate: Moonring-Owner), one with a wrong or malformed token
// 403; either changes nothing, is counted ([ServerStats]) and logged at a
// bounded rate. The token is checked before the body is read, and again
// with the change.
//
//   - With ServerConfig.Key the server derives the token of every name
//     itself and requires exactly it, compared in constant time: nobody
//     without the key can create (squat), replace, renew or delete any
//     name.
//   - Without it, the server binds a name to the token of the PUT that
//     creates it (trust on first use) and requires that token for every
//     later change of the name, until the binding goes with the entry (a
//     DELETE or an expiry); it keeps only the token's SHA-256, in memory
//     and in Dir. A name created without a token is not bound, and anyone
//     may change it, as before owner tokens, until a change that carries a
//     token binds it; ServerConfig.RequireOwner refuses such names.
//
// What this does not protect: the token travels in the clear over http://,
// so an observer on the path can replay it for that name (serve the server
// behind TLS and give the stores an https:// URL); anyone who holds the
// segment key (every engine of the deployment) may change every name; a
// server without the key lets the first comer take a free name, including
// that of an engine whose descriptor expired while it was away; reads are
// open to anyone who reaches the server; and the descriptor's content is
// only as trustworthy as the server and its path (signatures of
// descriptors are a separate matter).
//
// # Expiry and persistence
//
// Every descriptor expires: one not PUT again within its time to live is
// removed as a DELETE would, so the segment of an engine that died, which
// cannot Delete it, goes away and its watchers see Deleted. [HTTP] stores
// renew their descriptors on their own.
//
// With ServerConfig.Dir, every change of a descriptor (PUT, DELETE,
// expiry) writes or removes that descriptor's own file before the request
// is answered (a temporary file synced and renamed over it), so a change
// costs what its entry costs; a change that cannot be written is undone and
// answered 500. Renewals write nothing unless they change the time to live
// or bind the name. NewServer reads the files back; the reloaded
// descriptors keep their ETags, owners and times to live, but their clocks
// restart: each lives a full time to live from the restart, giving live
// owners time to renew. A restart without the files loses nothing for good
// either: a live [HTTP] store's next renewal stores its descriptor again.
// An entry sent as chunks is a file of its header (version 3; an older
// server refuses to start on it) and a file per chunk, each written,
// synced and renamed when it is uploaded, before any header that lists it,
// and removed when no entry lists it; NewServer removes those no entry
// lists. The directory of an earlier version held every descriptor in one file,
// segments.json: NewServer moves its entries to their own files (unbound)
// and removes it.
//
// Serve it with [Server.HTTPServer] on a listener from
// [Server.LimitListener], which bound headers, timeouts and connections;
// [Server.Stats] counts what was refused.
//
// A Server is safe for concurrent use. It lives from NewServer until Close,
// which stops expiries and makes it answer 503; serving it (an
// [http.Server], its listener and shutdown) is the caller's.
type Server struct {
	cfg             ServerConfig // with defaults filled in
	dir             string       // "" without a Dir
	maxTTL          time.Duration
	ownerKey        []byte           // nil without ServerConfig.Key
	signer          *segtable.Signer // nil without ServerConfig.Key: checks descriptors' signatures
	requireOwner    bool
	maxDesc         int
	maxNames        int
	maxBytes        int64
	maxChunked      int64
	maxConns        int
	maxConnsPerHost int
	logf            func(string, ...any)
	mux             *http.ServeMux

	// authLog, sizeLog, namesLog, bytesLog and busyLog log refusals of
	// credentials, sizes, quotas and reads; connLog connections refused;
	// httpLog http.Server's errors.
	authLog, sizeLog, namesLog, bytesLog, busyLog, connLog, httpLog *rateLog

	limMu sync.Mutex
	lims  []*connLimiter // the listeners from LimitListener
	stats struct {
		unauthenticated, forbidden, tooLarge, tooManyNames, tooManyBytes, connsRefused, busy atomic.Uint64
	}
	// reading is the room the PUTs reading their bodies have reserved, in
	// bytes, at most serverReadingDescs * maxDesc.
	reading atomic.Int64

	mu      sync.Mutex
	closed  bool
	entries map[string]*serverEntry
	bytes   int64 // the sum of the entries' size() and of every chunk's bytes
	// chunks holds the chunks of each name that has any (server_chunks.go),
	// at most maxNames names; pending counts those listed by no entry, all
	// names together.
	chunks     map[string]*nameChunks
	pending    int
	pendingTTL time.Duration // serverPendingTTL when made
	// rev counts changes; it starts above any revision of the directory
	// and above the clock in nanoseconds, so that ETags never repeat
	// across restarts, with or without a directory.
	rev uint64
}

// serverEntry is one stored descriptor. Its epoch, body, etag and rev never
// change (a PUT replaces the entry); ttl, expires, timer, owner and bound
// change under Server.mu. Only the JSON is kept, not the parsed descriptor,
// so that what an entry costs is what MaxBytes counts.
type serverEntry struct {
	epoch   uint64
	body    []byte // the descriptor as served and saved
	etag    string // `"<epoch>-<rev>"`
	rev     uint64
	ttl     time.Duration
	expires time.Time
	timer   *time.Timer // runs Server.expire; nil until the entry is stored
	// owner is the SHA-256 of the owner token bound to the name, when
	// bound is set.
	owner ownerHash
	bound bool
	// head is set, and body nil, for a descriptor sent as chunks: its
	// header and chunks (server_chunks.go).
	head *entryHead
	// checked is what the server with the key checked of a descriptor
	// sent as chunks, which the next header of the name starts from
	// (checkChunked); nil otherwise.
	checked *chunksChecked
}

// size is what an entry counts against MaxBytes beside its chunks.
func (e *serverEntry) size() int64 {
	if e.head != nil {
		return e.head.size()
	}
	return int64(len(e.body))
}

// NewServer returns a server holding the descriptors saved in cfg.Dir, if
// any. It fails when a limit is negative or MaxBytes below MaxDescriptor,
// when Dir cannot be created or read, or when a file in it that should
// hold a descriptor does not: a corrupt file is left for an operator to
// inspect or remove, never overwritten.
func NewServer(cfg ServerConfig) (*Server, error) {
	cfg.Key = slices.Clone(cfg.Key)
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&cfg.MaxTTL, DefaultMaxTTL)
	def(&cfg.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	def(&cfg.ReadTimeout, DefaultReadTimeout)
	def(&cfg.WriteTimeout, DefaultWriteTimeout)
	def(&cfg.IdleTimeout, DefaultIdleTimeout)
	if cfg.MaxDescriptor == 0 {
		cfg.MaxDescriptor = DefaultMaxDescriptor
	}
	if cfg.MaxNames == 0 {
		cfg.MaxNames = DefaultMaxNames
	}
	if cfg.MaxBytes == 0 {
		cfg.MaxBytes = max(DefaultMaxBytes, int64(cfg.MaxDescriptor))
	}
	if cfg.MaxChunked == 0 {
		cfg.MaxChunked = DefaultMaxChunked
	}
	if cfg.MaxConns == 0 {
		cfg.MaxConns = DefaultMaxConns
	}
	if cfg.MaxConnsPerHost == 0 {
		cfg.MaxConnsPerHost = min(DefaultMaxConnsPerHost, cfg.MaxConns)
	}
	if cfg.MaxHeaderBytes == 0 {
		cfg.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	switch {
	case cfg.MaxTTL < MinTTL:
		return nil, fmt.Errorf("metadata server: MaxTTL %v is below the minimum time to live, %v", cfg.MaxTTL, MinTTL)
	case cfg.MaxDescriptor < 0, cfg.MaxNames < 0, cfg.MaxBytes < 0, cfg.MaxChunked < 0, cfg.MaxConns < 0, cfg.MaxConnsPerHost < 0, cfg.MaxHeaderBytes < 0,
		cfg.ReadHeaderTimeout < 0, cfg.ReadTimeout < 0, cfg.WriteTimeout < 0, cfg.IdleTimeout < 0:
		return nil, errors.New("metadata server: negative limit")
	case cfg.MaxBytes < int64(cfg.MaxDescriptor):
		return nil, fmt.Errorf("metadata server: MaxBytes %d below MaxDescriptor %d", cfg.MaxBytes, cfg.MaxDescriptor)
	}
	s := &Server{
		cfg:             cfg,
		dir:             cfg.Dir,
		maxTTL:          cfg.MaxTTL,
		ownerKey:        newOwnerKey(cfg.Key),
		signer:          newSigner(cfg.Key),
		requireOwner:    cfg.RequireOwner,
		maxDesc:         cfg.MaxDescriptor,
		maxNames:        cfg.MaxNames,
		maxBytes:        cfg.MaxBytes,
		maxChunked:      cfg.MaxChunked,
		maxConns:        cfg.MaxConns,
		maxConnsPerHost: cfg.MaxConnsPerHost,
		logf:            cfg.Logf,
		entries:         make(map[string]*serverEntry),
		chunks:          make(map[string]*nameChunks),
		pendingTTL:      serverPendingTTL,
		rev:             uint64(max(time.Now().UnixNano(), 0)),
	}
	if s.logf == nil {
		s.logf = func(string, ...any) {}
	}
	for _, l := range []**rateLog{&s.authLog, &s.sizeLog, &s.namesLog, &s.bytesLog, &s.busyLog, &s.connLog, &s.httpLog} {
		*l = newRateLog(s.logf, serverLogInterval)
	}
	if s.dir != "" {
		if err := os.MkdirAll(s.dir, 0o755); err != nil {
			return nil, fmt.Errorf("metadata server: %w", err)
		}
		if err := s.load(); err != nil {
			return nil, fmt.Errorf("metadata server: %s: %w", s.dir, err)
		}
		if len(s.entries) > s.maxNames || s.bytes > s.maxBytes {
			s.logf("%s holds %d descriptors of %d bytes, more than the limits (%d, %d): new names are refused until some go", s.dir, len(s.entries), s.bytes, s.maxNames, s.maxBytes)
		}
	}
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("GET "+serverSegmentsPath+"{name}", s.serveGet)
	s.mux.HandleFunc("PUT "+serverSegmentsPath+"{name}", s.servePut)
	s.mux.HandleFunc("DELETE "+serverSegmentsPath+"{name}", s.serveDelete)
	s.mux.HandleFunc("PUT "+serverSegmentsPath+"{name}/chunks/{epoch}/{seq}", s.servePutChunk)
	s.mux.HandleFunc("PUT "+serverSegmentsPath+"{name}/header", s.servePutHeader)
	s.mux.HandleFunc("GET "+serverSegmentsPath+"{name}/header", s.serveGetHeader)
	s.mux.HandleFunc("GET "+serverSegmentsPath+"{name}/chunks", s.serveGetChunks)
	s.mux.HandleFunc("GET "+serverHealthPath, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok")
	})
	now := time.Now()
	for name, e := range s.entries {
		s.arm(name, e, now)
	}
	return s, nil
}

func newServerEntry(d *segtable.SegmentDesc, rev uint64, ttl time.Duration) (*serverEntry, error) {
	body, err := d.Marshal()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err)
	}
	return &serverEntry{
		epoch: d.Epoch,
		body:  body,
		etag:  fmt.Sprintf(`"%d-%d"`, d.Epoch, rev),
		rev:   rev,
		ttl:   ttl,
	}, nil
}

// add stores e under name, in place of what was there; s.mu is held or s
// not yet shared.
func (s *Server) add(name string, e *serverEntry) {
	if old := s.entries[name]; old != nil {
		s.bytes -= old.size()
	}
	s.entries[name] = e
	s.bytes += e.size()
}

// remove removes the entry of name, and every chunk held for the name;
// s.mu is held.
func (s *Server) remove(name string) {
	if old := s.entries[name]; old != nil {
		s.bytes -= old.size()
		delete(s.entries, name)
	}
	s.dropChunks(name, nil)
}

// arm starts the entry's time to live at now; s.mu is held, or s is not
// shared yet.
func (s *Server) arm(name string, e *serverEntry, now time.Time) {
	e.expires = now.Add(e.ttl)
	if e.timer == nil {
		e.timer = time.AfterFunc(e.ttl, func() { s.expire(name, e) })
	} else {
		e.timer.Reset(e.ttl)
	}
}

// expire removes e, stored under name, if its time to live has passed.
func (s *Server) expire(name string, e *serverEntry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.entries[name] != e {
		return // replaced or deleted meanwhile
	}
	if left := time.Until(e.expires); left > 0 {
		e.timer.Reset(left) // renewed after the timer fired
		return
	}
	s.remove(name)
	s.rev++
	s.logf("segment %q (epoch %d) expired: not renewed within %v", name, e.epoch, e.ttl)
	if err := s.unpersist(name); err != nil {
		s.logf("segment %q expired, but its file in %s could not be removed (a restart would bring it back for one time to live): %v", name, s.dir, err)
	}
}

// Names returns the names the server holds descriptors under, sorted (for
// an operator's listing; the descriptors themselves are served per name).
// It is safe for concurrent use; after Close it returns none.
func (s *Server) Names() []string {
	s.mu.Lock()
	names := make([]string, 0, len(s.entries))
	for n := range s.entries {
		names = append(names, n)
	}
	s.mu.Unlock()
	slices.Sort(names)
	return names
}

// Stats returns the server's counts; see [ServerStats]. It is safe to call
// at any time, also after Close (Names and Bytes are then 0).
func (s *Server) Stats() ServerStats {
	s.mu.Lock()
	names, bytes, chunks := len(s.entries), s.bytes, 0
	for _, nc := range s.chunks {
		chunks += len(nc.byID)
	}
	s.mu.Unlock()
	conns, refused, evicted := s.connStats()
	return ServerStats{
		Names:           names,
		Bytes:           bytes,
		Chunks:          chunks,
		Conns:           conns,
		ConnsEvicted:    evicted,
		Unauthenticated: s.stats.unauthenticated.Load(),
		Forbidden:       s.stats.forbidden.Load(),
		TooLarge:        s.stats.tooLarge.Load(),
		TooManyNames:    s.stats.tooManyNames.Load(),
		TooManyBytes:    s.stats.tooManyBytes.Load(),
		ConnsRefused:    refused,
		Busy:            s.stats.busy.Load(),
	}
}

// Close stops expiries and makes the server answer 503 to every request
// but healthz. Descriptors stay in Dir, if any, for the next server.
// It is idempotent and returns nil.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	for _, e := range s.entries {
		e.timer.Stop()
	}
	for _, nc := range s.chunks {
		if nc.timer != nil {
			nc.timer.Stop()
		}
	}
	s.entries, s.bytes, s.chunks, s.pending = nil, 0, nil, 0
	return nil
}
