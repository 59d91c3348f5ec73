package mooncake

import (
	"bytes"
	"encoding/hex"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
)

// TestGoldenFrames: frames written out by hand from the format: 8 bytes
// of little-endian length, the type byte, Mooncake's JSON writer's text
// (a newline at its end).
func TestGoldenFrames(t *testing.T) {
	for _, tc := range []struct {
		hex  string
		typ  FrameType
		body string
	}{
		// A probe: length 4 = type + "{}\n".
		{"0400000000000000" + "03" + "7b7d0a", FrameProbe, "{}\n"},
		// Its answer.
		{"1600000000000000" + "03" + hex.EncodeToString([]byte(`{"status":"success"}`+"\n")), FrameProbe, `{"status":"success"}` + "\n"},
		// A metadata request whose body is "null\n" (an engine without a
		// local descriptor encodes nothing).
		{"0600000000000000" + "01" + "6e756c6c0a", FrameMetadata, "null\n"},
		// The old protocol: no type byte, the JSON at once.
		{"0300000000000000" + "7b7d0a", FrameOld, "{}\n"},
		// A notify.
		{"2c00000000000000" + "02" + hex.EncodeToString([]byte(`{"name":"a:1","notify_msg":"block 7 done"}`+"\n")), FrameNotify, `{"name":"a:1","notify_msg":"block 7 done"}` + "\n"},
		// A connection (handshake) request, one byte of body.
		{"0200000000000000" + "00" + "20", FrameConnection, " "},
	} {
		raw, err := hex.DecodeString(tc.hex)
		if err != nil {
			t.Fatal(err)
		}
		f, n, err := ParseFrame(raw, 0)
		if err != nil || n != len(raw) || f.Type != tc.typ || string(f.Body) != tc.body {
			t.Errorf("ParseFrame(%s) = %v %q, %d, %v", tc.hex, f.Type, f.Body, n, err)
		}
		f2, err := ReadFrame(bytes.NewReader(raw), 0)
		if err != nil || f2.Type != tc.typ || string(f2.Body) != tc.body {
			t.Errorf("ReadFrame(%s) = %v %q, %v", tc.hex, f2.Type, f2.Body, err)
		}
		if enc := AppendFrame(nil, tc.typ, []byte(tc.body)); !bytes.Equal(enc, raw) {
			t.Errorf("AppendFrame(%v, %q) = %x, want %s", tc.typ, tc.body, enc, tc.hex)
		}
		var w bytes.Buffer
		if err := WriteFrame(&w, tc.typ, []byte(tc.body)); err != nil || !bytes.Equal(w.Bytes(), raw) {
			t.Errorf("WriteFrame: %x, %v", w.Bytes(), err)
		}
	}
}

func TestFrameRefuses(t *testing.T) {
	le := func(n uint64) string {
		b := AppendFrame(nil, FrameOld, nil)
		b[0], b[1], b[2], b[3] = byte(n), byte(n>>8), byte(n>>16), byte(n>>24)
		return hex.EncodeToString(b)
	}
	for what, h := range map[string]string{
		"zero length":      le(0),
		"over the default": le(DefaultMaxFrame + 1),
		"over the limit":   "ffffffffffffffff",
		"type byte 0x80":   "0200000000000000" + "80" + "7b",
		"type byte 0xff":   "0200000000000000" + "ff" + "7b",
	} {
		raw, _ := hex.DecodeString(h)
		raw = append(raw, make([]byte, 16)...)
		if _, _, err := ParseFrame(raw, 0); !errors.Is(err, ErrBadFrame) {
			t.Errorf("ParseFrame %s: %v", what, err)
		}
		if _, err := ReadFrame(bytes.NewReader(raw), 0); !errors.Is(err, ErrBadFrame) && !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("ReadFrame %s: %v", what, err)
		}
	}
	// A raised limit admits a larger frame; the limit never passes
	// MaxFrameLimit.
	big := AppendFrame(nil, FrameMetadata, make([]byte, DefaultMaxFrame+10))
	if _, _, err := ParseFrame(big, 2*DefaultMaxFrame); err != nil {
		t.Errorf("raised limit: %v", err)
	}
	if frameMax(1<<40) != MaxFrameLimit {
		t.Error("limit above MaxFrameLimit")
	}
	// Short input.
	for _, b := range [][]byte{nil, {1, 0, 0}, AppendFrame(nil, FrameProbe, []byte("{}"))[:10]} {
		if _, _, err := ParseFrame(b, 0); err != io.ErrUnexpectedEOF {
			t.Errorf("ParseFrame(%x): %v", b, err)
		}
		if _, err := ReadFrame(bytes.NewReader(b), 0); err != io.ErrUnexpectedEOF && !(len(b) == 0 && err == io.EOF) {
			t.Errorf("ReadFrame(%x): %v", b, err)
		}
	}
}

func TestFrameDocuments(t *testing.T) {
	h, err := DecodeHandshake(readGolden(t, "handshake.json"))
	if err != nil {
		t.Fatal(err)
	}
	want := &HandshakeDesc{LocalNICPath: "10.1.0.8:15002@mlx5_0", PeerNICPath: "10.1.0.7:15001@mlx5_1",
		LocalGID: "00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64:08", QPNums: []uint32{281, 282}, ReadyAckSupported: true}
	if !reflect.DeepEqual(h, want) {
		t.Errorf("handshake %+v", h)
	}
	enc, _ := h.Encode()
	if !sameJSON(t, enc, readGolden(t, "handshake.json")) {
		t.Errorf("encoded %s", enc)
	}
	if srv, dev, ok := SplitNICPath(h.LocalNICPath); !ok || srv != "10.1.0.8:15002" || dev != "mlx5_0" || NICPath(srv, dev) != h.LocalNICPath {
		t.Errorf("NIC path %q %q %v", srv, dev, ok)
	}
	r, err := DecodeHandshake(readGolden(t, "handshake-refused.json"))
	if err != nil || r.ReplyMsg == "" || r.ReadyAckSupported || len(r.QPNums) != 0 {
		t.Errorf("refusal %+v, %v", r, err)
	}
	enc, _ = r.Encode()
	if !sameJSON(t, enc, readGolden(t, "handshake-refused.json")) {
		t.Errorf("encoded %s", enc)
	}

	n, err := DecodeNotify(readGolden(t, "notify.json"))
	if err != nil || *n != (NotifyDesc{"10.1.0.8:15002", "kv-block 42 ready"}) {
		t.Errorf("notify %+v, %v", n, err)
	}
	n, err = DecodeNotify(readGolden(t, "notify-reply.json"))
	if err != nil || *n != NotifyOK {
		t.Errorf("notify reply %+v, %v", n, err)
	}
	enc, _ = NotifyOK.Encode()
	if !sameJSON(t, enc, readGolden(t, "notify-reply.json")) {
		t.Errorf("encoded %s", enc)
	}
	p, err := DecodeProbeReply(readGolden(t, "probe-reply.json"))
	if err != nil || *p != ProbeOK {
		t.Errorf("probe %+v, %v", p, err)
	}

	for what, doc := range map[string]string{
		"null":          "null\n",
		"array":         "[]",
		"lid":           `{"local_lid":65536}`,
		"qp type":       `{"qp_num":["1"]}`,
		"qp range":      `{"qp_num":[4294967296]}`,
		"too many qps":  `{"qp_num":[` + strings.Repeat("1,", MaxQPs) + `1]}`,
		"string length": `{"reply_msg":"` + strings.Repeat("x", MaxString+1) + `"}`,
	} {
		if _, err := DecodeHandshake([]byte(doc)); !errors.Is(err, ErrBadFrame) {
			t.Errorf("handshake %s: %v", what, err)
		}
	}
	if h, err := DecodeHandshake([]byte(`{"ready_ack":"yes"}`)); err != nil || !h.ReadyAckSupported || h.ReadyAck {
		t.Errorf("a non-boolean ready_ack: %+v, %v", h, err)
	}
	for _, doc := range []string{"null", `{"name":1}`, `{"notify_msg":[]}`} {
		if _, err := DecodeNotify([]byte(doc)); !errors.Is(err, ErrBadFrame) {
			t.Errorf("notify %s: %v", doc, err)
		}
	}
	if _, err := DecodeProbeReply([]byte(`{"status":2}`)); !errors.Is(err, ErrBadFrame) {
		t.Errorf("probe: %v", err)
	}
}
