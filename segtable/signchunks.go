package segtable

import (
	"crypto/hmac"
	"crypto/sha256"
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
	if prevSrc == nil || prevOut == nil || !prevOut.signed || len(prevSrc.list) != len(prevOut.list) {
		prevSrc, prevOut = &BufferChunks{}, &BufferChunks{signed: true}
	}
	a, b := src.list, prevSrc.list
	p, hi := src.Changed(prevSrc)
	q := len(a) - hi
	out := &BufferChunks{n: src.n, signed: true, acc: prevOut.acc, list: make([]*chunk, 0, len(a))}
	out.list = append(out.list, prevOut.list[:p]...)
	replaced := prevOut.list[p : len(b)-q]
	for _, c := range replaced {
		xor(&out.acc, &c.elem)
	}
	m := hmac.New(sha256.New, s.key[:])
	set := hmac.New(sha256.New, s.setKey[:])
	l := lender{old: replaced}
	var raw [macSize]byte
	for _, c := range a[p : len(a)-q] {
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
		mac := s.chunkMAC(m, name, epoch, sc.seq, sc.raws, raw[:0])
		sc.mac = encodeMAC(mac)
		sc.elem = s.setElem(set, sc.seq, [macSize]byte(mac))
		xor(&out.acc, &sc.elem)
		out.list = append(out.list, sc)
	}
	out.list = append(out.list, prevOut.list[len(b)-q:]...)
	return out
}

func xor(acc, e *[32]byte) {
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
