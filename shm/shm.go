//go:build linux

package shm

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/subtle"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/internal/ratelog"
	"github.com/moonring/moonring/segtable"
	"github.com/moonring/moonring/transport"
)

// Name is the transport's name in segment descriptors.
const Name = "shm"

// Config configures a Transport. The zero value is ready to use.
type Config struct {
	// Key is the segment key shared by the deployment (any length): a
	// connection starts with both sides proving they hold it (HMACs over
	// fresh nonces), before any buffer is asked for. Empty: a random key,
	// published in Endpoint, so whoever reads the descriptor may connect
	// (the buffers' own keys still guard each buffer). The engine passes
	// its TCP transport's key when this one is empty.
	Key []byte
	// NoMap makes this transport's endpoints ask targets for
	// process_vm_readv/writev access even to memfd-backed buffers: the
	// fallback path, for tests and for hosts that forbid shared mappings.
	NoMap bool
	// RevokeTimeout bounds how long Unregister waits for each peer to stop
	// using a buffer (default 10 s); a peer that does not answer in time is
	// disconnected. Sending the revoke to a peer that does not read takes
	// up to two ReplyTimeouts more (the write lock, then the write).
	RevokeTimeout time.Duration
	// ReplyTimeout bounds the wait for a target's answer to a grant or a
	// notification, each write of a control message (on either side: a
	// peer that stops reading is disconnected), and a new connection's
	// proof of the key on the target (default 5 s).
	ReplyTimeout time.Duration

	// Any process of the host (of any user, in the same network
	// namespace) can connect to the target's socket. These bound what
	// connections cost it; Transport.Stats counts what they did, and
	// Logger hears of it (one line a second per reason at most).

	// MaxPending bounds the connections that have not proved the key yet
	// (default DefaultMaxPending, 256). Past it, the oldest of them is
	// closed to make room: an honest peer proves the key within a round
	// trip, so the oldest is the likeliest to be one that never will, and
	// connections held open without the key cannot lock peers out (each
	// lives ReplyTimeout at most anyway).
	MaxPending int
	// MaxPendingPerUID bounds the same per user id of the connecting
	// process (SO_PEERCRED; default DefaultMaxPendingPerUID, 64): past it
	// the oldest pending connection of that user is closed, so that one
	// user's connections do not push out another's. (No bound per process:
	// a user can make as many processes as connections.)
	MaxPendingPerUID int
	// MaxConns bounds the connections that proved the key (default
	// DefaultMaxConns, 1024). While it is reached, a new connection is
	// closed at once after the accept, and one that proves the key is
	// refused (its Open fails with ErrUnreachable; the engine tries its
	// next transport).
	MaxConns int
	// Logger hears of connections dropped by these limits or that fail
	// the proof of the key (default: discard).
	Logger *slog.Logger
}

// Transport is the same-host transport of one engine: the target side
// serves its buffers to peers of this host over a Unix socket, and its
// endpoints reach the buffers of other engines of this host. Safe for
// concurrent use. Use New; Close releases it.
type Transport struct {
	cfg  Config
	boot [16]byte
	// endpoint is what peers dial: boot id and abstract socket name, and
	// the segment key when it is a random one.
	endpoint string
	key      []byte
	ln       *net.UnixListener

	self    atomic.Pointer[string] // the engine's segment name, From of notifications
	deliver atomic.Pointer[func(*transport.Notification) error]

	mu sync.Mutex
	// regs are the registered buffers by address, and byHandle the same
	// by handle, under mu: a registration or an unregistration beside n
	// others costs O(log n), not a scan or a copy of all of them.
	regs     segtable.Sorted[*region]
	byHandle map[uint64]*region
	seq      uint64 // the last registration handle
	conns    map[*server]struct{}
	eps      map[*Endpoint]struct{}
	// pending holds the connections that have not proved the key, oldest
	// first, and pendingUID counts them per user; peers counts those that
	// proved it. Under mu.
	pending    []*server
	pendingUID map[int]int
	peers      int
	closed     bool
	// revoked is closed once Close's revoke of every buffer at every
	// peer has ended: an Unregister or a second Close that comes during
	// Close waits for it, as the buffer may still be in a peer's copy.
	revoked chan struct{}
	wg      sync.WaitGroup

	refusals refusalCounters
	rlog     [refReasons]ratelog.Limit
}

// region is one registered buffer on the target side.
type region struct {
	handle uint64
	addr   uintptr
	length uint64
	remote bool
	key    [16]byte
	// file is the memfd behind the buffer when it may be handed out whole
	// (the buffer covers the file); nil means process_vm access only.
	file *os.File
	off  int64
	size int64
	// revoked: Unregister began; no new grants.
	revoked bool
	// shared: the file was handed out whole, so peers may map the rest of
	// its last page, past the buffer: nothing may be registered there.
	shared bool
}

var (
	_ transport.Transport           = (*Transport)(nil)
	_ transport.Notifier            = (*Transport)(nil)
	_ transport.ContextUnregisterer = (*Transport)(nil)
)

// Errors particular to this transport.
var (
	// ErrOtherHost: the segment's engine runs on another host (or in
	// another network namespace, whose Unix sockets are out of reach).
	ErrOtherHost = errors.New("shm: segment not on this host")
	// ErrProtocol: the peer broke the control protocol.
	ErrProtocol = errors.New("shm: protocol violation")
)

// nonce returns 128 fresh random bits.
func nonce() [2]uint64 {
	var b [16]byte
	rand.Read(b[:])
	return [2]uint64{binary.LittleEndian.Uint64(b[:]), binary.LittleEndian.Uint64(b[8:])}
}

// bootID reads the kernel's boot id: two processes that read the same one
// run on the same kernel.
func bootID() ([16]byte, error) {
	var id [16]byte
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return id, fmt.Errorf("shm: boot id: %w", err)
	}
	h, err := hex.DecodeString(strings.ReplaceAll(strings.TrimSpace(string(b)), "-", ""))
	if err != nil || len(h) != 16 {
		return id, fmt.Errorf("shm: boot id %q: %w", b, transport.ErrNotSupported)
	}
	copy(id[:], h)
	return id, nil
}

// New starts a transport listening on an abstract Unix socket of a random
// name.
func New(cfg Config) (*Transport, error) {
	if cfg.RevokeTimeout <= 0 {
		cfg.RevokeTimeout = 10 * time.Second
	}
	if cfg.ReplyTimeout <= 0 {
		cfg.ReplyTimeout = 5 * time.Second
	}
	if cfg.MaxPending <= 0 {
		cfg.MaxPending = DefaultMaxPending
	}
	if cfg.MaxPendingPerUID <= 0 {
		cfg.MaxPendingPerUID = DefaultMaxPendingPerUID
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = DefaultMaxConns
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	boot, err := bootID()
	if err != nil {
		return nil, err
	}
	var r [8]byte
	rand.Read(r[:])
	name := fmt.Sprintf("moonring-shm-%d-%x", os.Getpid(), r)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: "@" + name, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("shm: listen: %w", err)
	}
	key := cfg.Key
	endpoint := hex.EncodeToString(boot[:]) + "/" + name
	if len(key) == 0 {
		key = make([]byte, 32)
		rand.Read(key)
		endpoint += "/" + hex.EncodeToString(key)
	}
	t := &Transport{
		cfg:        cfg,
		boot:       boot,
		endpoint:   endpoint,
		key:        key,
		ln:         ln,
		conns:      map[*server]struct{}{},
		byHandle:   map[uint64]*region{},
		pendingUID: map[int]int{},
		eps:        map[*Endpoint]struct{}{},
		revoked:    make(chan struct{}),
	}
	t.self.Store(new(string))
	t.wg.Add(1)
	go t.accept()
	return t, nil
}

// Name returns "shm".
func (t *Transport) Name() string { return Name }

// Endpoint returns the boot id and socket name peers dial, and the
// segment key when it is a random one.
func (t *Transport) Endpoint() string { return t.endpoint }

// SliceSize is 4 MiB: a slice is one memory copy, and fewer slices mean
// less bookkeeping; small enough that retries and deadlines stay fine.
func (t *Transport) SliceSize() uint64 { return 4 << 20 }

// SetNotify implements transport.Notifier.
func (t *Transport) SetNotify(self string, deliver func(*transport.Notification) error) {
	t.self.Store(&self)
	t.deliver.Store(&deliver)
}

// Register gives b a random 128-bit key. A remote-accessible buffer that
// covers all of a memfd from mem.AllocShared (the engine's Alloc) can be
// mapped by peers; any other is reached through process_vm_readv/writev.
// A local-only buffer is never handed out.
func (t *Transport) Register(b *segtable.Buffer) (segtable.Registration, error) {
	r := &region{addr: b.Addr, length: b.Length, remote: b.Remote}
	rand.Read(r.key[:])
	if b.Remote {
		if f, off, err := mem.File(b.Addr, b.Length); err == nil {
			var st unix.Stat_t
			if err := unix.Fstat(int(f.Fd()), &st); err == nil && off == 0 && pageUp(b.Length) == uint64(st.Size) {
				r.file, r.off, r.size = f, off, st.Size
			} else {
				f.Close() // shares its file with other memory: not handed out
			}
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		r.close()
		return segtable.Registration{}, fmt.Errorf("shm: register: %w", transport.ErrClosed)
	}
	if p := t.sharedBefore(r.addr); p != nil {
		r.close()
		return segtable.Registration{}, fmt.Errorf("shm: register %#x: in the last page of the file of buffer %#x, which peers have mapped whole: %w", b.Addr, p.addr, segtable.ErrOverlap)
	}
	t.seq++
	r.handle = t.seq
	t.regs.Insert(uint64(r.addr), r)
	t.byHandle[r.handle] = r
	reg := segtable.Registration{Handle: r.handle}
	if b.Remote {
		reg.Key = hex.EncodeToString(r.key[:])
	}
	return reg, nil
}

func pageUp(n uint64) uint64 {
	p := uint64(os.Getpagesize())
	return (n + p - 1) &^ (p - 1)
}

func (r *region) close() {
	if r.file != nil {
		r.file.Close()
		r.file = nil
	}
}

// Unregister withdraws the buffer: no new grants, and every peer holding
// one is told to stop using it and answers once its copies are done and
// its mapping is gone. A peer that does not answer within RevokeTimeout is
// disconnected (it then drops everything of this transport) and Unregister
// reports it.
func (t *Transport) Unregister(b *segtable.Buffer, reg segtable.Registration) error {
	return t.UnregisterContext(context.Background(), b, reg)
}

// UnregisterContext is Unregister with the wait for the peers bounded by
// ctx as well as by RevokeTimeout: when ctx ends first, every peer that
// has not answered yet is disconnected at once, as after RevokeTimeout,
// and the error wraps segtable.ErrBusy and ctx's error. The buffer is
// withdrawn either way. (A disconnected peer's mapping of a memfd is its
// own, and a process_vm write it had begun may still land: see Trust in
// the package doc.) Safe for concurrent use.
func (t *Transport) UnregisterContext(ctx context.Context, b *segtable.Buffer, reg segtable.Registration) error {
	t.mu.Lock()
	r := t.byHandle[reg.Handle]
	if r == nil {
		t.mu.Unlock()
		return fmt.Errorf("shm: unregister %#x: %w", b.Addr, segtable.ErrNotFound)
	}
	if r.revoked {
		t.mu.Unlock()
		return fmt.Errorf("shm: unregister %#x: already being unregistered: %w", b.Addr, segtable.ErrNotFound)
	}
	r.revoked = true
	if t.closed {
		// Close took the peers, and revokes every buffer at each: once
		// that is done no peer uses this one.
		t.mu.Unlock()
		<-t.revoked
		t.mu.Lock()
		t.forget(r)
		r.close() // under mu: Close's last loop may close it too
		t.mu.Unlock()
		return nil
	}
	var peers []*server
	for s := range t.conns {
		peers = append(peers, s)
	}
	t.mu.Unlock()

	// Every peer at once, as Close does: stuck peers cost one
	// RevokeTimeout together, not one each in turn.
	errs := make([]error, len(peers))
	var wg sync.WaitGroup
	for i, s := range peers {
		wg.Go(func() { errs[i] = s.revoke(ctx, r.handle, t.cfg.RevokeTimeout) })
	}
	wg.Wait()
	t.mu.Lock()
	t.forget(r)
	t.mu.Unlock()
	r.close()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("shm: unregister %#x: %w", b.Addr, err)
	}
	return nil
}

// sharedBefore returns a registration at the nearest start below addr
// whose file peers have mapped whole and whose span holds addr, or nil:
// every registration there, as one may be draining while the same buffer
// is registered again (only the one that was granted whole is shared).
// t.mu must be held.
func (t *Transport) sharedBefore(addr uintptr) *region {
	if addr == 0 {
		return nil
	}
	var found *region
	at, seen := uint64(0), false
	t.regs.Descend(uint64(addr)-1, func(k uint64, p *region) bool {
		if seen && k != at {
			return false
		}
		at, seen = k, true
		if p.shared && addr < p.addr+uintptr(p.size) {
			found = p
			return false
		}
		return true
	})
	return found
}

// forget drops r from the registered buffers. t.mu must be held.
func (t *Transport) forget(r *region) {
	if t.byHandle[r.handle] == r {
		delete(t.byHandle, r.handle)
		t.regs.Delete(uint64(r.addr), func(x *region) bool { return x == r })
	}
}

// grant answers an initiator's request for a buffer: it must be registered
// with exactly that range, remote-accessible, not being withdrawn, and the
// key must match.
//
// whole reports whether r's file holds no other registered buffer (the
// file's last page, past r, may: another registration of the same
// allocation's tail), so that it may be handed out.
func (t *Transport) grant(addr, length uint64, key *[16]byte) (r *region, status uint16, whole bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	// The last registration at addr: a buffer registered again while its
	// old registration drains sits after it.
	r, at, ok := t.regs.FloorValue(addr)
	if !ok || at != addr || r.length != length {
		return nil, statusRange, false
	}
	if !r.remote || r.revoked || t.closed || subtle.ConstantTimeCompare(r.key[:], key[:]) != 1 {
		return nil, statusDenied, false
	}
	whole = true
	if r.size > 0 {
		t.regs.Descend(addr+uint64(r.size)-1, func(k uint64, x *region) bool {
			if k < addr {
				return false
			}
			if x != r {
				whole = false // another buffer starts in the file's span
			}
			return whole
		})
	}
	if whole && r.file != nil {
		r.shared = true // the file may go out now: keep its tail free
	}
	return r, statusOK, whole
}

// accept serves connections until the listener closes.
func (t *Transport) accept() {
	defer t.wg.Done()
	for {
		c, err := t.ln.AcceptUnix()
		if err != nil {
			return // closed
		}
		s := &server{t: t, c: c, acks: map[uint64]chan struct{}{}, uid: peerUID(c)}
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			c.Close()
			return
		}
		drop, reasons, ok := t.admit(s)
		if ok {
			t.conns[s] = struct{}{}
			t.wg.Add(1)
		}
		t.mu.Unlock()
		for i, d := range drop {
			// Counted before the close, which its peer may see at once.
			t.refused(reasons[i], d.uid)
			d.c.Close() // its serve ends and forgets it
		}
		if ok {
			go s.serve()
		}
	}
}

// Open connects to the engine of this host that published desc and asks
// for every buffer desc lists with a key of this transport. It fails with
// ErrUnreachable (wrapping ErrOtherHost) when that engine runs elsewhere.
func (t *Transport) Open(ctx context.Context, desc *segtable.SegmentDesc) (transport.Endpoint, error) {
	t.mu.Lock()
	closed := t.closed
	t.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("shm: open %s: %w", desc.Name, transport.ErrClosed)
	}
	e := &Endpoint{t: t, name: desc.Name, byHandle: map[uint64]*mapping{}}
	e.descs.Store(segtable.NewMirror[span](nil, nil, nil))
	if err := e.connect(ctx, desc); err != nil {
		if c := e.conn.Load(); c != nil {
			c.close()
		}
		return nil, fmt.Errorf("shm: open %s: %w", desc.Name, err)
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		e.Close()
		return nil, fmt.Errorf("shm: open %s: %w", desc.Name, transport.ErrClosed)
	}
	t.eps[e] = struct{}{}
	t.mu.Unlock()
	return e, nil
}

// Close stops serving (peers drop their mappings when their connection
// ends), closes every endpoint, and waits for the goroutines.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		<-t.revoked // as the first Close: no peer uses any buffer
		return nil
	}
	t.closed = true
	conns := t.conns
	eps := t.eps
	t.conns, t.eps = map[*server]struct{}{}, map[*Endpoint]struct{}{}
	// Peers stop using every buffer before the memory may go; with no
	// buffer served there is nothing to wait for (every Unregister
	// revoked its buffer or cut the peers that held it), so a peer that
	// does not answer cannot hold Close.
	served := false
	t.regs.Ascend(func(_ uint64, r *region) bool {
		served = r.remote
		return !served
	})
	t.mu.Unlock()
	t.ln.Close()
	var wg sync.WaitGroup
	for s := range conns {
		wg.Go(func() {
			if served {
				s.revoke(context.Background(), allHandles, t.cfg.RevokeTimeout)
			}
			s.c.Close()
		})
	}
	wg.Wait()
	close(t.revoked)
	for e := range eps {
		e.Close()
	}
	t.wg.Wait()
	t.mu.Lock()
	t.regs.Ascend(func(_ uint64, r *region) bool {
		r.close()
		return true
	})
	t.regs.Reset(nil, nil)
	clear(t.byHandle)
	t.mu.Unlock()
	return nil
}

// server is the target's side of one initiator's connection.
type server struct {
	t   *Transport
	c   *net.UnixConn
	wmu sync.Mutex // one packet at a time

	note transport.Notification // reused by every notification (serve only)

	mu    sync.Mutex
	acks  map[uint64]chan struct{} // revokes waiting for their answer
	gone  bool
	ready bool // the hello is over: before, the peer holds nothing to revoke

	uid int // the connecting process's user id, -1 if unknown
	// pending: among t.pending; peer: counted in t.peers. Under t.mu.
	pending, peer bool
	// proved: the peer proved the key, or was refused for another reason
	// already counted (serve only).
	proved bool
}

func (s *server) send(m *msg, oob []byte) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	return s.sendLocked(m, oob)
}

// sendLocked is send for a caller that holds wmu. A peer that stops
// reading fails it after ReplyTimeout: a write blocked for good would
// hold wmu, and with it every revoke (Unregister, Close) of this peer.
func (s *server) sendLocked(m *msg, oob []byte) error {
	var buf [maxMsg]byte
	s.c.SetWriteDeadline(time.Now().Add(s.t.cfg.ReplyTimeout))
	_, _, err := s.c.WriteMsgUnix(m.encode(buf[:]), oob, nil)
	return err
}

// serve answers the initiator until the connection ends.
func (s *server) serve() {
	defer s.t.wg.Done()
	defer s.finish()
	defer func() {
		if !s.proved {
			s.t.mu.Lock()
			// Evicted: counted then; closed with the transport: no fault.
			counted := !s.pending || s.t.closed
			s.t.mu.Unlock()
			if !counted {
				s.t.refused(refFailed, s.uid)
			}
		}
	}()
	pk, err := newPackets(s.c)
	if err != nil {
		return
	}
	var m msg
	// The handshake within ReplyTimeout: a connection that never proves
	// the key holds a goroutine and a descriptor only that long.
	s.c.SetReadDeadline(time.Now().Add(s.t.cfg.ReplyTimeout))
	// The hello first: a peer on another kernel cannot connect to an
	// abstract socket, but its boot id must match all the same.
	if !s.read(pk, &m) || m.typ != msgHello {
		return
	}
	ci := [2]uint64{m.c, m.d}
	ack := msg{typ: msgHelloAck, seq: m.seq, a: version, key: s.t.boot}
	ct := nonce()
	ack.c, ack.d = ct[0], ct[1]
	switch {
	case m.a != version:
		ack.status = statusBadVersion
	case m.key != s.t.boot:
		ack.status = statusOtherHost
	}
	if s.send(&ack, nil) != nil || ack.status != statusOK {
		return
	}
	if !s.read(pk, &m) || m.typ != msgProof {
		return
	}
	want := proof(s.t.key, "initiator", ci, ct)
	got := m.getProof()
	pa := msg{typ: msgProofAck, seq: m.seq}
	if !hmac.Equal(want[:], got[:]) {
		s.proved = true // counted here
		s.t.refused(refBadKey, s.uid)
		pa.status = statusBadKey
		s.send(&pa, nil)
		return
	}
	s.proved = true
	if ok, full := s.t.login(s); !ok {
		if full {
			s.t.refused(refFull, s.uid)
			pa.status = statusFull
			s.send(&pa, nil)
		}
		return
	}
	pa.putProof(proof(s.t.key, "target", ci, ct))
	if s.send(&pa, nil) != nil {
		return
	}
	s.c.SetReadDeadline(time.Time{})
	// Revokes from now on: one sent earlier could reach the initiator
	// before the answers of its hello, which it would take for a broken
	// target. It held no grant then, and a buffer marked revoked before
	// this is refused to it below.
	s.mu.Lock()
	s.ready = true
	s.mu.Unlock()
	for s.read(pk, &m) {
		switch m.typ {
		case msgGrant:
			if s.grant(&m) != nil {
				return
			}
		case msgRevokeAck:
			s.mu.Lock()
			if ch := s.acks[m.handle]; ch != nil {
				close(ch)
				delete(s.acks, m.handle)
			}
			s.mu.Unlock()
		case msgNotify:
			if s.notify(&m) != nil {
				return
			}
		default:
			return // an answer's type from an initiator: broken peer
		}
	}
}

// read reads one packet, dropping any descriptors a peer sent (none are
// expected), and reports whether it decoded.
func (s *server) read(pk *packets, m *msg) bool {
	p, oob, flags, err := pk.read()
	if err != nil {
		return false
	}
	if len(oob) > 0 {
		closeRights(oob)
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 || len(p) > maxMsg {
		return false
	}
	return decode(p, m) == nil
}

// closeRights closes every descriptor in a control message.
func closeRights(oob []byte) int {
	n := 0
	cms, _ := unix.ParseSocketControlMessage(oob)
	for i := range cms {
		fds, _ := unix.ParseUnixRights(&cms[i])
		for _, fd := range fds {
			unix.Close(fd)
			n++
		}
	}
	return n
}

func (s *server) grant(m *msg) error {
	// The check and the answer under wmu: Unregister marks the buffer
	// revoked before its revoke is sent, under wmu too, so on the socket
	// a revoke either follows this grant (the peer drops what it just
	// took) or finds the grant refused; it never overtakes it.
	s.wmu.Lock()
	defer s.wmu.Unlock()
	r, st, whole := s.t.grant(m.a, m.b, &m.key)
	ack := msg{typ: msgGrantAck, seq: m.seq, status: st, a: m.a, b: m.b}
	if st != statusOK {
		return s.sendLocked(&ack, nil)
	}
	ack.handle = r.handle
	if r.file == nil || !whole || m.flags&flagVM != 0 {
		ack.flags = flagVM
		return s.sendLocked(&ack, nil)
	}
	ack.c, ack.d = uint64(r.off), uint64(r.size)
	// r.file stays open while this runs: Unregister closes it only after
	// every connection answered the revoke, which this goroutine serves.
	return s.sendLocked(&ack, unix.UnixRights(int(r.file.Fd())))
}

func (s *server) notify(m *msg) error {
	ack := msg{typ: msgNotifyAck, seq: m.seq}
	d := s.t.deliver.Load()
	if d == nil {
		ack.status = statusDenied
	} else {
		n := &s.note
		if string(m.tail[:m.b]) != n.From { // the same name every time: converted once
			n.From = string(m.tail[:m.b])
		}
		n.Tag, n.Msg = m.a, nil
		if m.c > 0 {
			n.Msg = m.tail[m.b:]
		}
		if err := (*d)(n); err != nil {
			ack.status = statusFull
		}
		n.Msg = nil // valid only during the call
	}
	return s.send(&ack, nil)
}

// allHandles in a revoke withdraws every buffer (the target closes).
const allHandles = 0

// revoke tells the initiator to stop using a buffer and waits for its
// answer, until timeout or the end of ctx: then it disconnects the peer.
// A peer that never took the buffer answers at once.
func (s *server) revoke(ctx context.Context, handle uint64, timeout time.Duration) error {
	ch := make(chan struct{})
	s.mu.Lock()
	if s.gone || !s.ready {
		s.mu.Unlock()
		return nil // its mappings went with the connection, or it has none yet
	}
	s.acks[handle] = ch
	s.mu.Unlock()
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	// The send too ends with wctx: waiting for the write lock behind a
	// write to a peer that does not read, or in that write, takes a
	// ReplyTimeout each, and closing the connection ends both.
	// cut says the peer was disconnected for want of an answer: ch is
	// closed then too (by finish), and that is no answer.
	var cut atomic.Bool
	stop := context.AfterFunc(wctx, func() {
		select {
		case <-ch: // answered
		default:
			cut.Store(true)
			s.c.Close()
		}
	})
	defer stop()
	if err := s.send(&msg{typ: msgRevoke, handle: handle}, nil); err != nil {
		s.c.Close()
	}
	select {
	case <-ch:
		if !cut.Load() {
			return nil
		}
	case <-wctx.Done():
		select {
		case <-ch:
			if !cut.Load() {
				return nil // answered as the time ran out
			}
		default:
			cut.Store(true)
			s.c.Close()
			<-ch // finish closes it once serve returns
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("shm: peer had not released the buffer when the caller gave up; disconnected: %w: %w", segtable.ErrBusy, err)
	}
	return fmt.Errorf("shm: peer did not release buffer within %v; disconnected", timeout)
}

// finish forgets the connection and releases revokes waiting on it.
func (s *server) finish() {
	s.c.Close()
	s.mu.Lock()
	s.gone = true
	for h, ch := range s.acks {
		close(ch)
		delete(s.acks, h)
	}
	s.mu.Unlock()
	s.t.mu.Lock()
	delete(s.t.conns, s)
	s.t.unpend(s)
	if s.peer {
		s.peer = false
		s.t.peers--
	}
	s.t.mu.Unlock()
}
