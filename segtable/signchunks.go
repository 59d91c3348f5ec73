package segtable

import (
	"hash"
	"maps"
	"reflect"
)

// Signing a publisher's chunks one republish at a time (see sign.go for
// what the MACs cover).

// SignChunks returns src signed by s for the segment name at epoch: the
// same chunks, in the same order, with the same numbers and buffers, each
// with its MACs, and the set hash the header MAC covers (HeaderMAC). The
// result equals what a signing from scratch makes (Sign).
//
// prevSrc and prevOut are the src and the result of the last call for the
// same name and epoch, or nil. The chunks src shares with prevSrc, by
// pointer, at its head and its tail take their signed counterparts from
// prevOut, and the set hash is prevOut's with the chunks between replaced:
// a republish after one registration signs one or two chunks, whatever
// the number of chunks. A buffer of the new chunks that one of the
// replaced chunks held, unchanged, keeps its MAC. src is not modified.
// Safe for concurrent use.
func (s *Signer) SignChunks(name string, epoch uint64, src, prevSrc, prevOut *BufferChunks) *BufferChunks {
	if src == nil {
		src = &BufferChunks{}
	}
	// A reader's list (JoinChunks) is no signed counterpart: its chunks
	// carry neither raw MACs nor set elements.
	if prevSrc == nil || prevOut == nil || !prevOut.signed || prevOut.wire || !samePages(prevSrc, prevOut) {
		prevSrc, prevOut = &BufferChunks{}, &BufferChunks{signed: true}
	}
	// The pages src shares with prevSrc keep their signed counterparts;
	// those between are made again, mirroring src's, from the signed
	// chunks of the pages they replace where src kept the chunk, and
	// from new signatures where it did not.
	a, b := src.pages, prevSrc.pages
	pp, pq := commonEnds(a, b)
	out := &BufferChunks{n: src.n, count: src.count, signed: true, acc: prevOut.acc,
		pages: make([]*chunkPage, 0, len(a))}
	out.pages = append(out.pages, prevOut.pages[:pp]...)
	oldSrc := pageChunks(b[pp : len(b)-pq])
	oldOut := pageChunks(prevOut.pages[pp : len(b)-pq])
	for _, c := range oldOut {
		xor(&out.acc, &c.elem)
	}
	m := s.mac()
	defer s.macs.Put(m)
	l := lender{old: oldOut}
	j := 0 // in oldSrc: both in address order
	for _, pg := range a[pp : len(a)-pq] {
		chunks := make([]*chunk, len(pg.chunks))
		for i, c := range pg.chunks {
			for j < len(oldSrc) && oldSrc[j].first < c.first {
				j++
			}
			if j < len(oldSrc) && oldSrc[j] == c {
				chunks[i] = oldOut[j]
			} else {
				chunks[i] = s.signChunk(m, &l, name, epoch, c)
			}
			xor(&out.acc, &chunks[i].elem)
		}
		out.pages = append(out.pages, newChunkPage(chunks))
	}
	out.pages = append(out.pages, prevOut.pages[len(b)-pq:]...)
	return out
}

// signChunk returns c signed: a copy with its buffers' MACs (lent by l
// where it holds the buffer unchanged), its MAC and its set element.
func (s *Signer) signChunk(m hash.Hash, l *lender, name string, epoch uint64, c *chunk) *chunk {
	sc := &chunk{seq: c.seq, first: c.first, bufs: make([]BufferDesc, len(c.bufs)), raws: make([]byte, 0, len(c.bufs)*macSize)}
	copy(sc.bufs, c.bufs)
	for i := range sc.bufs {
		bd := &sc.bufs[i]
		if mac, r, ok := l.lend(bd); ok {
			bd.MAC = mac
			sc.raws = append(sc.raws, r...)
		} else {
			sc.raws = s.bufferMAC(m, name, epoch, bd, sc.raws)
			bd.MAC = encodeMAC(sc.raws[len(sc.raws)-macSize:])
		}
	}
	sum := s.chunkSum(m, name, epoch, sc.seq, sc.raws)
	sc.mac = encodeMAC(sum[:macSize])
	sc.elem = [elemSize]byte(sum[macSize:])
	return sc
}

// samePages reports whether a and b have pages of the same numbers of
// chunks: b may be a's signed counterpart.
func samePages(a, b *BufferChunks) bool {
	if len(a.pages) != len(b.pages) {
		return false
	}
	for i, pg := range a.pages {
		if len(pg.chunks) != len(b.pages[i].chunks) {
			return false
		}
	}
	return true
}

func xor(acc, e *[elemSize]byte) {
	for i := range acc {
		acc[i] ^= e[i]
	}
}

// lender hands out the MACs of the buffers of the chunks a republish
// replaced, to the same buffers in the chunks that replace them: both in
// address order, so one pass.
type lender struct {
	old  []*chunk
	c, i int
}

// lend returns the MAC of the replaced buffer that is b, unchanged, as
// published and raw.
func (l *lender) lend(b *BufferDesc) (string, []byte, bool) {
	for l.c < len(l.old) {
		bufs := l.old[l.c].bufs
		if l.i >= len(bufs) {
			l.c, l.i = l.c+1, 0
			continue
		}
		x := &bufs[l.i]
		if x.Addr < b.Addr {
			l.i++
			continue
		}
		if x.Addr == b.Addr && x.Length == b.Length && x.Location == b.Location && sameKeys(x.Keys, b.Keys) {
			return x.MAC, l.old[l.c].raws[l.i*macSize : (l.i+1)*macSize], true
		}
		return "", nil, false
	}
	return "", nil, false
}

// sameKeys reports whether two key maps say the same: the same map (a
// publisher makes a buffer's once; a copy of the buffer shares it), or
// equal ones.
func sameKeys(a, b map[string]string) bool {
	if reflect.ValueOf(a).UnsafePointer() == reflect.ValueOf(b).UnsafePointer() {
		return true
	}
	return maps.Equal(a, b)
}
