package mctcp

// fuzz_test.go: FuzzServe feeds arbitrary bytes to the target's request
// loop as a peer would send them. The one registered buffer is mapped
// between inaccessible pages, so a touch outside it faults, and is served
// at a fixed address so that the corpus can name it.

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/mem"
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
	f.Fuzz(func(t *testing.T, in []byte) {
		srv, cli := net.Pipe()
		sc := &srvConn{c: srv}
		done := make(chan struct{})
		go func() {
			defer close(done)
			cli.Write(in)
			cli.Close()
		}()
		drained := make(chan struct{})
		go func() {
			defer close(drained)
			io.Copy(io.Discard, cli)
		}()
		tr.serve(sc) // must return, not panic, not fault
		srv.Close()
		<-done
		<-drained
	})
}
