package segtable

import (
	"crypto/hmac"
	"fmt"
	"hash"
)

// Verifying a publisher's chunks one republish at a time: the reader's
// counterpart of SignChunks (see sign.go for what the MACs cover). A
// reader that takes every republish of a segment through the in-process
// store gets the publisher's signed chunks by pointer (SegmentDesc.Chunked,
// CloneShared), each immutable once made; a chunk it verified once, at
// the same address, says the same on the next descriptor. So it checks
// only the chunks that are not in the last descriptor it verified for the
// name and epoch, and updates the set hash by the chunks that left and
// came: O(changed chunks), where Verify is a MAC per buffer.

// Verified is what a reader keeps of the last Chunked descriptor whose
// signatures it checked: its name, epoch and chunks, and the set hash and
// counts it computed over them itself. Signer.VerifySince takes it to
// check the next descriptor of the same name and epoch by the chunks
// that changed. It is immutable and safe for concurrent use; it holds
// the chunks (the garbage collector ends it).
type Verified struct {
	name   string
	epoch  uint64
	cs     *BufferChunks
	acc    [elemSize]byte // the XOR of the elements computed, one per chunk of cs
	chunks int            // counted, not read from cs
	n      int
}

// VerifySince checks d as Verify does and returns what the next call
// takes as prev. For a signed Chunked d (the in-process store's, see
// SegmentDesc.CloneShared, or a networked store reader's, see
// JoinChunks) and a prev of the same name and epoch, it
// checks only the chunks of d that are not prev's, by pointer, at its
// head and tail (a chunk never changes once made, and prev's were each
// checked: their buffers' MACs, their MAC and their set element against
// the reader's own computation): every buffer's MAC in them, their
// MACs (a reader's chunk, MakeChunk, carries no set element: its element
// is computed when it comes and again when it leaves), and the header
// MAC over a set hash and counts the reader
// computes from prev's, less the chunks that left and plus those that
// came. What it accepts is what Verify accepts: a chunk forged or spliced
// among unchanged ones fails its own MACs or the header's set hash. It
// returns a nil Verified, and costs what Verify does, for a flat or
// unsigned d. Safe for concurrent use.
func (s *Signer) VerifySince(d *SegmentDesc, prev *Verified) (*Verified, error) {
	cs := d.Chunked
	if cs == nil || d.MAC == "" || d.Rev == 0 || !cs.signed {
		return nil, s.Verify(d)
	}
	if d.Validate() != nil {
		return nil, fmt.Errorf("%w: %q: malformed", ErrForged, d.Name)
	}
	v := &Verified{name: d.Name, epoch: d.Epoch, cs: cs}
	m := s.mac()
	defer s.macs.Put(m)
	var raws []byte
	var came []*chunk
	if prev != nil && prev.name == d.Name && prev.epoch == d.Epoch && prev.cs != nil {
		var left []*chunk
		came, left = diffChunks(cs, prev.cs)
		v.acc, v.chunks, v.n = prev.acc, prev.chunks-len(left), prev.n
		for _, c := range left {
			// Checked against the reader's own sum when it came; a
			// reader's chunk (MakeChunk) carries none, so it is that sum
			// again, from the MACs its buffers held then.
			e := c.elem
			if c.wire {
				var err error
				if raws, e, err = s.wireElem(m, d.Name, d.Epoch, c, raws[:0]); err != nil {
					return nil, err
				}
			}
			xor(&v.acc, &e)
			v.n -= len(c.bufs)
		}
	} else {
		came = pageChunks(cs.pages)
	}
	for _, c := range came {
		var err error
		var e [elemSize]byte
		if raws, e, err = s.verifyChunk(m, d.Name, d.Epoch, c, raws[:0]); err != nil {
			return nil, err
		}
		xor(&v.acc, &e)
		v.chunks++
		v.n += len(c.bufs)
	}
	got, ok := decodeMAC(d.MAC)
	var want [macSize]byte
	if !ok || !hmac.Equal(got[:], s.headerMAC(m, d, v.chunks, v.n, &v.acc, want[:0])) {
		return nil, fmt.Errorf("%w: %q", ErrForged, d.Name)
	}
	return v, nil
}

// verifyChunk checks a signed chunk of the segment name at epoch: its
// buffers in order and not empty, each buffer's MAC, the chunk's MAC and,
// for a publisher's chunk, its set element, all against the reader's own
// computation, and returns the element computed. raws is scratch,
// returned for reuse.
func (s *Signer) verifyChunk(m hash.Hash, name string, epoch uint64, c *chunk, raws []byte) ([]byte, [elemSize]byte, error) {
	var elem [elemSize]byte
	if len(c.bufs) == 0 || c.first != c.bufs[0].Addr || checkRun(c.bufs, 0, false) != nil {
		return raws, elem, fmt.Errorf("%w: %q chunk %d malformed", ErrForged, name, c.seq)
	}
	var want [macSize]byte
	for i := range c.bufs {
		got, ok := decodeMAC(c.bufs[i].MAC)
		if !ok || !hmac.Equal(got[:], s.bufferMAC(m, name, epoch, &c.bufs[i], want[:0])) {
			return raws, elem, fmt.Errorf("%w: %q chunk %d buffer %d", ErrForged, name, c.seq, i)
		}
		raws = append(raws, got[:]...)
	}
	got, ok := decodeMAC(c.mac)
	sum := s.chunkSum(m, name, epoch, c.seq, raws)
	if !ok || !hmac.Equal(got[:], sum[:macSize]) || !c.wire && !hmac.Equal(c.elem[:], sum[macSize:]) {
		return raws, elem, fmt.Errorf("%w: %q chunk %d", ErrForged, name, c.seq)
	}
	return raws, [elemSize]byte(sum[macSize:]), nil
}

// wireElem returns the set element of c, a reader's chunk (MakeChunk)
// that verifyChunk accepted for the segment name at epoch: the sum of its
// number and its buffers' MACs. raws is scratch, returned for reuse.
func (s *Signer) wireElem(m hash.Hash, name string, epoch uint64, c *chunk, raws []byte) ([]byte, [elemSize]byte, error) {
	var elem [elemSize]byte
	for i := range c.bufs {
		got, ok := decodeMAC(c.bufs[i].MAC)
		if !ok { // verifyChunk decoded it: a chunk never changes
			return raws, elem, fmt.Errorf("%w: %q chunk %d buffer %d", ErrForged, name, c.seq, i)
		}
		raws = append(raws, got[:]...)
	}
	sum := s.chunkSum(m, name, epoch, c.seq, raws)
	return raws, [elemSize]byte(sum[macSize:]), nil
}

// diffChunks returns the chunks of a that are not b's and the chunks of
// b that are not a's, by pointer: what a change from b to a made and
// dropped. The pages and chunks at the heads and tails, shared, are
// skipped by pointer; between them, both in address order, one pass
// pairs the chunks they share, so that changes far apart (several
// republishes read at once) cost the chunks they made, not every chunk
// between them. Any pairing of identical pointers gives what a made and
// dropped as multisets, which is what the set hash needs. Both nil-safe;
// it reads no buffer.
func diffChunks(a, b *BufferChunks) (came, left []*chunk) {
	var ap, bp []*chunkPage
	if a != nil {
		ap = a.pages
	}
	if b != nil {
		bp = b.pages
	}
	pp, pq := commonEnds(ap, bp)
	am, bm := pageChunks(ap[pp:len(ap)-pq]), pageChunks(bp[pp:len(bp)-pq])
	cp, cq := commonEnds(am, bm)
	am, bm = am[cp:len(am)-cq], bm[cp:len(bm)-cq]
	j := 0
	for _, c := range am {
		for j < len(bm) && bm[j].first < c.first {
			left = append(left, bm[j])
			j++
		}
		if j < len(bm) && bm[j] == c {
			j++
			continue
		}
		came = append(came, c)
	}
	return came, append(left, bm[j:]...)
}
