package segtable

// Descriptor authentication. A descriptor tells peers where to connect
// (Endpoints, with any TLS pin a transport puts there) and which keys open
// which memory (Buffers), so a party that could change it could send peers
// to a relay. An engine that knows the deployment's segment key signs what
// it publishes; readers check before they act.
//
// The signature has two levels so that a publisher with many buffers does
// not re-sign them all on every registration: each buffer carries a MAC of
// its own (bound to the segment's name and epoch), computed once when the
// buffer first appears, and the descriptor's MAC covers the header fields
// and a SHA-256 of the buffers' MACs in order. Republishing after one
// registration costs one buffer MAC and one pass of SHA-256 over 16 bytes a
// buffer. A reader checks every buffer's MAC and the header's.

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"sort"
)

// ErrForged reports a descriptor whose MAC is missing or does not match
// under the checker's key: it was not published by an engine that holds the
// key, or it was changed since. A retry does not help.
var ErrForged = errors.New("segtable: descriptor fails its signature check")

// macSize is the length of a MAC as published: HMAC-SHA256 truncated to 128
// bits.
const macSize = 16

// Signer signs and checks segment descriptors with a key derived from a
// deployment's segment key. It is safe for concurrent use; it holds no state
// beyond the key.
type Signer struct {
	key [32]byte
}

// NewSigner returns a Signer for the segment key (any length but not
// empty). The descriptor key is derived from it under a label of its own,
// so it differs from the keys the transports derive for their hellos.
func NewSigner(segmentKey []byte) (*Signer, error) {
	if len(segmentKey) == 0 {
		return nil, errors.New("segtable: empty segment key")
	}
	m := hmac.New(sha256.New, segmentKey)
	m.Write([]byte("moonring descriptor key v1"))
	s := new(Signer)
	m.Sum(s.key[:0])
	return s, nil
}

// Sign sets the MAC of every buffer of d that has none and of d itself.
// Buffers whose MAC is set are taken as signed: a publisher keeps a buffer's
// MAC as long as the buffer's fields, the name and the epoch stay the same
// (SignBuffer computes one). d must pass Validate.
func (s *Signer) Sign(d *SegmentDesc) {
	m := hmac.New(sha256.New, s.key[:])
	var raw [macSize]byte
	for i := range d.Buffers {
		if d.Buffers[i].MAC == "" {
			d.Buffers[i].MAC = encodeMAC(s.bufferMAC(m, d.Name, d.Epoch, &d.Buffers[i], raw[:0]))
		}
	}
	d.MAC = encodeMAC(s.headerMAC(m, d, raw[:0]))
}

// SignBuffer returns the MAC of buffer b of the segment name at epoch, as
// Sign would set it.
func (s *Signer) SignBuffer(name string, epoch uint64, b *BufferDesc) string {
	return encodeMAC(s.bufferMAC(hmac.New(sha256.New, s.key[:]), name, epoch, b, nil))
}

// Verify checks the MACs of d and of every buffer of d. It returns nil when
// they match, or an error wrapping ErrForged that says which part failed.
func (s *Signer) Verify(d *SegmentDesc) error {
	if d.MAC == "" {
		return fmt.Errorf("%w: %q is not signed", ErrForged, d.Name)
	}
	m := hmac.New(sha256.New, s.key[:])
	var want [macSize]byte
	for i := range d.Buffers {
		got, ok := decodeMAC(d.Buffers[i].MAC)
		if !ok || !hmac.Equal(got[:], s.bufferMAC(m, d.Name, d.Epoch, &d.Buffers[i], want[:0])) {
			return fmt.Errorf("%w: %q buffer %d", ErrForged, d.Name, i)
		}
	}
	got, ok := decodeMAC(d.MAC)
	if !ok || !hmac.Equal(got[:], s.headerMAC(m, d, want[:0])) {
		return fmt.Errorf("%w: %q", ErrForged, d.Name)
	}
	return nil
}

// bufferMAC appends the MAC of b, bound to the segment's name and epoch.
func (s *Signer) bufferMAC(m hash.Hash, name string, epoch uint64, b *BufferDesc, out []byte) []byte {
	m.Reset()
	var e enc
	e.str("moonring buffer v1")
	e.str(name)
	e.u64(epoch)
	e.u64(b.Addr)
	e.u64(b.Length)
	e.str(b.Location)
	e.strMap(b.Keys)
	m.Write(e.b)
	var sum [sha256.Size]byte
	return append(out, m.Sum(sum[:0])[:macSize]...)
}

// headerMAC appends the MAC of d's own fields and of its buffers' MACs in
// order (as published: a buffer whose MAC does not decode contributes its
// text, and fails its own check).
func (s *Signer) headerMAC(m hash.Hash, d *SegmentDesc, out []byte) []byte {
	set := sha256.New()
	for i := range d.Buffers {
		if raw, ok := decodeMAC(d.Buffers[i].MAC); ok {
			set.Write(raw[:])
		} else {
			var e enc
			e.str(d.Buffers[i].MAC)
			set.Write(e.b)
		}
	}
	var e enc
	e.str("moonring descriptor v1")
	e.u64(uint64(d.Version))
	e.str(d.Name)
	e.u64(d.Epoch)
	e.strMap(d.Endpoints)
	e.u64(uint64(len(d.Devices)))
	for _, dv := range d.Devices {
		e.str(dv.Name)
		e.str(dv.Kind)
		e.u64(uint64(int64(dv.Node)))
	}
	e.u64(uint64(len(d.Buffers)))
	e.b = set.Sum(e.b)
	m.Reset()
	m.Write(e.b)
	var sum [sha256.Size]byte
	return append(out, m.Sum(sum[:0])[:macSize]...)
}

// enc is the canonical encoding MACs are computed over: fixed-width
// integers and length-prefixed strings, maps in key order, so that two
// descriptors encode alike exactly when they say the same thing.
type enc struct{ b []byte }

func (e *enc) u64(v uint64) { e.b = binary.BigEndian.AppendUint64(e.b, v) }

func (e *enc) str(s string) {
	e.u64(uint64(len(s)))
	e.b = append(e.b, s...)
}

func (e *enc) strMap(m map[string]string) {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	e.u64(uint64(len(keys)))
	for _, k := range keys {
		e.str(k)
		e.str(m[k])
	}
}

// macEncoding is strict: one text per MAC.
var macEncoding = base64.RawURLEncoding.Strict()

func encodeMAC(raw []byte) string { return macEncoding.EncodeToString(raw) }

func decodeMAC(s string) (raw [macSize]byte, ok bool) {
	if macEncoding.DecodedLen(len(s)) != macSize {
		return raw, false
	}
	n, err := macEncoding.Decode(raw[:], []byte(s))
	return raw, err == nil && n == macSize
}

// SameBuffer reports whether a and b describe the same buffer with the same
// keys, so that a MAC computed for one holds for the other (MACs aside).
func SameBuffer(a, b *BufferDesc) bool {
	if a.Addr != b.Addr || a.Length != b.Length || a.Location != b.Location || len(a.Keys) != len(b.Keys) {
		return false
	}
	for k, v := range a.Keys {
		if w, ok := b.Keys[k]; !ok || w != v {
			return false
		}
	}
	return true
}
