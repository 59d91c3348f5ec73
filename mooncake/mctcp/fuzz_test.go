package mctcp

// fuzz_test.go: FuzzServe feeds arbitrary bytes to the target's request
// loop as a peer would send them, and compares what it answers and what
// it leaves in the buffer with a model of the protocol. The one
// registered buffer is mapped between inaccessible pages, so a touch
// outside it faults, and is served at a fixed address so that the corpus
// can name it.

import (
	"bytes"
	"encoding/binary"
	"net"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/mem"
	"github.com/moonring/moonring/internal/testpattern"
	"github.com/moonring/moonring/segtable"
)

const (
	fuzzAddr = 0x5000_0000_0000
	fuzzLen  = 2 * 4096
)

func fuzzHeader(length, addr uint64, op byte) []byte {
	var h [headerSize]byte
	binary.LittleEndian.PutUint64(h[0:], length)
	binary.LittleEndian.PutUint64(h[8:], addr)
	h[16] = op
	return h[:]
}

func FuzzServe(f *testing.F) {
	buf, free, err := mem.AllocGuarded(fuzzLen)
	if err != nil {
		f.Skip("no guarded memory here:", err)
	}
	f.Cleanup(func() { free() })
	var bufs segtable.Buffers
	b, err := bufs.Register(buf, "", true)
	if err != nil {
		f.Fatal(err)
	}
	tr, err := New(Config{MaxLength: 4096 + 1, FrameTimeout: time.Second, IdleTimeout: time.Second})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() {
		tr.Close()
		bufs.Unregister(f.Context(), b.ID)
	})
	if _, err := tr.Register(b); err != nil {
		f.Fatal(err)
	}
	(*tr.regs.Load())[0].addr = fuzzAddr // no request is served yet
	cat := func(p ...[]byte) []byte { return bytes.Join(p, nil) }
	data := bytes.Repeat([]byte("mooncake"), 64)
	f.Add([]byte{})
	f.Add(cat(fuzzHeader(16, fuzzAddr, 0x01), data[:16], fuzzHeader(16, fuzzAddr, 0x00)))
	f.Add(cat(fuzzHeader(16, fuzzAddr, 0x81), data[:16], fuzzHeader(16, fuzzAddr, 0x80)))
	f.Add(cat(fuzzHeader(64, fuzzAddr+fuzzLen-64, 0x80), fuzzHeader(65, fuzzAddr+fuzzLen-64, 0x80)))
	f.Add(cat(fuzzHeader(8, fuzzAddr-1, 0x81), data[:8]))
	f.Add(fuzzHeader(1<<62, fuzzAddr, 0x81))
	f.Add(fuzzHeader(4097, fuzzAddr, 0x80))
	f.Add(fuzzHeader(0, fuzzAddr, 0x80))
	f.Add(fuzzHeader(8, fuzzAddr, 0x02))
	f.Add(fuzzHeader(16, ^uint64(0)-7, 0x80))
	f.Add(cat(fuzzHeader(100, fuzzAddr, 0x81), data[:40]))
	f.Add(fuzzHeader(8, fuzzAddr, 0x80)[:13])
	initial := make([]byte, fuzzLen)
	testpattern.Fill(initial, 9)
	f.Fuzz(func(t *testing.T, in []byte) {
		copy(buf, initial) // no connection is being served
		c := &fuzzConn{in: bytes.NewReader(in)}
		tr.serve(&srvConn{c: c}) // must return, not panic, not fault
		want, mem := fuzzModel(in, initial, 4096+1)
		if !bytes.Equal(c.out.Bytes(), want) {
			t.Fatalf("the target answered\n% x\nthe protocol says\n% x", c.out.Bytes(), want)
		}
		if !bytes.Equal(buf, mem) {
			t.Fatal("the buffer is not what the WRITEs make it")
		}
	})
}

// fuzzModel runs a byte stream through the protocol as FORMATS.md states
// it, on a copy of initial served at fuzzAddr: the bytes the target must
// answer, and the buffer it must leave.
func fuzzModel(in, initial []byte, maxLen uint64) (out, mem []byte) {
	mem = bytes.Clone(initial)
	for len(in) >= headerSize {
		length := binary.LittleEndian.Uint64(in[0:])
		addr := binary.LittleEndian.Uint64(in[8:])
		op, v2 := in[16]&^opV2, in[16]&opV2 != 0
		in = in[headerSize:]
		if op != opRead && op != opWrite {
			return out, mem
		}
		off := addr - fuzzAddr
		if length == 0 || length > maxLen || addr < fuzzAddr || off >= fuzzLen || length > fuzzLen-off {
			if v2 {
				out = appendStatus(out, statusRefused)
			}
			return out, mem
		}
		if op == opWrite {
			if uint64(len(in)) < length {
				// The payload is cut short: what came has landed (the
				// bytes go straight into the buffer), and no answer.
				copy(mem[off:], in)
				return out, mem
			}
			copy(mem[off:], in[:length])
			in = in[length:]
			if v2 {
				out = appendStatus(out, statusOK)
			}
			continue
		}
		if v2 {
			out = appendStatus(out, statusOK)
		}
		out = append(out, mem[off:off+length]...)
	}
	return out, mem
}

// fuzzConn is a connection whose peer sent in and then closed its side:
// reads take in, then io.EOF; writes gather in out.
type fuzzConn struct {
	in  *bytes.Reader
	out bytes.Buffer
}

func (c *fuzzConn) Read(p []byte) (int, error)       { return c.in.Read(p) }
func (c *fuzzConn) Write(p []byte) (int, error)      { return c.out.Write(p) }
func (c *fuzzConn) Close() error                     { return nil }
func (c *fuzzConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *fuzzConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *fuzzConn) SetDeadline(time.Time) error      { return nil }
func (c *fuzzConn) SetReadDeadline(time.Time) error  { return nil }
func (c *fuzzConn) SetWriteDeadline(time.Time) error { return nil }
