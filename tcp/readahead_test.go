package tcp

// Tests of the read-ahead of a response header with the payload before it
// (conn.readPlanned, reader.payload), against a target scripted by hand:
// the answers come split at chosen bytes, with statuses and ids the test
// picks, a hostile target's included.

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/moonring/moonring/transport"
)

// scriptTarget accepts connections, speaks the target's side of the hello
// with the segment key k, and hands each connection to the test, which
// reads the request frames and writes the answers it wants.
type scriptTarget struct {
	ln    net.Listener
	k     []byte
	conns chan net.Conn
}

func newScriptTarget(t *testing.T, k []byte) *scriptTarget {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	st := &scriptTarget{ln: ln, k: k, conns: make(chan net.Conn, 8)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if err := st.hello(c); err != nil {
				c.Close()
				continue
			}
			select {
			case st.conns <- c:
			default:
				c.Close()
			}
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		for {
			select {
			case c := <-st.conns:
				c.Close()
			default:
				return
			}
		}
	})
	return st
}

func (st *scriptTarget) addr() string { return st.ln.Addr().String() }

// hello is the target's side of PROTOCOL.md's hello.
func (st *scriptTarget) hello(c net.Conn) error {
	c.SetDeadline(time.Now().Add(hang))
	defer c.SetDeadline(time.Time{})
	var h [specHelloLen]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return err
	}
	cnonce := h[8:24]
	snonce := make([]byte, 16)
	rand.Read(snonce)
	var ch [specChallengeLen]byte
	copy(ch[:], "MRNG")
	binary.BigEndian.PutUint16(ch[4:], 1)
	copy(ch[8:24], snonce)
	binary.BigEndian.PutUint32(ch[24:], 64<<20)
	if _, err := c.Write(ch[:]); err != nil {
		return err
	}
	var proof [specProofLen]byte
	if _, err := io.ReadFull(c, proof[:]); err != nil {
		return err
	}
	if !hmac.Equal(proof[:], specMAC(st.k, "initiator", cnonce, snonce)) {
		return errors.New("bad proof")
	}
	var acc [specAcceptLen]byte
	copy(acc[4:], specMAC(st.k, "target", cnonce, snonce))
	_, err := c.Write(acc[:])
	return err
}

// scripted is a one-rail endpoint to a scriptTarget, with a local buffer.
type scripted struct {
	ep     transport.Endpoint
	c      net.Conn // the target's end of the rail
	local  []byte
	remote testBuf
	st     *scriptTarget
}

func newScripted(t *testing.T, cfg Config) *scripted {
	t.Helper()
	// A real target only for a buffer's key and the segment key: the
	// descriptor points at the scripted one.
	targ := newSide(t, Config{})
	s := &scripted{remote: targ.register(t, targ.alloc(t, 1<<20, 0), true)}
	s.st = newScriptTarget(t, targ.k)
	cfg.Rails = 1
	if cfg.idleWatch == 0 {
		// The reading stays with whoever holds it: planStats reads the
		// reader's counters, which an idle watch firing on a slow machine
		// (-race) would hand to the receiver goroutine meanwhile.
		cfg.idleWatch = time.Hour
	}
	init := newSide(t, cfg)
	s.local = init.alloc(t, 1<<20, canaryByte)
	ep, err := init.tr.Open(context.Background(), targ.desc(s.st.addr(), s.remote))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ep.Close() })
	s.ep = ep
	s.c = s.accept(t)
	return s
}

// accept returns the target's end of the next connection dialed.
func (s *scripted) accept(t *testing.T) net.Conn {
	t.Helper()
	select {
	case c := <-s.st.conns:
		c.SetDeadline(time.Now().Add(hang))
		return c
	case <-time.After(hang):
		t.Fatal("hang: no connection")
		return nil
	}
}

// frames reads n request frames and returns their ids and lengths.
func (s *scripted) frames(t *testing.T, n int) (ids []uint32, lens []uint32) {
	t.Helper()
	var b [specReqLen]byte
	for range n {
		if _, err := io.ReadFull(s.c, b[:]); err != nil {
			t.Fatalf("frame: %v", err)
		}
		if b[0] != specRead {
			t.Fatalf("frame op %d, want READ", b[0])
		}
		ids = append(ids, binary.BigEndian.Uint32(b[4:]))
		lens = append(lens, binary.BigEndian.Uint32(b[12:]))
	}
	return ids, lens
}

// resp appends a response header to b.
func resp(b []byte, id uint32, status byte) []byte {
	b = binary.BigEndian.AppendUint32(b, id)
	return append(b, status, 0, 0, 0)
}

// pattern returns n bytes that tell case c's READ i and offset apart.
func pattern(c, i, n int) []byte {
	p := make([]byte, n)
	for j := range p {
		p[j] = byte(c*131 + i*31 + j*7 + j>>8)
	}
	return p
}

// readCase is READs posted at once, each at its own place in the local
// buffer with a gap after it that no READ may touch.
type readCase struct {
	sizes []int
	offs  []int
	comp  chanCompleter
}

func (s *scripted) post(t *testing.T, sizes ...int) *readCase {
	t.Helper()
	rc := &readCase{sizes: sizes, comp: make(chanCompleter, len(sizes))}
	var sl []transport.Slice
	off := 0
	for i, n := range sizes {
		rc.offs = append(rc.offs, off)
		sl = append(sl, localSlice(transport.Read, s.local[off:off+n], s.remote.addr, uint64(i)))
		off += n + 13
	}
	if k, err := s.ep.Post(rc.comp, sl); k != len(sl) || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	return rc
}

// dst is READ i's destination.
func (rc *readCase) dst(local []byte, i int) []byte {
	return local[rc.offs[i] : rc.offs[i]+rc.sizes[i]]
}

// reset puts the canary back over every byte the case's READs or gaps
// cover.
func (rc *readCase) reset(local []byte) {
	last := len(rc.sizes) - 1
	end := rc.offs[last] + rc.sizes[last] + 13
	for i := range local[:end] {
		local[i] = canaryByte
	}
}

// A stream of large READs answered with every split of the bytes around
// a response's end: the last bytes of a payload, the next header and the
// first bytes of the next payload each arrive apart from what follows, so
// that the read of a payload takes none, part or all of the next header
// with it. Every READ completes once, with its bytes where it asked and
// nowhere else, whether the next answer is large (read ahead again),
// small (through the receive buffer) or of a failed status.
func TestReadAheadSplits(t *testing.T) {
	s := newScripted(t, Config{})
	const big = 32 << 10
	hits0 := s.aheads()
	for ci, c := range []struct {
		sizes  []int
		status []byte
	}{
		{[]int{big, big, big}, []byte{stOK, stOK, stOK}},
		{[]int{big, big, 4096}, []byte{stOK, stOK, stOK}},
		{[]int{big, 100, big}, []byte{stOK, stOK, stOK}},
		{[]int{big, big, big}, []byte{stOK, stDenied, stOK}},
		{[]int{directMin, directMin, directMin}, []byte{stOK, stRange, stOK}},
	} {
		// The stream, and where each response ends in it.
		var stream []byte
		var ends []int
		pays := make([][]byte, len(c.sizes))
		// Splits: none, then every byte from three before the first
		// response's end to three into the second one's payload, and
		// the same around the second's end.
		splits := []int{0}
		for pass := 0; ; pass++ {
			var split int
			if pass > 0 {
				if pass-1 >= len(splits) {
					break
				}
				split = splits[pass-1]
			}
			rc := s.post(t, c.sizes...)
			ids, lens := s.frames(t, len(c.sizes))
			if stream == nil {
				for i, n := range lens {
					if int(n) != c.sizes[i] {
						t.Fatalf("frame %d: length %d, want %d", i, n, c.sizes[i])
					}
					stream = resp(stream, ids[i], c.status[i])
					if c.status[i] == stOK {
						pays[i] = pattern(ci, i, int(n))
						stream = append(stream, pays[i]...)
					}
					ends = append(ends, len(stream))
				}
				splits = splits[:0]
				for _, e := range ends[:2] {
					for k := e - 3; k <= e+specRespLen+3 && k < len(stream); k++ {
						splits = append(splits, k)
					}
				}
			} else {
				// Later passes: the same frames but for their ids.
				b := stream
				for i := range ids {
					at := 0
					if i > 0 {
						at = ends[i-1]
					}
					binary.BigEndian.PutUint32(b[at:], ids[i])
				}
			}
			first := 0
			if split > 0 {
				if _, err := s.c.Write(stream[:split]); err != nil {
					t.Fatal(err)
				}
				// The first READ is done once its payload is read: the
				// split is then where the initiator's reading stands.
				if split >= ends[0] {
					s.expect(t, rc, 0, c.status[0], pays[0])
					first = 1
				} else {
					time.Sleep(time.Millisecond)
				}
			}
			if _, err := s.c.Write(stream[split:]); err != nil {
				t.Fatal(err)
			}
			for i := first; i < len(c.sizes); i++ {
				s.expect(t, rc, i, c.status[i], pays[i])
			}
			s.gaps(t, rc, fmt.Sprintf("case %d split %d", ci, split))
			rc.reset(s.local)
		}
	}
	if s.aheads() == hits0 {
		t.Error("no payload read took bytes of the next response with it")
	}
}

// aheads counts the reads of the rail's payloads that took bytes of the
// next response with them. The rail's reading is idle between the tests'
// cases (every READ completed).
func (s *scripted) aheads() uint64 {
	c := s.ep.(*Endpoint).rails[0].Load()
	if c == nil {
		return 0
	}
	return c.src.(*nbReader).aheads
}

// expect waits for the next completion, which must be READ i's, with the
// error its status gives and its bytes.
func (s *scripted) expect(t *testing.T, rc *readCase, i int, status byte, pay []byte) {
	t.Helper()
	select {
	case x := <-rc.comp:
		if x.token != uint64(i) {
			t.Fatalf("completion of READ %d, want %d", x.token, i)
		}
		want := map[byte]error{stOK: nil, stDenied: transport.ErrDenied, stRange: transport.ErrRange, stBusy: transport.ErrNotifyFull}[status]
		if !errors.Is(x.err, want) || (want == nil && x.err != nil) {
			t.Fatalf("READ %d: %v, want %v", i, x.err, want)
		}
	case <-time.After(hang):
		t.Fatalf("hang: READ %d", i)
	}
	// A READ that failed may hold bytes of the answers after it, which a
	// read plan (readplan.go) put there: only a READ done holds a
	// payload, exactly its own.
	if status != stOK {
		return
	}
	if dst := rc.dst(s.local, i); !bytes.Equal(dst, pay) {
		t.Fatalf("READ %d (status %d): bytes wrong", i, status)
	}
}

// gaps checks that no byte between the case's READs changed.
func (s *scripted) gaps(t *testing.T, rc *readCase, what string) {
	t.Helper()
	for i := range rc.sizes {
		end := rc.offs[i] + rc.sizes[i]
		for j, b := range s.local[end : end+13] {
			if b != canaryByte {
				t.Fatalf("%s: byte %d after READ %d changed", what, j, i)
			}
		}
	}
}

// A hostile or broken target's next answer, read ahead with a payload, is
// refused as it would be from the socket: an id that is not the next
// one's, or reserved bytes set, breaks the connection with ErrProtocol;
// the READs behind it fail, and no byte outside their destinations
// changed.
func TestReadAheadUnexpected(t *testing.T) {
	const big = 32 << 10
	for _, bad := range []struct {
		name string
		hdr  func(next uint32) []byte
	}{
		{"id skips one", func(next uint32) []byte { return resp(nil, next+1, stOK) }},
		{"id of the READ answered", func(next uint32) []byte { return resp(nil, next-1, stOK) }},
		{"reserved byte", func(next uint32) []byte { return append(resp(nil, next, stOK)[:7], 1) }},
		{"unknown status", func(next uint32) []byte { return resp(nil, next, 9) }},
	} {
		for _, split := range []int{0, 3, specRespLen} { // after the payload: none, part, all of the bad header
			t.Run(fmt.Sprintf("%s/split%d", bad.name, split), func(t *testing.T) {
				s := newScripted(t, Config{})
				rc := s.post(t, big, big, big)
				ids, _ := s.frames(t, 3)
				pay := pattern(1, 0, big)
				stream := append(resp(nil, ids[0], stOK), pay...)
				end := len(stream)
				stream = append(stream, bad.hdr(ids[1])...)
				stream = append(stream, pattern(1, 1, big)...) // what a payload would be
				if split == 0 {
					s.c.Write(stream)
				} else {
					s.c.Write(stream[:end+split])
					s.expect(t, rc, 0, stOK, pay)
					s.c.Write(stream[end+split:])
				}
				got := rc.comp.await(t, 3-min(split, 1))
				if split == 0 {
					if err := got[0]; err != nil {
						t.Fatalf("READ 0: %v", err)
					}
				}
				for i := 1; i < 3; i++ {
					// Their destinations may hold what a read plan
					// put there (readplan.go); nothing around them.
					if err := got[uint64(i)]; !errors.Is(err, ErrProtocol) {
						t.Errorf("READ %d: %v, want ErrProtocol", i, err)
					}
				}
				s.gaps(t, rc, bad.name)
			})
		}
	}
}

// A driver that leaves once its condition holds, with the next answer's
// header read ahead with its last payload: the receiver takes the
// reading over and reads that answer from the bytes held, and the next
// driver's wait on the connection sees an answer begun (no spin).
func TestReadAheadDriverLeaves(t *testing.T) {
	tp := newTimeoutPair(t, 0, 0, false)
	const big, n = 32 << 10, 8
	pat := pattern(3, 0, n*big)
	w := localSlice(transport.Write, pat, tp.remote.addr, 1)
	comp := make(chanCompleter, 1)
	if k, err := tp.ep.Post(comp, []transport.Slice{w}); k != 1 || err != nil {
		t.Fatalf("Post: %d, %v", k, err)
	}
	comp.await(t, 1)
	ep := tp.ep.(*Endpoint)
	c := rail0(t, tp.ep)
	nb := c.src.(*nbReader)
	u := &countUntil{ch: make(chanCompleter, n)}
	copy(tp.local, pat[:64]) // idleOwed WRITEs these 64 bytes over the pattern's first
	idleOwed(t, tp, u)
	before := nb.aheads
	for round := range 20 {
		clear(tp.local[:n*big])
		u.got.Store(0)
		u.want.Store(1) // the driver leaves after the first answer
		var sl []transport.Slice
		for i := range n {
			sl = append(sl, driven(localSlice(transport.Read, tp.local[i*big:(i+1)*big], tp.remote.addr+uint64(i*big), uint64(i))))
		}
		if k, err := ep.Post(u, sl); k != n || err != nil {
			t.Fatalf("Post: %d, %v", k, err)
		}
		ep.Drive(u, 0)
		for tok, err := range u.ch.await(t, n) {
			if err != nil {
				t.Fatalf("round %d, READ %d: %v", round, tok, err)
			}
		}
		if !bytes.Equal(tp.local[:n*big], pat) {
			t.Fatalf("round %d: bytes wrong", round)
		}
		waitFor(t, "the rail idle", func() bool { return c.rd.Load() == rdIdle })
	}
	if nb.aheads == before {
		t.Error("no payload read took the next header with it")
	}
}

// TestReadAheadAllocs: 32 KiB READs (read straight into their
// destinations, each with the next header) allocate nothing, one at a
// time or 64 at once.
func TestReadAheadAllocs(t *testing.T) {
	const big = 32 << 10
	for _, batch := range []int{1, 64} {
		targ := newSide(t, Config{})
		remote := targ.register(t, targ.alloc(t, (batch+1)*big, 0), true)
		init := newSide(t, Config{Rails: 1})
		ep, err := init.tr.Open(t.Context(), targ.desc("", remote))
		if err != nil {
			t.Fatal(err)
		}
		local := init.alloc(t, batch*big, 7)
		sp := &steadyPost{ep: ep, comp: make(chanCompleter, batch), timer: time.NewTimer(hang)}
		for i := range batch {
			sp.s = append(sp.s, localSlice(transport.Read, local[i*big:(i+1)*big], remote.addr+uint64(i+1)*big, uint64(i+1)))
		}
		for range max(50, 200/batch) {
			sp.one()
		}
		allocs := testing.AllocsPerRun(max(100, 500/batch), sp.one)
		if sp.fails != 0 {
			t.Fatalf("%d at a time: %d slices failed or hung", batch, sp.fails)
		}
		if allocs != 0 && countAllocs(t) {
			t.Errorf("%v allocations per batch of %d READs of 32 KiB, want 0", allocs, batch)
		}
		ep.Close()
	}
}
