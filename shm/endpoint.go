//go:build linux

package shm

import (
	"context"
	"crypto/hmac"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/fastcopy"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Endpoint reaches the buffers of one engine of this host: mapped buffers
// by a plain copy, the others by process_vm_readv/writev. It implements
// transport.Copier: a slice moves on the poller's goroutine with no
// syscall when the buffer is mapped. Safe for concurrent use.
type Endpoint struct {
	t    *Transport
	name string

	// mu serializes connecting and granting (Open, Update, Close).
	mu   sync.Mutex
	conn atomic.Pointer[client]
	// addr is the socket the connection went to.
	addr string

	// maps are the granted buffers by remote address, read without a
	// lock (find) and changed by the connection's reader (grants,
	// revokes, the end) under mmu, which also guards byHandle, the same
	// mappings by the target's handle: a grant or a revoke costs
	// O(log n), where a list copied whole made opening a segment of n
	// buffers O(n^2) (BenchmarkScaleOpen).
	maps     segtable.Sorted[*mapping]
	byHandle map[uint64]*mapping
	mmu      sync.Mutex
	// descs are the buffers the descriptor lists for this transport, in
	// the shape of its chunks (a slice inside one but not granted is
	// denied, not out of range): an update makes entries for, and asks
	// for the grants of, only the chunks that changed. regrant (under
	// mu) makes the next update ask for every buffer again: an update
	// failed before it asked for all it had to.
	descs   atomic.Pointer[segtable.Mirror[span]]
	regrant bool
	// refusedAsks are the listed buffers the last update asked for and
	// the target refused (or this side could not install), asked for
	// again at the next update while listed: as every ungranted buffer
	// was before the Mirror. Under mu.
	refusedAsks []*segtable.BufferDesc
	closed      atomic.Bool
}

type span struct{ addr, length uint64 }

// mapping is one granted buffer of the target.
type mapping struct {
	raddr, length uint64
	handle        uint64
	// base is the buffer's first byte in this process when mapped; nil
	// means process_vm access to pid.
	base unsafe.Pointer
	mm   []byte
	pid  int
	ref  segtable.Ref
}

var (
	_ transport.Endpoint     = (*Endpoint)(nil)
	_ transport.InlineCopier = (*Endpoint)(nil)
)

// parseEndpoint splits "bootid/socketname[/keyhex]".
func parseEndpoint(s string) (boot [16]byte, name string, key []byte, err error) {
	b, rest, ok := strings.Cut(s, "/")
	name, k, hasKey := strings.Cut(rest, "/")
	h, herr := hex.DecodeString(b)
	if hasKey {
		key, err = hex.DecodeString(k)
	}
	if !ok || herr != nil || err != nil || len(h) != 16 || name == "" || len(name) > 100 ||
		strings.ContainsRune(name, 0) || (hasKey && len(key) == 0) {
		return boot, "", nil, fmt.Errorf("%w: endpoint %q", segtable.ErrBadDesc, s)
	}
	copy(boot[:], h)
	return boot, name, key, nil
}

// connect dials the target desc names (when not connected to it already)
// and asks for every buffer of desc. mu must be held, or e not yet shared.
func (e *Endpoint) connect(ctx context.Context, desc *segtable.SegmentDesc) error {
	ep, ok := desc.Endpoints[Name]
	if !ok {
		return fmt.Errorf("no %s endpoint: %w", Name, transport.ErrUnreachable)
	}
	boot, name, key, err := parseEndpoint(ep)
	if err != nil {
		return errors.Join(err, transport.ErrUnreachable)
	}
	if key == nil {
		key = e.t.cfg.Key // the target's key is a secret of the deployment
	}
	if boot != e.t.boot {
		return fmt.Errorf("%w: %w", ErrOtherHost, transport.ErrUnreachable)
	}
	old := e.descs.Load()
	if e.regrant {
		old = nil
	}
	c := e.conn.Load()
	if c == nil || c.dead.Load() || e.addr != name {
		if c != nil {
			c.close()
		}
		if c, err = e.dial(ctx, name, key); err != nil {
			return err
		}
		e.addr = name
		e.conn.Store(c)
		old = nil // a new connection holds no grant
	}
	// The buffers of the chunks that are not old's (all of them for a
	// flat desc: O(n) then, as always), to ask for unless granted
	// already, and those refused before that the descriptor still lists
	// (a refusal may pass: a grant this side could not install, say at
	// the kernel's limit of mappings).
	var asks []*segtable.BufferDesc
	m := segtable.NewMirror(old, segtable.ChunksOf(desc), func(b *segtable.BufferDesc) (span, bool) {
		if _, ok := b.Keys[Name]; !ok {
			return span{}, false
		}
		asks = append(asks, b)
		return span{b.Addr, b.Length}, true
	})
	e.descs.Store(m)
	if old != nil && len(e.refusedAsks) > 0 {
		fresh := make(map[uint64]bool, len(asks)) // a changed chunk that lists it again asks for it
		for _, b := range asks {
			fresh[b.Addr] = true
		}
		for _, b := range e.refusedAsks {
			if sp, _ := m.Floor(b.Addr); !fresh[b.Addr] && sp != nil && sp.addr == b.Addr && sp.length == b.Length {
				asks = append(asks, b)
			}
		}
	}
	e.regrant = true // until every ask below is answered
	var refused []*segtable.BufferDesc
	for _, b := range asks {
		if g, _, ok := e.maps.FloorValue(b.Addr); ok && g.raddr == b.Addr {
			continue // granted already
		}
		var key [16]byte
		if h, err := hex.DecodeString(b.Keys[Name]); err == nil && len(h) == 16 {
			copy(key[:], h)
		} // else: a zero key, which the target refuses
		err := c.grant(b.Addr, b.Length, &key, e.t.cfg.NoMap)
		switch {
		case errors.Is(err, transport.ErrDenied) || errors.Is(err, transport.ErrRange):
			refused = append(refused, b)
		case err != nil:
			return err
		}
	}
	e.refusedAsks = refused
	e.regrant = false
	return nil
}

// dial connects and says hello. Any failure means this transport cannot
// reach the target.
func (e *Endpoint) dial(ctx context.Context, name string, key []byte) (*client, error) {
	d := net.Dialer{}
	nc, err := d.DialContext(ctx, "unixpacket", "@"+name)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", transport.ErrUnreachable, err)
	}
	uc := nc.(*net.UnixConn)
	c := &client{e: e, c: uc, wait: map[uint32]chan reply{}, done: make(chan struct{})}
	if raw, err := uc.SyscallConn(); err == nil {
		raw.Control(func(fd uintptr) {
			if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
				c.pid = int(cred.Pid)
			}
		})
	}
	if dl, ok := ctx.Deadline(); ok {
		uc.SetDeadline(dl)
	} else {
		uc.SetDeadline(time.Now().Add(e.t.cfg.ReplyTimeout))
	}
	if err := hello(uc, e.t.boot, key); err != nil {
		uc.Close()
		return nil, err
	}
	uc.SetDeadline(time.Time{})
	// Under the lock that Close takes before it waits: a WaitGroup must
	// not gain a goroutine while Wait may be running.
	e.t.mu.Lock()
	if e.t.closed {
		e.t.mu.Unlock()
		uc.Close()
		return nil, transport.ErrClosed
	}
	e.t.wg.Add(1)
	e.t.mu.Unlock()
	go c.run()
	return c, nil
}

// Granted counts the target's buffers this endpoint reaches: mapped into
// this process, and through process_vm calls.
func (e *Endpoint) Granted() (mapped, vm int) {
	e.maps.Ascend(func(_ uint64, g *mapping) bool {
		if g.base != nil {
			mapped++
		} else {
			vm++
		}
		return true
	})
	return mapped, vm
}

// hello runs the initiator's side of the handshake: same host, then the
// proofs of the segment key both ways.
func hello(uc *net.UnixConn, boot [16]byte, key []byte) error {
	var buf [maxMsg + 1]byte
	ci := nonce()
	h := msg{typ: msgHello, a: version, key: boot, c: ci[0], d: ci[1]}
	var ack msg
	roundTrip := func(m *msg, want uint8) error {
		if _, err := uc.Write(m.encode(buf[:])); err != nil {
			return err
		}
		n, err := uc.Read(buf[:])
		if err == nil {
			err = decode(buf[:n], &ack)
		}
		if err == nil && ack.typ != want {
			err = fmt.Errorf("%w: answer of type %d", ErrProtocol, ack.typ)
		}
		return err
	}
	if err := roundTrip(&h, msgHelloAck); err != nil {
		return fmt.Errorf("%w: hello: %w", transport.ErrUnreachable, err)
	}
	if ack.status != statusOK || ack.key != boot {
		return fmt.Errorf("%w: %w: hello refused (status %d)", transport.ErrUnreachable, ErrOtherHost, ack.status)
	}
	ct := [2]uint64{ack.c, ack.d}
	p := msg{typ: msgProof}
	p.putProof(proof(key, "initiator", ci, ct))
	if err := roundTrip(&p, msgProofAck); err != nil {
		return fmt.Errorf("%w: key proof: %w", transport.ErrUnreachable, err)
	}
	if ack.status == statusFull {
		return fmt.Errorf("%w: the target serves as many peers as it takes (its MaxConns)", transport.ErrUnreachable)
	}
	want := proof(key, "target", ci, ct)
	got := ack.getProof()
	if ack.status != statusOK || !hmac.Equal(want[:], got[:]) {
		return fmt.Errorf("%w: the segment key does not match (status %d)", transport.ErrDenied, ack.status)
	}
	return nil
}

// Rails returns 1: a copy has one lane.
func (e *Endpoint) Rails() int { return 1 }

// Update follows the segment's new descriptor: buffers it adds are asked
// for, and a restarted target (a new socket) is dialled afresh.
func (e *Endpoint) Update(desc *segtable.SegmentDesc) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Load() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), e.t.cfg.ReplyTimeout)
	defer cancel()
	e.connect(ctx, desc) // on failure slices fail; the next Update retries
}

// find returns the mapping holding [addr, addr+n), or nil. Mappings do
// not overlap (install refuses a grant that would).
func (e *Endpoint) find(addr, n uint64) *mapping {
	m, _, ok := e.maps.FloorValue(addr)
	if !ok || n > m.length || addr-m.raddr > m.length-n {
		return nil
	}
	return m
}

// Post moves every slice and completes it before returning.
func (e *Endpoint) Post(c transport.Completer, s []transport.Slice) (int, error) {
	for i := range s {
		c.Complete(s[i].Token, e.Copy(&s[i]))
	}
	return len(s), nil
}

// Copy moves one slice on the caller's goroutine: a memory copy into or out
// of a mapped buffer, one process_vm call for the others, a round trip on
// the control socket for a notification.
func (e *Endpoint) Copy(s *transport.Slice) error {
	c := e.conn.Load()
	if e.closed.Load() || c == nil {
		return transport.ErrClosed
	}
	var m *mapping
	if s.Op != transport.Notify {
		m = e.find(s.Remote, s.Length)
	}
	return e.copy(c, m, s)
}

// CopyNow moves s at once when it is a copy through a mapping, which gains
// nothing from a batch; it leaves the others (process_vm calls,
// notifications) to CopyBatch. It implements transport.InlineCopier.
func (e *Endpoint) CopyNow(s *transport.Slice, h *transport.Holds) (bool, error) {
	c := e.conn.Load()
	if s.Op == transport.Notify || e.closed.Load() || c == nil {
		return false, nil
	}
	m := e.find(s.Remote, s.Length)
	if m == nil || m.base == nil {
		return false, nil
	}
	return true, e.copyHold(c, m, s, h)
}

// copy moves s through m, the mapping that find returned for it (nil when
// none did).
func (e *Endpoint) copy(c *client, m *mapping, s *transport.Slice) error {
	return e.copyHold(c, m, s, nil)
}

// copyHold is copy that leaves its reference on m in h, if not nil (see
// transport.HoldingCopier).
func (e *Endpoint) copyHold(c *client, m *mapping, s *transport.Slice, h *transport.Holds) error {
	if s.Op == transport.Notify {
		return c.notify(s)
	}
	if m == nil {
		return e.missing(c, s)
	}
	ok, release := h.Take(&m.ref)
	if !ok {
		return e.missing(c, s)
	}
	var err error
	if m.base != nil {
		fastcopy.Copy(through(m, s))
	} else {
		err = vmCopy(m.pid, s)
	}
	if release {
		m.ref.Release()
	}
	return err
}

// through returns the destination and the source of s, a copy through m (a
// mapping).
func through(m *mapping, s *transport.Slice) (dst, src []byte) {
	remote := unsafe.Slice((*byte)(unsafe.Add(m.base, s.Remote-m.raddr)), s.Length)
	local := unsafe.Slice((*byte)(s.Local), s.Length)
	if s.Op == transport.Write {
		return remote, local
	}
	return local, remote
}

// prefetch starts loading the head of s's source and destination in m, a
// mapping. A hint: m may be going (a prefetch reads nothing and cannot
// fault); copyHold takes the reference.
func prefetch(s *transport.Slice, m *mapping) {
	remote := unsafe.Add(m.base, s.Remote-m.raddr)
	if s.Op == transport.Write {
		fastcopy.Prefetch(remote, s.Local, uintptr(s.Length))
	} else {
		fastcopy.Prefetch(s.Local, remote, uintptr(s.Length))
	}
}

// maxIov bounds the slices one process_vm call moves.
const maxIov = 64

// CopyBatch moves the slices in order, as Copy would, but the runs of
// consecutive slices in the same direction that go through process_vm
// calls move with one call per run. Consecutive copies through mappings
// large enough move four at once (transport.CopyGroup), so that a run of
// scattered blocks keeps four times the misses in flight; before a
// smaller one it asks the CPU for the start of the next slice's source
// and destination when that one is a copy through a mapping too
// (fastcopy.Prefetch), to the same end.
func (e *Endpoint) CopyBatch(s []transport.Slice, errs []error) {
	c := e.conn.Load()
	if e.closed.Load() || c == nil {
		for i := range s {
			errs[i] = transport.ErrClosed
		}
		return
	}
	find := func(i int) *mapping {
		if i >= len(s) || s[i].Op == transport.Notify {
			return nil
		}
		return e.find(s[i].Remote, s[i].Length)
	}
	// The batch holds each mapping it copies through from its first copy
	// to its end (up to the Holds' few; the others are taken per copy):
	// the references are one counter per mapping that every copier
	// writes, and a batch of scattered blocks copies through one mapping
	// again and again. A notification's round trip holds none.
	var h transport.Holds
	var g transport.CopyGroup
	for i, m := 0, find(0); i < len(s); {
		if m == nil || m.base != nil {
			next := find(i + 1) // looked up once: it is the next round's m
			if m != nil && transport.CopyGroups(s[i].Length) {
				if ok, release := h.Take(&m.ref); ok {
					dst, src := through(m, &s[i])
					g.Add(dst, src, &m.ref, release)
					errs[i] = nil
				} else {
					errs[i] = e.missing(c, &s[i]) // going
				}
				i++
				m = next
				continue
			}
			g.Flush()
			if m != nil && next != nil && next.base != nil {
				prefetch(&s[i+1], next)
			}
			if s[i].Op == transport.Notify {
				h.Release()
			}
			errs[i] = e.copyHold(c, m, &s[i], &h)
			i++
			m = next
			continue
		}
		g.Flush()
		n := e.vmRun(s[i:min(len(s), i+maxIov)])
		e.vmBatch(s[i:i+n], errs[i:i+n])
		i += n
		m = find(i)
	}
	g.Flush()
	h.Release()
}

// vmRun counts the leading slices of s (at least the first, which must)
// that go through process_vm calls in the same direction.
func (e *Endpoint) vmRun(s []transport.Slice) int {
	n := 1
	for n < len(s) && s[n].Op == s[0].Op {
		m := e.find(s[n].Remote, s[n].Length)
		if m == nil || m.base != nil {
			break
		}
		n++
	}
	return n
}

// vmBatch moves a run from vmRun with one process_vm call. A slice whose
// mapping went meanwhile, and every slice after a short transfer, moves
// alone with Copy, which says what is wrong.
func (e *Endpoint) vmBatch(s []transport.Slice, errs []error) {
	var (
		local  [maxIov]unix.Iovec
		remote [maxIov]unix.RemoteIovec
		held   [maxIov]*mapping
	)
	k := 0
	pid := 0
	for i := range s {
		m := e.find(s[i].Remote, s[i].Length)
		if m == nil || m.base != nil || (pid != 0 && m.pid != pid) || !m.ref.Acquire() {
			break
		}
		pid = m.pid
		held[k] = m
		local[k] = unix.Iovec{Base: (*byte)(s[i].Local)}
		local[k].SetLen(int(s[i].Length))
		remote[k] = unix.RemoteIovec{Base: uintptr(s[i].Remote), Len: int(s[i].Length)}
		k++
	}
	var n int
	var err error
	if k > 0 {
		if s[0].Op == transport.Write {
			n, err = unix.ProcessVMWritev(pid, local[:k], remote[:k], 0)
		} else {
			n, err = unix.ProcessVMReadv(pid, local[:k], remote[:k], 0)
		}
	}
	done := 0
	if err == nil {
		for done < k && uint64(n) >= s[done].Length {
			n -= int(s[done].Length)
			errs[done] = nil
			done++
		}
	}
	for i := range k {
		held[i].ref.Release()
	}
	for i := done; i < len(s); i++ {
		errs[i] = e.Copy(&s[i])
	}
}

// missing says why no mapping serves s.
func (e *Endpoint) missing(c *client, s *transport.Slice) error {
	if e.closed.Load() || e.t.isClosed() {
		return transport.ErrClosed
	}
	if c.dead.Load() {
		return transport.ErrPeer
	}
	if sp, _ := e.descs.Load().Floor(s.Remote); sp != nil && s.Length <= sp.length && s.Remote-sp.addr <= sp.length-s.Length {
		return transport.ErrDenied // listed, but not granted (or withdrawn)
	}
	return transport.ErrRange
}

func (t *Transport) isClosed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.closed
}

// vmCopy moves a slice with one process_vm_readv/writev call.
func vmCopy(pid int, s *transport.Slice) error {
	local := []unix.Iovec{{Base: (*byte)(s.Local)}}
	local[0].SetLen(int(s.Length))
	remote := []unix.RemoteIovec{{Base: uintptr(s.Remote), Len: int(s.Length)}}
	var n int
	var err error
	if s.Op == transport.Write {
		n, err = unix.ProcessVMWritev(pid, local, remote, 0)
	} else {
		n, err = unix.ProcessVMReadv(pid, local, remote, 0)
	}
	switch {
	case errors.Is(err, unix.EPERM), errors.Is(err, unix.EFAULT):
		return fmt.Errorf("%w: process_vm: %w", transport.ErrDenied, err)
	case err != nil:
		return fmt.Errorf("%w: process_vm: %w", transport.ErrPeer, err)
	case uint64(n) != s.Length:
		return fmt.Errorf("%w: process_vm moved %d of %d bytes", transport.ErrPeer, n, s.Length)
	}
	return nil
}

// Close drops every mapping once the copies on it are done, then hangs up.
// Slices after Close fail with ErrClosed.
func (e *Endpoint) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed.Swap(true) {
		return nil
	}
	if c := e.conn.Load(); c != nil {
		c.close()
	}
	e.t.mu.Lock()
	delete(e.t.eps, e)
	e.t.mu.Unlock()
	return nil
}

// install adds a granted buffer (a grant answer with its descriptor, if
// any). It runs on the connection's reader.
func (e *Endpoint) install(pid int, m *msg, fd int) error {
	g := &mapping{raddr: m.a, length: m.b, handle: m.handle, pid: pid}
	if g.length == 0 || g.raddr+g.length < g.raddr {
		return fmt.Errorf("%w: grant of [%#x, +%d)", ErrProtocol, g.raddr, g.length)
	}
	if m.flags&flagVM == 0 {
		base, mm, err := mapFile(fd, m)
		if err != nil {
			return err
		}
		g.base, g.mm = base, mm
	} else if pid <= 0 {
		return fmt.Errorf("%w: no pid for process_vm access", ErrProtocol)
	}
	e.mmu.Lock()
	defer e.mmu.Unlock()
	// The last mapping that starts within the grant's range or before it
	// is the only one that may overlap it.
	if p, _, ok := e.maps.FloorValue(g.raddr + g.length - 1); ok && p.raddr+p.length > g.raddr {
		g.unmap()
		return fmt.Errorf("%w: grant of [%#x, +%d) overlaps one held", ErrProtocol, g.raddr, g.length)
	}
	if e.byHandle[g.handle] != nil {
		g.unmap()
		return fmt.Errorf("%w: a second grant of handle %d", ErrProtocol, g.handle)
	}
	e.maps.Insert(g.raddr, g)
	e.byHandle[g.handle] = g
	return nil
}

// mapFile maps the file a target handed over, after checking that it is
// sealed against shrinking (so no access can fault) and holds the range.
func mapFile(fd int, m *msg) (unsafe.Pointer, []byte, error) {
	if fd < 0 {
		return nil, nil, fmt.Errorf("%w: grant without a descriptor", ErrProtocol)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return nil, nil, fmt.Errorf("%w: file not sealed against shrinking (%v)", transport.ErrDenied, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, nil, fmt.Errorf("shm: fstat: %w", err)
	}
	size := uint64(st.Size)
	if m.d != size || m.c > size || m.b > size-m.c || size > 1<<46 || m.b == 0 {
		return nil, nil, fmt.Errorf("%w: range [%d, +%d) of a %d-byte file", ErrProtocol, m.c, m.b, size)
	}
	mm, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("shm: map %d bytes: %w", size, err)
	}
	return unsafe.Pointer(&mm[m.c]), mm, nil
}

// unmap releases the mapping; it runs once, after g left the list and
// its copies drained.
func (g *mapping) unmap() {
	if g.mm != nil {
		unix.Munmap(g.mm)
	}
}

// drop withdraws the mapping of handle (all of them when all is set): no
// new copy starts on it, the ones running finish, then it is unmapped. It
// runs on the connection's reader.
func (e *Endpoint) drop(handle uint64, all bool) {
	e.mmu.Lock()
	var gone []*mapping
	if all {
		gone = e.maps.Values()
		e.maps.Reset(nil, nil)
		clear(e.byHandle)
	} else if g := e.byHandle[handle]; g != nil {
		gone = []*mapping{g}
		delete(e.byHandle, handle)
		e.maps.Delete(g.raddr, func(x *mapping) bool { return x == g })
	}
	e.mmu.Unlock()
	for _, g := range gone {
		// Copies are short: wait as long as they take.
		g.ref.Drain(context.Background())
		g.unmap()
	}
}

func unsafePointer(b []byte) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(b)) }
