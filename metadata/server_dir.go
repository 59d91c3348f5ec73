package metadata

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/moonring/moonring/segtable"
)

// The directory of a [Server] (ServerConfig.Dir) holds one file per
// descriptor, "seg-<hex SHA-256 of the name>.json": a name of up to 255
// bytes always makes a short file name that needs no escaping and is the
// same on a case-insensitive file system. Each file is written whole to a
// temporary file in the directory, synced and renamed over the entry's, so
// that a change costs what its own entry costs and a crash leaves the old
// or the new entry, never half of one.
const (
	serverEntryPrefix  = "seg-"
	serverEntrySuffix  = ".json"
	serverEntryVersion = 2
	// serverChunkedVersion is the version of an entry file that holds a
	// header (a descriptor sent as chunks): its chunks are files of their
	// own, "chk-<hex SHA-256 of the name>-<epoch>-<seq>-<hex hash>.json",
	// each written (synced and renamed) before the entry file that lists
	// it, and removed once no entry lists it; NewServer reads those an
	// entry lists and removes the others.
	serverChunkedVersion = 3
	serverChunkPrefix    = "chk-"
	// serverTempPattern names the temporary files; a crash may leave
	// some, which NewServer removes.
	serverTempPattern = ".seg-*.tmp"
	// serverLegacyFile is the file of the first format (version 1): every
	// descriptor in one file, rewritten at every change. NewServer reads
	// it once, writes its entries in the new format and removes it.
	serverLegacyFile    = "segments.json"
	serverLegacyVersion = 1
)

// serverEntryJSON is the format of an entry's file.
type serverEntryJSON struct {
	Version int    `json:"version"`
	Name    string `json:"name"`
	Rev     uint64 `json:"rev"`
	TTL     string `json:"ttl"` // a time.Duration, e.g. "30s"
	// Owner is the hex SHA-256 of the owner token bound to the name, ""
	// when none is.
	Owner string          `json:"owner,omitempty"`
	Desc  json.RawMessage `json:"desc"`
}

// serverChunkedJSON is the format of the file of an entry sent as chunks.
type serverChunkedJSON struct {
	Version int             `json:"version"`
	Name    string          `json:"name"`
	Rev     uint64          `json:"rev"`
	TTL     string          `json:"ttl"`
	Owner   string          `json:"owner,omitempty"`
	Header  json.RawMessage `json:"header"`
}

// serverLegacyJSON is the format of the legacy file.
type serverLegacyJSON struct {
	Version  int                     `json:"version"`
	Rev      uint64                  `json:"rev"`
	Segments []serverLegacyEntryJSON `json:"segments"`
}

type serverLegacyEntryJSON struct {
	Rev  uint64          `json:"rev"`
	TTL  string          `json:"ttl"`
	Desc json.RawMessage `json:"desc"`
}

// entryFile returns the file name of name's entry.
func entryFile(name string) string {
	h := sha256.Sum256([]byte(name))
	return serverEntryPrefix + hex.EncodeToString(h[:]) + serverEntrySuffix
}

// decodeStrict decodes one JSON value of b into v, refusing unknown fields
// and anything after it.
func decodeStrict(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("corrupt file: %w", err)
	}
	if dec.More() {
		return errors.New("corrupt file: data after the JSON object")
	}
	return nil
}

// load reads the directory into s.entries: the entries' files, and the
// legacy file if there is one, whose entries it writes in the new format
// before removing it. It fails on any file it cannot read or that is not
// valid, naming it; such a file is left as it is for an operator.
func (s *Server) load() error {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return err
	}
	used := make(map[string]bool) // chunk files the entries list
	for _, de := range ents {
		fn := de.Name()
		path := filepath.Join(s.dir, fn)
		switch {
		case strings.HasPrefix(fn, ".seg-") && strings.HasSuffix(fn, ".tmp"):
			os.Remove(path) // a write a crash interrupted
		case strings.HasPrefix(fn, serverEntryPrefix) && strings.HasSuffix(fn, serverEntrySuffix):
			if err := s.loadEntry(fn, used); err != nil {
				return fmt.Errorf("loading %s: %w", path, err)
			}
		}
	}
	for _, de := range ents {
		if fn := de.Name(); strings.HasPrefix(fn, serverChunkPrefix) && !used[fn] {
			os.Remove(filepath.Join(s.dir, fn)) // listed by no entry
		}
	}
	legacy := filepath.Join(s.dir, serverLegacyFile)
	found, err := s.loadLegacy(legacy)
	if err != nil {
		return fmt.Errorf("loading %s: %w", legacy, err)
	}
	if found {
		if err := os.Remove(legacy); err != nil {
			return fmt.Errorf("removing %s after moving its entries to their own files: %w", legacy, err)
		}
		syncDir(s.dir)
		s.logf("moved the descriptors of %s to a file each; it is removed", legacy)
	}
	return nil
}

// loadEntry reads the entry file fn, and the files of the chunks it lists,
// whose names it adds to used.
func (s *Server) loadEntry(fn string, used map[string]bool) error {
	b, err := os.ReadFile(filepath.Join(s.dir, fn))
	if err != nil {
		return err
	}
	var v struct {
		Version int `json:"version"`
	}
	if json.Unmarshal(b, &v) == nil && v.Version == serverChunkedVersion {
		return s.loadChunked(fn, b, used)
	}
	var f serverEntryJSON
	if err := decodeStrict(b, &f); err != nil {
		return err
	}
	if f.Version != serverEntryVersion {
		return fmt.Errorf("entry version %d, want %d", f.Version, serverEntryVersion)
	}
	if err := checkName(f.Name); err != nil {
		return err
	}
	if entryFile(f.Name) != fn {
		return fmt.Errorf("holds segment %q, whose file is %s", f.Name, entryFile(f.Name))
	}
	e, err := s.decodeEntry(f.Name, f.Rev, f.TTL, f.Desc)
	if err != nil {
		return err
	}
	if f.Owner != "" {
		h, err := hex.DecodeString(f.Owner)
		if err != nil || len(h) != len(e.owner) {
			return fmt.Errorf("bad owner %q", f.Owner)
		}
		copy(e.owner[:], h)
		e.bound = true
	}
	s.add(f.Name, e)
	return nil
}

// decodeEntry makes the entry of a descriptor read from the directory.
func (s *Server) decodeEntry(name string, rev uint64, ttlText string, desc []byte) (*serverEntry, error) {
	d, err := segtable.UnmarshalDesc(desc)
	if err != nil {
		return nil, err
	}
	if d.Name != name {
		return nil, fmt.Errorf("descriptor of segment %q under %q", d.Name, name)
	}
	ttl, err := time.ParseDuration(ttlText)
	if err != nil || ttl <= 0 {
		return nil, fmt.Errorf("segment %q: bad ttl %q", name, ttlText)
	}
	s.rev = max(s.rev, rev)
	return newServerEntry(d, rev, min(max(ttl, MinTTL), s.maxTTL))
}

// loadLegacy reads the legacy file, if there is one, and writes each of
// its entries that has no file of its own yet (a migration a crash
// interrupted) to one. It reports whether there was a file.
func (s *Server) loadLegacy(path string) (bool, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	var f serverLegacyJSON
	if err := decodeStrict(b, &f); err != nil {
		return false, err
	}
	if f.Version != serverLegacyVersion {
		return false, fmt.Errorf("file version %d, want %d", f.Version, serverLegacyVersion)
	}
	s.rev = max(s.rev, f.Rev)
	seen := make(map[string]bool, len(f.Segments))
	var moved []string
	for i, fe := range f.Segments {
		d, err := segtable.UnmarshalDesc(fe.Desc)
		if err != nil {
			return false, fmt.Errorf("segment %d: %w", i, err)
		}
		if err := checkName(d.Name); err != nil {
			return false, fmt.Errorf("segment %d: %w", i, err)
		}
		if seen[d.Name] {
			return false, fmt.Errorf("segment %d: %q appears twice", i, d.Name)
		}
		seen[d.Name] = true
		e, err := s.decodeEntry(d.Name, fe.Rev, fe.TTL, fe.Desc)
		if err != nil {
			return false, fmt.Errorf("segment %d: %w", i, err)
		}
		if s.entries[d.Name] == nil {
			s.add(d.Name, e)
			moved = append(moved, d.Name)
		}
	}
	for _, name := range moved {
		if err := s.persist(name, s.entries[name]); err != nil {
			return false, err
		}
	}
	return true, nil
}

// persist writes e, the entry of name, to its file; s.mu is held or s not
// yet shared. Without a directory it does nothing.
func (s *Server) persist(name string, e *serverEntry) error {
	if s.dir == "" {
		return nil
	}
	var v any
	owner := ""
	if e.bound {
		owner = hex.EncodeToString(e.owner[:])
	}
	if e.head != nil {
		v = &serverChunkedJSON{Version: serverChunkedVersion, Name: name, Rev: e.rev, TTL: e.ttl.String(), Owner: owner, Header: e.head.header}
	} else {
		v = &serverEntryJSON{Version: serverEntryVersion, Name: name, Rev: e.rev, TTL: e.ttl.String(), Owner: owner, Desc: e.body}
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if err := s.writeFile(entryFile(name), b, true); err != nil {
		return err
	}
	syncDir(s.dir)
	return nil
}

// writeFile writes b to the file fn of the directory through a temporary
// file, synced when sync is set, renamed over fn.
func (s *Server) writeFile(fn string, b []byte, sync bool) error {
	tmp, err := os.CreateTemp(s.dir, serverTempPattern)
	if err != nil {
		return err
	}
	_, err = tmp.Write(b)
	if err == nil && sync {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(s.dir, fn))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return nil
}

// unpersist removes the file of name's entry; s.mu is held. A file already
// gone is not an error.
func (s *Server) unpersist(name string) error {
	if s.dir == "" {
		return nil
	}
	err := os.Remove(filepath.Join(s.dir, entryFile(name)))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	syncDir(s.dir)
	return nil
}

// syncDir makes renames and removals in dir durable where the file system
// allows.
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}
