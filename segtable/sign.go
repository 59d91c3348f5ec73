package segtable

// Descriptor authentication. A descriptor tells peers where to connect
// (Endpoints, with any TLS pin a transport puts there) and which keys open
// which memory (Buffers), so a party that could change it could send peers
// to a relay. An engine that knows the deployment's segment key signs what
// it publishes; readers check before they act.
//
// The signature follows the chunks a publisher keeps its buffers in
// (chunks.go), so that a republish after one registration signs one chunk
// and the header, whatever the number of buffers:
//
//   - each buffer has a MAC bound to the segment's name and epoch, made
//     once when the buffer first appears;
//   - each chunk has a MAC over the name, the epoch, the chunk's sequence
//     number and its buffers' MACs in order, made once when the chunk is
//     made (a chunk never changes: a change makes a new chunk with a new
//     number);
//   - the header MAC covers the version, name, epoch, Rev, endpoints,
//     devices, the numbers of chunks and buffers, and a set hash of the
//     chunks: the XOR of one 128-bit element per chunk, the half of the
//     chunk's HMAC-SHA256 that its published MAC leaves out (a keyed
//     multiset hash, MSet-XOR-Hash: the elements are never published, so
//     a set of chunks other than the one signed matches with probability
//     2^-128, as a MAC does). A publish updates it with the elements of
//     the chunks it replaced and made, O(1), where a hash over every chunk
//     in order was O(n).
//
// What a reader that accepts a descriptor knows: every buffer it lists,
// with its keys, was published by a holder of the key for this name and
// epoch (buffer and chunk MACs), in this combination (the set hash in the
// header: a chunk of an older descriptor, spliced into a newer one in
// place of another or beside them, changes the set and fails, and so does
// one moved to another segment or epoch, whose MACs bind those), and the
// header is the one published at Rev. An older descriptor replayed whole
// verifies, being one the key holder signed: readers refuse a Rev older
// than one they accepted for the epoch (metadata.Signed), as they refuse
// an older epoch, so a buffer once withdrawn does not come back. Order
// needs no MAC of its own: buffers must be in address order and not
// overlap (Validate), so the set of chunks fixes the list, and a chunk's
// position is not bound (positions shift on every split, and binding them
// would make a publish re-sign every chunk after the change).

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"sort"
	"sync"
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
	key  [32]byte
	macs sync.Pool // of hash.Hash: HMAC-SHA256 under key, reset before use
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
	s.macs.New = func() any { return hmac.New(sha256.New, s.key[:]) }
	return s, nil
}

// Sign signs d in full, as a publisher that kept nothing from its earlier
// publishes would: every buffer's MAC, every chunk's and the header's.
// A Chunked d gets signed chunks of its own (d.Chunked is replaced, not
// changed); a flat one is cut into chunks of ChunkSize buffers numbered
// from 1, its buffers' MACs and Chunks set in place. d gets Rev 1 unless
// it has one. d must pass Validate.
func (s *Signer) Sign(d *SegmentDesc) {
	if d.Rev == 0 {
		d.Rev = 1
	}
	if d.Chunked != nil {
		d.Chunked = s.SignChunks(d.Name, d.Epoch, d.Chunked, nil, nil)
		d.MAC = s.HeaderMAC(d)
		return
	}
	cs := s.signFlat(d.Name, d.Epoch, d.Buffers)
	for i, b := range cs.Buffers() {
		d.Buffers[i].MAC = b.MAC
	}
	d.Chunks = cs.infos()
	c := *d
	c.Buffers, c.Chunks, c.Chunked = nil, nil, cs
	d.MAC = s.HeaderMAC(&c)
}

// signFlat returns bufs signed as chunks of ChunkSize numbered from 1.
func (s *Signer) signFlat(name string, epoch uint64, bufs []BufferDesc) *BufferChunks {
	cs, err := NewBufferChunks(bufs)
	if err != nil {
		cs = &BufferChunks{} // d fails Validate: so does what Sign makes of it
	}
	return s.SignChunks(name, epoch, cs, nil, nil)
}

// SignBuffer returns the MAC of buffer b of the segment name at epoch, as
// Sign would set it.
func (s *Signer) SignBuffer(name string, epoch uint64, b *BufferDesc) string {
	m := s.mac()
	defer s.macs.Put(m)
	return encodeMAC(s.bufferMAC(m, name, epoch, b, nil))
}

// Verify checks the MACs of d: the header's, every chunk's and every
// buffer's. It returns nil when they match, or an error wrapping ErrForged
// that says which part failed. A descriptor without Rev is checked as the
// first version of the format signed it (a MAC per buffer and a header
// MAC over them, no chunks), for engines not yet upgraded. Its cost is a
// MAC per buffer: readers check what they act on.
func (s *Signer) Verify(d *SegmentDesc) error {
	if d.MAC == "" {
		return fmt.Errorf("%w: %q is not signed", ErrForged, d.Name)
	}
	if d.Chunked != nil {
		d = d.Clone()
	}
	if d.Rev == 0 {
		return s.verifyV1(d)
	}
	if d.Validate() != nil || len(d.Chunks) == 0 && len(d.Buffers) > 0 {
		return fmt.Errorf("%w: %q: its chunks do not partition its buffers", ErrForged, d.Name)
	}
	m := s.mac()
	defer s.macs.Put(m)
	var acc [elemSize]byte
	var want [macSize]byte
	lo := 0
	var raws []byte
	for ci, c := range d.Chunks {
		bufs := d.Buffers[lo : lo+c.N]
		raws = raws[:0]
		for i := range bufs {
			got, ok := decodeMAC(bufs[i].MAC)
			if !ok || !hmac.Equal(got[:], s.bufferMAC(m, d.Name, d.Epoch, &bufs[i], want[:0])) {
				return fmt.Errorf("%w: %q buffer %d", ErrForged, d.Name, lo+i)
			}
			raws = append(raws, got[:]...)
		}
		got, ok := decodeMAC(c.MAC)
		sum := s.chunkSum(m, d.Name, d.Epoch, c.Seq, raws)
		if !ok || !hmac.Equal(got[:], sum[:macSize]) {
			return fmt.Errorf("%w: %q chunk %d", ErrForged, d.Name, ci)
		}
		xor(&acc, (*[elemSize]byte)(sum[macSize:]))
		lo += c.N
	}
	got, ok := decodeMAC(d.MAC)
	if !ok || !hmac.Equal(got[:], s.headerMAC(m, d, len(d.Chunks), len(d.Buffers), &acc, want[:0])) {
		return fmt.Errorf("%w: %q", ErrForged, d.Name)
	}
	return nil
}

// verifyV1 checks a descriptor signed by the first version of the format:
// a MAC per buffer, and the header's over them.
func (s *Signer) verifyV1(d *SegmentDesc) error {
	if d.Chunks != nil {
		return fmt.Errorf("%w: %q: chunks without a Rev", ErrForged, d.Name)
	}
	m := s.mac()
	defer s.macs.Put(m)
	var want [macSize]byte
	for i := range d.Buffers {
		got, ok := decodeMAC(d.Buffers[i].MAC)
		if !ok || !hmac.Equal(got[:], s.bufferMAC(m, d.Name, d.Epoch, &d.Buffers[i], want[:0])) {
			return fmt.Errorf("%w: %q buffer %d", ErrForged, d.Name, i)
		}
	}
	got, ok := decodeMAC(d.MAC)
	if !ok || !hmac.Equal(got[:], s.headerMACv1(m, d, want[:0])) {
		return fmt.Errorf("%w: %q", ErrForged, d.Name)
	}
	return nil
}

// chunkSum returns the HMAC of a chunk: its number and its buffers' MACs
// (raws: n raw MACs one after another), bound to the segment's name and
// epoch. Its first macSize bytes are the chunk's MAC as published; the
// others, never published, are the chunk's element of the set hash.
func (s *Signer) chunkSum(m hash.Hash, name string, epoch, seq uint64, raws []byte) [sha256.Size]byte {
	m.Reset()
	var e enc
	e.str("moonring chunk v2")
	e.str(name)
	e.u64(epoch)
	e.u64(seq)
	e.u64(uint64(len(raws) / macSize))
	m.Write(e.b)
	m.Write(raws)
	var sum [sha256.Size]byte
	m.Sum(sum[:0])
	return sum
}

// elemSize is the size of a chunk's element of the set hash: the half of
// its HMAC that is not published.
const elemSize = sha256.Size - macSize

// mac returns an HMAC-SHA256 under s's key, reset, from the pool; put it
// back with s.macs.Put.
func (s *Signer) mac() hash.Hash {
	m := s.macs.Get().(hash.Hash)
	m.Reset()
	return m
}

// headerMAC appends the MAC of d's own fields, its Rev, and its chunks'
// count, buffer count and set hash acc.
func (s *Signer) headerMAC(m hash.Hash, d *SegmentDesc, chunks, buffers int, acc *[elemSize]byte, out []byte) []byte {
	var e enc
	e.str("moonring descriptor v2")
	e.u64(uint64(d.Version))
	e.str(d.Name)
	e.u64(d.Epoch)
	e.u64(d.Rev)
	e.strMap(d.Endpoints)
	e.u64(uint64(len(d.Devices)))
	for _, dv := range d.Devices {
		e.str(dv.Name)
		e.str(dv.Kind)
		e.u64(uint64(int64(dv.Node)))
	}
	e.u64(uint64(chunks))
	e.u64(uint64(buffers))
	e.b = append(e.b, acc[:]...)
	m.Reset()
	m.Write(e.b)
	var sum [sha256.Size]byte
	return append(out, m.Sum(sum[:0])[:macSize]...)
}

// HeaderMAC returns the header MAC of d, whose buffers are Chunked and
// signed by s (SignChunks), as Sign sets it: what a publisher that keeps
// its signed chunks computes on each republish, in O(1).
func (s *Signer) HeaderMAC(d *SegmentDesc) string {
	cs := d.Chunked
	if cs == nil {
		cs = &BufferChunks{signed: true}
	}
	m := s.mac()
	defer s.macs.Put(m)
	return encodeMAC(s.headerMAC(m, d, cs.count, cs.n, &cs.acc, nil))
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

// headerMACv1 appends the MAC the first version of the format put on a
// descriptor: d's own fields and its buffers' MACs in order (as
// published: a buffer whose MAC does not decode contributes its text, and
// fails its own check).
func (s *Signer) headerMACv1(m hash.Hash, d *SegmentDesc, out []byte) []byte {
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
