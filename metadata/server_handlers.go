// server_handlers.go holds the HTTP side of a metadata [Server]: ServeHTTP
// and its handlers of GET, PUT and DELETE of a segment, with the checks of
// a request's name, TTL, size and owner token and the answers that refuse
// one. The entries they act on, and their expiry, are in server.go.

package metadata

import (
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/moonring/moonring/segtable"
)

// ServeHTTP serves the metadata protocol; see [Server].
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mux.ServeHTTP(w, r)
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
	w.Header().Set(headerChunks, "1")
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
	body := e.whole()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.Write(body)
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

// refuse answers a request refused for ref, counting and logging it.
func (s *Server) refuse(w http.ResponseWriter, r *http.Request, name string, ref refusal) {
	if ref.code == http.StatusUnauthorized {
		s.stats.unauthenticated.Add(1)
		w.Header().Set("WWW-Authenticate", headerOwner)
	} else {
		s.stats.forbidden.Add(1)
	}
	s.authLog.printf("refused %s of segment %q from %s (%d): %s", r.Method, name, r.RemoteAddr, ref.code, ref.msg)
	http.Error(w, ref.msg, ref.code)
}

// tooLarge answers a PUT whose descriptor is over MaxDescriptor.
func (s *Server) tooLarge(w http.ResponseWriter, r *http.Request, name string) {
	s.stats.tooLarge.Add(1)
	msg := fmt.Sprintf("descriptor of more than %d bytes (this server's MaxDescriptor)", s.maxDesc)
	s.sizeLog.printf("refused PUT of segment %q from %s (413): %s", name, r.RemoteAddr, msg)
	http.Error(w, msg, http.StatusRequestEntityTooLarge)
}

// authorizeNow is authorize with the entry name holds now.
func (s *Server) authorizeNow(name string, tok []byte, present bool) refusal {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.authorize(name, tok, present, s.entries[name])
}

func (s *Server) servePut(w http.ResponseWriter, r *http.Request) {
	p, ok := s.readPutRequest(w, r)
	if !ok {
		return
	}
	name, ttl, renew, tok, present, body := p.name, p.ttl, p.renew, p.tok, p.present, p.body
	d, err := segtable.UnmarshalDesc(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if d.Name != name {
		http.Error(w, fmt.Sprintf("descriptor of segment %q put under %q", d.Name, name), http.StatusBadRequest)
		return
	}
	if s.signer != nil {
		// With the key the server is a reader that checks too: it keeps
		// only descriptors an engine with the key signed.
		if err := s.signer.Verify(d); err != nil {
			s.refuse(w, r, name, refusal{http.StatusForbidden, "the descriptor is not signed with the segment key: " + err.Error()})
			return
		}
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		http.Error(w, "metadata server closed", http.StatusServiceUnavailable)
		return
	}
	now := time.Now()
	old := s.entries[name]
	if ref := s.authorize(name, tok, present, old); ref.code != 0 {
		s.refuse(w, r, name, ref) // the name changed hands while the body came
		return
	}
	if old != nil && old.epoch != d.Epoch {
		http.Error(w, fmt.Sprintf("held by epoch %d, not %d", old.epoch, d.Epoch), http.StatusConflict)
		return
	}
	if old != nil && renew {
		s.renewEntry(w, name, old, ttl, tok, now)
		return
	}
	s.rev++
	e, err := newServerEntry(d, s.rev, ttl)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if !s.admit(w, r, name, e, old, tok) {
		return
	}
	var oldLen int64
	if old != nil {
		oldLen = old.size()
	}
	if grow := int64(len(e.body)) - oldLen; grow > 0 && s.bytes+grow > s.maxBytes {
		s.stats.tooManyBytes.Add(1)
		msg := fmt.Sprintf("this server holds %d bytes of descriptors; %d more would pass its most, %d (MaxBytes)", s.bytes, grow, s.maxBytes)
		s.bytesLog.printf("refused PUT of segment %q from %s (429): %s", name, r.RemoteAddr, msg)
		http.Error(w, msg, http.StatusTooManyRequests)
		return
	}
	if err := s.persist(name, e); err != nil {
		http.Error(w, "saving the descriptor: "+err.Error(), http.StatusInternalServerError)
		return
	}
	s.add(name, e)
	s.dropChunks(name, nil) // of a descriptor sent as chunks that e replaces
	if old != nil {
		old.timer.Stop()
	}
	s.arm(name, e, now)
	w.Header().Set("ETag", e.etag)
	w.WriteHeader(http.StatusNoContent)
}

// renewEntry restarts the time to live of old, the entry of name, as a
// renewal PUT asks (ttl, tok), and answers it; s.mu is held.
func (s *Server) renewEntry(w http.ResponseWriter, name string, old *serverEntry, ttl time.Duration, tok []byte, now time.Time) {
	changed := old.ttl != ttl
	old.ttl = ttl
	if tok != nil {
		// Binds an unbound name; with the key, rebinds one that a
		// server without it bound to a token that was not the key's.
		if h := hashToken(tok); !old.bound || !old.owner.equal(&h) {
			old.owner, old.bound, changed = h, true, true
		}
	}
	s.arm(name, old, now)
	if changed {
		if err := s.persist(name, old); err != nil {
			s.logf("segment %q renewed (time to live %v), but its file in %s could not be written: %v", name, ttl, s.dir, err)
		}
	}
	w.Header().Set("ETag", old.etag)
	w.WriteHeader(http.StatusNoContent)
}

// putRequest is what a PUT of a descriptor or a header asks: the name,
// the time to live, whether it renews, and the credential and body
// readPut read.
type putRequest struct {
	name    string
	ttl     time.Duration
	renew   bool
	tok     []byte
	present bool
	body    []byte
}

// readPutRequest reads a PUT of a descriptor or a header up to its body
// (readPut), or answers it and reports false.
func (s *Server) readPutRequest(w http.ResponseWriter, r *http.Request) (p putRequest, ok bool) {
	if p.name, ok = s.begin(w, r); !ok {
		return p, false
	}
	var err error
	if p.ttl, err = s.parseTTL(r.Header.Get(headerTTL)); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return p, false
	}
	if v := r.Header.Get(headerRenew); v != "" {
		if p.renew, err = strconv.ParseBool(v); err != nil {
			http.Error(w, fmt.Sprintf("%s %q is not a boolean", headerRenew, v), http.StatusBadRequest)
			return p, false
		}
	}
	p.tok, p.present, p.body, ok = s.readPut(w, r, p.name)
	return p, ok
}

// admit binds e, about to replace old (nil: none) under name, to its
// owner (tok's, or old's), and checks that a new name is within
// MaxNames, else answers 429 and reports false; s.mu is held.
func (s *Server) admit(w http.ResponseWriter, r *http.Request, name string, e, old *serverEntry, tok []byte) bool {
	switch {
	case tok != nil:
		e.owner, e.bound = hashToken(tok), true
	case old != nil:
		e.owner, e.bound = old.owner, old.bound
	}
	if old == nil && len(s.entries) >= s.maxNames {
		s.stats.tooManyNames.Add(1)
		msg := fmt.Sprintf("this server holds %d names, its most (MaxNames)", len(s.entries))
		s.namesLog.printf("refused PUT of segment %q from %s (429): %s", name, r.RemoteAddr, msg)
		http.Error(w, msg, http.StatusTooManyRequests)
		return false
	}
	return true
}

// readPut checks the owner token of a PUT about name (a descriptor, a
// header or a chunk) and reads its body, at most MaxDescriptor bytes,
// within the room serverReadingDescs leaves; it answers the request and
// returns !ok when either fails.
func (s *Server) readPut(w http.ResponseWriter, r *http.Request, name string) (tok []byte, present bool, body []byte, ok bool) {
	// The credential first: the body of a stranger is not read.
	tok, present = requestToken(r)
	if ref := s.authorizeNow(name, tok, present); ref.code != 0 {
		s.refuse(w, r, name, ref)
		return nil, false, nil, false
	}
	if r.ContentLength > int64(s.maxDesc) {
		s.tooLarge(w, r, name)
		return nil, false, nil, false
	}
	room := int64(s.maxDesc) // what a body of unknown length may take
	if r.ContentLength >= 0 {
		room = r.ContentLength
	}
	if s.reading.Add(room) > serverReadingDescs*int64(s.maxDesc) {
		s.reading.Add(-room)
		s.stats.busy.Add(1)
		msg := fmt.Sprintf("busy: the descriptors of other PUTs being read add up to %d bytes; try again", serverReadingDescs*int64(s.maxDesc))
		s.busyLog.printf("refused PUT of segment %q from %s (503): %s", name, r.RemoteAddr, msg)
		w.Header().Set("Retry-After", "1")
		http.Error(w, msg, http.StatusServiceUnavailable)
		return nil, false, nil, false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, room))
	s.reading.Add(-room)
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			s.tooLarge(w, r, name)
			return nil, false, nil, false
		}
		http.Error(w, "reading the descriptor: "+err.Error(), http.StatusBadRequest)
		return nil, false, nil, false
	}
	return tok, present, body, true
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
	tok, present := requestToken(r)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		http.Error(w, "metadata server closed", http.StatusServiceUnavailable)
		return
	}
	old := s.entries[name]
	if ref := s.authorize(name, tok, present, old); ref.code != 0 {
		s.refuse(w, r, name, ref)
		return
	}
	if old == nil {
		http.Error(w, fmt.Sprintf("no segment %q", name), http.StatusNotFound)
		return
	}
	if epoch != 0 && old.epoch != epoch {
		http.Error(w, fmt.Sprintf("held by epoch %d, not %d", old.epoch, epoch), http.StatusConflict)
		return
	}
	if err := s.unpersist(name); err != nil {
		http.Error(w, "saving the deletion: "+err.Error(), http.StatusInternalServerError)
		return
	}
	s.remove(name)
	s.rev++
	old.timer.Stop()
	w.WriteHeader(http.StatusNoContent)
}
