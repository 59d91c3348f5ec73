// server_chunks.go holds a metadata [Server]'s descriptors sent as chunks
// (chunks.go): the chunks it holds per name, listed by the name's entry
// or uploaded and not listed yet (collected after serverPendingTTL), the
// handlers of chunk and header PUTs and GETs, and the assembly of the
// whole descriptor a plain GET serves.

package metadata

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/moonring/moonring/metadata/internal/chunkwire"
	"github.com/moonring/moonring/segtable"
)

// serverPendingTTL is how long a chunk uploaded and listed by no header
// is kept: a publisher sends its header right after its chunks. A
// variable for tests.
var serverPendingTTL = time.Minute

const (
	// serverMaxPending bounds the chunks uploaded and not listed, all
	// names together (each name holds at most maxEntryChunks of them).
	serverMaxPending = 1 << 20
)

// chunkID names a chunk of a name on the server.
type chunkID struct{ epoch, seq, sum uint64 }

// srvChunk is one chunk a server holds: immutable but for listed and
// added, which change under Server.mu.
type srvChunk struct {
	id    chunkID
	n     int
	first uint64 // the first buffer's address
	end   uint64 // the end of the last buffer
	value []byte // its encoding, as json.Marshal makes it
	// listed: the name's entry lists it; else it is pending since added.
	listed bool
	added  time.Time
}

// nameChunks is the chunks a server holds for one name; Server.mu guards
// it.
type nameChunks struct {
	byID    map[chunkID]*srvChunk
	bytes   int64 // of their values
	pending int   // those not listed
	// timer collects pending chunks older than serverPendingTTL; nil when
	// none is pending.
	timer *time.Timer
}

// entryHead is the part of an entry sent as chunks: immutable once made.
type entryHead struct {
	header []byte // the header, as a header GET serves it
	// pre and post are the whole descriptor before and after the
	// buffers' elements, so that pre + chunks' elements + post is what
	// the flat descriptor's Marshal makes.
	pre, post []byte
	chunks    []*srvChunk // in address order
	bySeq     map[uint64]*srvChunk
	epoch     uint64
}

func (h *entryHead) size() int64 { return int64(len(h.header) + len(h.pre) + len(h.post)) }

// whole returns the descriptor e holds as a GET serves it.
func (e *serverEntry) whole() []byte {
	h := e.head
	if h == nil {
		return e.body
	}
	return joinWhole(h.pre, h.post, len(h.chunks), func(i int) []byte { return h.chunks[i].value })
}

// newEntryHead makes the head of an entry of the header ch (its body
// header) listing chunks.
func newEntryHead(ch *chunkHeader, header []byte, chunks []*srvChunk) (*entryHead, error) {
	pre, post, err := wholeParts(ch)
	if err != nil {
		return nil, err
	}
	h := &entryHead{header: header, pre: pre, post: post, chunks: chunks,
		bySeq: make(map[uint64]*srvChunk, len(chunks)), epoch: ch.Desc.Epoch}
	for _, c := range chunks {
		h.bySeq[c.id.seq] = c
	}
	return h, nil
}

// wholeParts returns the whole descriptor of the header ch before and
// after its buffers' elements: pre + the chunks' encodings without their
// brackets, joined by commas, + post is what the flat descriptor's
// Marshal makes.
func wholeParts(ch *chunkHeader) (pre, post []byte, err error) {
	d := ch.Desc
	d.Buffers = []segtable.BufferDesc{}
	if ch.Signed {
		d.Chunks = make([]segtable.ChunkInfo, len(ch.Chunks))
		for i, c := range ch.Chunks {
			d.Chunks[i] = segtable.ChunkInfo{Seq: c.Seq, N: c.N, MAC: c.MAC}
		}
	}
	b, err := json.Marshal(&d)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %v", segtable.ErrBadDesc, err)
	}
	// No string holds this unescaped: the first is the key.
	const mark = `"buffers":[]`
	i := bytes.Index(b, []byte(mark))
	if i < 0 {
		return nil, nil, fmt.Errorf("%w: no buffers in the descriptor's encoding", segtable.ErrBadDesc)
	}
	cut := i + len(mark) - 1
	return b[:cut:cut], b[cut:], nil
}

// joinWhole returns pre, the encodings of chunks (JSON arrays, not
// empty) without their brackets joined by commas, and post.
func joinWhole(pre, post []byte, chunks int, value func(i int) []byte) []byte {
	n := len(pre) + len(post)
	for i := range chunks {
		n += len(value(i)) - 1
	}
	b := make([]byte, 0, n)
	b = append(b, pre...)
	for i := range chunks {
		if i > 0 {
			b = append(b, ',')
		}
		v := value(i)
		b = append(b, v[1:len(v)-1]...)
	}
	return append(b, post...)
}

// dropChunks removes the chunks of name that keep does not list (nil:
// every one) with their files, best effort; s.mu is held.
func (s *Server) dropChunks(name string, keep *entryHead) {
	nc := s.chunks[name]
	if nc == nil {
		return
	}
	for id, c := range nc.byID {
		if keep != nil && keep.epoch == id.epoch && keep.bySeq[id.seq] == c {
			continue
		}
		s.dropChunk(name, nc, c)
	}
	s.tidy(name, nc)
}

// dropChunk removes c, a chunk of name, and its file; s.mu is held.
func (s *Server) dropChunk(name string, nc *nameChunks, c *srvChunk) {
	delete(nc.byID, c.id)
	nc.bytes -= int64(len(c.value))
	s.bytes -= int64(len(c.value))
	if !c.listed {
		nc.pending--
		s.pending--
	}
	s.unpersistChunk(name, c.id)
}

// tidy forgets nc, the chunks of name, once it holds none, and stops its
// timer when nothing is pending; s.mu is held.
func (s *Server) tidy(name string, nc *nameChunks) {
	if nc.pending == 0 && nc.timer != nil {
		nc.timer.Stop()
		nc.timer = nil
	}
	if len(nc.byID) == 0 && s.chunks[name] == nc {
		delete(s.chunks, name)
	}
}

// sweep drops the chunks of name pending for serverPendingTTL or longer.
func (s *Server) sweep(name string, nc *nameChunks) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.chunks[name] != nc {
		return
	}
	now := time.Now()
	next := time.Duration(0)
	for _, c := range nc.byID {
		if c.listed {
			continue
		}
		if age := now.Sub(c.added); age >= s.pendingTTL {
			s.dropChunk(name, nc, c)
		} else if left := s.pendingTTL - age; next == 0 || left < next {
			next = left
		}
	}
	nc.timer = nil
	if nc.pending > 0 {
		nc.timer = time.AfterFunc(max(next, time.Millisecond), func() { s.sweep(name, nc) })
	}
	s.tidy(name, nc)
}

// chunkRefusal answers a chunk or header PUT refused for its size (413,
// ErrBadDesc to an HTTP store) or a quota (429, ErrQuota), counting and
// logging it.
func (s *Server) chunkRefusal(w http.ResponseWriter, r *http.Request, name string, code int, msg string) {
	switch code {
	case http.StatusRequestEntityTooLarge:
		s.stats.tooLarge.Add(1)
		s.sizeLog.printf("refused PUT of segment %q from %s (413): %s", name, r.RemoteAddr, msg)
	case http.StatusTooManyRequests:
		s.stats.tooManyBytes.Add(1)
		s.bytesLog.printf("refused PUT of segment %q from %s (429): %s", name, r.RemoteAddr, msg)
	}
	http.Error(w, msg, code)
}

func (s *Server) servePutChunk(w http.ResponseWriter, r *http.Request) {
	name, ok := s.begin(w, r)
	if !ok {
		return
	}
	epoch, err1 := strconv.ParseUint(r.PathValue("epoch"), 10, 64)
	seq, err2 := strconv.ParseUint(r.PathValue("seq"), 10, 64)
	if err1 != nil || err2 != nil {
		http.Error(w, "bad chunk epoch or sequence number", http.StatusBadRequest)
		return
	}
	tok, present, body, ok := s.readPut(w, r, name)
	if !ok {
		return
	}
	bufs, err := decodeChunkValue(body)
	if err == nil {
		err = canonicalChunk(body, bufs)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	last := bufs[len(bufs)-1]
	c := &srvChunk{id: chunkID{epoch, seq, chunkSum(body)}, n: len(bufs), first: bufs[0].Addr,
		end: last.Addr + last.Length, value: body}
	// The file first, outside the lock: its name is its content's.
	if err := s.persistChunk(name, c); err != nil {
		http.Error(w, "saving the chunk: "+err.Error(), http.StatusInternalServerError)
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	kept := false
	defer func() {
		if !kept {
			if nc := s.chunks[name]; nc == nil || nc.byID[c.id] == nil {
				s.unpersistChunk(name, c.id)
			}
		}
	}()
	if s.closed {
		http.Error(w, "metadata server closed", http.StatusServiceUnavailable)
		return
	}
	old := s.entries[name]
	if ref := s.authorize(name, tok, present, old); ref.code != 0 {
		s.refuse(w, r, name, ref)
		return
	}
	if old != nil && old.epoch != epoch {
		http.Error(w, fmt.Sprintf("held by epoch %d, not %d", old.epoch, epoch), http.StatusConflict)
		return
	}
	nc := s.chunks[name]
	if nc != nil && nc.byID[c.id] != nil {
		kept = true
		if h := nc.byID[c.id]; !h.listed {
			h.added = time.Now()
		}
		w.WriteHeader(http.StatusNoContent)
		return
	}
	switch {
	case nc == nil && len(s.chunks) >= s.maxNames:
		s.stats.tooManyNames.Add(1)
		msg := fmt.Sprintf("this server holds the chunks of %d names, its most (MaxNames)", len(s.chunks))
		s.namesLog.printf("refused PUT of a chunk of segment %q from %s (429): %s", name, r.RemoteAddr, msg)
		http.Error(w, msg, http.StatusTooManyRequests)
		return
	case nc != nil && nc.pending >= maxEntryChunks:
		s.chunkRefusal(w, r, name, http.StatusRequestEntityTooLarge, fmt.Sprintf("%d chunks uploaded and not listed, the most a name may hold", nc.pending))
		return
	case s.pending >= serverMaxPending:
		s.chunkRefusal(w, r, name, http.StatusTooManyRequests, fmt.Sprintf("this server holds %d chunks uploaded and not listed, its most", s.pending))
		return
	}
	held := int64(len(body))
	if nc != nil {
		held += nc.bytes
	}
	if old != nil {
		held += old.size()
	}
	if held > s.maxChunked {
		s.chunkRefusal(w, r, name, http.StatusRequestEntityTooLarge, fmt.Sprintf("the chunks of segment %q would hold %d bytes, more than %d (this server's MaxChunked)", name, held, s.maxChunked))
		return
	}
	if s.bytes+int64(len(body)) > s.maxBytes {
		s.chunkRefusal(w, r, name, http.StatusTooManyRequests, fmt.Sprintf("this server holds %d bytes of descriptors; %d more would pass its most, %d (MaxBytes)", s.bytes, len(body), s.maxBytes))
		return
	}
	if s.dir != "" {
		// A header that dropped a chunk of this id (a concurrent upload of
		// the same chunk) may have removed the file since it was written.
		if _, err := os.Stat(filepath.Join(s.dir, chunkFile(name, c.id))); err != nil {
			if err := s.persistChunk(name, c); err != nil {
				http.Error(w, "saving the chunk: "+err.Error(), http.StatusInternalServerError)
				return
			}
		}
	}
	if nc == nil {
		nc = &nameChunks{byID: make(map[chunkID]*srvChunk)}
		s.chunks[name] = nc
	}
	c.added = time.Now()
	nc.byID[c.id] = c
	nc.bytes += int64(len(body))
	s.bytes += int64(len(body))
	nc.pending++
	s.pending++
	if nc.timer == nil {
		nc.timer = time.AfterFunc(s.pendingTTL, func() { s.sweep(name, nc) })
	}
	kept = true
	w.WriteHeader(http.StatusNoContent)
}

// chunksChecked is what a server with the key checked of a descriptor
// sent as chunks: its chunks decoded, made once and shared from one
// header to the next while listed unchanged (chunkwire.Set), and the
// signatures checked over them (segtable.Verified).
type chunksChecked struct {
	set *chunkwire.Set
	v   *segtable.Verified
}

// checkChunked checks the signatures of the descriptor of header h, whose
// listed chunks the server holds (chunks, in h's order), starting from
// prev, what it checked of the name's descriptor before (nil: nothing).
// Only the chunks prev does not hold are decoded and have their buffers'
// MACs checked (segtable.Signer.VerifySince); the header's MAC over the
// set of chunks is checked whole: a republish after one registration
// costs a chunk or two and O(chunks), where decoding and checking the
// whole descriptor was O(buffers), under the server's lock. It accepts
// what Verify of the whole descriptor accepts. s.mu held.
func (s *Server) checkChunked(h *chunkHeader, chunks []*srvChunk, prev *chunksChecked) (*chunksChecked, error) {
	var set *chunkwire.Set
	var pv *segtable.Verified
	if prev != nil {
		set, pv = prev.set, prev.v
	}
	got := make(map[uint64]heldChunk)
	for i, c := range h.Chunks {
		if set.Has(h.Desc.Epoch, c) {
			continue
		}
		held, err := chunkwire.DecodeListed(c, chunks[i].value)
		if err != nil {
			return nil, err
		}
		got[c.Seq] = held
	}
	d, next, err := chunkwire.AssembleChunked(h, set, got)
	if err != nil {
		return nil, err
	}
	v, err := s.signer.VerifySince(d, pv)
	if err != nil {
		return nil, err
	}
	return &chunksChecked{set: next, v: v}, nil
}

func (s *Server) servePutHeader(w http.ResponseWriter, r *http.Request) {
	p, ok := s.readPutRequest(w, r)
	if !ok {
		return
	}
	name, ttl, renew, tok, present, body := p.name, p.ttl, p.renew, p.tok, p.present, p.body
	ch, err := parseChunkHeader(name, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
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
	if ref := s.authorize(name, tok, present, old); ref.code != 0 {
		s.refuse(w, r, name, ref)
		return
	}
	epoch := ch.Desc.Epoch
	if old != nil && old.epoch != epoch {
		http.Error(w, fmt.Sprintf("held by epoch %d, not %d", old.epoch, epoch), http.StatusConflict)
		return
	}
	if old != nil && renew {
		s.renewEntry(w, name, old, ttl, tok, now)
		return
	}
	nc := s.chunks[name]
	chunks := make([]*srvChunk, len(ch.Chunks))
	var missing []uint64
	for i, hc := range ch.Chunks {
		var c *srvChunk
		if nc != nil {
			c = nc.byID[chunkID{epoch, hc.Seq, hc.Sum}]
		}
		if c == nil {
			missing = append(missing, hc.Seq)
			continue
		}
		if c.n != hc.N {
			http.Error(w, fmt.Sprintf("chunk %d holds %d buffers, the header says %d", hc.Seq, c.n, hc.N), http.StatusBadRequest)
			return
		}
		if i > 0 && chunks[i-1] != nil && c.first < chunks[i-1].end {
			http.Error(w, fmt.Sprintf("chunk %d overlaps or comes before the chunk listed before it", hc.Seq), http.StatusBadRequest)
			return
		}
		chunks[i] = c
	}
	if missing != nil {
		b, _ := json.Marshal(missingJSON{Missing: missing})
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusPreconditionFailed)
		w.Write(b)
		return
	}
	seen := make(map[uint64]bool, len(chunks))
	for _, c := range chunks {
		if seen[c.id.seq] {
			http.Error(w, fmt.Sprintf("chunk %d listed twice", c.id.seq), http.StatusBadRequest)
			return
		}
		seen[c.id.seq] = true
	}
	head, err := newEntryHead(ch, body, chunks)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.rev++
	e := &serverEntry{epoch: epoch, head: head, etag: fmt.Sprintf(`"%d-%d"`, epoch, s.rev), rev: s.rev, ttl: ttl}
	if s.signer != nil {
		var prev *chunksChecked
		if old != nil {
			prev = old.checked
		}
		if e.checked, err = s.checkChunked(ch, chunks, prev); err != nil {
			s.refuse(w, r, name, refusal{http.StatusForbidden, "the descriptor is not signed with the segment key: " + err.Error()})
			return
		}
	}
	if !s.admit(w, r, name, e, old, tok) {
		return
	}
	var oldLen int64
	if old != nil {
		oldLen = old.size()
	}
	if held := nc.bytes + e.size(); held > s.maxChunked {
		s.chunkRefusal(w, r, name, http.StatusRequestEntityTooLarge, fmt.Sprintf("segment %q would hold %d bytes, more than %d (this server's MaxChunked)", name, held, s.maxChunked))
		return
	}
	if grow := e.size() - oldLen; grow > 0 && s.bytes+grow > s.maxBytes {
		s.chunkRefusal(w, r, name, http.StatusTooManyRequests, fmt.Sprintf("this server holds %d bytes of descriptors; %d more would pass its most, %d (MaxBytes)", s.bytes, grow, s.maxBytes))
		return
	}
	if s.dir != "" {
		syncDir(s.dir) // the chunks' files before the entry's that lists them
	}
	if err := s.persist(name, e); err != nil {
		http.Error(w, "saving the descriptor: "+err.Error(), http.StatusInternalServerError)
		return
	}
	s.add(name, e)
	for _, c := range chunks {
		if !c.listed {
			c.listed = true
			nc.pending--
			s.pending--
		}
	}
	s.dropChunks(name, head)
	if old != nil {
		old.timer.Stop()
	}
	s.arm(name, e, now)
	w.Header().Set("ETag", e.etag)
	w.WriteHeader(http.StatusNoContent)
}

// entryFor returns the entry of name for a GET, or answers 404.
func (s *Server) entryFor(w http.ResponseWriter, name string) *serverEntry {
	s.mu.Lock()
	e := s.entries[name]
	s.mu.Unlock()
	if e == nil {
		http.Error(w, fmt.Sprintf("no segment %q", name), http.StatusNotFound)
	}
	return e
}

func (s *Server) serveGetHeader(w http.ResponseWriter, r *http.Request) {
	name, ok := s.begin(w, r)
	if !ok {
		return
	}
	e := s.entryFor(w, name)
	if e == nil {
		return
	}
	h := w.Header()
	h.Set("ETag", e.etag)
	if etagMatch(r.Header.Get("If-None-Match"), e.etag) {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	body := e.body // a whole descriptor, not sent as chunks
	if e.head != nil {
		body = e.head.header
	}
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.Write(body)
}

func (s *Server) serveGetChunks(w http.ResponseWriter, r *http.Request) {
	name, ok := s.begin(w, r)
	if !ok {
		return
	}
	epoch, seqs, ok := chunkQuery(w, r)
	if !ok {
		return
	}
	e := s.entryFor(w, name)
	if e == nil {
		return
	}
	if e.head == nil || e.head.epoch != epoch {
		http.Error(w, fmt.Sprintf("segment %q lists no chunk of epoch %d", name, epoch), http.StatusNotFound)
		return
	}
	chunks := make([]*srvChunk, len(seqs))
	for i, seq := range seqs {
		if chunks[i] = e.head.bySeq[seq]; chunks[i] == nil { // e.head never changes
			http.Error(w, fmt.Sprintf("segment %q lists no chunk %d", name, seq), http.StatusNotFound)
			return
		}
	}
	writeChunks(w, e.etag, len(chunks), func(i int) []byte { return chunks[i].value })
}

// chunkFile returns the file name of a chunk of name.
func chunkFile(name string, id chunkID) string {
	h := sha256.Sum256([]byte(name))
	return fmt.Sprintf("%s%s-%d-%d-%016x%s", serverChunkPrefix, hex.EncodeToString(h[:]), id.epoch, id.seq, id.sum, serverEntrySuffix)
}

// persistChunk writes c, a chunk of name, to its file, synced (before any
// entry file lists it). Without a directory it does nothing.
func (s *Server) persistChunk(name string, c *srvChunk) error {
	if s.dir == "" {
		return nil
	}
	return s.writeFile(chunkFile(name, c.id), c.value, true)
}

// unpersistChunk removes the file of a chunk of name, best effort.
func (s *Server) unpersistChunk(name string, id chunkID) {
	if s.dir != "" {
		os.Remove(filepath.Join(s.dir, chunkFile(name, id)))
	}
}

// loadChunked reads b, the file fn of an entry sent as chunks, and the
// files of the chunks it lists, whose names it adds to used.
func (s *Server) loadChunked(fn string, b []byte, used map[string]bool) error {
	var f serverChunkedJSON
	if err := decodeStrict(b, &f); err != nil {
		return err
	}
	if err := checkName(f.Name); err != nil {
		return err
	}
	if entryFile(f.Name) != fn {
		return fmt.Errorf("holds segment %q, whose file is %s", f.Name, entryFile(f.Name))
	}
	ch, err := parseChunkHeader(f.Name, f.Header)
	if err != nil {
		return err
	}
	ttl, err := time.ParseDuration(f.TTL)
	if err != nil || ttl <= 0 {
		return fmt.Errorf("segment %q: bad ttl %q", f.Name, f.TTL)
	}
	epoch := ch.Desc.Epoch
	nc := &nameChunks{byID: make(map[chunkID]*srvChunk, len(ch.Chunks))}
	chunks := make([]*srvChunk, len(ch.Chunks))
	for i, hc := range ch.Chunks {
		id := chunkID{epoch, hc.Seq, hc.Sum}
		cf := chunkFile(f.Name, id)
		value, err := os.ReadFile(filepath.Join(s.dir, cf))
		if err != nil {
			return fmt.Errorf("chunk %d: %w", hc.Seq, err)
		}
		if chunkSum(value) != hc.Sum {
			return fmt.Errorf("chunk %d: %s does not hash to %016x", hc.Seq, cf, hc.Sum)
		}
		bufs, err := decodeChunkValue(value)
		if err != nil {
			return fmt.Errorf("chunk %d: %w", hc.Seq, err)
		}
		if len(bufs) != hc.N || nc.byID[id] != nil {
			return fmt.Errorf("chunk %d: %d buffers, or listed twice", hc.Seq, len(bufs))
		}
		last := bufs[len(bufs)-1]
		c := &srvChunk{id: id, n: len(bufs), first: bufs[0].Addr, end: last.Addr + last.Length, value: value, listed: true}
		if i > 0 && c.first < chunks[i-1].end {
			return fmt.Errorf("chunk %d overlaps the chunk before it", hc.Seq)
		}
		chunks[i] = c
		nc.byID[id] = c
		nc.bytes += int64(len(value))
		used[cf] = true
	}
	head, err := newEntryHead(ch, []byte(f.Header), chunks)
	if err != nil {
		return err
	}
	s.rev = max(s.rev, f.Rev)
	e := &serverEntry{epoch: epoch, head: head, etag: fmt.Sprintf(`"%d-%d"`, epoch, f.Rev), rev: f.Rev,
		ttl: min(max(ttl, MinTTL), s.maxTTL)}
	if f.Owner != "" {
		h, err := hex.DecodeString(f.Owner)
		if err != nil || len(h) != len(e.owner) {
			return fmt.Errorf("bad owner %q", f.Owner)
		}
		copy(e.owner[:], h)
		e.bound = true
	}
	s.add(f.Name, e)
	s.chunks[f.Name] = nc
	s.bytes += nc.bytes
	return nil
}
