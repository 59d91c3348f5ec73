package mooncake

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
)

// TestGoldenRDMAHandshakes: the documents of one RDMA handshake (the
// request, the target's answer, the ready acknowledgement) and a request
// from an engine that predates the acknowledgement, written from
// Mooncake's source: each checks as an RDMA handshake, holds what the
// format says, and encodes back to exactly the compact text Mooncake's
// writer produces (members sorted).
func TestGoldenRDMAHandshakes(t *testing.T) {
	gidA := [GIDLen]byte{10: 0xff, 11: 0xff, 12: 0xc0, 13: 0xa8, 14: 0x64, 15: 0x08}
	gidB := gidA
	gidB[15] = 0x07
	for _, tc := range []struct {
		file string
		want RDMAHandshake
	}{
		{"handshake.json", RDMAHandshake{LocalServer: "10.1.0.8:15002", LocalDevice: "mlx5_0", PeerServer: "10.1.0.7:15001", PeerDevice: "mlx5_1",
			GID: gidA, QPNums: []uint32{281, 282}, ReadyAckSupported: true}},
		{"handshake-answer.json", RDMAHandshake{LocalServer: "10.1.0.7:15001", LocalDevice: "mlx5_1", PeerServer: "10.1.0.8:15002", PeerDevice: "mlx5_0",
			GID: gidB, QPNums: []uint32{1043, 1044}, ReadyAckSupported: true}},
		{"handshake-ready-ack.json", RDMAHandshake{LocalServer: "10.1.0.8:15002", LocalDevice: "mlx5_0", PeerServer: "10.1.0.7:15001", PeerDevice: "mlx5_1",
			GID: gidA, QPNums: []uint32{281, 282}, ReadyAckSupported: true, ReadyAck: true}},
		{"handshake-ib-old.json", RDMAHandshake{LocalServer: "node-a", LocalDevice: "mlx5_2", PeerServer: "node-b", PeerDevice: "mlx5_3", LID: 17,
			GID: [GIDLen]byte{0xfe, 0x80, 8: 0xb8, 0x59, 0x9f, 0x03, 0x00, 0x12, 0x34, 0x56}, QPNums: []uint32{77, 78, 79, 80}}},
	} {
		raw := readGolden(t, tc.file)
		h, err := DecodeHandshake(raw)
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		r, err := h.RDMA()
		if err != nil {
			t.Fatalf("%s: %v", tc.file, err)
		}
		if !reflect.DeepEqual(*r, tc.want) {
			t.Errorf("%s: %+v, want %+v", tc.file, *r, tc.want)
		}
		// Mooncake's compact writer: members sorted, no spaces (as
		// encoding/json writes a map).
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		sorted, _ := json.Marshal(m)
		enc, err := r.Desc().Encode()
		if err != nil || !bytes.Equal(enc, sorted) {
			t.Errorf("%s: encoded\n%s\nwant\n%s (%v)", tc.file, enc, sorted, err)
		}
	}
	req, _ := DecodeHandshake(readGolden(t, "handshake.json"))
	r, _ := req.RDMA()
	ans := r.Answer(0, gidB, []uint32{1043, 1044})
	enc, _ := ans.Encode()
	want := readGolden(t, "handshake-answer.json")
	if !sameJSON(t, enc, want) {
		t.Errorf("Answer encodes %s, want %s", enc, want)
	}
	a, _ := ans.RDMA()
	if err := r.CheckAnswer(a); err != nil {
		t.Errorf("CheckAnswer of the golden answer: %v", err)
	}
}

// TestRDMAHandshakeRefuses: every malformed field is refused with
// ErrBadHandshake (and so ErrBadFrame), and answers that do not match the
// request are refused by CheckAnswer.
func TestRDMAHandshakeRefuses(t *testing.T) {
	good := func() *HandshakeDesc {
		h, err := DecodeHandshake(readGolden(t, "handshake.json"))
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	for what, mod := range map[string]func(h *HandshakeDesc){
		"no local path":      func(h *HandshakeDesc) { h.LocalNICPath = "" },
		"local without @":    func(h *HandshakeDesc) { h.LocalNICPath = "mlx5_0" },
		"local no device":    func(h *HandshakeDesc) { h.LocalNICPath = "a:1@" },
		"local no server":    func(h *HandshakeDesc) { h.LocalNICPath = "@mlx5_0" },
		"peer without @":     func(h *HandshakeDesc) { h.PeerNICPath = "x" },
		"no gid":             func(h *HandshakeDesc) { h.LocalGID = "" },
		"ipv6 gid":           func(h *HandshakeDesc) { h.LocalGID = "fe80::1" },
		"short gid":          func(h *HandshakeDesc) { h.LocalGID = "00:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64" },
		"long gid":           func(h *HandshakeDesc) { h.LocalGID += ":00" },
		"gid trailing colon": func(h *HandshakeDesc) { h.LocalGID += ":" },
		"gid three digits":   func(h *HandshakeDesc) { h.LocalGID = "000:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64:08" },
		"gid not hex":        func(h *HandshakeDesc) { h.LocalGID = "0g:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64:08" },
		"gid sign":           func(h *HandshakeDesc) { h.LocalGID = "+1:00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64:08" },
		"gid empty byte":     func(h *HandshakeDesc) { h.LocalGID = ":00:00:00:00:00:00:00:00:00:ff:ff:c0:a8:64:08" },
		"no qps":             func(h *HandshakeDesc) { h.QPNums = nil },
		"too many qps":       func(h *HandshakeDesc) { h.QPNums = make([]uint32, MaxRDMAQPs+1) },
		"qp 0":               func(h *HandshakeDesc) { h.QPNums = []uint32{0, 5} },
		"qp 1 (GSI)":         func(h *HandshakeDesc) { h.QPNums = []uint32{1, 5} },
		"qp over 24 bits":    func(h *HandshakeDesc) { h.QPNums = []uint32{1 << 24} },
		"qp twice":           func(h *HandshakeDesc) { h.QPNums = []uint32{7, 8, 7} },
	} {
		h := good()
		mod(h)
		if _, err := h.RDMA(); !errors.Is(err, ErrBadHandshake) || !errors.Is(err, ErrBadFrame) {
			t.Errorf("%s: %v", what, err)
		}
	}
	if g, err := ParseGID("A:b:C:d:0:1:2:3:4:5:6:7:8:9:Ff:eE"); err != nil || FormatGID(g) != "0a:0b:0c:0d:00:01:02:03:04:05:06:07:08:09:ff:ee" {
		t.Errorf("one-digit and upper-case bytes: %x, %v", g, err)
	}
	if _, err := ParseGID(strings.Repeat("00:", 15) + "00\n"); err == nil {
		t.Error("a GID with a newline parsed")
	}
	req, _ := good().RDMA()
	for what, mod := range map[string]func(a *RDMAHandshake){
		"its own path":     func(a *RDMAHandshake) { a.LocalDevice = "mlx5_9" },
		"another server":   func(a *RDMAHandshake) { a.LocalServer = "10.1.0.9:15001" },
		"not our path":     func(a *RDMAHandshake) { a.PeerDevice = "mlx5_7" },
		"fewer queue prs":  func(a *RDMAHandshake) { a.QPNums = a.QPNums[:1] },
		"more queue pairs": func(a *RDMAHandshake) { a.QPNums = append(a.QPNums, 99) },
	} {
		a, err := req.Answer(0, req.GID, []uint32{40, 41}).RDMA()
		if err != nil {
			t.Fatal(err)
		}
		mod(a)
		if err := req.CheckAnswer(a); !errors.Is(err, ErrBadHandshake) {
			t.Errorf("%s: %v", what, err)
		}
	}
}
