package shm

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
)

// The control protocol runs over a Unix SOCK_SEQPACKET connection between
// an initiator's endpoint and the target's transport, both on one host, so
// it is native little-endian and every message is one packet: a 64-byte
// frame, and for notifications a tail with the sender's name and message.
//
//	byte  0     type
//	byte  1     flags
//	bytes 2-3   status
//	bytes 4-7   seq: the initiator's request number, echoed in the answer
//	bytes 8-15  handle: the target's registration of a buffer
//	bytes 16-47 a, b, c, d: per type (below)
//	bytes 48-63 key: a buffer's 128-bit key, or the sender's boot id in hello
//
//	hello       I->T  a = version, key = boot id, c|d = initiator's nonce
//	helloAck    T->I  status, a = version, key = boot id, c|d = target's nonce
//	proof       I->T  a|b|c|d = HMAC-SHA256(K, "moonring/shm/1 initiator" |
//	                  nonce I | nonce T), K the segment key
//	proofAck    T->I  status, a|b|c|d = HMAC-SHA256(K, "moonring/shm/1 target" |
//	                  nonce I | nonce T)
//	grant       I->T  a = addr, b = length, key; flags&flagVM: no mapping wanted
//	grantAck    T->I  status, handle, a = addr, b = length, c = offset of addr
//	                  in the file, d = file size; flags&flagVM: no file, use
//	                  process_vm_readv/writev; otherwise one descriptor
//	                  (SCM_RIGHTS) rides along
//	revoke      T->I  handle: stop using the buffer, unmap it, then answer
//	revokeAck   I->T  handle
//	notify      I->T  a = tag, b = length of from, c = length of msg; tail
//	                  from|msg
//	notifyAck   T->I  status
//
// Nothing but proof may follow a hello, and nothing but grants and
// notifications a proof the target accepted: both sides have then shown
// that they hold the segment key, which never crosses the socket.
const (
	msgHello = 1 + iota
	msgHelloAck
	msgGrant
	msgGrantAck
	msgRevoke
	msgRevokeAck
	msgNotify
	msgNotifyAck
	msgProof
	msgProofAck
	msgLast = msgProofAck
)

// version is the protocol version a hello carries.
const version = 2

// flagVM in a grant asks for, and in a grantAck grants, access through
// process_vm_readv/writev rather than a mapping.
const flagVM = 1

// Answer statuses.
const (
	statusOK = iota
	statusDenied
	statusRange
	statusFull
	statusBadVersion
	statusOtherHost
	statusBadKey
	statusLast = statusBadKey
)

const (
	frameSize = 64
	maxName   = 1024
	// maxMsg bounds one packet: a frame and the tail of a notification.
	maxMsg = frameSize + maxName + 4096
)

// msg is one decoded packet. tail aliases the read buffer.
type msg struct {
	typ    uint8
	flags  uint8
	status uint16
	seq    uint32
	handle uint64
	a, b   uint64
	c, d   uint64
	key    [16]byte
	tail   []byte
}

var errBadMsg = errors.New("shm: malformed control message")

// encode writes m's frame and tail into buf, which must hold them, and
// returns the packet.
func (m *msg) encode(buf []byte) []byte {
	buf = buf[:frameSize+len(m.tail)]
	buf[0], buf[1] = m.typ, m.flags
	binary.LittleEndian.PutUint16(buf[2:], m.status)
	binary.LittleEndian.PutUint32(buf[4:], m.seq)
	binary.LittleEndian.PutUint64(buf[8:], m.handle)
	binary.LittleEndian.PutUint64(buf[16:], m.a)
	binary.LittleEndian.PutUint64(buf[24:], m.b)
	binary.LittleEndian.PutUint64(buf[32:], m.c)
	binary.LittleEndian.PutUint64(buf[40:], m.d)
	copy(buf[48:64], m.key[:])
	copy(buf[frameSize:], m.tail)
	return buf
}

// decode parses one packet, checking everything a peer could get wrong: the
// type, the status, and for a notification that the tail holds exactly the
// lengths the frame names. Other types carry no tail.
func decode(p []byte, m *msg) error {
	if len(p) < frameSize {
		return fmt.Errorf("%w: %d bytes", errBadMsg, len(p))
	}
	*m = msg{
		typ: p[0], flags: p[1],
		status: binary.LittleEndian.Uint16(p[2:]),
		seq:    binary.LittleEndian.Uint32(p[4:]),
		handle: binary.LittleEndian.Uint64(p[8:]),
		a:      binary.LittleEndian.Uint64(p[16:]),
		b:      binary.LittleEndian.Uint64(p[24:]),
		c:      binary.LittleEndian.Uint64(p[32:]),
		d:      binary.LittleEndian.Uint64(p[40:]),
	}
	copy(m.key[:], p[48:64])
	if m.typ < msgHello || m.typ > msgLast {
		return fmt.Errorf("%w: type %d", errBadMsg, m.typ)
	}
	if m.status > statusLast || m.flags&^flagVM != 0 {
		return fmt.Errorf("%w: status %d flags %#x", errBadMsg, m.status, m.flags)
	}
	tail := p[frameSize:]
	if m.typ != msgNotify {
		if len(tail) != 0 {
			return fmt.Errorf("%w: %d stray bytes after type %d", errBadMsg, len(tail), m.typ)
		}
		return nil
	}
	if m.b > maxName || m.c > 4096 || uint64(len(tail)) != m.b+m.c {
		return fmt.Errorf("%w: notify of %d+%d bytes in %d", errBadMsg, m.b, m.c, len(tail))
	}
	m.tail = tail
	return nil
}

// proof is the HMAC of one side of the hello over both nonces.
func proof(key []byte, side string, ci, ct [2]uint64) [32]byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("moonring/shm/1 " + side))
	var b [32]byte
	binary.LittleEndian.PutUint64(b[0:], ci[0])
	binary.LittleEndian.PutUint64(b[8:], ci[1])
	binary.LittleEndian.PutUint64(b[16:], ct[0])
	binary.LittleEndian.PutUint64(b[24:], ct[1])
	m.Write(b[:])
	var out [32]byte
	m.Sum(out[:0])
	return out
}

// putProof and getProof carry a proof in a frame's a, b, c, d.
func (m *msg) putProof(p [32]byte) {
	m.a = binary.LittleEndian.Uint64(p[0:])
	m.b = binary.LittleEndian.Uint64(p[8:])
	m.c = binary.LittleEndian.Uint64(p[16:])
	m.d = binary.LittleEndian.Uint64(p[24:])
}

func (m *msg) getProof() (p [32]byte) {
	binary.LittleEndian.PutUint64(p[0:], m.a)
	binary.LittleEndian.PutUint64(p[8:], m.b)
	binary.LittleEndian.PutUint64(p[16:], m.c)
	binary.LittleEndian.PutUint64(p[24:], m.d)
	return p
}
