// rpc_exchange.go holds what the RPC daemon does with one connection's
// bytes: read one request frame, bounded, and compute the answer of its
// type. It touches no socket, so that the fuzz target can drive it.

package mooncake

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"

	"github.com/moonring/moonring/transport"
)

// The fixed answers, as Mooncake's JSON writer writes them (a newline at
// the end).
var (
	nullBody   = []byte("null\n")
	probeBody  = []byte(`{"status":"success"}` + "\n")
	notifyOK   = []byte(`{"name":"","notify_msg":"success"}` + "\n")
	notifyNack = []byte(`{"name":"","notify_msg":""}` + "\n")
)

// NoHandshakeReply is the reply_msg of a Connection frame the daemon has no
// handshake function for.
const NoHandshakeReply = "moonring: this engine takes no Mooncake transport handshake"

// readRequest reads one frame of at most max bytes after the length. Unlike
// ReadFrame it grows its buffer as bytes arrive, so a length alone, with
// nothing behind it, costs no allocation of that length.
func readRequest(r io.Reader, max int) (Frame, error) {
	var h [frameHeader]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return Frame{}, err
	}
	n := binary.LittleEndian.Uint64(h[:])
	if err := checkLen(n, max); err != nil {
		return Frame{}, err
	}
	var buf bytes.Buffer
	buf.Grow(int(min(n, 4096)))
	if _, err := io.CopyN(&buf, r, int64(n)); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return Frame{}, err
	}
	return classify(buf.Bytes())
}

// exchange reads one request from r and writes its answer to w. It
// returns the request's type, and an error when the request was
// unreadable or malformed (nothing is written then) or the answer could
// not be written.
func (s *RPCServer) exchange(r io.Reader, w io.Writer) (FrameType, error) {
	f, err := readRequest(r, s.max)
	if err != nil {
		return 0, fmt.Errorf("reading a request: %w", err)
	}
	body, err := s.answer(f)
	if err != nil {
		return f.Type, fmt.Errorf("%v request: %w", f.Type, err)
	}
	if err := WriteFrame(w, f.Type, body); err != nil {
		return f.Type, fmt.Errorf("writing the %v answer: %w", f.Type, err)
	}
	return f.Type, nil
}

// answer returns the answer to f; an error when f's document is malformed,
// which Mooncake answers by closing the connection.
func (s *RPCServer) answer(f Frame) ([]byte, error) {
	if !json.Valid(f.Body) {
		return nil, fmt.Errorf("%w: the document is not JSON", ErrBadFrame)
	}
	switch f.Type {
	case FrameMetadata:
		// The requester's own descriptor: Mooncake ignores it, so do we.
		return s.descBody(), nil
	case FrameProbe:
		return probeBody, nil
	case FrameNotify:
		n, err := DecodeNotify(f.Body)
		if err != nil {
			return nil, err
		}
		return s.deliver(n), nil
	case FrameConnection, FrameOld:
		h, err := DecodeHandshake(f.Body)
		if err != nil {
			return nil, err
		}
		return s.shake(h)
	}
	return nil, fmt.Errorf("%w: type %v", ErrBadFrame, f.Type)
}

// descBody is the metadata answer: this engine's descriptor in Mooncake's
// schema, or null.
func (s *RPCServer) descBody() []byte {
	if s.desc == nil {
		return nullBody
	}
	d := s.desc()
	if d == nil {
		return nullBody
	}
	if c := s.cache.Load(); c != nil && c.d == d {
		return c.body
	}
	md, _, err := FromSegtable(d)
	if err != nil {
		s.logLimited(&s.logAnswers, "serving null: %v", err)
		return nullBody
	}
	md.Timestamp = TimestampNow()
	b, err := md.Encode()
	if err != nil {
		s.logLimited(&s.logAnswers, "serving null: segment %q: %v", d.Name, err)
		return nullBody
	}
	b = append(b, '\n')
	s.cache.Store(&descCache{d: d, body: b})
	return b
}

// deliver hands a notification to the engine: Mooncake's success answer
// when it took it, the refusal (an empty notify_msg) otherwise.
func (s *RPCServer) deliver(n *NotifyDesc) []byte {
	f := s.notify.Load()
	if f == nil {
		s.logLimited(&s.logAnswers, "refused a notification from %q: no receiver", n.Name)
		return notifyNack
	}
	if err := (*f)(&transport.Notification{From: n.Name, Msg: []byte(n.NotifyMsg)}); err != nil {
		s.logLimited(&s.logAnswers, "refused a notification from %q: %v", n.Name, err)
		return notifyNack
	}
	return notifyOK
}

// shake answers a Connection frame through the handshake function, or
// refuses it.
func (s *RPCServer) shake(req *HandshakeDesc) ([]byte, error) {
	var ans *HandshakeDesc
	if f := s.handshake.Load(); f == nil {
		ans = &HandshakeDesc{ReplyMsg: NoHandshakeReply}
	} else {
		a, err := (*f)(req)
		switch {
		case err != nil:
			ans = &HandshakeDesc{ReplyMsg: err.Error()}
			if a != nil {
				c := *a
				c.ReplyMsg = err.Error()
				ans = &c
			}
		case a == nil:
			ans = &HandshakeDesc{ReplyMsg: "moonring: the handshake gave no answer"}
		default:
			ans = a
		}
	}
	if len(ans.ReplyMsg) > MaxString {
		c := *ans
		c.ReplyMsg = c.ReplyMsg[:MaxString]
		ans = &c
	}
	b, err := ans.Encode()
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}
