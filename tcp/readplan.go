// readplan.go holds the read plan of a rail's receiving side: the read
// of the rest of a payload straight from the socket takes, in the same
// readv, the answers queued behind it, each header into the plan and each
// READ's payload straight into its own destination, and the answers wholly
// in are then completed with no read at all.

package tcp

import (
	"unsafe"

	"github.com/moonring/moonring/transport"
	"golang.org/x/sys/unix"
)

// planMax bounds the answers one readv takes behind the payload it ends:
// with it, the iovecs of a readv (2*planMax+2) and the headers a plan
// holds. A stream of 32 KiB READs then costs a read system call per
// planMax answers, or per what the socket holds when that is less.
const planMax = 16

// readPlan is what the last payload read took of the answers queued
// behind it (conn.readPlanned) that receiveOne has not taken yet (take).
// Answer j answers queue position first+j; its header is hdrs[j], and
// in[j] bytes of the payload planned for it (size[j]: a READ's length,
// 0 for any other answer) are in its destination. Every answer but the
// last is wholly in, and the last one's header is; the bytes after the
// plan's are in the nbReader's over, then in the socket.
//
// The plan is what the answers would be if every one were the next
// expected, with status OK. An answer that is not (take's caller sees it
// from its header) gives the bytes read after its header back to the
// stream (conn.unplan). It belongs to whoever holds the reading, as
// the queue's consumer side does (drive.go).
type readPlan struct {
	first   uint64 // the queue position of answer 0
	n, next int    // answers planned; the next one to take
	hdrs    [planMax][respSize]byte
	size    [planMax]int
	in      [planMax]int
	// iov is the readv's: the rest of the payload being read, the
	// headers and payloads planned, the nbReader's ahead.
	iov [2 + 2*planMax]unix.Iovec
	// taken counts the answers taken from plans, unplans the plans
	// given back (tests read them).
	taken, unplans uint64
}

// pending reports whether an answer of the plan waits to be taken.
func (pl *readPlan) pending() bool { return pl.next < pl.n }

// held is how many bytes of the stream the plan holds.
func (pl *readPlan) held() int {
	h := 0
	for j := pl.next; j < pl.n; j++ {
		h += respSize + pl.in[j]
	}
	return h
}

// take copies the next planned answer's header into hdr and returns how
// many bytes of its payload are in its destination, and the payload
// planned for it.
func (pl *readPlan) take(hdr *[respSize]byte) (in, planned int) {
	j := pl.next
	*hdr = pl.hdrs[j]
	pl.taken++
	pl.next++
	if pl.next == pl.n {
		pl.n, pl.next = 0, 0
	}
	return pl.in[j], pl.size[j]
}

// planReader is the socket as the rest of a payload is read from it
// (reader.payload): its Read is conn.readPlanned.
type planReader conn

// Read reads the rest of the head's payload into p, planning the answers
// behind it (conn.readPlanned).
func (pr *planReader) Read(p []byte) (int, error) { return (*conn)(pr).readPlanned(p) }

// readPlanned reads into p, the rest of the payload of the answer at the
// queue's head, waiting for bytes. When answers are owed after it, the
// same readv takes what follows p in the stream: the header and payload
// of up to planMax answers queued behind (c.plan, empty when it is
// called) and then up to a header's worth into the nbReader's ahead. Bytes
// the nbReader holds come first, with no readv.
func (c *conn) readPlanned(p []byte) (int, error) {
	nb := c.src.(*nbReader)
	head := c.q.Head()
	pl := &c.plan
	if nb.held() > 0 || len(p) == 0 || head+1 >= c.q.Committed() || pl.pending() {
		// A pending plan is never planned over (none is, today: an
		// answer taken from a plan but its last is wholly in).
		return nb.Read(p)
	}
	pl.first = head + 1
	// Only the frames gathered can be answered; past them the ahead's
	// few bytes wait for an answer the sender may just have sent.
	end := min(c.gathered.Load(), pl.first+planMax)
	v := appendIovec(pl.iov[:0], p)
	// The destinations planned overlap neither the head's (all of it: p
	// is only what is left of it, and the bytes before p are its own,
	// read already) nor one another: the bytes the readv puts in one are
	// still there if a failed READ before it gives them back (unplan),
	// and a READ completed cannot change them.
	var spans [planMax + 1]span
	spans[0] = spanOf(p)
	if hs := &c.q.Slot(head).s; hs.Op == transport.Read {
		spans[0] = spanOf(unsafe.Slice((*byte)(hs.Local), hs.Length))
	}
	k := 0
	for pos := pl.first; pos < end; pos++ {
		var dst []byte
		if s := &c.q.Slot(pos).s; s.Op == transport.Read {
			dst = unsafe.Slice((*byte)(s.Local), s.Length)
			if spanOf(dst).overlaps(spans[:k+1]) {
				break
			}
		}
		spans[k+1] = spanOf(dst)
		v = appendIovec(v, pl.hdrs[k][:])
		v = appendIovec(v, dst)
		pl.size[k] = len(dst)
		k++
	}
	v = appendIovec(v, nb.ahead[:])
	n, err := nb.readv(v)
	clear(v) // hold no pointer into the callers' buffers
	if err != nil || n <= len(p) {
		return n, err
	}
	nb.aheads++
	past := n - len(p)
	for j := 0; j < k && past > 0; j++ {
		got := min(past, respSize+pl.size[j])
		past -= got
		if got < respSize {
			// A header cut short ends what came: it waits with the
			// stream's next bytes.
			nb.over = append(nb.ahead[:0], pl.hdrs[j][:got]...)
			break
		}
		pl.in[j] = got - respSize
		pl.n++
	}
	if past > 0 {
		nb.over = nb.ahead[:past] // after every answer planned
	}
	return len(p), nil
}

// unplan gives back to the stream what the readv put after the header of
// an answer that was not the one planned: a READ that failed has no
// payload, so cur (the bytes landed in its destination) and every answer
// of the plan after it are the bytes that follow its header. They are
// copied, in order and with those the nbReader holds, into a new buffer
// that the next reads return before the socket's (an allocation, on a
// path only a failed READ takes), and the plan is emptied. The answers
// whose bytes these are are then read from it as from the socket.
func (c *conn) unplan(cur []byte) {
	pl := &c.plan
	nb := c.src.(*nbReader)
	size := len(cur) + pl.held() + nb.held()
	b := make([]byte, 0, size)
	b = append(b, cur...)
	for j := pl.next; j < pl.n; j++ {
		b = append(b, pl.hdrs[j][:]...)
		if in := pl.in[j]; in > 0 {
			b = append(b, unsafe.Slice((*byte)(c.q.Slot(pl.first+uint64(j)).s.Local), in)...)
		}
	}
	b = append(b, nb.over...)
	nb.over = b
	pl.n, pl.next = 0, 0
	pl.unplans++
}

// span is the addresses of a buffer's bytes, [start, end).
type span struct{ start, end uintptr }

// spanOf returns b's span.
func spanOf(b []byte) span {
	start := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return span{start, start + uintptr(len(b))}
}

// overlaps reports whether s shares a byte with one of spans.
func (s span) overlaps(spans []span) bool {
	for _, o := range spans {
		if s.start < o.end && o.start < s.end {
			return true
		}
	}
	return false
}

// appendIovec appends an iovec for b to v when b is not empty.
func appendIovec(v []unix.Iovec, b []byte) []unix.Iovec {
	if len(b) == 0 {
		return v
	}
	iv := unix.Iovec{Base: unsafe.SliceData(b)}
	iv.SetLen(len(b))
	return append(v, iv)
}
