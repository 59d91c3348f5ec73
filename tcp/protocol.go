package tcp

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Wire constants; see PROTOCOL.md.
const (
	version  = 1
	magic    = "MRNG"
	reqSize  = 32
	respSize = 8

	opRead   = 1
	opWrite  = 2
	opNotify = 3
	opGroup  = 4 // the headers of the WRITEs that follow (group.go)

	// featGroups, in the challenge's features word, says the target
	// takes group frames (opGroup) of up to maxGroup WRITEs; featWide,
	// of up to maxWide.
	featGroups = 1
	featWide   = 2

	// maxGroup bounds the WRITEs one group frame announces to a target
	// that offers groups but not wide ones, maxWide to one that offers
	// both, and maxGroupBytes their payloads together. Wide groups let
	// WRITEs of 16 KiB to under 64 KiB fill a group's 1 MiB: per group the target
	// pays a wake, a header read and readvs that do not shrink with its
	// payloads (32 KiB WRITEs: a third fewer readvs and epoll waits, a
	// quarter fewer context switches per GB).
	maxGroup      = 16
	maxWide       = 64
	maxGroupBytes = 1 << 20

	stOK     = 0
	stDenied = 1
	stRange  = 2
	stBusy   = 3

	// maxNotify bounds a NOTIFY payload: tag, name length, name, message.
	maxNotify = 8 + 2 + 255 + 4096

	helloOK         = 0
	helloBadVersion = 1
	helloTLS        = 2
	helloBadKey     = 3
	helloBusy       = 4

	keySize   = 32
	nonceSize = 16
)

// Errors of the hello. None is helped by retrying without a change.
var (
	// ErrVersion: the peer speaks another protocol version.
	ErrVersion = errors.New("tcp: protocol version not supported by peer")
	// ErrAuth: the peers do not hold the same segment key.
	ErrAuth = errors.New("tcp: segment key refused")
	// ErrTLSRequired: the target accepts only TLS connections.
	ErrTLSRequired = errors.New("tcp: target requires TLS")
	// ErrPinMismatch: the peer's TLS certificate is not the one its
	// endpoint pins (Config.AutoTLS): someone else answered at its
	// address, a relay perhaps. It wraps ErrAuth.
	ErrPinMismatch = fmt.Errorf("%w: the peer's TLS certificate is not the one its endpoint pins", ErrAuth)
	// ErrNoPin: an AutoTLS initiator refused a peer whose endpoint pins no
	// certificate (a target without AutoTLS, or an older descriptor of it
	// replayed). It wraps ErrPinMismatch.
	ErrNoPin = fmt.Errorf("%w: the endpoint pins no certificate, and this transport speaks only TLS (AutoTLS)", ErrPinMismatch)
	// ErrProtocol: the peer broke the framing; the connection is closed.
	ErrProtocol = errors.New("tcp: protocol error")
)

// request is a decoded request header.
type request struct {
	op     uint8
	id     uint32
	buffer uint32
	length uint32
	key    uint64
	addr   uint64
}

func (r *request) encode(b []byte) {
	_ = b[reqSize-1]
	b[0], b[1], b[2], b[3] = r.op, 0, 0, 0
	binary.BigEndian.PutUint32(b[4:], r.id)
	binary.BigEndian.PutUint32(b[8:], r.buffer)
	binary.BigEndian.PutUint32(b[12:], r.length)
	binary.BigEndian.PutUint64(b[16:], r.key)
	binary.BigEndian.PutUint64(b[24:], r.addr)
}

// decode parses a request header; it refuses framing it cannot trust.
func (r *request) decode(b []byte, maxLen uint32) error {
	_ = b[reqSize-1]
	*r = request{
		op:     b[0],
		id:     binary.BigEndian.Uint32(b[4:]),
		buffer: binary.BigEndian.Uint32(b[8:]),
		length: binary.BigEndian.Uint32(b[12:]),
		key:    binary.BigEndian.Uint64(b[16:]),
		addr:   binary.BigEndian.Uint64(b[24:]),
	}
	switch {
	case r.op < opRead || r.op > opGroup:
		return fmt.Errorf("%w: unknown op %d", ErrProtocol, r.op)
	case r.op == opGroup:
		// Its length is the count of WRITE headers that follow it.
		if r.id != 0 || r.buffer != 0 || r.key != 0 || r.addr != 0 || b[1]|b[2]|b[3] != 0 || r.length < 2 || r.length > maxWide {
			return fmt.Errorf("%w: bad group frame", ErrProtocol)
		}
		return nil
	case r.op == opNotify && (r.buffer != 0 || r.key != 0 || r.addr != 0 || r.length < 10 || r.length > maxNotify):
		return fmt.Errorf("%w: bad notify frame", ErrProtocol)
	case b[1]|b[2]|b[3] != 0:
		return fmt.Errorf("%w: flags or reserved bytes set", ErrProtocol)
	case r.length == 0 || r.length > maxLen:
		return fmt.Errorf("%w: length %d outside [1, %d]", ErrProtocol, r.length, maxLen)
	}
	return nil
}

func encodeResp(b []byte, id uint32, status uint8) {
	_ = b[respSize-1]
	binary.BigEndian.PutUint32(b, id)
	b[4], b[5], b[6], b[7] = status, 0, 0, 0
}

func decodeResp(b []byte) (id uint32, status uint8, err error) {
	_ = b[respSize-1]
	if b[5]|b[6]|b[7] != 0 || b[4] > stBusy {
		return 0, 0, fmt.Errorf("%w: bad response", ErrProtocol)
	}
	return binary.BigEndian.Uint32(b), b[4], nil
}

func mac(key []byte, role string, cnonce, snonce []byte) []byte {
	h := hmac.New(sha256.New, key)
	io.WriteString(h, "moonring/1 "+role)
	h.Write(cnonce)
	h.Write(snonce)
	return h.Sum(nil)
}
