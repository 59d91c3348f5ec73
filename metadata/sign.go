package metadata

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/moonring/moonring/internal/ratelog"
	"github.com/moonring/moonring/segtable"
)

// Errors of a [Signed] store, beside the [Store] sentinels.
var (
	// ErrForged reports a descriptor that fails its signature check under
	// the reader's key (it is [segtable.ErrForged]). The store treats it
	// as absent: the error also matches [ErrNotFound].
	ErrForged = segtable.ErrForged
	// ErrStale reports a descriptor of an older epoch than one this store
	// already accepted under its name: a replay of a dead instance's
	// descriptor. It is treated as absent: the error also matches
	// [ErrNotFound].
	ErrStale = errors.New("metadata: descriptor older than one already seen")
)

// maxSeen bounds the names whose newest epoch a Signed store remembers;
// past it the memory starts afresh (a replay is then refused only by its
// signature's epoch binding, not by age).
const maxSeen = 1 << 16

// Signed is a [Store] that signs what it publishes and checks what it reads,
// with a key derived from the deployment's segment key
// ([segtable.NewSigner]). Put signs a copy of the descriptor (a buffer
// signed by an earlier Put of the same name and epoch keeps its MAC, so a
// republish after one registration computes one buffer MAC); Get and Watch
// hand out only descriptors whose signatures hold and whose epoch is not
// older than one already accepted under the name. A descriptor that fails
// is treated as absent (Get: an error matching [ErrNotFound] and
// [ErrForged] or [ErrStale]; Watch: a Deleted event), counted (Refused) and
// logged at most once a second.
//
// It is safe for concurrent use. Close closes the wrapped store; Signed
// holds nothing else but the goroutine of each Watch, which ends when the
// wrapped store's channel closes.
type Signed struct {
	inner  Store
	signer *segtable.Signer
	log    *slog.Logger

	mu     sync.Mutex
	signed map[string]*signedSet // what the last Put of each name signed
	seen   map[string]uint64     // the newest epoch accepted, per name

	forged, stale, unsigned atomic.Uint64
	logLimit                ratelog.Limit

	// allow names the transports an unsigned descriptor may be reached
	// through (AllowUnsigned); nil: none, unsigned is forged.
	allow map[string]bool
}

var _ Store = (*Signed)(nil)

// NewSigned wraps s. key is the deployment's segment key (not empty); log
// hears of refused descriptors (nil: discard).
func NewSigned(s Store, key []byte, log *slog.Logger) (*Signed, error) {
	signer, err := segtable.NewSigner(key)
	if err != nil {
		return nil, fmt.Errorf("metadata: signed store: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Signed{inner: s, signer: signer, log: log, signed: map[string]*signedSet{}, seen: map[string]uint64{}}, nil
}

// Unwrap returns the wrapped store.
func (s *Signed) Unwrap() Store { return s.inner }

// Name returns the wrapped store's own segment name where it has one (a
// [P2P] store), else "".
func (s *Signed) Name() string {
	if n, ok := s.inner.(interface{ Name() string }); ok {
		return n.Name()
	}
	return ""
}

// String names the wrapped store.
func (s *Signed) String() string { return s.inner.String() }

// Close closes the wrapped store.
func (s *Signed) Close() error { return s.inner.Close() }

// SignedStats counts the descriptors a Signed store refused.
type SignedStats struct {
	// Forged counts descriptors whose signature failed.
	Forged uint64
	// Stale counts descriptors of an epoch older than one already seen.
	Stale uint64
	// Unsigned counts descriptors without any signature handed on, cut
	// down to the transports AllowUnsigned names (not a refusal).
	Unsigned uint64
}

// Refused returns the counts of descriptors refused so far, and of the
// unsigned ones let through cut down.
func (s *Signed) Refused() SignedStats {
	return SignedStats{Forged: s.forged.Load(), Stale: s.stale.Load(), Unsigned: s.unsigned.Load()}
}

// AllowUnsigned lets through descriptors that carry no signature at all
// (no MAC on the descriptor: a Mooncake engine's, whose protocols have
// none), cut down to the endpoints and buffer keys of the transports
// named: an endpoint or key named t or starting "t." stays, every other
// goes, so an unsigned descriptor can never point moonring's authenticated
// transports (tcp, shm, rdma, efa) anywhere. One left with no endpoint is
// refused as forged. A descriptor with a MAC that does not verify is
// refused as before. Call it before the store is used; it is not safe
// for concurrent use with the store's methods.
func (s *Signed) AllowUnsigned(transports ...string) {
	s.allow = make(map[string]bool, len(transports))
	for _, t := range transports {
		s.allow[t] = true
	}
}

// allowed reports whether an endpoint or key name belongs to a transport
// AllowUnsigned named.
func (s *Signed) allowed(name string) bool {
	if i := strings.IndexByte(name, '.'); i >= 0 {
		name = name[:i]
	}
	return s.allow[name]
}

// cutUnsigned cuts d, which has no signature, down to the allowed
// transports, in place (d is the caller's own copy); false when nothing
// reachable is left.
func (s *Signed) cutUnsigned(d *segtable.SegmentDesc) bool {
	for k := range d.Endpoints {
		if !s.allowed(k) {
			delete(d.Endpoints, k)
		}
	}
	for i := range d.Buffers {
		for k := range d.Buffers[i].Keys {
			if !s.allowed(k) {
				delete(d.Buffers[i].Keys, k)
			}
		}
		d.Buffers[i].MAC = ""
	}
	return len(d.Endpoints) > 0
}

// Put signs a copy of d and stores it; see [Store].
func (s *Signed) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil || d.Validate() != nil {
		return s.inner.Put(ctx, d) // the store's own error for it
	}
	// A copy with buffers of its own (their Keys maps are d's, read only:
	// the store copies what it keeps), and the cache of this Put's buffer
	// MACs, whose Keys are the cache's own.
	c := *d
	c.Buffers = slices.Clone(d.Buffers)
	cache := make([]segtable.BufferDesc, len(c.Buffers))
	s.mu.Lock()
	var prev []segtable.BufferDesc
	if p := s.signed[d.Name]; p != nil && p.epoch == d.Epoch {
		prev = p.buffers
	}
	j := 0
	for i := range c.Buffers {
		b := &c.Buffers[i]
		for j < len(prev) && prev[j].Addr < b.Addr {
			j++
		}
		if j < len(prev) && segtable.SameBuffer(b, &prev[j]) {
			b.MAC = prev[j].MAC
			cache[i] = prev[j]
			continue
		}
		b.MAC = s.signer.SignBuffer(d.Name, d.Epoch, b)
		cache[i] = *b
		cache[i].Keys = maps.Clone(b.Keys)
	}
	s.signer.Sign(&c) // the header: every buffer has its MAC
	s.mu.Unlock()
	if err := s.inner.Put(ctx, &c); err != nil {
		return err
	}
	s.mu.Lock()
	if len(s.signed) >= maxSeen {
		clear(s.signed)
	}
	s.signed[d.Name] = &signedSet{epoch: d.Epoch, buffers: cache}
	s.mu.Unlock()
	return nil
}

// signedSet is what a Put signed: its epoch and its buffers with their MACs.
type signedSet struct {
	epoch   uint64
	buffers []segtable.BufferDesc
}

// Delete removes the descriptor under name; see [Store].
func (s *Signed) Delete(ctx context.Context, name string, epoch uint64) error {
	err := s.inner.Delete(ctx, name, epoch)
	if err == nil {
		s.mu.Lock()
		delete(s.signed, name)
		s.mu.Unlock()
	}
	return err
}

// Get returns the descriptor under name if its signature holds; see
// [Signed].
func (s *Signed) Get(ctx context.Context, name string) (*segtable.SegmentDesc, error) {
	d, err := s.inner.Get(ctx, name)
	if err != nil {
		return nil, err
	}
	if err := s.check(name, d); err != nil {
		return nil, fmt.Errorf("metadata %s: get %q: %w (%w)", s.inner, name, ErrNotFound, err)
	}
	return d, nil
}

// check verifies d, read under name, and remembers its epoch.
func (s *Signed) check(name string, d *segtable.SegmentDesc) error {
	err := s.signer.Verify(d)
	if err != nil && d.MAC == "" && s.allow != nil {
		if !s.cutUnsigned(d) {
			err = fmt.Errorf("%w: unsigned, and no endpoint of a transport that may be reached unsigned", ErrForged)
		} else {
			err = nil
			s.unsigned.Add(1)
		}
	}
	if err == nil && d.Name != name {
		err = fmt.Errorf("%w: %q served under %q", ErrForged, d.Name, name)
	}
	if err != nil {
		s.forged.Add(1)
		s.refused(name, err)
		return err
	}
	s.mu.Lock()
	seen, ok := s.seen[name]
	if ok && d.Epoch < seen {
		s.mu.Unlock()
		s.stale.Add(1)
		err := fmt.Errorf("%w: epoch %d after %d", ErrStale, d.Epoch, seen)
		s.refused(name, err)
		return err
	}
	if !ok && len(s.seen) >= maxSeen {
		clear(s.seen)
	}
	s.seen[name] = d.Epoch
	s.mu.Unlock()
	return nil
}

// refused logs a refusal, at most once a second, with the number of those
// not logged since.
func (s *Signed) refused(name string, err error) {
	if ok, suppressed := s.logLimit.Allow(); ok {
		s.log.Warn("metadata: descriptor refused", "store", s.inner.String(), "segment", name, "err", err, "suppressed", suppressed)
	}
}

// Watch follows name in the wrapped store, handing on only descriptors whose
// signature holds; a descriptor that fails is reported as Deleted. See
// [Store] and [Signed].
func (s *Signed) Watch(ctx context.Context, name string) (<-chan Event, error) {
	in, err := s.inner.Watch(ctx, name)
	if err != nil {
		return nil, err
	}
	out := make(chan Event, 1)
	go func() {
		defer close(out)
		// last is the descriptor last handed on, for the Deleted event that
		// stands for a refused one (stores report the removed descriptor).
		last := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: name}
		for ev := range in {
			switch {
			case ev.Deleted || ev.Desc == nil:
			case s.check(name, ev.Desc) != nil:
				ev = Event{Desc: last.Clone(), Deleted: true}
			default:
				last = ev.Desc.Clone()
			}
			SendLatest(out, ev) // this goroutine is out's only sender
		}
	}()
	return out, nil
}
