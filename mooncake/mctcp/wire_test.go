package mctcp

import (
	"bytes"
	"encoding/hex"
	"testing"
)

// The header and status words byte by byte, as Mooncake's
// tcp_transport lays them out (FORMATS.md).
func TestWireGolden(t *testing.T) {
	var h [headerSize]byte
	putHeader(h[:], header{length: 0x10000, addr: 0x7f1234567000, op: opWrite, v2: true})
	want, _ := hex.DecodeString("0000010000000000" + "00705634127f0000" + "81" + "00000000000000")
	if !bytes.Equal(h[:], want) {
		t.Fatalf("header\n% x\nwant\n% x", h[:], want)
	}
	// The receiver ignores the padding, whatever it holds.
	copy(h[17:], bytes.Repeat([]byte{0xAB}, 7))
	got, ok := parseHeader(h[:])
	if !ok || got != (header{length: 0x10000, addr: 0x7f1234567000, op: opWrite, v2: true}) {
		t.Fatalf("parsed %+v, %v", got, ok)
	}
	for op, wantOK := range map[byte]bool{0x00: true, 0x01: true, 0x80: true, 0x81: true, 0x02: false, 0x82: false, 0xff: false} {
		h[16] = op
		if _, ok := parseHeader(h[:]); ok != wantOK {
			t.Errorf("opcode %#x: ok %v, want %v", op, ok, wantOK)
		}
	}
	var st [statusSize]byte
	putStatus(st[:], statusOK)
	if hex.EncodeToString(st[:]) != "000000005654434d" {
		t.Fatalf("OK status % x", st[:])
	}
	putStatus(st[:], statusRefused)
	if hex.EncodeToString(st[:]) != "010000005654434d" {
		t.Fatalf("refused status % x", st[:])
	}
	if code, ok := parseStatus(st[:]); !ok || code != statusRefused {
		t.Fatalf("parseStatus = %d, %v", code, ok)
	}
	if _, ok := parseStatus([]byte("mooncake")); ok {
		t.Fatal("a word without the magic parsed")
	}
}
