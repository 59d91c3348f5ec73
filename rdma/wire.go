package rdma

import (
	"encoding/binary"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// The control handshake: the initiator dials the target's control
// listener, sends a hello with its queue pair's address (GID, LID, QPN,
// PSN, MTU) and the target device it wants, and reads the target's
// answer: accept with the target queue pair's address, or refuse. Both
// messages are msgLen bytes, big-endian:
//
//	0  "MRQP"
//	4  version (1)
//	5  kind (1 hello, 2 accept, 3 refuse)
//	6  device index (hello, accept) or refusal code (refuse), u16
//	8  GID, 16 bytes
//	24 LID, u16
//	26 path MTU (ibv_mtu: 1..5 for 256..4096 bytes)
//	27 outstanding RDMA READs the sender accepts as responder
//	28 QPN, u32 (< 2^24)
//	32 first PSN, u32 (< 2^24)
//
// The connection then stays open for the queue pair's life: when either
// side closes it, the other tears its queue pair down.
const (
	msgLen     = 36
	msgVersion = 1

	kindHello  = 1
	kindAccept = 2
	kindRefuse = 3
)

// Refusal codes.
const (
	refuseDevice = 1 // no such device
	refuseQP     = 2 // could not create or connect the queue pair
	refuseLimit  = 3 // MaxPeerQPs reached
	refuseClosed = 4 // the transport is closing
)

// qpAddr is one side's queue pair, as the handshake carries it.
type qpAddr struct {
	Kind     uint8
	Device   uint16 // or the refusal code
	GID      [16]byte
	LID      uint16
	MTU      uint8
	RdAtomic uint8
	QPN      uint32
	PSN      uint32
}

func (m *qpAddr) encode(b *[msgLen]byte) {
	copy(b[0:4], "MRQP")
	b[4] = msgVersion
	b[5] = m.Kind
	binary.BigEndian.PutUint16(b[6:], m.Device)
	copy(b[8:24], m.GID[:])
	binary.BigEndian.PutUint16(b[24:], m.LID)
	b[26] = m.MTU
	b[27] = m.RdAtomic
	binary.BigEndian.PutUint32(b[28:], m.QPN)
	binary.BigEndian.PutUint32(b[32:], m.PSN)
}

func decodeQPAddr(b []byte) (qpAddr, error) {
	var m qpAddr
	if len(b) != msgLen {
		return m, fmt.Errorf("%w: message of %d bytes, want %d", ErrHandshake, len(b), msgLen)
	}
	if string(b[0:4]) != "MRQP" {
		return m, fmt.Errorf("%w: bad magic %q", ErrHandshake, b[0:4])
	}
	if b[4] != msgVersion {
		return m, fmt.Errorf("%w: version %d, want %d", ErrHandshake, b[4], msgVersion)
	}
	m.Kind = b[5]
	m.Device = binary.BigEndian.Uint16(b[6:])
	copy(m.GID[:], b[8:24])
	m.LID = binary.BigEndian.Uint16(b[24:])
	m.MTU = b[26]
	m.RdAtomic = b[27]
	m.QPN = binary.BigEndian.Uint32(b[28:])
	m.PSN = binary.BigEndian.Uint32(b[32:])
	switch m.Kind {
	case kindRefuse:
		return m, nil
	case kindHello, kindAccept:
	default:
		return m, fmt.Errorf("%w: message kind %d", ErrHandshake, m.Kind)
	}
	if m.QPN == 0 || m.QPN >= 1<<24 || m.PSN >= 1<<24 {
		return m, fmt.Errorf("%w: QPN %#x or PSN %#x out of range", ErrHandshake, m.QPN, m.PSN)
	}
	if m.MTU < 1 || m.MTU > 5 {
		return m, fmt.Errorf("%w: MTU code %d", ErrHandshake, m.MTU)
	}
	if m.RdAtomic == 0 {
		return m, fmt.Errorf("%w: no outstanding RDMA READ allowed", ErrHandshake)
	}
	return m, nil
}

// formatEndpoint is what Endpoint publishes: the control listener's
// host:port, a slash, and the device names in index order.
func formatEndpoint(addr string, devices []string) string {
	return addr + "/" + strings.Join(devices, ",")
}

// parseEndpoint undoes formatEndpoint.
func parseEndpoint(s string) (addr string, devices []string, err error) {
	i := strings.LastIndexByte(s, '/')
	if i < 0 {
		return "", nil, fmt.Errorf("rdma endpoint %q: no device list", s)
	}
	addr = s[:i]
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return "", nil, fmt.Errorf("rdma endpoint %q: %v", s, err)
	}
	if s[i+1:] == "" {
		return "", nil, fmt.Errorf("rdma endpoint %q: no device", s)
	}
	devices = strings.Split(s[i+1:], ",")
	if len(devices) > 1<<16 {
		return "", nil, fmt.Errorf("rdma endpoint %q: too many devices", s)
	}
	for _, d := range devices {
		if d == "" {
			return "", nil, fmt.Errorf("rdma endpoint %q: empty device name", s)
		}
	}
	return addr, devices, nil
}

// formatKey is a remote-accessible buffer's key: its rkeys in device
// order, in hex, separated by dots.
func formatKey(rkeys []uint32) string {
	var b strings.Builder
	for i, k := range rkeys {
		if i > 0 {
			b.WriteByte('.')
		}
		b.WriteString(strconv.FormatUint(uint64(k), 16))
	}
	return b.String()
}

// parseKey undoes formatKey for a peer with n devices.
func parseKey(s string, n int) ([]uint32, error) {
	if s == "" {
		return nil, fmt.Errorf("no rkey: the buffer is not remote-accessible")
	}
	parts := strings.Split(s, ".")
	if len(parts) != n {
		return nil, fmt.Errorf("key %q has %d rkeys for %d devices", s, len(parts), n)
	}
	out := make([]uint32, n)
	for i, p := range parts {
		v, err := strconv.ParseUint(p, 16, 32)
		if err != nil {
			return nil, fmt.Errorf("key %q: %v", s, err)
		}
		out[i] = uint32(v)
	}
	return out, nil
}

// mtuCode and mtuBytes convert between ibv_mtu codes and bytes.
func mtuBytes(code uint8) int {
	if code < 1 || code > 5 {
		return 0
	}
	return 128 << code
}
