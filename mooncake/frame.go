package mooncake

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
)

// FrameType is the type byte of a frame on a Mooncake engine's RPC port.
type FrameType uint8

// The frame types. A frame of the old protocol has no type byte; the
// receiver takes it as a Connection request and answers in the old
// protocol too.
const (
	FrameConnection FrameType = 0 // the transport handshake (RDMA queue pairs)
	FrameMetadata   FrameType = 1 // P2PHANDSHAKE: ask for the peer's segment descriptor
	FrameNotify     FrameType = 2 // a notification message
	FrameProbe      FrameType = 3 // liveness
	FrameOld        FrameType = 0xff
)

func (t FrameType) String() string {
	switch t {
	case FrameConnection:
		return "connection"
	case FrameMetadata:
		return "metadata"
	case FrameNotify:
		return "notify"
	case FrameProbe:
		return "probe"
	case FrameOld:
		return "old"
	}
	return fmt.Sprintf("frame-type-%d", uint8(t))
}

// Bounds of a frame's length (type byte and JSON). Mooncake refuses frames
// over 1 MiB unless its MC_HANDSHAKE_MAX_LENGTH raises the limit, to at
// most 128 MiB.
const (
	DefaultMaxFrame = 1 << 20
	MaxFrameLimit   = 128 << 20
	frameHeader     = 8
)

// ErrBadFrame reports a malformed RPC frame or frame document; a retry
// does not help.
var ErrBadFrame = errors.New("mooncake: malformed RPC frame")

// Frame is one message on the RPC port: its type and its JSON text.
type Frame struct {
	Type FrameType
	Body []byte
}

// AppendFrame appends the frame of t and body to dst: the length (8 bytes,
// little-endian) of what follows, the type byte (none for FrameOld), the
// body.
func AppendFrame(dst []byte, t FrameType, body []byte) []byte {
	n := uint64(len(body))
	if t != FrameOld {
		n++
	}
	dst = binary.LittleEndian.AppendUint64(dst, n)
	if t != FrameOld {
		dst = append(dst, byte(t))
	}
	return append(dst, body...)
}

func frameMax(max int) int {
	if max <= 0 {
		return DefaultMaxFrame
	}
	return min(max, MaxFrameLimit)
}

// classify splits a frame's content into type and body as a receiver
// does: a first byte of 0..3 is the type; 4..0x7f begins an old-protocol
// frame's JSON (which starts with '{' or '['); 0x80 and above are refused
// (Mooncake on x86 compares the byte as a signed char, takes it as a type
// and drops the connection as unknown).
func classify(content []byte) (Frame, error) {
	switch c := content[0]; {
	case c <= byte(FrameProbe):
		return Frame{Type: FrameType(c), Body: content[1:]}, nil
	case c >= 0x80:
		return Frame{}, fmt.Errorf("%w: type byte %#x", ErrBadFrame, c)
	}
	return Frame{Type: FrameOld, Body: content}, nil
}

// ParseFrame reads one frame from the front of b, of at most max bytes
// after the length (DefaultMaxFrame when max <= 0, never over
// MaxFrameLimit). It returns the frame, whose Body aliases b, and the bytes
// it took; io.ErrUnexpectedEOF when b holds only part of a frame.
func ParseFrame(b []byte, max int) (Frame, int, error) {
	if len(b) < frameHeader {
		return Frame{}, 0, io.ErrUnexpectedEOF
	}
	n := binary.LittleEndian.Uint64(b)
	if err := checkLen(n, frameMax(max)); err != nil {
		return Frame{}, 0, err
	}
	if uint64(len(b)-frameHeader) < n {
		return Frame{}, 0, io.ErrUnexpectedEOF
	}
	f, err := classify(b[frameHeader : frameHeader+int(n)])
	return f, frameHeader + int(n), err
}

func checkLen(n uint64, max int) error {
	switch {
	case n == 0:
		return fmt.Errorf("%w: zero length", ErrBadFrame)
	case n > uint64(max):
		return fmt.Errorf("%w: length %d over %d", ErrBadFrame, n, max)
	}
	return nil
}

// ReadFrame reads one frame from r, bounded as ParseFrame. A short read is
// io.ErrUnexpectedEOF (io.EOF before the first byte).
func ReadFrame(r io.Reader, max int) (Frame, error) {
	var h [frameHeader]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return Frame{}, err
	}
	n := binary.LittleEndian.Uint64(h[:])
	if err := checkLen(n, frameMax(max)); err != nil {
		return Frame{}, err
	}
	content := make([]byte, n)
	if _, err := io.ReadFull(r, content); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return Frame{}, err
	}
	return classify(content)
}

// WriteFrame writes the frame of t and body to w in one Write.
func WriteFrame(w io.Writer, t FrameType, body []byte) error {
	_, err := w.Write(AppendFrame(make([]byte, 0, frameHeader+1+len(body)), t, body))
	return err
}

// Bounds of the frame documents.
const (
	// MaxQPs bounds the queue pair numbers of one handshake.
	MaxQPs = 1024
)

// HandshakeDesc is the document of a Connection frame, both ways: the
// initiator's endpoint, then the target's answer. Mooncake's RDMA transport
// connects one queue pair set per pair of NICs; the NIC paths name them.
type HandshakeDesc struct {
	// Payload is transport-specific and opaque; the RDMA transport leaves
	// it empty.
	Payload string
	// LocalNICPath is the sender's NIC, "server@device"; PeerNICPath the
	// NIC of the receiver it wants to reach.
	LocalNICPath string
	PeerNICPath  string
	// LocalLID and LocalGID address the sender's port (GID as in a
	// descriptor's devices).
	LocalLID uint16
	LocalGID string
	// QPNums are the sender's queue pair numbers.
	QPNums []uint32
	// ReadyAckSupported: the member ready_ack is present (the sender knows
	// the ready acknowledgement); ReadyAck its value.
	ReadyAckSupported bool
	ReadyAck          bool
	// ReplyMsg, in an answer, is the reason of a refusal; empty on success.
	ReplyMsg string
	// EFAAddr and CXIAddr: endpoint addresses of the efa and cxi builds.
	EFAAddr string
	CXIAddr string
}

// DecodeHandshake parses a Connection document strictly: members of the
// wrong type, more than MaxQPs queue pairs, a LID over 16 bits or strings
// over MaxString are refused; absent members stay zero.
func DecodeHandshake(b []byte) (*HandshakeDesc, error) {
	var w struct {
		Payload      string          `json:"payload"`
		LocalNICPath string          `json:"local_nic_path"`
		LocalLID     *uint64         `json:"local_lid"`
		LocalGID     string          `json:"local_gid"`
		PeerNICPath  string          `json:"peer_nic_path"`
		QPNum        []uint32        `json:"qp_num"`
		ReadyAck     json.RawMessage `json:"ready_ack"`
		ReplyMsg     string          `json:"reply_msg"`
		EFAAddr      string          `json:"efa_addr"`
		CXIAddr      string          `json:"cxi_addr"`
	}
	if err := unmarshalObject(b, &w); err != nil {
		return nil, err
	}
	h := &HandshakeDesc{Payload: w.Payload, LocalNICPath: w.LocalNICPath, LocalGID: w.LocalGID,
		PeerNICPath: w.PeerNICPath, QPNums: w.QPNum, ReplyMsg: w.ReplyMsg, EFAAddr: w.EFAAddr, CXIAddr: w.CXIAddr}
	if w.LocalLID != nil {
		if *w.LocalLID > math.MaxUint16 {
			return nil, fmt.Errorf("%w: local_lid %d", ErrBadFrame, *w.LocalLID)
		}
		h.LocalLID = uint16(*w.LocalLID)
	}
	if len(h.QPNums) > MaxQPs {
		return nil, fmt.Errorf("%w: %d queue pairs", ErrBadFrame, len(h.QPNums))
	}
	if w.ReadyAck != nil {
		h.ReadyAckSupported = true
		// Mooncake takes a non-boolean as false; so do we.
		_ = json.Unmarshal(w.ReadyAck, &h.ReadyAck)
	}
	for _, s := range []string{h.Payload, h.LocalNICPath, h.LocalGID, h.PeerNICPath, h.ReplyMsg, h.EFAAddr, h.CXIAddr} {
		if len(s) > MaxString {
			return nil, fmt.Errorf("%w: a string of %d bytes", ErrBadFrame, len(s))
		}
	}
	return h, nil
}

// Encode writes the document as Mooncake's RDMA transport does: every
// member always, but ready_ack only when supported, efa_addr and cxi_addr
// only when set.
func (h *HandshakeDesc) Encode() ([]byte, error) {
	m := map[string]any{
		"payload":        h.Payload,
		"local_nic_path": h.LocalNICPath,
		"local_lid":      h.LocalLID,
		"local_gid":      h.LocalGID,
		"peer_nic_path":  h.PeerNICPath,
		"qp_num":         nonNilU32(h.QPNums),
		"reply_msg":      h.ReplyMsg,
	}
	if h.ReadyAckSupported || h.ReadyAck {
		m["ready_ack"] = h.ReadyAck
	}
	if h.EFAAddr != "" {
		m["efa_addr"] = h.EFAAddr
	}
	if h.CXIAddr != "" {
		m["cxi_addr"] = h.CXIAddr
	}
	return json.Marshal(m)
}

func nonNilU32(s []uint32) []uint32 {
	if s == nil {
		return []uint32{}
	}
	return s
}

// NICPath joins a server name and a device name as the handshake names a
// NIC: "server@device".
func NICPath(server, device string) string { return server + "@" + device }

// SplitNICPath splits "server@device" at the first '@'; ok is false
// without one.
func SplitNICPath(p string) (server, device string, ok bool) {
	return strings.Cut(p, "@")
}

// NotifyDesc is the document of a Notify frame: the sender's segment name
// and its message. The receiver answers with an empty name and the message
// "success"; an answer with an empty message is a refusal.
type NotifyDesc struct {
	Name      string `json:"name"`
	NotifyMsg string `json:"notify_msg"`
}

// NotifyOK is the answer to an accepted notification.
var NotifyOK = NotifyDesc{Name: "", NotifyMsg: "success"}

// MaxNotifyMsg bounds a notification message; the frame bounds it anyway.
const MaxNotifyMsg = DefaultMaxFrame

// DecodeNotify parses a Notify document strictly.
func DecodeNotify(b []byte) (*NotifyDesc, error) {
	var n NotifyDesc
	if err := unmarshalObject(b, &n); err != nil {
		return nil, err
	}
	if len(n.Name) > MaxString || len(n.NotifyMsg) > MaxNotifyMsg {
		return nil, fmt.Errorf("%w: notify of %d+%d bytes", ErrBadFrame, len(n.Name), len(n.NotifyMsg))
	}
	return &n, nil
}

// Encode writes the Notify document.
func (n *NotifyDesc) Encode() ([]byte, error) { return json.Marshal(n) }

// ProbeReply is the answer to a Probe frame (whose request is "{}").
type ProbeReply struct {
	Status string `json:"status"`
}

// ProbeOK is the answer of a live engine.
var ProbeOK = ProbeReply{Status: "success"}

// DecodeProbeReply parses a Probe answer.
func DecodeProbeReply(b []byte) (*ProbeReply, error) {
	var p ProbeReply
	if err := unmarshalObject(b, &p); err != nil {
		return nil, err
	}
	if len(p.Status) > MaxString {
		return nil, fmt.Errorf("%w: probe status of %d bytes", ErrBadFrame, len(p.Status))
	}
	return &p, nil
}

// unmarshalObject decodes a JSON object (Mooncake's writer ends it with a
// newline) into v, refusing anything else, "null" included.
func unmarshalObject(b []byte, v any) error {
	if len(b) > MaxFrameLimit {
		return fmt.Errorf("%w: %d bytes", ErrBadFrame, len(b))
	}
	t := bytes.TrimSpace(b)
	if len(t) == 0 || t[0] != '{' {
		return fmt.Errorf("%w: not a JSON object", ErrBadFrame)
	}
	if err := json.Unmarshal(t, v); err != nil {
		return fmt.Errorf("%w: %v", ErrBadFrame, err)
	}
	return nil
}
