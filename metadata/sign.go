package metadata

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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
	// already accepted under its name (a replay of a dead instance's
	// descriptor), or of the same epoch with an older Rev (a replay of an
	// earlier republish). It is treated as absent: the error also matches
	// [ErrNotFound].
	ErrStale = errors.New("metadata: descriptor older than one already seen")
)

// maxSeen bounds the names whose newest epoch a Signed store remembers;
// past it the memory starts afresh (a replay is then refused only by its
// signature's epoch binding, not by age).
const maxSeen = 1 << 16

// Signed is a [Store] that signs what it publishes and checks what it reads,
// with a key derived from the deployment's segment key
// ([segtable.NewSigner]). Put signs a copy of the descriptor with a Rev
// above every Rev it gave the name in the epoch. An engine's descriptor
// comes as copy-on-write chunks (segtable.SegmentDesc.Chunked): Put keeps
// what it signed last, by pointer, and signs only the chunks that changed
// and the header (segtable.Signer.SignChunks), so a republish after one
// registration costs the same with one buffer or a million; a flat
// descriptor is signed whole, its unchanged buffers keeping their MACs.
// Get and Watch hand out only descriptors whose signatures hold and whose
// epoch is not older than one already accepted under the name, nor, in
// that epoch, their Rev (a replay of an older republish, which could bring
// back a buffer since withdrawn). A descriptor that fails is treated as
// absent (Get: an error matching [ErrNotFound] and [ErrForged] or
// [ErrStale]; Watch: a Deleted event, but for an older Rev, which a watch
// skips), counted (Refused) and logged at most once a second. A Chunked
// descriptor (the in-process Memory store hands out the publisher's
// chunks, shared) is checked by the chunks that are not in the last one
// accepted under its name and epoch (segtable.Signer.VerifySince), which
// the store keeps: a reader's check of a republish costs the chunks it
// changed, not a MAC per buffer, and refuses what Verify refuses.
//
// It is safe for concurrent use. Close closes the wrapped store; Signed
// holds nothing else but the goroutine of each Watch, which ends when the
// wrapped store's channel closes.
type Signed struct {
	inner  Store
	signer *segtable.Signer
	log    *slog.Logger

	mu     sync.Mutex
	signed map[string]*signedSet // what the Puts of each name signed
	seen   map[string]epochRev   // the newest epoch and Rev accepted, per name

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
	return &Signed{inner: s, signer: signer, log: log, signed: map[string]*signedSet{}, seen: map[string]epochRev{}}, nil
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
	if d.Chunked != nil {
		*d = *d.Clone() // shared chunks (CloneShared): cut a flat copy of its own
	}
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
	d.Chunks = nil
	return len(d.Endpoints) > 0
}

// Put signs a copy of d and stores it; see [Store] and [Signed].
func (s *Signed) Put(ctx context.Context, d *segtable.SegmentDesc) error {
	if d == nil || d.Validate() != nil {
		return s.inner.Put(ctx, d) // the store's own error for it
	}
	src := d.Chunked
	if src == nil {
		// A flat descriptor (not an engine's): its buffers as chunks of
		// their own, whose buffers keep the MACs the last Put gave them.
		var err error
		if src, err = segtable.NewBufferChunks(d.Buffers); err != nil {
			return s.inner.Put(ctx, d)
		}
	}
	c := *d
	s.mu.Lock()
	p := s.signed[d.Name]
	if p == nil || p.epoch != d.Epoch {
		if len(s.signed) >= maxSeen {
			clear(s.signed)
		}
		p = &signedSet{epoch: d.Epoch}
		s.signed[d.Name] = p
	}
	// Rev grows with every Put, even one that fails: two descriptors the
	// key vouches for never share a name, an epoch and a Rev.
	p.rev = max(d.Rev, p.rev+1)
	c.Rev = p.rev
	prevSrc, prevOut := p.src, p.out
	s.mu.Unlock()
	out := s.signer.SignChunks(d.Name, d.Epoch, src, prevSrc, prevOut)
	c.Buffers, c.Chunks, c.Chunked = nil, nil, out
	c.MAC = s.signer.HeaderMAC(&c)
	if err := s.inner.Put(ctx, &c); err != nil {
		return err
	}
	s.mu.Lock()
	if p.epoch == d.Epoch && s.signed[d.Name] == p {
		p.src, p.out = src, out
	}
	s.mu.Unlock()
	return nil
}

// signedSet is what the Puts of a name signed: the epoch, the last Rev
// given, and the chunks of the last Put that succeeded with their signed
// counterparts (for segtable.Signer.SignChunks).
type signedSet struct {
	epoch    uint64
	rev      uint64
	src, out *segtable.BufferChunks
}

// Delete removes the descriptor under name; see [Store].
func (s *Signed) Delete(ctx context.Context, name string, epoch uint64) error {
	err := s.inner.Delete(ctx, name, epoch)
	if err == nil {
		// The Rev stays: a Put after the Delete, in the same epoch, must
		// not look older than what readers saw before it.
		s.mu.Lock()
		if p := s.signed[name]; p != nil {
			p.src, p.out = nil, nil
		}
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

// check verifies d, read under name, and remembers its epoch. A Chunked
// d (the in-process store's, shared) is checked by the chunks that are
// not in the last one accepted under the name in its epoch
// (segtable.Signer.VerifySince): a republish costs the changed chunks,
// not a MAC per buffer.
func (s *Signed) check(name string, d *segtable.SegmentDesc) error {
	s.mu.Lock()
	prev := s.seen[name].v
	s.mu.Unlock()
	v, err := s.signer.VerifySince(d, prev)
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
	// An unsigned descriptor's Rev is anyone's to write: it is neither
	// checked nor remembered (what such a descriptor may do is cut down
	// already, see AllowUnsigned).
	signed := d.MAC != ""
	s.mu.Lock()
	seen, ok := s.seen[name]
	switch {
	case ok && d.Epoch < seen.epoch:
		s.mu.Unlock()
		s.stale.Add(1)
		err := fmt.Errorf("%w: epoch %d after %d", ErrStale, d.Epoch, seen.epoch)
		s.refused(name, err)
		return err
	case ok && signed && d.Epoch == seen.epoch && d.Rev < seen.rev:
		s.mu.Unlock()
		s.stale.Add(1)
		err := fmt.Errorf("%w: %w: rev %d after %d", ErrStale, errRollback, d.Rev, seen.rev)
		s.refused(name, err)
		return err
	}
	if !signed {
		// Nor does it move the epoch: one claiming epoch 2^64-1 would
		// make every later signed descriptor of the name stale.
		s.mu.Unlock()
		return nil
	}
	if !ok && len(s.seen) >= maxSeen {
		clear(s.seen)
	}
	if !ok || d.Epoch > seen.epoch {
		seen = epochRev{epoch: d.Epoch}
	}
	seen.rev = max(seen.rev, d.Rev)
	if v != nil {
		seen.v = v
	}
	s.seen[name] = seen
	s.mu.Unlock()
	return nil
}

// epochRev is the newest epoch accepted under a name, the newest Rev
// within it, and the chunks of the last Chunked descriptor accepted, as
// verified (nil: none; VerifySince checks the epoch and name it holds).
type epochRev struct {
	epoch, rev uint64
	v          *segtable.Verified
}

// errRollback marks an ErrStale of an older Rev within the epoch: a watch
// skips it, keeping the newer descriptor it has.
var errRollback = errors.New("an older republish of the same epoch")

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
		// A Chunked one is kept as a header of its own sharing the
		// chunks (CloneShared), not copied whole.
		last := &segtable.SegmentDesc{Version: segtable.DescVersion, Name: name}
		for ev := range in {
			if !ev.Deleted && ev.Desc != nil {
				switch err := s.check(name, ev.Desc); {
				case errors.Is(err, errRollback):
					continue // an older republish: the newer one handed on stands
				case err != nil:
					ev = Event{Desc: last.CloneShared(), Deleted: true}
				default:
					last = ev.Desc.CloneShared()
				}
			}
			SendLatest(out, ev) // this goroutine is out's only sender
		}
	}()
	return out, nil
}
