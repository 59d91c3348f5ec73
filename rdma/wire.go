package rdma

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
)

// The control handshake: the initiator dials the target's control
// listener; both send a fresh 16-byte nonce ("MRQA", version 1, nonce: 21
// bytes each way); the initiator sends a hello with its queue pair's
// address (GID, LID, QPN, PSN, MTU) and the target device it wants,
// followed by HMAC-SHA256(K, "moonring rdma/1 initiator" | cnonce | snonce
// | hello); the target checks it before it creates anything and answers
// accept (its queue pair's address) or refuse, followed by
// HMAC-SHA256(K, "moonring rdma/1 target" | cnonce | snonce | answer),
// which the initiator checks. K is the segment key (see Config.Key). Hello
// and answer are msgLen bytes, big-endian:
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
	refuseAuth   = 5 // the initiator's MAC is wrong: another segment key
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
// host:port, a slash, and the device names in index order; then, when the
// segment key is not shared by configuration, a slash and the key in hex.
func formatEndpoint(addr string, devices []string, key []byte) string {
	s := addr + "/" + strings.Join(devices, ",")
	if key != nil {
		s += "/" + hex.EncodeToString(key)
	}
	return s
}

// parseEndpoint undoes formatEndpoint; key is nil when none is published.
func parseEndpoint(s string) (addr string, devices []string, key []byte, err error) {
	parts := strings.Split(s, "/")
	if len(parts) < 2 || len(parts) > 3 {
		return "", nil, nil, fmt.Errorf("rdma endpoint %q: want host:port/devices[/key]", s)
	}
	addr = parts[0]
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return "", nil, nil, fmt.Errorf("rdma endpoint %q: %v", s, err)
	}
	if len(parts) == 3 {
		key, err = hex.DecodeString(parts[2])
		if err != nil || len(key) != keySize {
			return "", nil, nil, fmt.Errorf("rdma endpoint %q: bad key", s)
		}
	}
	if parts[1] == "" {
		return "", nil, nil, fmt.Errorf("rdma endpoint %q: no device", s)
	}
	devices = strings.Split(parts[1], ",")
	if len(devices) > 1<<16 {
		return "", nil, nil, fmt.Errorf("rdma endpoint %q: too many devices", s)
	}
	for _, d := range devices {
		if d == "" {
			return "", nil, nil, fmt.Errorf("rdma endpoint %q: empty device name", s)
		}
	}
	return addr, devices, key, nil
}

// keySize is the length of a segment key.
const keySize = 32

// ErrAuth: the peer holds another segment key.
var ErrAuth = errors.New("rdma: segment key refused")

// deriveKey turns a configured key of any length into a segment key.
func deriveKey(k []byte) []byte {
	h := sha256.New()
	h.Write([]byte("moonring rdma segment key\x00"))
	h.Write(k)
	return h.Sum(nil)
}

func authMAC(key []byte, role string, cn, sn *[16]byte, msg *[msgLen]byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("moonring rdma/1 " + role))
	m.Write(cn[:])
	m.Write(sn[:])
	m.Write(msg[:])
	return m.Sum(nil)
}

const nonceLen = 4 + 1 + 16

func writeNonce(w io.Writer, n *[16]byte) error {
	var b [nonceLen]byte
	copy(b[:], "MRQA")
	b[4] = msgVersion
	copy(b[5:], n[:])
	_, err := w.Write(b[:])
	return err
}

func readNonce(r io.Reader, n *[16]byte) error {
	var b [nonceLen]byte
	if _, err := io.ReadFull(r, b[:]); err != nil {
		return err
	}
	if string(b[:4]) != "MRQA" || b[4] != msgVersion {
		return fmt.Errorf("%w: bad nonce message %x", ErrHandshake, b[:5])
	}
	copy(n[:], b[5:])
	return nil
}

// dialHandshake runs the initiator's side on conn with segment key key:
// it sends hello and returns the target's answer, whose MAC it checked.
func dialHandshake(conn io.ReadWriter, key []byte, hello *qpAddr) (qpAddr, error) {
	var cn, sn [16]byte
	rand.Read(cn[:])
	if err := writeNonce(conn, &cn); err != nil {
		return qpAddr{}, err
	}
	if err := readNonce(conn, &sn); err != nil {
		return qpAddr{}, err
	}
	var out [msgLen + sha256.Size]byte
	var h [msgLen]byte
	hello.encode(&h)
	copy(out[:], h[:])
	copy(out[msgLen:], authMAC(key, "initiator", &cn, &sn, &h))
	if _, err := conn.Write(out[:]); err != nil {
		return qpAddr{}, err
	}
	if _, err := io.ReadFull(conn, out[:]); err != nil {
		return qpAddr{}, err
	}
	a := (*[msgLen]byte)(out[:msgLen])
	ans, err := decodeQPAddr(a[:])
	if err != nil {
		return qpAddr{}, err
	}
	if ans.Kind == kindRefuse && ans.Device == refuseAuth {
		return ans, fmt.Errorf("%w: the target refused this segment key", ErrAuth)
	}
	if !hmac.Equal(out[msgLen:], authMAC(key, "target", &cn, &sn, a)) {
		return qpAddr{}, fmt.Errorf("%w: the target's answer does not carry this segment key's MAC", ErrAuth)
	}
	return ans, nil
}

// serveHandshake runs the target's side on conn with segment key key: it
// reads the initiator's hello, checks its MAC (a wrong one is refused with
// refuseAuth and ErrAuth), and sends what answer returns for it.
func serveHandshake(conn io.ReadWriter, key []byte, answer func(*qpAddr) qpAddr) (hello, ans qpAddr, err error) {
	var cn, sn [16]byte
	if err := readNonce(conn, &cn); err != nil {
		return hello, ans, err
	}
	rand.Read(sn[:])
	if err := writeNonce(conn, &sn); err != nil {
		return hello, ans, err
	}
	var in [msgLen + sha256.Size]byte
	if _, err := io.ReadFull(conn, in[:]); err != nil {
		return hello, ans, err
	}
	h := (*[msgLen]byte)(in[:msgLen])
	if hello, err = decodeQPAddr(h[:]); err != nil {
		return hello, ans, err
	}
	if hello.Kind != kindHello {
		return hello, ans, fmt.Errorf("%w: message kind %d, want a hello", ErrHandshake, hello.Kind)
	}
	if !hmac.Equal(in[msgLen:], authMAC(key, "initiator", &cn, &sn, h)) {
		ans = qpAddr{Kind: kindRefuse, Device: refuseAuth}
		err = fmt.Errorf("%w: the initiator's hello does not carry this segment key's MAC", ErrAuth)
	} else {
		ans = answer(&hello)
	}
	var out [msgLen + sha256.Size]byte
	a := (*[msgLen]byte)(out[:msgLen])
	ans.encode(a)
	copy(out[msgLen:], authMAC(key, "target", &cn, &sn, a))
	if _, werr := conn.Write(out[:]); werr != nil && err == nil {
		err = werr
	}
	return hello, ans, err
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
