package mctcp

// wire.go: Mooncake's TCP data protocol on the wire (FORMATS.md, "Mooncake's
// TCP data protocol"): the 24-byte request header and the version 2 status
// word. Nothing here touches a socket.

import "encoding/binary"

// Sizes and codes of the wire.
const (
	// headerSize is a request header's size: length u64 LE, address u64
	// LE, opcode u8, then 7 bytes the receiver ignores (Mooncake's sender
	// writes its struct's padding, whatever it holds).
	headerSize = 24
	// statusSize is a version 2 status word's size.
	statusSize = 8

	opRead  = 0
	opWrite = 1
	// opV2 is the opcode's flag that asks for version 2 framing.
	opV2 = 0x80

	// statusMagic is the top 32 bits of every version 2 status word
	// ("MCTV").
	statusMagic = 0x4D435456
	// statusOK and statusRefused are the low 32 bits.
	statusOK      = 0
	statusRefused = 1
)

// header is a decoded request header.
type header struct {
	length uint64
	addr   uint64
	op     uint8 // opRead or opWrite, the flag taken off
	v2     bool
}

// putHeader encodes h into b[:headerSize], padding zeroed.
func putHeader(b []byte, h header) {
	_ = b[headerSize-1]
	binary.LittleEndian.PutUint64(b[0:], h.length)
	binary.LittleEndian.PutUint64(b[8:], h.addr)
	op := h.op
	if h.v2 {
		op |= opV2
	}
	b[16] = op
	clear(b[17:headerSize])
}

// parseHeader decodes b[:headerSize]. ok is false for an opcode other than
// READ and WRITE (with or without the version 2 flag): Mooncake's server
// takes any such opcode for a READ, ours closes the connection.
func parseHeader(b []byte) (h header, ok bool) {
	_ = b[headerSize-1]
	h.length = binary.LittleEndian.Uint64(b[0:])
	h.addr = binary.LittleEndian.Uint64(b[8:])
	h.v2 = b[16]&opV2 != 0
	h.op = b[16] &^ opV2
	return h, h.op == opRead || h.op == opWrite
}

// statusWord is the version 2 status word of code.
func statusWord(code uint32) uint64 { return statusMagic<<32 | uint64(code) }

// putStatus encodes the status word of code into b[:statusSize].
func putStatus(b []byte, code uint32) { binary.LittleEndian.PutUint64(b, statusWord(code)) }

// appendStatus appends the status word of code to b.
func appendStatus(b []byte, code uint32) []byte {
	return binary.LittleEndian.AppendUint64(b, statusWord(code))
}

// parseStatus decodes a status word: its code, and false when the top 32
// bits are not the magic (a peer that speaks version 1, or a stream out of
// step).
func parseStatus(b []byte) (code uint32, ok bool) {
	w := binary.LittleEndian.Uint64(b)
	return uint32(w), w>>32 == statusMagic
}
