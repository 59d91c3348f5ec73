// group.go holds the target's side of a group frame (PROTOCOL.md,
// Groups): the headers of up to maxWide WRITEs come first, so the target
// knows every destination before the payloads arrive and reads them
// straight from the socket into registered memory, most in one readv,
// instead of through the frames' buffer and a copy each.

package tcp

import (
	"bufio"
	"fmt"
	"io"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// headRoom is the most bytes of headers a frame takes: a group frame and
// the headers of its WRITEs.
const headRoom = reqSize * (1 + maxWide)

// groupTail is the buffer a payload's last readv reads past it into: the
// next frame's headers, which the frames' bufio.Reader then gets from
// nbReader.over without a system call. It holds a frame's headers at
// most, and a readv takes no more of it than the next frame is expected
// to need (nextHeads), so that little of the next payload is read into
// it (and copied out again).
const groupTail = headRoom

// nextHeads is how many bytes of headers the frame after a bulk one of k
// WRITEs (a group, or k = 1 a lone WRITE) is expected to take: a stream of
// bulk WRITEs sends frames alike, so as many as this one's, and at least
// a narrow group's (after a lone WRITE, a run that grew into a group). A
// next frame with more headers costs one more read; one with fewer, a
// copy of the next payload's first bytes.
func nextHeads(k int) int { return reqSize * (1 + max(k, maxGroup)) }

// groupStats counts, for tests, the group frames a target served, the
// readvs of their payloads (and of WRITEs read as one, fillOne), those
// that read past a payload into its tail, the waits that set a low-water
// mark (lowat.go), and the payload bytes copied out of the frames' buffer
// or the tail rather than read into their destinations; widest is the
// most WRITEs one group frame held.
type groupStats struct{ frames, readvs, tails, marks, copied, widest atomic.Uint64 }

// add counts one group frame of k WRITEs served by g, and g's reads since
// the last.
func (s *groupStats) add(g *groupIn, k int) {
	s.frames.Add(1)
	for w := s.widest.Load(); uint64(k) > w && !s.widest.CompareAndSwap(w, uint64(k)); w = s.widest.Load() {
	}
	s.flush(g)
}

// flush adds g's counts of reads since the last and zeroes them.
func (s *groupStats) flush(g *groupIn) {
	// Shared by every connection: a count of 0 (most marks and copies)
	// leaves its cache line alone.
	take(&s.readvs, &g.readvs)
	take(&s.tails, &g.tails)
	take(&s.marks, &g.marks)
	take(&s.copied, &g.copied)
}

// take adds *n to sum, when it is not 0, and zeroes it.
func take(sum *atomic.Uint64, n *uint64) {
	if *n != 0 {
		sum.Add(*n)
		*n = 0
	}
}

// groupIn is a connection's state for the group frames and bulk WRITEs it
// reads: taken from grps (server.go) while it has them in hand, owned by
// the connection's goroutine until it gives it back.
type groupIn struct {
	hdrs [maxWide * reqSize]byte
	reqs [maxWide]request
	regs [maxWide]*region // held from the checks until the payload is in
	st   [maxWide]uint8
	dst  [maxWide][]byte // a payload's destination; nil when it is dropped
	ds   [][]byte        // what is left of the destinations being filled, in dsb
	dsb  [maxWide][]byte
	v    []unix.Iovec
	one  [1][]byte // fillOne's destination
	tail [groupTail]byte
	// The counts groupStats sums (tests read them, through
	// Transport.groups).
	readvs, tails, marks, copied uint64
}

// read serves a group frame announcing k WRITEs: it reads and checks
// their headers, then their payloads, each into its destination or, when
// the WRITE is refused, dropped. The requests and statuses to answer are
// g.reqs[:k] and g.st[:k]. The caller has armed the connection's
// deadline for the whole group (FrameTimeout): a stalled initiator holds
// the group's regions no longer. Every region read holds is released on
// every way out, and no pointer into registered memory is kept.
func (g *groupIn) read(t *Transport, br *bufio.Reader, nb *nbReader, k int, sv *served) error {
	defer g.forget()
	h := g.hdrs[:k*reqSize]
	if nb != nil && br.Buffered() < len(h) {
		// The headers and not a byte more: a payload byte read with them
		// would be copied out of the frames' buffer.
		nb.limit = len(h) - br.Buffered()
	}
	_, err := io.ReadFull(br, h)
	if nb != nil {
		nb.limit = 0
	}
	if err != nil {
		return err
	}
	// Every header is decoded before any region is held: a framing error
	// leaves nothing to release.
	total := 0
	for i := range k {
		r := &g.reqs[i]
		if err := r.decode(h[i*reqSize:], t.cfg.MaxLength); err != nil {
			return err
		}
		if r.op != opWrite {
			return fmt.Errorf("%w: a group holds op %d (WRITEs only)", ErrProtocol, r.op)
		}
		total += int(r.length)
	}
	if total > maxGroupBytes {
		// One FrameTimeout covers the group: more than this bound would
		// let a peer hold its regions for a longer payload than a frame.
		return fmt.Errorf("%w: a group of %d payload bytes (at most %d)", ErrProtocol, total, maxGroupBytes)
	}
	defer g.release(k)
	for i := range k {
		r, st := t.check(&g.reqs[i])
		g.regs[i], g.st[i], g.dst[i] = r, st, nil
		if r != nil {
			q := &g.reqs[i]
			g.dst[i] = unsafe.Slice((*byte)(unsafe.Add(r.base, q.addr-r.addr)), q.length)
		}
	}
	for i := 0; i < k; {
		if g.dst[i] == nil {
			if _, err := br.Discard(int(g.reqs[i].length)); err != nil {
				return err
			}
			sv.denied.Add(1)
			i++
			continue
		}
		j := i + 1
		for j < k && g.dst[j] != nil {
			j++
		}
		tail := 0
		if j == k {
			tail = nextHeads(k)
		}
		if err := g.fill(br, nb, g.dst[i:j], tail); err != nil {
			return err
		}
		for ; i < j; i++ {
			g.regs[i].ref.Release()
			g.regs[i] = nil
			sv.writes.Add(1)
			sv.writeBytes.Add(uint64(g.reqs[i].length))
		}
	}
	return nil
}

// fillOne reads one WRITE's payload into dst as fill reads a group's
// last run: what the buffers hold, then straight from the socket, with
// the next frame's headers in the same readv.
func (g *groupIn) fillOne(br *bufio.Reader, nb *nbReader, dst []byte) error {
	g.one[0] = dst
	err := g.fill(br, nb, g.one[:], nextHeads(1))
	g.forget()
	return err
}

// forget drops the group's pointers into registered memory.
func (g *groupIn) forget() {
	clear(g.dst[:])
	clear(g.dsb[:])
	g.one[0] = nil
	clear(g.v[:cap(g.v)])
	g.ds = nil
}

// release lets go of the regions still held.
func (g *groupIn) release(k int) {
	for i, r := range g.regs[:k] {
		if r != nil {
			r.ref.Release()
			g.regs[i] = nil
		}
	}
}

// fill reads the stream's next bytes into dsts, in order: first what the
// frames' buffer and nb's over hold (copies), then the rest straight from
// the socket. A tail above 0 adds that much of the tail buffer to the
// readvs (at the group's end: what follows is the next frame).
func (g *groupIn) fill(br *bufio.Reader, nb *nbReader, dsts [][]byte, tail int) error {
	g.ds = append(g.dsb[:0], dsts...)
	// Bytes the buffer holds come before any the socket has: Read copies
	// them without reading the socket while Buffered is not 0.
	for len(g.ds) > 0 && br.Buffered() > 0 {
		n, _ := br.Read(g.ds[0])
		g.copied += uint64(n)
		g.consume(n)
	}
	if nb == nil || nb.rc == nil {
		// TLS: the records go through the buffer.
		for _, d := range g.ds {
			if _, err := io.ReadFull(br, d); err != nil {
				return err
			}
		}
		return nil
	}
	for len(g.ds) > 0 && nb.held() > 0 {
		n, _ := nb.Read(g.ds[0])
		g.copied += uint64(n)
		g.consume(n)
	}
	marks := nb.lowats
	for len(g.ds) > 0 {
		owed := 0
		for _, d := range g.ds {
			owed += len(d)
		}
		nb.expect(owed) // the initiator has sent the frame's header: they come
		g.v = appendIovecs(g.v[:0], g.ds)
		if tail > 0 {
			g.v = appendIovec(g.v, g.tail[:tail])
		}
		n, err := nb.readv(g.v)
		nb.expect(0)
		if err != nil {
			return err
		}
		g.readvs++
		n = g.consume(n)
		if n > 0 {
			g.tails++
			// Past the payloads: the next frames' bytes, read next (over
			// was empty, and no readv runs again before it is).
			nb.over = g.tail[:n]
		}
	}
	g.marks += nb.lowats - marks
	return nil
}

// consume takes n bytes off the front of g.ds and returns what is left of
// n past its end.
func (g *groupIn) consume(n int) int {
	for len(g.ds) > 0 && n > 0 {
		m := min(n, len(g.ds[0]))
		g.ds[0] = g.ds[0][m:]
		n -= m
		if len(g.ds[0]) == 0 {
			g.ds = g.ds[1:]
		}
	}
	for len(g.ds) > 0 && len(g.ds[0]) == 0 {
		g.ds = g.ds[1:]
	}
	return n
}
