package tcp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
	"testing"

	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/transport"
)

// The fuzz target's buffer as peers name it. The target compares a
// request's address and key with its registration and reaches memory only
// through the registration's base, so FuzzServerFrames gives the
// registration a fixed wire address and key: a corpus entry then means the
// same in every process, where mmap addresses and random keys differ.
const (
	fuzzAddr = 0x1000_0000
	fuzzKey  = 0x6d6f_6f6e_7269_6e67
	fuzzMax  = 16 << 10 // maxlen: above the buffer, so both checks show
	fuzzName = "fuzz-initiator"
)

type fuzzTarget struct {
	s       *side
	remote  testBuf // remote-accessible, 2 pages between guard pages
	local   testBuf // local-only, 1 page between guard pages, canary-filled
	initial []byte

	mu    sync.Mutex
	notes []transport.Notification // delivered, copied
}

func newFuzzTarget(f *testing.F) *fuzzTarget {
	s := newSide(f, Config{MaxLength: fuzzMax, SliceSize: 4096})
	ft := &fuzzTarget{s: s}
	s.tr.SetNotify("fuzz-target", ft.deliver)
	ft.remote = s.register(f, s.alloc(f, 2*page, 0), true)
	ft.local = s.register(f, s.alloc(f, page, canaryByte), false)
	ft.initial = make([]byte, len(ft.remote.mem))
	testpattern.Fill(ft.initial, 5)
	// No connection exists yet; every connection's first read orders this
	// write before the server's reads of the region.
	rs := s.tr.regs.Values()
	if len(rs) != 1 {
		f.Fatalf("%d regions registered, want the remote-accessible buffer alone", len(rs))
	}
	rs[0].addr, rs[0].key = fuzzAddr, fuzzKey
	ft.remote.addr, ft.remote.key = fuzzAddr, fuzzKey
	return ft
}

// deliver takes notifications like an engine: it copies them, and refuses
// (the queue is full) those with an odd tag.
func (ft *fuzzTarget) deliver(n *transport.Notification) error {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	ft.notes = append(ft.notes, transport.Notification{From: n.From, Tag: n.Tag, Msg: bytes.Clone(n.Msg)})
	if n.Tag&1 != 0 {
		return transport.ErrNotifyFull
	}
	return nil
}

// fuzzItem is a response the model expects.
type fuzzItem struct {
	id     uint32
	status []uint8 // the statuses PROTOCOL.md allows
	// payload is a READ's bytes at its turn; loose marks bytes that a
	// later WRITE of the stream overwrites, which PROTOCOL.md leaves
	// unordered against the READ (it orders responses, not execution).
	payload []byte
	off     int
	loose   []bool
}

// fuzzWant is what the model predicts for a frame stream.
type fuzzWant struct {
	items []fuzzItem
	// clean: the stream ends at a frame boundary or inside a header, so
	// every response arrives before the connection closes. Otherwise (a
	// framing error, a truncated payload) a prefix of them does.
	clean bool
	mem   []byte
	notes []transport.Notification
}

// model runs the stream against PROTOCOL.md: the slow reference the server
// is compared with.
func (ft *fuzzTarget) model(stream []byte) fuzzWant {
	w := fuzzWant{mem: bytes.Clone(ft.initial)}
	size := uint64(len(w.mem))
	for {
		if len(stream) < specReqLen {
			w.clean = true
			return w
		}
		h := stream[:specReqLen]
		stream = stream[specReqLen:]
		op, id := h[0], binary.BigEndian.Uint32(h[4:])
		buffer, length := binary.BigEndian.Uint32(h[8:]), binary.BigEndian.Uint32(h[12:])
		key, addr := binary.BigEndian.Uint64(h[16:]), binary.BigEndian.Uint64(h[24:])
		if h[1]|h[2]|h[3] != 0 || length == 0 || length > fuzzMax {
			return w
		}
		switch op {
		case specRead, specWrite:
		case specGroup:
			var ok bool
			if stream, ok = ft.modelGroup(&w, h, stream); !ok {
				return w
			}
			continue
		case 3: // NOTIFY
			if buffer != 0 || key != 0 || addr != 0 || length < 10 || length > 10+255+4096 {
				return w
			}
			if uint32(len(stream)) < length {
				return w
			}
			p := stream[:length]
			stream = stream[length:]
			nl := int(binary.BigEndian.Uint16(p[8:]))
			if nl > 255 || 10+nl > len(p) || len(p)-10-nl > transport.MaxNotifyMessage {
				return w
			}
			n := transport.Notification{From: string(p[10 : 10+nl]), Tag: binary.BigEndian.Uint64(p), Msg: bytes.Clone(p[10+nl:])}
			w.notes = append(w.notes, n)
			st := uint8(0)
			if n.Tag&1 != 0 {
				st = 3
			}
			w.items = append(w.items, fuzzItem{id: id, status: []uint8{st}})
			continue
		default:
			return w
		}
		it, ok, off := ft.modelCheck(id, buffer, length, key, addr, size)
		if op == specRead {
			if ok {
				it.payload = bytes.Clone(w.mem[off : off+int(length)])
				it.off = off
			}
			w.items = append(w.items, it)
			continue
		}
		var cut bool
		if stream, cut = w.modelWrite(stream, ok, off, int(length)); cut {
			return w // the payload ends early: its bytes landed, no response
		}
		w.items = append(w.items, it)
	}
}

// modelCheck is PROTOCOL.md's checks of a READ or WRITE: the buffer and
// its key, then the address, then the range. It returns the response
// expected, whether the request moves bytes, and its offset in the buffer.
func (ft *fuzzTarget) modelCheck(id, buffer, length uint32, key, addr, size uint64) (fuzzItem, bool, int) {
	it := fuzzItem{id: id}
	if buffer != ft.remote.id || key != fuzzKey || addr < fuzzAddr || addr-fuzzAddr >= size {
		it.status = append(it.status, 1)
	} else if uint64(length) > size-(addr-fuzzAddr) {
		it.status = append(it.status, 2)
	}
	ok := len(it.status) == 0
	if ok {
		it.status = []uint8{0}
	}
	return it, ok, int(addr - fuzzAddr)
}

// modelWrite lands a WRITE's payload of length bytes from the stream
// (when ok, at off) and returns the rest of the stream; cut reports a
// payload the stream ends inside (its bytes up to there landed).
func (w *fuzzWant) modelWrite(stream []byte, ok bool, off, length int) (rest []byte, cut bool) {
	n := min(length, len(stream))
	if ok {
		copy(w.mem[off:], stream[:n])
		for i := range w.items {
			w.items[i].overwritten(off, n)
		}
	}
	return stream[n:], n < length
}

// modelGroup runs a group frame (PROTOCOL.md, Groups) whose header is h:
// the count of WRITE headers that follow, then their payloads in order.
// It returns the stream after the group, and false where the connection
// ends (a framing error, or a stream cut short).
func (ft *fuzzTarget) modelGroup(w *fuzzWant, h, stream []byte) ([]byte, bool) {
	size := uint64(len(w.mem))
	k := binary.BigEndian.Uint32(h[12:])
	if allEqual(h[1:12], 0) >= 0 || allEqual(h[16:32], 0) >= 0 || k < 2 || k > 64 {
		return nil, false
	}
	if len(stream) < int(k)*specReqLen {
		return nil, false
	}
	hs := stream[:k*specReqLen]
	stream = stream[k*specReqLen:]
	// Every header is read and checked before any payload.
	total := 0
	for i := range k {
		m := hs[i*specReqLen:]
		if m[0] != specWrite || m[1]|m[2]|m[3] != 0 {
			return nil, false
		}
		l := binary.BigEndian.Uint32(m[12:])
		if l == 0 || l > fuzzMax {
			return nil, false
		}
		total += int(l)
	}
	if total > 1<<20 { // at most 1 MiB of payloads a group
		return nil, false
	}
	for i := range k {
		m := hs[i*specReqLen:]
		length := binary.BigEndian.Uint32(m[12:])
		it, ok, off := ft.modelCheck(binary.BigEndian.Uint32(m[4:]), binary.BigEndian.Uint32(m[8:]), length, binary.BigEndian.Uint64(m[16:]), binary.BigEndian.Uint64(m[24:]), size)
		var cut bool
		if stream, cut = w.modelWrite(stream, ok, off, int(length)); cut {
			return nil, false
		}
		w.items = append(w.items, it)
	}
	return stream, true
}

// overwritten marks the bytes of a READ that a later WRITE of [off, off+n)
// changes.
func (it *fuzzItem) overwritten(off, n int) {
	lo, hi := max(off, it.off), min(off+n, it.off+len(it.payload))
	if it.payload == nil || lo >= hi {
		return
	}
	if it.loose == nil {
		it.loose = make([]bool, len(it.payload))
	}
	for i := lo; i < hi; i++ {
		it.loose[i-it.off] = true
	}
}

// run feeds one stream to the target on a fresh connection after a valid
// hello and compares everything it can see with the model.
func (ft *fuzzTarget) run(t *testing.T, stream []byte) {
	copy(ft.remote.mem, ft.initial)
	ft.mu.Lock()
	ft.notes = ft.notes[:0]
	ft.mu.Unlock()
	want := ft.model(stream)

	rc := ft.s.raw(t)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		rc.c.Write(stream) // fails once the target closes early: fine
		rc.c.(*net.TCPConn).CloseWrite()
	}()
	got, err := io.ReadAll(rc.c)
	wg.Wait()
	if err != nil && (want.clean || !errors.Is(err, syscall.ECONNRESET)) {
		t.Fatalf("reading responses: %v (clean stream %v)", err, want.clean)
	}
	// The target closed: its goroutine for this connection must end.
	ft.s.waitServed(t)

	r := got
	for i, it := range want.items {
		if len(r) < specRespLen {
			if want.clean {
				t.Fatalf("response %d of %d missing (%d bytes left)", i, len(want.items), len(r))
			}
			if len(r) > 0 && !bytes.HasPrefix(binary.BigEndian.AppendUint32(nil, it.id), r[:min(4, len(r))]) {
				t.Fatalf("response %d: partial id % x, want %#x", i, r, it.id)
			}
			r = nil
			break
		}
		id, st := binary.BigEndian.Uint32(r), r[4]
		if id != it.id || !bytes.Contains(it.status, []byte{st}) || r[5]|r[6]|r[7] != 0 {
			t.Fatalf("response %d: % x; want id %#x, status in %v, zeros", i, r[:specRespLen], it.id, it.status)
		}
		r = r[specRespLen:]
		if st != 0 || it.payload == nil {
			continue
		}
		n := min(len(r), len(it.payload))
		if n < len(it.payload) && want.clean {
			t.Fatalf("response %d: READ payload cut at %d of %d bytes", i, n, len(it.payload))
		}
		for j := range n {
			if r[j] != it.payload[j] && (it.loose == nil || !it.loose[j]) {
				t.Fatalf("response %d: READ payload byte %d is %#x, want %#x", i, j, r[j], it.payload[j])
			}
		}
		r = r[n:]
	}
	if len(r) != 0 {
		t.Fatalf("%d bytes after the last response the model expects", len(r))
	}
	if i := testpattern.FirstDiff(ft.remote.mem, want.mem); i >= 0 {
		t.Fatalf("remote buffer byte %d is %#x, model says %#x", i, ft.remote.mem[i], want.mem[i])
	}
	if i := allEqual(ft.local.mem, canaryByte); i >= 0 {
		t.Fatalf("local-only buffer changed at byte %d", i)
	}
	ft.mu.Lock()
	defer ft.mu.Unlock()
	if len(ft.notes) != len(want.notes) {
		t.Fatalf("%d notifications delivered, model says %d", len(ft.notes), len(want.notes))
	}
	for i, n := range ft.notes {
		m := want.notes[i]
		if n.From != m.From || n.Tag != m.Tag || !bytes.Equal(n.Msg, m.Msg) {
			t.Fatalf("notification %d: %q %#x %d bytes, model says %q %#x %d bytes", i, n.From, n.Tag, len(n.Msg), m.From, m.Tag, len(m.Msg))
		}
	}
}

// notifyFrame is a NOTIFY request with its payload per PROTOCOL.md.
func notifyFrame(id uint32, tag uint64, name string, msg []byte) []byte {
	p := binary.BigEndian.AppendUint64(nil, tag)
	p = binary.BigEndian.AppendUint16(p, uint16(len(name)))
	p = append(append(p, name...), msg...)
	return specReq{op: 3, id: id, length: uint32(len(p))}.frame(p)
}

// FuzzServerFrames feeds arbitrary frame streams to a target after a valid
// hello. The target must never panic or fault (its buffers sit between
// PROTOCOL.md guard pages), must answer exactly as the model of PROTOCOL.md
// says, must change no byte outside the remote-accessible buffer nor any
// inside it but what valid WRITEs write, and must end the connection and
// its goroutine on garbage and at the end of the stream (goleak checks for
// leaks when the tests end).
//
//	go test -run '^$' -fuzz FuzzServerFrames ./tcp/
func FuzzServerFrames(f *testing.F) {
	ft := newFuzzTarget(f)
	rid := ft.remote.id
	read := func(id uint32, off, n int) []byte {
		return specReq{op: specRead, id: id, buffer: rid, length: uint32(n), key: fuzzKey, addr: fuzzAddr + uint64(off)}.frame(nil)
	}
	write := func(id uint32, off int, payload []byte) []byte {
		return specReq{op: specWrite, id: id, buffer: rid, length: uint32(len(payload)), key: fuzzKey, addr: fuzzAddr + uint64(off)}.frame(payload)
	}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	data := bytes.Repeat([]byte("moonring"), 64)

	f.Add([]byte{})
	f.Add(write(1, 100, data[:16]))
	f.Add(read(2, 0, 2*page))
	f.Add(cat(write(1, 200, data[:300]), read(2, 100, 500)))
	f.Add(cat(read(1, 0, 64), write(2, 0, data[:64]), read(3, 0, 64)))
	f.Add(read(1, 0, 64)[:20])                                       // truncated header
	f.Add(write(1, 0, data[:64])[:40])                               // truncated payload
	f.Add(cat(read(1, 0, 8), write(2, 0, data)[:100]))               // a response, then a truncated payload
	f.Add(cat(read(1, 0, 8), read(2, 0, fuzzMax+1)))                 // above maxlen
	f.Add(read(1, 0, 1<<31)[:specReqLen])                            // a huge length
	f.Add(cat(read(1, 0, 8), read(2, 2*page-8, 16)))                 // past the end
	f.Add(cat(write(1, -8, data[:16]), read(2, 0, 8)))               // before the start
	f.Add(cat(read(1, 0, 8), []byte{9, 0, 0, 0}, read(2, 0, 8)[4:])) // a bad op
	f.Add(cat(read(1, 0, 8), []byte{1, 1, 0, 0}, read(2, 0, 8)[4:])) // flags set
	f.Add(cat(read(1, 0, 8), []byte{1, 0, 0, 1}, read(2, 0, 8)[4:])) // reserved set
	bad := specReq{op: specWrite, id: 1, buffer: rid, length: 64, key: fuzzKey ^ 1, addr: fuzzAddr}.frame(read(7, 0, 8))
	f.Add(cat(bad[:specReqLen+specReqLen], bytes.Repeat([]byte{0}, 32), read(2, 0, 8))) // wrong key: payload dropped
	other := specReq{op: specWrite, id: 1, buffer: rid + 1, length: 8, key: fuzzKey, addr: fuzzAddr}.frame(data[:8])
	f.Add(cat(other, read(2, 0, 8)))
	local := specReq{op: specWrite, id: 1, buffer: ft.local.id, length: 8, key: fuzzKey, addr: ft.local.addr}.frame(data[:8])
	f.Add(cat(local, read(2, 0, 8)))
	var fill [][]byte // eight READs of 8184 bytes fill a 64 KiB response buffer to the byte
	for i := range 8 {
		fill = append(fill, read(uint32(i), 0, 8184))
	}
	f.Add(cat(append(fill, read(8, 0, 8), notifyFrame(9, 2, fuzzName, data[:10]))...))
	f.Add(cat(notifyFrame(1, 4, fuzzName, data[:100]), notifyFrame(2, 5, "", nil), read(3, 0, 8)))
	f.Add(notifyFrame(1, 6, fuzzName, bytes.Repeat(data, 8)[:transport.MaxNotifyMessage]))
	f.Add(notifyFrame(1, 6, "", bytes.Repeat(data, 9)[:transport.MaxNotifyMessage+1]))
	long := notifyFrame(1, 6, "n", data[:20])
	binary.BigEndian.PutUint16(long[specReqLen+8:], 300) // a name longer than the payload
	f.Add(cat(long, read(2, 0, 8)))
	named := notifyFrame(1, 6, "n", data[:20])
	binary.BigEndian.PutUint32(named[8:], rid) // a NOTIFY naming a buffer
	f.Add(named)

	// Group frames: the headers of 2 to 64 WRITEs, then their payloads.
	group := groupFrame
	f.Add(group(write(1, 0, data[:100]), write(2, 300, data[:200])))
	f.Add(cat(read(1, 0, 64), group(write(2, 0, data[:64]), write(3, 64, data[:64]), write(4, 2*page-8, data[:16])), read(5, 0, 128)))
	refused := specReq{op: specWrite, id: 2, buffer: rid, length: 64, key: fuzzKey ^ 1, addr: fuzzAddr}.frame(data[:64])
	f.Add(cat(group(write(1, 0, data[:64]), refused, write(3, 8, data[:8])), read(4, 0, 8))) // a refused member
	f.Add(group(write(1, 0, data[:64]), write(2, 64, data[:64]))[:200])                      // cut in a payload
	f.Add(group(write(1, 0, data[:64]), write(2, 64, data[:64]))[:50])                       // cut in the headers
	f.Add(cat(group(write(1, 0, data[:8]), read(2, 0, 8)), read(3, 0, 8)))                   // a READ in a group
	var wide [][]byte                                                                        // a wide group: more than 16 WRITEs
	for i := range 40 {
		wide = append(wide, write(uint32(i+1), 8*i, data[:8]))
	}
	f.Add(cat(group(wide...), read(41, 0, 8)))
	f.Add(specReq{op: specGroup, length: 65}.frame(nil))                                      // too many
	f.Add(cat(specReq{op: specGroup, length: 1}.frame(write(1, 0, data[:8])), read(2, 0, 8))) // too few
	f.Add(specReq{op: specGroup, id: 1, length: 2}.frame(cat(write(1, 0, data[:8])[:32], write(2, 0, data[:8]))))

	f.Fuzz(ft.run)
}
