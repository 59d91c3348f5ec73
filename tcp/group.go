// group.go holds the target's side of a group frame (PROTOCOL.md,
// Groups): the headers of up to maxGroup WRITEs come first, so the target
// knows every destination before the payloads arrive and reads them
// straight from the socket into registered memory, most in one readv,
// instead of through the frames' buffer and a copy each.

package tcp

import (
	"bufio"
	"fmt"
	"io"
	"unsafe"

	"golang.org/x/sys/unix"
)

// groupTail is the buffer a group's last readv reads past its payloads
// into: the next frames' headers (a group frame and its headers take 544
// bytes) and the start of the next payload. The frames' bufio.Reader gets
// those bytes from nbReader.over without a system call, so it never reads
// 64 KiB of payloads into its own buffer between two groups.
const groupTail = 4 << 10

// groupIn is a connection's state for the group frames it serves; made on
// the first one and owned by the connection's goroutine.
type groupIn struct {
	hdrs [maxGroup * reqSize]byte
	reqs [maxGroup]request
	regs [maxGroup]*region // held from the checks until the payload is in
	st   [maxGroup]uint8
	dst  [maxGroup][]byte // a payload's destination; nil when it is dropped
	ds   [][]byte         // what is left of the destinations being filled, in dsb
	dsb  [maxGroup][]byte
	v    []unix.Iovec
	tail [groupTail]byte
}

// read serves a group frame announcing k WRITEs: it reads and checks
// their headers, then their payloads, each into its destination or, when
// the WRITE is refused, dropped. The requests and statuses to answer are
// g.reqs[:k] and g.st[:k]. wait is called before anything that may wait
// for the initiator (it arms the frame timeout). Every region read() holds
// is released on every way out.
func (g *groupIn) read(t *Transport, br *bufio.Reader, nb *nbReader, k int, wait func(), sv *served) error {
	h := g.hdrs[:k*reqSize]
	if br.Buffered() < len(h) {
		wait()
	}
	if _, err := io.ReadFull(br, h); err != nil {
		return err
	}
	// Every header is decoded before any region is held: a framing error
	// leaves nothing to release.
	for i := range k {
		r := &g.reqs[i]
		if err := r.decode(h[i*reqSize:], t.cfg.MaxLength); err != nil {
			return err
		}
		if r.op != opWrite {
			return fmt.Errorf("%w: a group holds op %d (WRITEs only)", ErrProtocol, r.op)
		}
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
			n := int(g.reqs[i].length)
			if br.Buffered() < n {
				wait()
			}
			if _, err := br.Discard(n); err != nil {
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
		if err := g.fill(br, nb, g.dst[i:j], j == k, wait); err != nil {
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
// the socket. last adds the tail buffer to the readvs (the group's end:
// what follows is the next frame).
func (g *groupIn) fill(br *bufio.Reader, nb *nbReader, dsts [][]byte, last bool, wait func()) error {
	g.ds = append(g.dsb[:0], dsts...)
	// Bytes the buffer holds come before any the socket has: Read copies
	// them without reading the socket while Buffered is not 0.
	for len(g.ds) > 0 && br.Buffered() > 0 {
		n, _ := br.Read(g.ds[0])
		g.consume(n)
	}
	if nb == nil || nb.rc == nil {
		// TLS: the records go through the buffer.
		for _, d := range g.ds {
			if len(d) == 0 {
				continue
			}
			wait()
			if _, err := io.ReadFull(br, d); err != nil {
				return err
			}
		}
		return nil
	}
	for len(g.ds) > 0 && nb.held() > 0 {
		n, _ := nb.Read(g.ds[0])
		g.consume(n)
	}
	if len(g.ds) > 0 {
		wait()
	}
	for len(g.ds) > 0 {
		g.v = appendIovecs(g.v[:0], g.ds)
		if last {
			iv := unix.Iovec{Base: &g.tail[0]}
			iv.SetLen(len(g.tail))
			g.v = append(g.v, iv)
		}
		n, err := nb.readv(g.v)
		if err != nil {
			return err
		}
		n = g.consume(n)
		if n > 0 {
			// Past the payloads: the next frames' bytes, read next (over
			// was empty, and no readv runs again before it is).
			nb.over = g.tail[:n]
		}
	}
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
