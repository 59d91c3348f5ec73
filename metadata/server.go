package metadata

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
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
	// ServerConfig.MaxTTL says otherwise.
	DefaultMaxTTL = time.Hour
	// serverMaxDesc bounds the body of a PUT, as p2pMaxDesc bounds a
	// peer's answer.
	serverMaxDesc = p2pMaxDesc
	// serverMaxName bounds a segment name.
	serverMaxName = 255
	// serverFile is the name of the file in ServerConfig.Dir that keeps the
	// descriptors.
	serverFile = "segments.json"
	// serverFileVersion is the version of that file's format.
	serverFileVersion = 1
)

// ServerConfig configures [NewServer]. Its zero value keeps descriptors in
// memory only, with times to live of [MinTTL] to [DefaultMaxTTL].
type ServerConfig struct {
	// Dir, when not empty, is the directory (created if missing) where
	// the server keeps its descriptors, in the file segments.json,
	// rewritten atomically after every change and read back by NewServer,
	// so that a restarted server still holds them. One server at a time
	// may use a Dir.
	Dir string
	// MaxTTL is the longest time to live a PUT may ask for; default
	// [DefaultMaxTTL]. A longer one is refused (400).
	MaxTTL time.Duration
	// Logf, when set, is told of what happens beside requests: a
	// descriptor that expired, a file that could not be written after an
	// expiry. It may be called from any goroutine, with the server's lock
	// held: it must not call the server back.
	Logf func(format string, args ...any)
}

// Server is the metadata server of a deployment (`moonring
// metadata-server`): an [http.Handler] that keeps the descriptors of many
// segments, one per name, for [HTTP] stores to publish and read. It serves:
//
//   - GET /moonring/v1/segments/{name}: the descriptor as JSON (200), with
//     an ETag ("<epoch>-<revision>", new at every change) and honouring
//     If-None-Match (304), so pollers pay little for an unchanged
//     descriptor; 404 when the name holds none. HEAD likewise.
//   - PUT /moonring/v1/segments/{name}: stores the descriptor in the body
//     (at most 16 MiB; 413 beyond), which must be valid and carry name
//     (else 400), under the epoch rules of [Store]: 409 when the name is
//     held by another epoch, 204 with the new ETag otherwise. The header
//     Moonring-TTL gives the descriptor's time to live in decimal seconds
//     (default 30, or MaxTTL if less; from [MinTTL] to
//     ServerConfig.MaxTTL, else 400). A PUT
//     with the header "Moonring-Renew: 1" is a renewal: when the name holds
//     the same epoch it only restarts the time to live (the descriptor,
//     its ETag and the file are left alone, so watchers see nothing); when
//     the name holds nothing it stores the body as any PUT does.
//   - DELETE /moonring/v1/segments/{name}?epoch=N: removes the descriptor
//     if its epoch is N, whatever it is when N is 0 or absent (204); 404
//     when the name holds none, 409 when the epochs differ, 400 when N is
//     not a number.
//   - GET /moonring/v1/healthz: 200 "ok".
//
// A name is 1 to 255 bytes of letters, digits and ".-_:@[]%+~", and not "."
// or "..": nothing that could be a path or need escaping in one (400).
//
// Every descriptor expires: one not PUT again within its time to live is
// removed as a DELETE would, so the segment of an engine that died, which
// cannot Delete it, goes away and its watchers see Deleted. [HTTP] stores
// renew their descriptors on their own.
//
// With ServerConfig.Dir, every change (PUT of a descriptor, DELETE,
// expiry) rewrites the file (a temporary file renamed over it) before the
// request is answered; a change that cannot be written is undone and
// answered 500. Renewals write nothing unless they change the time to
// live. NewServer reads the file back; the reloaded descriptors keep their
// ETags and times to live, but their clocks restart: each lives a full time
// to live from the restart, giving live owners time to renew. A restart
// without the file loses nothing for good either: a live [HTTP] store's
// next renewal stores its descriptor again.
//
// A Server is safe for concurrent use. It lives from NewServer until Close,
// which stops expiries and makes it answer 503; serving it (an
// [http.Server], its listener and shutdown) is the caller's.
type Server struct {
	file   string // "" without a Dir
	maxTTL time.Duration
	logf   func(string, ...any)
	mux    *http.ServeMux

	mu      sync.Mutex
	closed  bool
	entries map[string]*serverEntry
	// rev counts changes; it starts above any revision of the file and
	// above the clock in nanoseconds, so that ETags never repeat across
	// restarts, with or without a file.
	rev uint64
}

// serverEntry is one stored descriptor. Its desc, body, etag and rev never
// change (a PUT replaces the entry); ttl, expires and timer change under
// Server.mu.
type serverEntry struct {
	desc    *segtable.SegmentDesc
	body    []byte // desc as served and saved
	etag    string // `"<epoch>-<rev>"`
	rev     uint64
	ttl     time.Duration
	expires time.Time
	timer   *time.Timer // runs Server.expire; nil until the entry is stored
}

// serverFileJSON is the format of the file in ServerConfig.Dir.
type serverFileJSON struct {
	Version  int                   `json:"version"`
	Rev      uint64                `json:"rev"`
	Segments []serverFileEntryJSON `json:"segments"`
}

type serverFileEntryJSON struct {
	Rev  uint64          `json:"rev"`
	TTL  string          `json:"ttl"` // a time.Duration, e.g. "30s"
	Desc json.RawMessage `json:"desc"`
}

// NewServer returns a server holding the descriptors saved in cfg.Dir, if
// any. It fails when Dir cannot be created or its file cannot be read, or
// holds anything but a valid list of descriptors: a corrupt file is left
// for an operator to inspect or remove, never overwritten.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.MaxTTL == 0 {
		cfg.MaxTTL = DefaultMaxTTL
	}
	if cfg.MaxTTL < MinTTL {
		return nil, fmt.Errorf("metadata server: MaxTTL %v is below the minimum time to live, %v", cfg.MaxTTL, MinTTL)
	}
	s := &Server{
		maxTTL:  cfg.MaxTTL,
		logf:    cfg.Logf,
		entries: make(map[string]*serverEntry),
		rev:     uint64(max(time.Now().UnixNano(), 0)),
	}
	if s.logf == nil {
		s.logf = func(string, ...any) {}
	}
	if cfg.Dir != "" {
		if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
			return nil, fmt.Errorf("metadata server: %w", err)
		}
		s.file = filepath.Join(cfg.Dir, serverFile)
		if err := s.load(); err != nil {
			return nil, fmt.Errorf("metadata server: loading %s: %w", s.file, err)
		}
	}
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("GET "+serverSegmentsPath+"{name}", s.serveGet)
	s.mux.HandleFunc("PUT "+serverSegmentsPath+"{name}", s.servePut)
	s.mux.HandleFunc("DELETE "+serverSegmentsPath+"{name}", s.serveDelete)
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

// load reads the file, if there is one, into s.entries.
func (s *Server) load() error {
	b, err := os.ReadFile(s.file)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var f serverFileJSON
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return fmt.Errorf("corrupt file: %w", err)
	}
	if dec.More() {
		return errors.New("corrupt file: data after the JSON object")
	}
	if f.Version != serverFileVersion {
		return fmt.Errorf("file version %d, want %d", f.Version, serverFileVersion)
	}
	s.rev = max(s.rev, f.Rev)
	for i, fe := range f.Segments {
		d, err := segtable.UnmarshalDesc(fe.Desc)
		if err != nil {
			return fmt.Errorf("segment %d: %w", i, err)
		}
		if err := checkName(d.Name); err != nil {
			return fmt.Errorf("segment %d: %w", i, err)
		}
		if _, dup := s.entries[d.Name]; dup {
			return fmt.Errorf("segment %d: %q appears twice", i, d.Name)
		}
		ttl, err := time.ParseDuration(fe.TTL)
		if err != nil || ttl <= 0 {
			return fmt.Errorf("segment %d (%q): bad ttl %q", i, d.Name, fe.TTL)
		}
		e, err := newServerEntry(d, fe.Rev, min(max(ttl, MinTTL), s.maxTTL))
		if err != nil {
			return fmt.Errorf("segment %d (%q): %w", i, d.Name, err)
		}
		s.entries[d.Name] = e
		s.rev = max(s.rev, fe.Rev)
	}
	return nil
}

func newServerEntry(d *segtable.SegmentDesc, rev uint64, ttl time.Duration) (*serverEntry, error) {
	body, err := d.Marshal()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err)
	}
	return &serverEntry{
		desc: d,
		body: body,
		etag: fmt.Sprintf(`"%d-%d"`, d.Epoch, rev),
		rev:  rev,
		ttl:  ttl,
	}, nil
}

// save writes every entry to the file, atomically: a temporary file in the
// same directory, synced, then renamed over the file. s.mu is held.
func (s *Server) save() error {
	if s.file == "" {
		return nil
	}
	f := serverFileJSON{Version: serverFileVersion, Rev: s.rev, Segments: make([]serverFileEntryJSON, 0, len(s.entries))}
	for _, e := range s.entries {
		f.Segments = append(f.Segments, serverFileEntryJSON{Rev: e.rev, TTL: e.ttl.String(), Desc: e.body})
	}
	b, err := json.Marshal(&f)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(s.file), "."+serverFile+"-*.tmp")
	if err != nil {
		return err
	}
	_, err = tmp.Write(b)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), s.file)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return err
	}
	if d, err := os.Open(filepath.Dir(s.file)); err == nil {
		d.Sync() // makes the rename durable where the file system allows
		d.Close()
	}
	return nil
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
	delete(s.entries, name)
	s.rev++
	s.logf("segment %q (epoch %d) expired: not renewed within %v", name, e.desc.Epoch, e.ttl)
	if err := s.save(); err != nil {
		s.logf("segment %q expired, but %s could not be written (a restart would bring it back for one time to live): %v", name, s.file, err)
	}
}

// ServeHTTP serves the metadata protocol; see [Server].
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mux.ServeHTTP(w, r)
}

// Close stops expiries and makes the server answer 503 to every request
// but healthz. Descriptors stay in the file, if any, for the next server.
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
	s.entries = nil
	return nil
}

// checkName reports why name cannot be a segment's name on a server; see
// [Server].
func checkName(name string) error {
	switch {
	case name == "":
		return errors.New("empty segment name")
	case len(name) > serverMaxName:
		return fmt.Errorf("segment name of %d bytes, more than %d", len(name), serverMaxName)
	case name == "." || name == "..":
		return fmt.Errorf("segment name %q", name)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte(".-_:@[]%+~", c) >= 0:
		default:
			return fmt.Errorf("bad character %q in segment name", c)
		}
	}
	return nil
}

// begin checks the name of a request and that the server is open, and
// answers the request when either fails.
func (s *Server) begin(w http.ResponseWriter, r *http.Request) (string, bool) {
	w.Header().Set("Cache-Control", "no-cache")
	name := r.PathValue("name")
	if err := checkName(name); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return "", false
	}
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		http.Error(w, "metadata server closed", http.StatusServiceUnavailable)
		return "", false
	}
	return name, true
}

func (s *Server) serveGet(w http.ResponseWriter, r *http.Request) {
	name, ok := s.begin(w, r)
	if !ok {
		return
	}
	s.mu.Lock()
	e := s.entries[name]
	s.mu.Unlock()
	if e == nil {
		http.Error(w, fmt.Sprintf("no segment %q", name), http.StatusNotFound)
		return
	}
	h := w.Header()
	h.Set("ETag", e.etag) // e's body and ETag never change
	if etagMatch(r.Header.Get("If-None-Match"), e.etag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(e.body)))
	w.Write(e.body)
}

// parseTTL reads a Moonring-TTL header; "" is DefaultTTL.
func (s *Server) parseTTL(v string) (time.Duration, error) {
	if v == "" {
		return min(DefaultTTL, s.maxTTL), nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
		return 0, fmt.Errorf("%s %q is not a number of seconds", headerTTL, v)
	}
	if f*1e9 < float64(MinTTL) || f*1e9 > float64(s.maxTTL) {
		return 0, fmt.Errorf("%s %q out of range [%v, %v]", headerTTL, v, MinTTL, s.maxTTL)
	}
	return time.Duration(f * 1e9), nil
}

func (s *Server) servePut(w http.ResponseWriter, r *http.Request) {
	name, ok := s.begin(w, r)
	if !ok {
		return
	}
	ttl, err := s.parseTTL(r.Header.Get(headerTTL))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	renew := false
	if v := r.Header.Get(headerRenew); v != "" {
		if renew, err = strconv.ParseBool(v); err != nil {
			http.Error(w, fmt.Sprintf("%s %q is not a boolean", headerRenew, v), http.StatusBadRequest)
			return
		}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, serverMaxDesc))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			http.Error(w, fmt.Sprintf("descriptor of more than %d bytes", serverMaxDesc), http.StatusRequestEntityTooLarge)
			return
		}
		http.Error(w, "reading the descriptor: "+err.Error(), http.StatusBadRequest)
		return
	}
	d, err := segtable.UnmarshalDesc(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if d.Name != name {
		http.Error(w, fmt.Sprintf("descriptor of segment %q put under %q", d.Name, name), http.StatusBadRequest)
		return
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		http.Error(w, "metadata server closed", http.StatusServiceUnavailable)
		return
	}
	now := time.Now()
	old := s.entries[name]
	if old != nil && old.desc.Epoch != d.Epoch {
		http.Error(w, fmt.Sprintf("held by epoch %d, not %d", old.desc.Epoch, d.Epoch), http.StatusConflict)
		return
	}
	if old != nil && renew {
		changed := old.ttl != ttl
		old.ttl = ttl
		s.arm(name, old, now)
		if changed {
			if err := s.save(); err != nil {
				s.logf("segment %q renewed with a time to live of %v, but %s could not be written: %v", name, ttl, s.file, err)
			}
		}
		w.Header().Set("ETag", old.etag)
		w.WriteHeader(http.StatusNoContent)
		return
	}
	s.rev++
	e, err := newServerEntry(d, s.rev, ttl)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.entries[name] = e
	if err := s.save(); err != nil {
		if old != nil {
			s.entries[name] = old
		} else {
			delete(s.entries, name)
		}
		http.Error(w, "saving the descriptor: "+err.Error(), http.StatusInternalServerError)
		return
	}
	if old != nil {
		old.timer.Stop()
	}
	s.arm(name, e, now)
	w.Header().Set("ETag", e.etag)
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) serveDelete(w http.ResponseWriter, r *http.Request) {
	name, ok := s.begin(w, r)
	if !ok {
		return
	}
	var epoch uint64
	if v := r.URL.Query().Get("epoch"); v != "" {
		var err error
		if epoch, err = strconv.ParseUint(v, 10, 64); err != nil {
			http.Error(w, fmt.Sprintf("epoch %q is not a number", v), http.StatusBadRequest)
			return
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		http.Error(w, "metadata server closed", http.StatusServiceUnavailable)
		return
	}
	old := s.entries[name]
	if old == nil {
		http.Error(w, fmt.Sprintf("no segment %q", name), http.StatusNotFound)
		return
	}
	if epoch != 0 && old.desc.Epoch != epoch {
		http.Error(w, fmt.Sprintf("held by epoch %d, not %d", old.desc.Epoch, epoch), http.StatusConflict)
		return
	}
	delete(s.entries, name)
	s.rev++
	if err := s.save(); err != nil {
		s.entries[name] = old
		http.Error(w, "saving the deletion: "+err.Error(), http.StatusInternalServerError)
		return
	}
	old.timer.Stop()
	w.WriteHeader(http.StatusNoContent)
}
