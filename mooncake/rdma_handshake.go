// rdma_handshake.go checks a Connection document for Mooncake's RDMA
// transport: its NIC paths, GID and queue pair numbers, bounded, before
// anything is created for it (FORMATS.md, "The RDMA handshake").

package mooncake

import (
	"errors"
	"fmt"
	"strings"
)

// ErrBadHandshake reports a Connection document that the RDMA handshake
// cannot use: a NIC path without server or device, a GID that is not 16
// hex bytes joined by colons, no queue pairs or more than [MaxRDMAQPs], a
// queue pair number outside 2..2^24-1 or repeated. It wraps [ErrBadFrame].
var ErrBadHandshake = fmt.Errorf("%w: RDMA handshake", ErrBadFrame)

// MaxRDMAQPs bounds the queue pairs of one RDMA handshake (Mooncake's
// num_qp_per_ep, MC_NUM_QP_PER_EP, 2 by default).
const MaxRDMAQPs = 64

// GIDLen is the length of a GID in bytes.
const GIDLen = 16

// RDMAHandshake is a Connection document checked for the RDMA transport
// (RDMAHandshake of [HandshakeDesc]): a value, not shared.
type RDMAHandshake struct {
	// LocalServer and LocalDevice name the sender's NIC; PeerServer and
	// PeerDevice the receiver's NIC it means.
	LocalServer, LocalDevice string
	PeerServer, PeerDevice   string
	// LID and GID address the sender's port.
	LID uint16
	GID [GIDLen]byte
	// QPNums are the sender's queue pair numbers, 1 to MaxRDMAQPs.
	QPNums []uint32
	// ReadyAckSupported and ReadyAck are the document's ready_ack.
	ReadyAckSupported, ReadyAck bool
}

// RDMA checks h as an RDMA handshake document (a request, or an answer
// without reply_msg) and returns it parsed, or an error wrapping
// [ErrBadHandshake]. Mooncake's reader would look a missing GID up in the
// sender's descriptor; every Mooncake engine sends one, and this check
// requires it.
func (h *HandshakeDesc) RDMA() (*RDMAHandshake, error) {
	r := &RDMAHandshake{LID: h.LocalLID, ReadyAckSupported: h.ReadyAckSupported, ReadyAck: h.ReadyAck}
	var err error
	if r.LocalServer, r.LocalDevice, err = parseNICPath(h.LocalNICPath); err != nil {
		return nil, fmt.Errorf("%w: local_nic_path: %w", ErrBadHandshake, err)
	}
	if r.PeerServer, r.PeerDevice, err = parseNICPath(h.PeerNICPath); err != nil {
		return nil, fmt.Errorf("%w: peer_nic_path: %w", ErrBadHandshake, err)
	}
	if r.GID, err = ParseGID(h.LocalGID); err != nil {
		return nil, fmt.Errorf("%w: local_gid: %w", ErrBadHandshake, err)
	}
	if len(h.QPNums) == 0 || len(h.QPNums) > MaxRDMAQPs {
		return nil, fmt.Errorf("%w: %d queue pairs (1 to %d)", ErrBadHandshake, len(h.QPNums), MaxRDMAQPs)
	}
	for i, n := range h.QPNums {
		if n < 2 || n >= 1<<24 {
			return nil, fmt.Errorf("%w: queue pair number %d", ErrBadHandshake, n)
		}
		for _, m := range h.QPNums[:i] {
			if m == n {
				return nil, fmt.Errorf("%w: queue pair number %d twice", ErrBadHandshake, n)
			}
		}
	}
	r.QPNums = append([]uint32(nil), h.QPNums...)
	return r, nil
}

var errNICPath = errors.New("not server@device")

// parseNICPath splits a NIC path at its first '@' as Mooncake does and
// requires both parts.
func parseNICPath(p string) (server, device string, err error) {
	server, device, ok := SplitNICPath(p)
	if !ok || server == "" || device == "" {
		return "", "", fmt.Errorf("%.100q: %w", p, errNICPath)
	}
	return server, device, nil
}

// ParseGID reads a GID as Mooncake writes it: 16 bytes in hex joined by
// colons ("00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01"; not the IPv6
// form "fe80::1"). Like Mooncake's reader it takes one or two hex digits
// per byte, of either case; it refuses anything else, and text after the
// 16th byte.
func ParseGID(s string) ([GIDLen]byte, error) {
	var g [GIDLen]byte
	parts := strings.Split(s, ":")
	if len(s) > 3*GIDLen || len(parts) != GIDLen {
		return g, fmt.Errorf("GID %.60q: not %d hex bytes joined by colons", s, GIDLen)
	}
	for i, p := range parts {
		if len(p) < 1 || len(p) > 2 {
			return g, fmt.Errorf("GID %.60q: byte %d", s, i)
		}
		var v byte
		for _, c := range []byte(p) {
			switch {
			case c >= '0' && c <= '9':
				c -= '0'
			case c >= 'a' && c <= 'f':
				c -= 'a' - 10
			case c >= 'A' && c <= 'F':
				c -= 'A' - 10
			default:
				return g, fmt.Errorf("GID %.60q: byte %d", s, i)
			}
			v = v<<4 | c
		}
		g[i] = v
	}
	return g, nil
}

// FormatGID writes a GID as Mooncake does: two lower-case hex digits per
// byte, joined by colons.
func FormatGID(g [GIDLen]byte) string {
	const hexd = "0123456789abcdef"
	b := make([]byte, 0, 3*GIDLen-1)
	for i, v := range g {
		if i > 0 {
			b = append(b, ':')
		}
		b = append(b, hexd[v>>4], hexd[v&15])
	}
	return string(b)
}

// Answer returns the answer to the request r that a target whose queue
// pairs are qps and whose port has lid and gid sends: its NIC path the
// one the request named, the peer's the requester's, ready_ack present
// and false (the target knows the acknowledgement), no reply_msg.
func (r *RDMAHandshake) Answer(lid uint16, gid [GIDLen]byte, qps []uint32) *HandshakeDesc {
	return &HandshakeDesc{
		LocalNICPath: NICPath(r.PeerServer, r.PeerDevice), PeerNICPath: NICPath(r.LocalServer, r.LocalDevice),
		LocalLID: lid, LocalGID: FormatGID(gid), QPNums: qps, ReadyAckSupported: true,
	}
}

// CheckAnswer checks the target's answer ans to the request r: it must
// name the two NICs the other way round and carry as many queue pairs
// (Mooncake connects queue pair i to the peer's i). The error wraps
// [ErrBadHandshake].
func (r *RDMAHandshake) CheckAnswer(ans *RDMAHandshake) error {
	if ans.LocalServer != r.PeerServer || ans.LocalDevice != r.PeerDevice ||
		ans.PeerServer != r.LocalServer || ans.PeerDevice != r.LocalDevice {
		return fmt.Errorf("%w: the answer names %s and %s, not %s and %s", ErrBadHandshake,
			NICPath(ans.LocalServer, ans.LocalDevice), NICPath(ans.PeerServer, ans.PeerDevice),
			NICPath(r.PeerServer, r.PeerDevice), NICPath(r.LocalServer, r.LocalDevice))
	}
	if len(ans.QPNums) != len(r.QPNums) {
		return fmt.Errorf("%w: the answer has %d queue pairs for %d (the peer's MC_NUM_QP_PER_EP differs)", ErrBadHandshake, len(ans.QPNums), len(r.QPNums))
	}
	return nil
}

// Desc returns r as a document, for the initiator's request (and, with
// ReadyAck set, its acknowledgement).
func (r *RDMAHandshake) Desc() *HandshakeDesc {
	return &HandshakeDesc{
		LocalNICPath: NICPath(r.LocalServer, r.LocalDevice), PeerNICPath: NICPath(r.PeerServer, r.PeerDevice),
		LocalLID: r.LID, LocalGID: FormatGID(r.GID), QPNums: r.QPNums,
		ReadyAckSupported: r.ReadyAckSupported, ReadyAck: r.ReadyAck,
	}
}
